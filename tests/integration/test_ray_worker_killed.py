"""A gateway whose tail runs on two Ray worker processes, one of them killed (SIGKILL) while it
holds requests: every request sent over gRPC gets exactly one answer, its own, either the
correct result or a clear, retry-able error (UNAVAILABLE). The replica pool sends a request
whose worker died to the other one ([Note: fault tolerance] in workers/actors.py), Ray starts
the killed worker again, and the gateway serves on. Real gRPC on 127.0.0.1, real ONNX Runtime
against a plain session of the same model."""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import onnxruntime as ort
import pytest

from cluster.errors import ClusterError
from cluster.gateway import PoolKey
from cluster.protocol.client import InferenceClient, make_request
from tests.integration._ray_gateway_support import ray_local, serve_conv_stack  # noqa: F401 - fixture
from tests.integration.test_gateway_overload import SHAPE

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.grpc, pytest.mark.timeout(300)]


def test_a_worker_killed_under_load_loses_no_request(tmp_path, ray_local):
    served = serve_conv_stack(tmp_path, ray_local, "replicas: 2\nmax_batch_size: 4\nmax_queue_delay_ms: 2\n"
                                                   "intra_op_threads: 1\nfrontier: {default_cut_count: 0}\n")
    d, gateway, server, cut = served.model_dir, served.gateway, served.server, served.cut
    pool = gateway._pools[PoolKey("s", "1", cut.cut_id)].pool
    rng = np.random.default_rng(2)
    frames = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(8)]
    sess = ort.InferenceSession(str(d / "model.onnx"), providers=["CPUExecutionProvider"])
    refs = [sess.run(None, {"x": x})[0] for x in frames]
    n_requests, concurrency = 160, 8
    outcomes: list[tuple[int, object]] = []

    async def main():
        pids = [(await r.health.remote())["pid"] for r in pool.replicas]
        sent = iter(range(n_requests))
        killed = asyncio.Event()
        async with InferenceClient(server.address) as c:
            async def client():
                for k in sent:
                    request = make_request("s", "1", cut.cut_id, {"x": frames[k % len(frames)]}, timeout_s=60.0,
                                           request_id=f"r{k}")
                    try:
                        outcomes.append((k, await c.infer(request)))
                    except ClusterError as e:
                        outcomes.append((k, e))

            async def killer():
                # The worker dies while it holds requests, once the pool is warm.
                while len(outcomes) < 24 or pool.stats().in_flight[0] == 0:
                    if len(outcomes) == n_requests:
                        return  # everything finished first: the assertion below says so
                    await asyncio.sleep(0.001)
                os.kill(pids[0], signal.SIGKILL)
                killed.set()

            await asyncio.gather(killer(), *(client() for _ in range(concurrency)))
            assert killed.is_set()
            # Ray starts the killed worker again, and the pool routes to it once it is back.
            health: dict = {"pid": pids[0]}
            for _ in range(600):
                try:
                    health = await pool.replicas[0].health.remote()
                except ray.exceptions.RayActorError:  # restarting
                    await asyncio.sleep(0.1)
                    continue
                if health["pid"] != pids[0]:
                    break
                await asyncio.sleep(0.1)
            after = await c.infer(make_request("s", "1", cut.cut_id, {"x": frames[0]}, timeout_s=60.0))
        return pids, health, after

    try:
        pids, health, after = asyncio.run(main())
        stats = pool.stats()
    finally:
        asyncio.run_coroutine_threadsafe(gateway.close(), server._loop).result()
        server.stop()
    assert sorted(k for k, _ in outcomes) == list(range(n_requests))  # each request answered once
    ok = [(k, o) for k, o in outcomes if not isinstance(o, BaseException)]
    failed = [o for _, o in outcomes if isinstance(o, BaseException)]
    for k, resp in ok:
        assert resp.request_id == f"r{k}"
        np.testing.assert_allclose(resp.outputs["y"], refs[k % len(frames)], rtol=1e-4, atol=1e-5)
    assert all(e.retryable and "restarting" in str(e) for e in failed), failed
    assert stats.replica_failures >= 1 and stats.retries >= 1
    assert stats.completed + stats.failed + stats.errors == stats.requests and stats.errors == 0
    assert stats.in_flight == (0, 0)
    assert health["pid"] not in pids
    np.testing.assert_allclose(after.outputs["y"], refs[0], rtol=1e-4, atol=1e-5)
