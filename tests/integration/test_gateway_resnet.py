"""End to end on ResNet50 (the zoo topology with seeded random weights): the head runs here
with ONNX Runtime, its boundary goes over gRPC on 127.0.0.1 to the gateway, whose
preloaded tail answers; the answer equals the whole model's."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from cluster.gateway import Gateway, LocalPoolFactory
from cluster.protocol.client import SyncInferenceClient, make_request
from cluster.protocol.encoding import encode
from cluster.registry import Registry
from cluster.server import serve_in_thread
from partitioner import load_zoo

pytestmark = [pytest.mark.grpc, pytest.mark.slow]


def _session(model: onnx.ModelProto | str) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    src = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(src, opts, providers=["CPUExecutionProvider"])


def test_resnet50_tail_over_grpc_equals_the_whole_model(tmp_path):
    d = tmp_path / "repo" / "resnet50" / "1"
    d.mkdir(parents=True)
    onnx.save(load_zoo("resnet50", random_weights=True, seed=7), str(d / "model.onnx"))
    # One chain cut in the middle keeps the test to one tail; docs/registry.md has the defaults.
    (d / "model.yaml").write_text("max_batch_size: 2\nfrontier: {default_cut_count: 1, include_cloud_only: false}\n")
    registry = Registry(str(tmp_path / "repo"))
    gateway = Gateway(registry, LocalPoolFactory(cache_dir=str(tmp_path / "ort")))
    registry.load_all()
    assert gateway.readiness()[0]
    lv = registry.resolve("resnet50", "")
    (cut,) = lv.frontier.cuts
    assert cut.edge_layers and len(cut.boundary) == 1

    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    whole = _session(lv.files.model_path)
    want = whole.run(None, {whole.get_inputs()[0].name: x})[0]
    head, _ = lv.files.splitter().split(lv.files.resolve_cut(cut.cut_id))
    hs = _session(head.model)
    bnd = dict(zip([o.name for o in hs.get_outputs()], hs.run(None, {hs.get_inputs()[0].name: x})))
    server = serve_in_thread(gateway)
    try:
        with SyncInferenceClient(server.address) as c:
            resp = c.infer(make_request("resnet50", "1", cut.cut_id, {k: bnd[k] for k in cut.boundary}, timeout_s=60))
            (name,) = resp.outputs
            got = resp.outputs[name]
            assert got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
            assert int(np.argmax(got)) == int(np.argmax(want))
            # int8 on the wire (4x fewer bytes) still gives the same class.
            q = {k: encode(bnd[k], precision="int8") for k in cut.boundary}
            resp8 = c.infer(make_request("resnet50", "1", cut.cut_id, q, timeout_s=60))
            assert int(np.argmax(resp8.outputs[name])) == int(np.argmax(want))
            assert resp.served_by == "resnet50@1"
    finally:
        asyncio.run_coroutine_threadsafe(gateway.close(), server._loop).result()
        server.stop()
    assert os.path.exists(os.path.join(lv.files.path, "segments", cut.cut_id, "tail.onnx"))
