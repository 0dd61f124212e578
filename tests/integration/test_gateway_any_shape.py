"""Serving any shape through a real gateway on 127.0.0.1 (in-process pools): tails over
symbolic H and W answer requests of two sizes in one run, batched within a size and never
across; their engines warm up on what the head makes of the registry's sample inputs; a
model whose int64 input sets a shape serves without sample inputs."""

from __future__ import annotations

import asyncio

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from cluster.gateway import Gateway, LocalPoolFactory, PoolKey
from cluster.protocol.client import InferenceClient, SyncInferenceClient, make_request
from cluster.registry import Registry
from cluster.server import serve_in_thread
from tests.serving_models import any_hw_model, reshape_by_input_model

pytestmark = pytest.mark.grpc


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    d = root / "hw" / "1"
    d.mkdir(parents=True)
    onnx.save(any_hw_model(), str(d / "model.onnx"))
    np.savez(d / "inputs.npz", x=np.random.default_rng(0).standard_normal((2, 4, 6, 6)).astype(np.float32))
    # A delay long enough that requests sent together meet in the queue.
    (d / "model.yaml").write_text("max_batch_size: 4\nmax_queue_delay_ms: 300\nsample_inputs: inputs.npz\n"
                                  "frontier: {default_cut_count: 1}\n")
    d = root / "reshape" / "1"
    d.mkdir(parents=True)
    onnx.save(reshape_by_input_model(), str(d / "model.onnx"))
    registry = Registry(str(root), cache_dir=str(tmp_path_factory.mktemp("cache")))
    gateway = Gateway(registry, LocalPoolFactory(cache_dir=str(tmp_path_factory.mktemp("ort"))))
    server = serve_in_thread(gateway)
    try:
        asyncio.run_coroutine_threadsafe(gateway.start(keep_going=True), server._loop).result(120)
        yield gateway, server
    finally:
        asyncio.run_coroutine_threadsafe(gateway.close(), server._loop).result()
        server.stop()


def _whole(x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(any_hw_model().SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def test_tails_over_symbolic_h_and_w_warm_up_on_the_sample_inputs(stack):
    gateway, _ = stack
    ready, detail = gateway.readiness()
    assert ready and detail["failed"] == {}, detail
    lv = gateway.registry.resolve("hw", "1")
    assert len(lv.frontier.cut_ids) == 2
    for cut in lv.frontier.cut_ids:
        engine = gateway._pools[PoolKey("hw", "1", cut)].engines[0]
        assert engine.any_shape and engine.warmed_up == "samples"


def test_two_shapes_are_served_in_one_run_and_batched_within_shape(stack):
    _, server = stack
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(shape).astype(np.float32)
          for shape in ((1, 4, 3, 3), (1, 4, 5, 7), (1, 4, 3, 3), (1, 4, 5, 7))]

    async def send_together():
        async with InferenceClient(server.address) as c:
            return await asyncio.gather(*(c.infer(make_request("hw", "1", "L", {"x": x})) for x in xs))

    responses = asyncio.run(send_together())
    for x, resp in zip(xs, responses):
        np.testing.assert_allclose(resp.outputs["y"], _whole(x), rtol=1e-4, atol=1e-5)
    sizes = [resp.timings_ms["batch_size"] for resp in responses]
    # Two of each shape: a batch never mixes them, and each pair met in one batch.
    assert sizes == [2.0, 2.0, 2.0, 2.0], sizes


def test_a_later_cut_serves_two_shapes(stack):
    gateway, server = stack
    lv = gateway.registry.resolve("hw", "1")
    cut = [c for c in lv.frontier.cuts if c.edge_layers][0]
    head, _ = lv.files.splitter().split(lv.files.resolve_cut(cut.cut_id))
    sess = ort.InferenceSession(head.model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    with SyncInferenceClient(server.address) as c:
        for shape in ((1, 4, 2, 9), (1, 4, 4, 4)):
            x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
            boundary = dict(zip(names, sess.run(None, {"x": x})))
            resp = c.infer(make_request("hw", "1", cut.cut_id, {k: boundary[k] for k in cut.boundary}))
            np.testing.assert_allclose(resp.outputs["y"], _whole(x), rtol=1e-4, atol=1e-5)


def test_a_model_whose_int64_input_sets_a_shape_serves_without_sample_inputs(stack):
    gateway, server = stack
    engine = gateway._pools[PoolKey("reshape", "1", "L")].engines[0]
    assert engine.warmed_up.startswith("skipped: its integer inputs shape set shapes")
    x = np.arange(6, dtype=np.float32)[None]
    with SyncInferenceClient(server.address) as c:
        resp = c.infer(make_request("reshape", "1", "L", {"x": x, "shape": np.array([2, 3])}))
    np.testing.assert_array_equal(resp.outputs["y"], x.reshape(2, 3))
