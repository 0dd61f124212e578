"""The gateway over real gRPC on 127.0.0.1 with in-process pools (real ORT engines and batchers):
routing, canary, rollback with requests in flight, deadlines, errors, artifacts."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import onnx
import pytest

from cluster.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    ProtocolError,
    UnknownCutError,
    UnknownModelError,
    UnknownVersionError,
)
from cluster.gateway import Gateway, LocalPoolFactory, PoolKey
from cluster.protocol.client import InferenceClient, InferResult, SyncInferenceClient, make_request
from cluster.protocol.encoding import encode
from cluster.registry import Registry, route
from cluster.server import serve_in_thread
from tests.integration._barrier import meet_at_a_barrier
from tests.onnx_models import conv_bn_relu_chain

pytestmark = pytest.mark.grpc

# v2 waits up to 400 ms to fill a batch of 64: requests stay in flight long enough to roll back under them.
SLOW_BATCH = "max_batch_size: 64\nmax_queue_delay_ms: 400\n"


def make_repo(root, versions=(("1", ""), ("2", SLOW_BATCH)), model="m") -> str:
    for i, (v, yml) in enumerate(versions):
        d = os.path.join(root, model, v)
        os.makedirs(d)
        onnx.save(conv_bn_relu_chain(3, seed=i), os.path.join(d, "model.onnx"))
        with open(os.path.join(d, "model.yaml"), "w") as fh:
            fh.write(yml + "frontier: {default_cut_count: 1}\n")
    return str(root)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = make_repo(tmp_path_factory.mktemp("repo"))
    registry = Registry(root, cache_dir=str(tmp_path_factory.mktemp("cache")))
    gateway = Gateway(registry, LocalPoolFactory(cache_dir=str(tmp_path_factory.mktemp("ort"))))
    registry.load("m", "1")
    registry.load("m", "2")
    registry.set_default("m", "1")
    server = serve_in_thread(gateway)
    yield registry, gateway, server
    stop(server, gateway)


def stop(server, gateway) -> None:
    """Closes the pools on the server's loop (their batchers live there), then the server."""
    asyncio.run_coroutine_threadsafe(gateway.close(), server._loop).result()
    server.stop()


def x_input(seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, 4, 5, 5)).astype(np.float32)


def whole_model(registry, version, x, path=None) -> np.ndarray:
    import onnxruntime as ort

    path = path or registry.resolve("m", version).files.model_path
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def head_outputs(registry, version, cut_id, x) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    lv = registry.resolve("m", version)
    cut = lv.files.resolve_cut(cut_id)
    head, _ = lv.files.splitter().split(cut)
    sess = ort.InferenceSession(head.model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, {"x": x})))


def test_frontier_tails_are_preloaded_and_the_gateway_is_ready(stack):
    registry, gateway, server = stack
    ready, detail = gateway.readiness()
    assert ready, detail
    for lv in registry.loaded():
        for cut in lv.frontier.cut_ids:
            assert PoolKey("m", lv.version, cut) in gateway._pools
    with SyncInferenceClient(server.address) as c:
        assert c.health() == "SERVING"


def test_infer_on_each_frontier_cut_equals_the_whole_model(stack):
    registry, _, server = stack
    x = x_input(1)
    want = whole_model(registry, "1", x)
    lv = registry.resolve("m", "1")
    with SyncInferenceClient(server.address) as c:
        for cut in lv.frontier.cuts:
            boundary = {"x": x} if not cut.edge_layers else head_outputs(registry, "1", cut.cut_id, x)
            boundary = {k: boundary[k] for k in cut.boundary}
            resp = c.infer(make_request("m", "1", cut.cut_id, boundary))
            assert resp.served_by == "m@1"
            np.testing.assert_allclose(resp.outputs["y"], want, rtol=1e-4, atol=1e-5)
            assert {"queue", "compute", "decode", "encode"} <= set(resp.timings_ms)
            assert "load" not in resp.timings_ms  # preloaded
        # An fp16-encoded boundary is decoded before the tail runs.
        cut = lv.frontier.cuts[-1]
        b = head_outputs(registry, "1", cut.cut_id, x)
        resp = c.infer(make_request("m", "1", cut.cut_id, {k: encode(b[k], precision="fp16", compression="zstd") for k in cut.boundary}))
        np.testing.assert_allclose(resp.outputs["y"], want, rtol=1e-2, atol=1e-2)


def test_a_cut_outside_the_frontier_is_cut_on_demand(stack):
    registry, gateway, server = stack
    lv = registry.resolve("m", "1")
    from partitioner import candidate_cuts

    graph = lv.files.splitter().graph
    extra = next(c for c in candidate_cuts(graph) if 0 < len(c.device) < len(graph) and c.key not in lv.frontier.cut_ids)
    x = x_input(2)
    head = head_outputs(registry, "1", extra.key, x)
    from partitioner import boundary

    with SyncInferenceClient(server.address) as c:
        resp = c.infer(make_request("m", "1", extra.key, {k: head[k] for k in boundary(graph, extra)}))
        again = c.infer(make_request("m", "1", extra.key, {k: head[k] for k in boundary(graph, extra)}))
    np.testing.assert_allclose(resp.outputs["y"], whole_model(registry, "1", x), rtol=1e-4, atol=1e-5)
    assert os.path.exists(os.path.join(lv.files.path, "segments", extra.key, "tail.onnx"))
    # [Note: tail load time]: the first request waited for the tail to load, and says so as server time.
    assert resp.timings_ms["load"] > 0 and "load" not in again.timings_ms
    assert InferResult.of(resp.to_msgpack(), 0, 1.0).server_ms >= resp.timings_ms["load"]


def test_unknown_model_version_cut_and_bad_tensors_are_errors(stack):
    registry, gateway, server = stack
    cut = registry.resolve("m", "1").frontier.cuts[0]
    x = {"x": x_input()}
    with SyncInferenceClient(server.address) as c:
        with pytest.raises(UnknownModelError, match="'nope'"):
            c.infer(make_request("nope", "1", cut.cut_id, x))
        with pytest.raises(UnknownVersionError, match="known versions: '2', '1'"):
            c.infer(make_request("m", "7", cut.cut_id, x))
        with pytest.raises(UnknownCutError, match="'zzz'"):
            c.infer(make_request("m", "1", "zzz", x))
        with pytest.raises(ProtocolError):
            c.infer(make_request("m", "1", cut.cut_id, {"wrong": x["x"]}))
        with pytest.raises(FailedPrecondition, match="profiles/cloud.json"):  # no profiles in this registry
            c.plan({"model": "m", "edge": "rpi4", "uplink": 1e6})
    m = gateway.metrics
    assert m.sample("splitinfer_requests_total", {"model": "nope", "version": "1", "status": "NOT_FOUND"}) == 1.0
    assert m.sample("splitinfer_requests_total", {"model": "m", "version": "1", "status": "INVALID_ARGUMENT"}) == 1.0


def test_deadline_reaches_the_batcher_and_the_request_never_runs(stack):
    registry, gateway, server = stack
    lv = registry.resolve("m", "2")
    cut = lv.frontier.cuts[0]
    pool = gateway._pools[PoolKey("m", "2", cut.cut_id)]
    before = pool.batches
    with SyncInferenceClient(server.address) as c:
        with pytest.raises(DeadlineExceeded):
            # v2 waits 400 ms for a batch to fill: a 100 ms deadline passes in the queue.
            c.infer(make_request("m", "2", cut.cut_id, {"x": x_input()}, timeout_s=0.1))
    time.sleep(0.5)
    assert pool.batches == before
    rejected = pool.batcher.stats().rejected
    assert rejected.get("deadline", 0) + rejected.get("cancelled", 0) >= 1


def test_canary_routes_the_same_ten_percent_of_devices(stack):
    registry, gateway, server = stack
    cut = registry.resolve("m", "1").frontier.cuts[0]
    registry.set_canary("m", "2", 10.0)
    try:
        devices = [f"cam-{i}" for i in range(60)]
        expected = {d: f"m@{route('m', '1', registry.canary('m'), d)}" for d in devices}
        assert "m@2" in expected.values() and "m@1" in expected.values()

        async def run() -> dict[str, str]:
            async with InferenceClient(server.address) as c:
                rs = await asyncio.gather(*(c.infer(make_request("m", "", cut.cut_id, {"x": x_input()}, device_id=d))
                                            for d in devices))
            return {d: r.served_by for d, r in zip(devices, rs)}

        assert asyncio.run(run()) == expected
        art = SyncInferenceClient(server.address)
        canary_dev = next(d for d, v in expected.items() if v == "m@2")
        assert art.get_artifacts("m", "", device_id=canary_dev).version == "2"
        stable_dev = next(d for d, v in expected.items() if v == "m@1")
        assert art.get_artifacts("m", "", device_id=stable_dev).version == "1"
        assert set(art.get_artifacts("m", "1").files) == {"model.onnx", "model.yaml", "frontier.json"}
        art.close()
    finally:
        registry.rollback("m", unload=False)


def test_rollback_with_50_requests_in_flight_loses_none(tmp_path):
    root = make_repo(tmp_path / "repo")
    registry = Registry(root)
    gateway = Gateway(registry, LocalPoolFactory(cache_dir=str(tmp_path / "ort")))
    registry.load("m", "1")
    registry.load("m", "2")
    registry.set_canary("m", "2", 100.0)
    v2 = registry.resolve("m", "2")
    cut = v2.frontier.cuts[0]
    x = x_input(3)
    server = serve_in_thread(gateway)
    try:

        async def run() -> list:
            async with InferenceClient(server.address) as c:
                tasks = [asyncio.ensure_future(c.infer(make_request("m", "", cut.cut_id, {"x": x}, device_id=f"d{i}",
                                                                    timeout_s=20)))
                         for i in range(50)]
                for _ in range(400):
                    if v2.in_flight == 50:
                        break
                    await asyncio.sleep(0.005)
                assert v2.in_flight == 50
                assert registry.rollback("m") == "2"
                after = await c.infer(make_request("m", "", cut.cut_id, {"x": x}, device_id="d0"))
                return [after] + list(await asyncio.gather(*tasks, return_exceptions=True))

        after, *results = asyncio.run(run())
        assert after.served_by == "m@1"
        assert [r.served_by for r in results] == ["m@2"] * 50
        want = whole_model(registry, "2", x, path=v2.files.model_path)
        for r in results:
            np.testing.assert_allclose(r.outputs["y"], want, rtol=1e-4, atol=1e-5)
        assert v2.drained.wait(5)
        for _ in range(100):
            if not any(k.version == "2" for k in gateway._pools):
                break
            time.sleep(0.01)
        assert not any(k.version == "2" for k in gateway._pools)
        assert gateway.metrics.sample("splitinfer_requests_total", {"model": "m", "version": "2", "status": "OK"}) == 50
    finally:
        stop(server, gateway)


def test_infer_stream_answers_in_order_with_errors_in_place(stack):
    registry, _, server = stack
    cut = registry.resolve("m", "1").frontier.cuts[0]
    reqs = [make_request("m", "1", cut.cut_id, {"x": x_input(i)}, request_id=f"r{i}") for i in range(6)]
    reqs[3] = make_request("m", "1", "missing", {"x": x_input()}, request_id="bad")
    with SyncInferenceClient(server.address) as c:
        out = list(c.infer_stream(reqs, timeout_s=30))
    assert isinstance(out[3], UnknownCutError)
    assert [r.request_id for i, r in enumerate(out) if i != 3] == ["r0", "r1", "r2", "r4", "r5"]
    want = whole_model(registry, "1", x_input(4))
    np.testing.assert_allclose(out[4].outputs["y"], want, rtol=1e-4, atol=1e-5)


def test_worker_errors_map_to_cluster_errors_and_status_codes():
    import grpc

    from cluster.errors import InternalError, ResourceExhausted, Unavailable
    from cluster.gateway import to_cluster_error
    from cluster.protocol.status import status_of
    from workers import errors as W

    cases = [
        (W.DeadlineExceededError("late", deadline_s=1.0, now_s=1.5), DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
        (W.QueueFullError("full", queue_size=4, max_queue_size=4), ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (W.InputError("bad shape"), ProtocolError, grpc.StatusCode.INVALID_ARGUMENT),
        (W.BatcherClosedError("closed", pending=0), Unavailable, grpc.StatusCode.UNAVAILABLE),
        (W.EngineLoadError("no", stage="session"), Unavailable, grpc.StatusCode.UNAVAILABLE),
        (RuntimeError("boom"), InternalError, grpc.StatusCode.INTERNAL),
    ]
    for exc, cls, code in cases:
        err = to_cluster_error(exc, "m@1@c")
        assert type(err) is cls, exc
        assert status_of(err) is code
    assert to_cluster_error(cases[1][0], "m@1@c").limit == 4
    assert "boom" not in to_cluster_error(RuntimeError("boom"), "m@1@c").message


def test_request_size_limit_of_model_yaml_is_enforced_before_the_pool(tmp_path):
    from cluster.errors import ResourceExhausted
    from cluster.server import RequestContext

    root = make_repo(tmp_path / "repo", versions=(("1", "max_request_bytes: 256\n"),))
    registry = Registry(root)
    gateway = Gateway(registry, LocalPoolFactory(cache_dir=str(tmp_path / "ort")))
    registry.load_all()
    cut = registry.resolve("m", "1").frontier.cuts[0]

    async def call():
        now = time.monotonic()
        ctx = RequestContext(method="Infer", received_monotonic_s=now, deadline_monotonic_s=now + 5)
        try:
            return await gateway.infer(make_request("m", "1", cut.cut_id, {"x": x_input()}), ctx)
        finally:
            await gateway.close()

    with pytest.raises(ResourceExhausted, match="request size of m@1 exhausted \\(limit 256\\)"):
        asyncio.run(call())
    assert gateway.backend_calls == 0


def test_in_process_replicas_run_their_batches_at_once_on_engines_sharing_weights(tmp_path):
    import onnxruntime as ort

    from cluster.gateway import LocalPool
    from cluster.metrics import GatewayMetrics
    from cluster.registry import ModelConfig

    path = str(tmp_path / "chain.onnx")
    onnx.save(conv_bn_relu_chain(3), path)
    pool = LocalPool(PoolKey("m", "1", "c0"), path, ModelConfig(max_batch_size=1, replicas=2, intra_op_threads=1),
                     GatewayMetrics(), cache_dir=str(tmp_path / "cache"))
    used = meet_at_a_barrier(pool.engines)  # two batches at once, on two engines
    xs = [x_input(seed) for seed in (1, 2)]

    shared = [e.shared_weight_bytes for e in pool.engines]

    async def main():
        try:
            return await asyncio.gather(*(pool.run({"x": x}, deadline_s=None, priority=0) for x in xs))
        finally:
            await pool.close()

    results = asyncio.run(main())
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for x, r in zip(xs, results):
        np.testing.assert_allclose(r.outputs["y"], sess.run(None, {"x": x})[0], rtol=1e-4, atol=1e-5)
    assert sorted(used) == sorted(id(e) for e in pool.engines)
    assert shared[0] > 0 and shared[0] == shared[1]  # both borrow the process-wide weight set
