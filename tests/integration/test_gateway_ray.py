"""The gateway with its tails on Ray actors (a local Ray cluster), over gRPC on 127.0.0.1."""

from __future__ import annotations

import asyncio

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from cluster.errors import DeadlineExceeded, ProtocolError
from cluster.gateway import Gateway
from cluster.protocol.client import SyncInferenceClient, make_request
from cluster.registry import Registry
from cluster.server import serve_in_thread
from tests.integration._gateway_support import write_version
from tests.integration._ray_gateway_support import ray_local  # noqa: F401 - fixture
from tests.onnx_models import conv_bn_relu_chain

pytestmark = [pytest.mark.ray, pytest.mark.grpc]


def test_ray_pools_serve_the_frontier_tails(tmp_path, ray_local):
    write_version(tmp_path / "repo", "m", "1", conv_bn_relu_chain(3),
                  "max_queue_delay_ms: 300\nmax_batch_size: 8\nfrontier: {default_cut_count: 1}\n")
    registry = Registry(str(tmp_path / "repo"))
    # Every request meets the worker's batcher (and its 300 ms wait), over the direct channel.
    gateway = Gateway(registry, ray_local.RayPoolFactory(provider="cpu"))
    registry.load_all()
    assert gateway.readiness()[0]
    lv = registry.resolve("m", "1")
    x = np.random.default_rng(0).standard_normal((1, 4, 5, 5)).astype(np.float32)
    want = ort.InferenceSession(lv.files.model_path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    cloud_only = lv.frontier.cuts[0]
    assert cloud_only.boundary == ("x",)
    server = serve_in_thread(gateway)
    try:
        with SyncInferenceClient(server.address) as c:
            resp = c.infer(make_request("m", "1", cloud_only.cut_id, {"x": x}, timeout_s=30))
            np.testing.assert_allclose(resp.outputs["y"], want, rtol=1e-4, atol=1e-5)
            assert resp.served_by == "m@1"
            with pytest.raises(ProtocolError):
                c.infer(make_request("m", "1", cloud_only.cut_id, {"x": x[:, :2]}, timeout_s=30))
            # The deadline travels to the actor's batcher, which waits 300 ms for company.
            with pytest.raises(DeadlineExceeded):
                c.infer(make_request("m", "1", cloud_only.cut_id, {"x": x}, timeout_s=0.1))
    finally:
        asyncio.run_coroutine_threadsafe(gateway.close(), server._loop).result()
        server.stop()


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_ray_pools_report_batch_sizes_and_queue_time_to_metrics(tmp_path, ray_local):
    import urllib.request

    from cluster.metrics import MetricsServer
    from cluster.protocol.client import InferenceClient

    # The workers wait up to 200 ms for company, so concurrent requests share batches.
    write_version(tmp_path / "repo", "m", "1", conv_bn_relu_chain(2),
                  "max_queue_delay_ms: 200\nmax_batch_size: 8\nfrontier: {default_cut_count: 0}\n")
    registry = Registry(str(tmp_path / "repo"))
    gateway = Gateway(registry, ray_local.RayPoolFactory(provider="cpu"))
    registry.load_all()
    cut = registry.resolve("m", "1").frontier.cuts[0]
    server = serve_in_thread(gateway)
    metrics_http = MetricsServer(gateway.metrics, gateway.readiness)
    n = 16
    xs = [np.random.default_rng(i).standard_normal((1, 4, 5, 5)).astype(np.float32) for i in range(n)]

    async def burst():
        async with InferenceClient(server.address) as c:
            return await asyncio.gather(*(c.infer(make_request("m", "1", cut.cut_id, {"x": x}, timeout_s=30))
                                          for x in xs))

    try:
        resps = asyncio.run(burst())
        assert all(r.served_by == "m@1" for r in resps)
        sizes = [r.timings_ms["batch_size"] for r in resps]
        assert max(sizes) > 1  # some requests shared a batch
        with urllib.request.urlopen(metrics_http.url + "/metrics", timeout=10) as fh:
            s = _samples(fh.read().decode())
    finally:
        metrics_http.stop()
        asyncio.run_coroutine_threadsafe(gateway.close(), server._loop).result()
        server.stop()
    # Every batch is counted once and every request is in exactly one batch.
    batches, requests_in_batches = s[("splitinfer_batch_size_count", ())], s[("splitinfer_batch_size_sum", ())]
    assert requests_in_batches == n and 1 <= batches < n
    queue = (("stage", "queue"),)
    assert s[("splitinfer_stage_latency_seconds_count", queue)] == n
    assert s[("splitinfer_stage_latency_seconds_sum", queue)] > 0
    assert s[("splitinfer_stage_latency_seconds_count", (("stage", "compute"),))] == n


def test_a_tail_that_no_node_can_take_is_reported_not_waited_on(tmp_path, ray_local):
    # A replica asks for a resource that no node offers: without a start timeout the
    # gateway's pool creation would wait for ever (and its requests with it).
    from cluster.errors import Unavailable
    from cluster.gateway import PoolKey
    from cluster.metrics import GatewayMetrics
    from cluster.registry import ModelConfig

    path = tmp_path / "tail.onnx"
    onnx.save(conv_bn_relu_chain(2), str(path))
    config = ModelConfig(ray_resources={"splitinfer-nowhere": 1})
    factory = ray_local.RayPoolFactory(provider="cpu", start_timeout_s=2)
    with pytest.raises(Unavailable) as caught:
        factory.create(PoolKey("m", "1", "c"), str(path), config, GatewayMetrics())
    message = str(caught.value)
    assert "within 2 s" in message
    assert "{'splitinfer-nowhere': 1}" in message  # what each replica asked for
    assert "offers {'splitinfer-nowhere': 0.0}" in message  # and what the cluster has of it
    assert "--pool-start-timeout-s" in message and "rayResources" in message
    # The same factory still makes pools that fit.
    pool = factory.create(PoolKey("m", "1", "d"), str(path), ModelConfig(), GatewayMetrics())
    x = np.random.default_rng(1).standard_normal((1, 4, 5, 5)).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    async def serve_one():
        try:
            return await pool.run({"x": x}, deadline_s=None, priority=0)
        finally:
            await pool.close()

    np.testing.assert_allclose(asyncio.run(serve_one()).outputs["y"], want, rtol=1e-4, atol=1e-5)


def test_ray_pools_serve_a_tail_over_symbolic_h_and_w_at_two_shapes(tmp_path, ray_local):
    from tests.serving_models import any_hw_model

    d = tmp_path / "repo" / "hw" / "1"
    d.mkdir(parents=True)
    model = any_hw_model()
    onnx.save(model, str(d / "model.onnx"))
    np.savez(d / "inputs.npz", x=np.ones((1, 4, 6, 6), np.float32))
    (d / "model.yaml").write_text("sample_inputs: inputs.npz\nfrontier: {default_cut_count: 0}\n")
    registry = Registry(str(tmp_path / "repo"))
    gateway = Gateway(registry, ray_local.RayPoolFactory(provider="cpu"))
    registry.load_all()
    assert gateway.readiness()[0]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    server = serve_in_thread(gateway)
    try:
        with SyncInferenceClient(server.address) as c:
            for shape in ((1, 4, 3, 3), (1, 4, 7, 5), (1, 4, 64, 96), (1, 4, 3, 3)):  # 96 KiB: the shared arena
                x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
                resp = c.infer(make_request("hw", "1", "L", {"x": x}, timeout_s=30))
                np.testing.assert_allclose(resp.outputs["y"], sess.run(None, {"x": x})[0], rtol=1e-4, atol=1e-5)
            with pytest.raises(ProtocolError):
                c.infer(make_request("hw", "1", "L", {"x": np.zeros((1, 3, 4, 4), np.float32)}, timeout_s=30))
    finally:
        asyncio.run_coroutine_threadsafe(gateway.close(), server._loop).result()
        server.stop()
