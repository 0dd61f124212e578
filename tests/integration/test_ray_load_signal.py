"""A gateway whose tails run on Ray workers (a local Ray cluster) answers with the load keys
that the in-process pool's answers carry: `timings_ms['utilisation']`, the expected and the
predicted waits, estimated from its own requests and their answers (cluster._pools.AnswerLoad)
without a call to the workers; `/readyz?load=1`'s view and the gauges show the pool's capacity,
arrivals, requests inside and predicted wait, and the results its workers computed after their
deadline. Real gRPC on 127.0.0.1, real ONNX Runtime."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from cluster.protocol.client import InferenceClient, make_request
from cluster.protocol.errors import DeadlineExceeded
from edge_agent.cloud_load import CloudLoad
from tests.integration._ray_gateway_support import ray_local, serve_conv_stack  # noqa: F401 - fixture
from tests.integration.test_gateway_overload import SHAPE, conv_stack

pytestmark = [pytest.mark.ray, pytest.mark.grpc]


def test_ray_pool_answers_carry_utilisation_and_expected_wait(tmp_path, ray_local):
    served = serve_conv_stack(tmp_path, ray_local, "max_batch_size: 4\nmax_queue_delay_ms: 0\nintra_op_threads: 1\n"
                                                   "frontier: {default_cut_count: 0}\n")
    gateway, server, cut = served.gateway, served.server, served.cut
    x = {"x": np.ones(SHAPE, np.float32)}

    async def main():
        async with InferenceClient(server.address) as c:
            def one():
                return c.infer(make_request("s", "1", cut.cut_id, x, timeout_s=60.0))

            paced = []
            start = time.monotonic()
            while time.monotonic() - start < 1.5:  # past one whole second of arrivals
                paced.append(await one())
                await asyncio.sleep(0.02)
            burst = await asyncio.gather(*(one() for _ in range(32)))
            return paced, burst

    try:
        paced, burst = asyncio.run(main())
        view = gateway.load()["pools"][f"s@1@{cut.cut_id}"]
        gauge = gateway.metrics.sample("splitinfer_predicted_wait_seconds",
                                       {"model": "s", "version": "1", "cut": cut.cut_id})
    finally:
        asyncio.run_coroutine_threadsafe(gateway.close(), server._loop).result()
        server.stop()
    # The burst's answer that waited longest came after most of the others.
    quiet, busy = paced[-1].timings_ms, max((r.timings_ms for r in burst), key=lambda t: t["queue"])
    for t in (quiet, busy):
        assert {"utilisation", "expected_wait"} <= set(t), t
        assert t["utilisation"] >= 0 and t["expected_wait"] >= 0
        # No urgent request came: the urgent figure is the formula with none of the arrivals ahead.
        assert 0 <= t["urgent_expected_wait"] <= t["expected_wait"]
    # The paced phase's last answer counts a whole second of its arrivals.
    assert quiet["utilisation"] > 0
    # 32 requests at once queue behind each other on one replica: the answers say so.
    waited_ms = sorted(r.timings_ms["queue"] for r in burst)
    assert busy["expected_wait"] > quiet["expected_wait"]
    assert busy["expected_wait"] > 0.2 * waited_ms[len(waited_ms) // 2]
    assert max(r.timings_ms["batch_size"] for r in burst) > 1
    # [Note: a Ray pool's predicted wait]: nothing inside as the paced answer left; the burst's first
    # answers left many of the 32 behind them, queued beyond the running batch.
    assert quiet["predicted_wait"] == 0 and quiet["urgent_predicted_wait"] == 0
    assert max(r.timings_ms["predicted_wait"] for r in burst) > 0
    assert all(r.timings_ms["expected_wait"] >= r.timings_ms["predicted_wait"] for r in burst)
    # None came urgent: an urgent request would wait for the running batch only.
    most = max((r.timings_ms for r in burst), key=lambda t: t["predicted_wait"])
    assert most["urgent_predicted_wait"] < most["predicted_wait"]
    assert all(0 <= r.timings_ms["urgent_predicted_wait"] <= r.timings_ms["predicted_wait"] for r in burst)
    assert view["predicted_wait_ms"] == 0 and gauge == 0
    # The gateway's load view: capacity and arrivals from the same answers, nothing left inside.
    assert view["queue_depth"] == 0 and view["capacity_rps"] > 0 and view["arrival_rps"] >= 0
    assert view["headroom_rps"] == pytest.approx(view["capacity_rps"] - view["arrival_rps"], abs=0.01)  # each rounded to 0.001
    load = CloudLoad()
    load.observe_timings(cut.cut_id, busy, 0.0)
    assert load.queue_ms(0.0)[cut.cut_id] == pytest.approx(busy["expected_wait"])
    assert load.to_dict(0.0)["utilisation"] == {cut.cut_id: pytest.approx(busy["utilisation"])}


def test_ray_pool_counts_the_results_its_workers_discard(tmp_path, ray_local, monkeypatch):
    # About 0.7 s a run on one core here: a first request, which no timed run can refuse, ends
    # long after its 0.2 s deadline, and reaches the worker well before it.
    big = (1, 8, 256, 256)
    monkeypatch.setattr(ray_local, "DISCARDS_EVERY_S", 0.2)
    served = serve_conv_stack(tmp_path, ray_local, "max_batch_size: 1\nintra_op_threads: 1\n"
                                                   "frontier: {default_cut_count: 0}\n",
                              model=conv_stack(width=128, shape=big))
    gateway, server, cut = served.gateway, served.server, served.cut
    name, labels = f"s@1@{cut.cut_id}", {"model": "s", "version": "1", "cut": cut.cut_id}

    async def main():
        async with InferenceClient(server.address) as c:
            with pytest.raises(DeadlineExceeded):
                await c.infer(make_request("s", "1", cut.cut_id, {"x": np.ones(big, np.float32)}, timeout_s=0.2))

    try:
        asyncio.run(main())
        deadline = time.monotonic() + 30.0
        while gateway.load()["pools"][name]["discarded"] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        view = gateway.load()["pools"][name]
        counted = gateway.metrics.sample("splitinfer_discarded_results_total", labels)
    finally:
        asyncio.run_coroutine_threadsafe(gateway.close(), server._loop).result()
        server.stop()
    assert view["discarded"] == 1 and counted == 1
