"""The hedge over real gRPC on 127.0.0.1: a remote answer that is late starts the local tail
beside the remote call before the deadline, the first answer is the request's, and the other
is dropped and counted; exactly one answer either way."""

import asyncio

import numpy as np
import pytest

from cluster.protocol.tensors import EncodedTensor
from edge_agent.cache import ArtifactCache
from edge_agent.config import config_from_dict
from edge_agent.engines import ModelSet
from edge_agent.runner import Counters, Runner
from partitioner import prefix_cut
from splitinfer.netem import LinkSetting
from tests.integration._edge_support import MODEL, VERSION, fixed_frontier, one_cut, runner_over_link, write_model

pytestmark = [pytest.mark.grpc, pytest.mark.timeout(120)]

SLO_MS = 400.0


def test_a_late_remote_answer_is_raced_by_the_local_tail_before_the_deadline(tmp_path):
    path, models, cut, x, ref = one_cut(tmp_path)
    # The local tail's measured time (what the hedge and the budget count on): a few ms here, while
    # the whole model is claimed at 1 s so that the policy offloads.
    ce = models.cuts[cut.key]
    head = ce.head.run({"x": x}, copy=True)
    for _ in range(3):
        ce.tail.run({n: head[n] for n in ce.boundary}, copy=True)
    assert ce.tail.stats().median_ms < 100

    async def go():
        async with runner_over_link(models, fixed_frontier(models.graph, cut), path, cut.key,
                                    tmp_path / "server-cache", LinkSetting.from_mbps(100, 100, 2),
                                    {"model": f"{MODEL}@{VERSION}", "sloMs": SLO_MS, "remoteTimeoutMs": 5000,
                                     "cacheDir": str(tmp_path / "cache"), "breakerFailures": 100},
                                    local_ms=1000.0) as (runner, backend, _):
            # Warm the connection and the tail engine (a loaded host may miss a short budget once).
            warm = [await runner.infer({"x": x}, request_id=f"warm{i}") for i in range(3)]
            warm_hedges = runner.counters.hedges
            runner.counters = Counters()
            backend.delay_s = lambda req: 0.9  # past the deadline, before the call's own (1.4 s)
            slow = await runner.infer({"x": x}, request_id="slow")
            hedges_at_answer = runner.counters.hedges
            for _ in range(300):  # the remote answer still comes, and is dropped
                if runner.counters.late_dropped:
                    break
                await asyncio.sleep(0.02)
            return warm, warm_hedges, slow, hedges_at_answer, runner.counters

    warm, warm_hedges, slow, hedges_at_answer, c = asyncio.run(go())
    # answers in time: no race (on a loaded host one may still be late)
    assert sum(a.served_by == "remote" for a in warm) >= 2 and warm_hedges <= 3 - sum(
        a.served_by == "remote" for a in warm)
    assert slow.served_by == "local_tail" and "hedged" in slow.fallback_reason
    np.testing.assert_allclose(slow.outputs["y"], ref, rtol=1e-4, atol=1e-5)
    assert slow.latency_ms < SLO_MS + 200  # the local tail started before the deadline (host slack aside)
    assert hedges_at_answer == 1 and c.late_dropped == 1 and c.remote_errors == {"timeout": 1}
    assert (c.answered, c.failed, c.local_tail, c.remote) == (1, 0, 1, 0)


def test_the_first_link_probe_sends_the_warm_plan_with_the_fewest_bytes(tmp_path):
    """Before any request offloaded, a probe sends zeros for the cheapest warm plan, in its encoding:
    a probe holds the device's uplink while it runs."""
    import concurrent.futures
    import dataclasses

    from partitioner import Cut
    from planner import Encoding, FrontierEntry

    path = write_model(tmp_path)
    models = ModelSet(path, cache=ArtifactCache(str(tmp_path / "cache")), model=MODEL, version=VERSION)
    cuts = [Cut(frozenset()), prefix_cut(models.graph, 1)]
    for cut in cuts:
        models.load_cut(cut)
    plans = [fixed_frontier(models.graph, cut, encoding=Encoding(enc)).entries[0].plan
             for cut, enc in zip(cuts, ("fp16", "fp32"))]
    front = fixed_frontier(models.graph, cuts[0])
    front = dataclasses.replace(front, entries=(FrontierEntry(0.1e6, 5e6, plans[1]), FrontierEntry(5e6, 1e9, plans[0])))
    cfg = config_from_dict({"gateway": "127.0.0.1:1", "model": f"{MODEL}@{VERSION}", "cacheDir": str(tmp_path / "c")})
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        runner = Runner(models, front, None, cfg, executor=pool, local_ms=1000.0)
        sizes = {p.key: p.breakdown.hop_up_ms[0] for p in plans}
        cheapest = min(plans, key=lambda p: sizes[p.key])
        req = runner._zero_request(5.0)
        assert req is not None and req.cut_id == cheapest.cut.key
        assert cheapest.encoding.precision == "fp16"  # the input in halves: 200 bytes against 400 and more
        assert all(isinstance(t, EncodedTensor) for t in req.tensors.values())
        other = next(p for p in plans if p is not cheapest)
        runner.unusable_cuts.add(cheapest.cut.key)  # the gateway does not know it: the next cheapest
        assert runner._zero_request(5.0).cut_id == other.cut.key
    models.close()
