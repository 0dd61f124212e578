"""The agent's accuracy budget: edge.yaml's min_agreement is validated, and the agent's
frontier keeps to the stricter of it and model.yaml's on the accuracy.json the gateway
ships, placing the lossy codecs the table measured."""

from __future__ import annotations

import json

import pytest

from edge_agent.config import EdgeConfig, load_config
from edge_agent.errors import ConfigError
from edge_agent.engines import make_frontier
from partitioner.cuts import Cut
from partitioner.synthetic import make_chain_graph
from planner import make_flops_profile
from planner.accuracy import AccuracyEntry, AccuracyTable

L = Cut(frozenset()).key


def _setup(agreement: float = 0.995):
    graph = make_chain_graph(6, seed=3, max_tensor_bytes=1 << 20)
    device = make_flops_profile(graph, device="slow", gflops=0.5)
    cloud = make_flops_profile(graph, device="fast", gflops=500.0)
    x_bytes = sum(graph.tensor[n].bytes_per_sample for n in graph.inputs)
    table = AccuracyTable(graph.model, "f", 4, (AccuracyEntry(L, "jpeg@90", agreement, "y", "top1", 4, x_bytes / 30,
                                                              0.2),))
    front = {"schema": "splitinfer.registry-frontier/1", "source": "planner", "cuts": [],
             "planner": {"link_range": {"up_lo_bps": 1e4, "up_hi_bps": 1e9, "down_ratio": 4.0, "rtt_ms": 20.0,
                                        "loss": 0.0}}}
    files = {"profiles/cloud.json": cloud.to_json().encode(), "accuracy.json": table.to_json().encode()}
    return graph, device, files, front


def _keys(front) -> set[str]:
    return {e.plan.encoding.key for e in front.entries}


def test_edge_yaml_budget_places_the_measured_jpeg_and_keeps_every_plan_above_it() -> None:
    graph, device, files, front = _setup()
    files = files | {"frontier.json": json.dumps(front).encode()}
    without = make_frontier(graph, device, files, "latency", ("fp32",))
    assert _keys(without) == {"fp32"}  # no budget: no lossy codec
    within = make_frontier(graph, device, files, "latency", ("fp32",), min_agreement=0.99)
    assert "jpeg@90" in _keys(within)
    assert all(e.plan.agreement is not None and e.plan.agreement >= 0.99 for e in within.entries)
    strict = make_frontier(graph, device, files, "latency", ("fp32",), min_agreement=0.999)
    assert "jpeg@90" not in _keys(strict)


def test_model_yaml_budget_from_frontier_json_applies_and_the_stricter_wins() -> None:
    graph, device, files, front = _setup()
    registry = files | {"frontier.json": json.dumps(front | {"min_agreement": 0.99}).encode()}
    assert "jpeg@90" in _keys(make_frontier(graph, device, registry, "latency", ("fp32",)))
    stricter = files | {"frontier.json": json.dumps(front | {"min_agreement": 0.999}).encode()}
    assert "jpeg@90" not in _keys(make_frontier(graph, device, stricter, "latency", ("fp32",), min_agreement=0.99))


def test_a_budget_without_a_usable_table_keeps_to_lossless_plans(caplog) -> None:
    graph, device, files, front = _setup()
    files = files | {"frontier.json": json.dumps(front).encode(), "accuracy.json": b"{not json"}
    front = make_frontier(graph, device, files, "latency", ("fp32", "fp16"), min_agreement=0.99)
    assert _keys(front) == {"fp32"}
    assert "ignoring the gateway's accuracy.json" in caplog.text


@pytest.mark.parametrize("value", [0, 1.5, -1, True, "high"])
def test_a_bad_min_agreement_in_edge_yaml_is_a_clear_error(tmp_path, value) -> None:
    path = tmp_path / "edge.yaml"
    path.write_text(f"gateway: 127.0.0.1:50051\nmodel: m\nmin_agreement: {json.dumps(value)}\n")
    with pytest.raises(ConfigError, match=r"min_agreement.*a fraction in \(0, 1\]"):
        load_config(str(path))


def test_edge_yaml_min_agreement_is_read() -> None:
    assert EdgeConfig(gateway="127.0.0.1:1", model="m", min_agreement=0.99).min_agreement == 0.99


def test_the_agent_sends_a_lossy_plan_through_its_codec() -> None:
    from types import SimpleNamespace

    import numpy as np

    from cluster.protocol.encoding import decode
    from edge_agent.engines import CutEngines
    from edge_agent.policy import Action
    from edge_agent.runner import Runner
    from planner import Encoding

    agent = SimpleNamespace(models=SimpleNamespace(model="m", version="1"), _device_id="d", image_norm=None)
    ce = CutEngines("L", None, None, ("x", "ids"), ())  # type: ignore[arg-type]
    yy, xx = np.mgrid[0:16, 0:16] / 16
    x = np.stack([np.sin(3 * xx + k) * np.cos(2 * yy) for k in range(3)])[None].astype(np.float32)
    ids = np.arange(4, dtype=np.int64)
    enc = Encoding(codec="jpeg", level=85, ratio=0.05, codec_ms_per_mb=1.0)
    req = Runner._make_request(agent, Action("offload", "L", enc), ce, {"x": x, "ids": ids}, "r1", 5.0)  # type: ignore[arg-type]
    t = req.tensors["x"]
    assert (t.precision, t.level) == ("jpeg", 85) and t.wire_bytes < x.nbytes / 4
    from cluster.protocol.lossy import measure_lossy

    assert np.abs(decode(t) - x).max() <= measure_lossy(x, "jpeg", 85, repeats=1).max_abs_err + 1e-6
    assert req.tensors["ids"] is not None and req.tensors["ids"].dtype == np.int64  # integers travel as they are
