"""The agent's frontier holds every remote plan that is best at some rate for any RTT it may
see ([Note: frontier at the lowest RTT] in edge_agent/engines.py), stated at the registry's RTT."""

from __future__ import annotations

import dataclasses

import pytest

from edge_agent.engines import DEFAULT_LINK_RANGE, LOWEST_RTT_MS, make_frontier
from partitioner import build_graph
from partitioner.zoo import load_zoo
from planner import Encoding, frontier
from planner.devices import reference_profile

ENCODINGS = ("fp32", "fp16")


@pytest.mark.parametrize("model", ["squeezenet", "resnet50"])
def test_the_agent_frontier_holds_the_plans_of_the_lowest_rtt_stated_at_the_registry_rtt(model):
    graph = build_graph(load_zoo(model, random_weights=True))
    device, cloud = reference_profile("rpi4", graph), reference_profile("t4", graph)
    files = {"profiles/cloud.json": cloud.to_json().encode()}
    agent = make_frontier(graph, device, files, "latency", ENCODINGS)

    def keys_at(rtt_ms: float) -> set[str]:
        rng = dataclasses.replace(DEFAULT_LINK_RANGE, rtt_ms=rtt_ms)
        return {e.plan.key for e in frontier(graph, [device, cloud], rng, encodings=[Encoding(e) for e in ENCODINGS]).entries}

    assert {e.plan.key for e in agent.entries} == keys_at(LOWEST_RTT_MS)
    assert keys_at(DEFAULT_LINK_RANGE.rtt_ms) <= keys_at(LOWEST_RTT_MS)
    assert agent.link_range == DEFAULT_LINK_RANGE
    for e in agent.entries:
        assert e.plan.link.rtt_ms == DEFAULT_LINK_RANGE.rtt_ms
        assert e.plan.breakdown.rtt_ms == (DEFAULT_LINK_RANGE.rtt_ms if e.plan.boundary else 0.0), e.plan.key
        b = e.plan.breakdown
        assert b.total_ms == pytest.approx(b.edge_ms + b.encode_ms + b.uplink_ms + b.rtt_ms + b.queue_ms + b.cloud_ms
                                           + b.downlink_ms)


def test_a_plan_best_only_at_a_low_rtt_is_on_the_agent_frontier():
    graph = build_graph(load_zoo("squeezenet", random_weights=True))
    device, cloud = reference_profile("rpi4", graph), reference_profile("t4", graph)
    agent = make_frontier(graph, device, {"profiles/cloud.json": cloud.to_json().encode()}, "latency", ENCODINGS)
    at_registry = frontier(graph, [device, cloud], DEFAULT_LINK_RANGE, encodings=[Encoding(e) for e in ENCODINGS])
    missing = {e.plan.key for e in agent.entries} - {e.plan.key for e in at_registry.entries}
    assert missing, "on this model and these devices a mid-network cut is best only below the registry's RTT"
    assert all(k.split(":")[0] not in ("L", "") for k in missing)
