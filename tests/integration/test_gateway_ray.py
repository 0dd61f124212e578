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
from tests.onnx_models import conv_bn_relu_chain

pytestmark = [pytest.mark.ray, pytest.mark.grpc]


@pytest.fixture(scope="module")
def ray_local():
    from cluster import ray_cluster

    started = not __import__("ray").is_initialized()
    ray_cluster.connect("local", num_cpus=2)
    yield ray_cluster
    if started:
        ray_cluster.shutdown()


def test_ray_pools_serve_the_frontier_tails(tmp_path, ray_local):
    d = tmp_path / "repo" / "m" / "1"
    d.mkdir(parents=True)
    onnx.save(conv_bn_relu_chain(3), str(d / "model.onnx"))
    (d / "model.yaml").write_text("max_queue_delay_ms: 300\nmax_batch_size: 8\nfrontier: {default_cut_count: 1}\n")
    registry = Registry(str(tmp_path / "repo"))
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
