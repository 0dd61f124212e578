"""The PyTorch backend (workers/_torch_engine.py) on the CPU: conversion, equality with
ONNX Runtime, FP16's tolerance, the missing-op error, and the Engine interface through
the batcher. Skips, with the reason, where torch or onnx2torch is not installed."""

from __future__ import annotations

import asyncio

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from tests.unit._engine_models import make_small_cnn, make_transformer_block, ort_row_by_row, small_cnn_input
from workers._ort import wants_torch
from workers.batcher import Batcher, BatcherConfig
from workers.engine import Engine, EngineConfig
from workers.errors import EngineLoadError

from workers._torch_engine import torch_available

torch_missing = torch_available()

needs_torch = pytest.mark.skipif(torch_missing is not None, reason=torch_missing or "")

CPU = EngineConfig(provider="torch-cpu", batch_buckets=(1, 2, 4, 8))


def test_torch_providers_are_config_values_and_route_to_torch():
    assert EngineConfig(provider="torch-cuda").provider == "torch-cuda"
    assert wants_torch("torch-cpu") and wants_torch("torch-cuda")
    assert not wants_torch("cpu") and not wants_torch("cuda")
    with pytest.raises(EngineLoadError, match="torch-cuda or torch-cpu"):
        EngineConfig(provider="torch")


def test_a_torch_cuda_worker_asks_ray_for_a_gpu():
    from workers._pool import num_gpus_for

    assert num_gpus_for(EngineConfig(provider="torch-cuda")) == 1.0
    assert num_gpus_for(EngineConfig(provider="torch-cpu")) == 0.0


def test_auto_stays_on_onnxruntime_without_a_gpu():
    import importlib.util

    gpu_ort = {"CUDAExecutionProvider", "TensorrtExecutionProvider"} & set(ort.get_available_providers())
    torch_gpu = False
    if torch_missing is None:
        import torch

        torch_gpu = torch.cuda.is_available()
    assert wants_torch("auto") == (not gpu_ort and torch_gpu and importlib.util.find_spec("onnx2torch") is not None)
    if not wants_torch("auto"):
        assert type(Engine(make_small_cnn(), EngineConfig(provider="auto"))).__name__ == "Engine"


@needs_torch
def test_engine_with_torch_provider_is_the_torch_backend_and_equals_ort():
    model = make_small_cnn()
    eng = Engine(model, CPU)
    assert type(eng).__name__ == "TorchEngine" and eng.provider == "torch-cpu"
    assert eng.batch_safe and eng.max_batch == 8 and eng.verify_error <= 1e-3
    x = small_cnn_input(3, 4)
    np.testing.assert_allclose(eng.run({"x": x})["y"], ort_row_by_row(model, {"x": x})[0], rtol=1e-4, atol=1e-5)
    outs = eng.run_batch([{"x": small_cnn_input(1, i)} for i in range(5)])
    for i, out in enumerate(outs):
        want = ort_row_by_row(model, {"x": small_cnn_input(1, i)})[0]
        np.testing.assert_allclose(out["y"], want, rtol=1e-4, atol=1e-5)
    assert eng.stats().run_count >= 1 and eng.stats().provider == "torch-cpu"


@needs_torch
def test_outputs_are_written_where_place_puts_them():
    eng = Engine(make_small_cnn(seed=8), CPU)
    x = small_cnn_input(2, 1)
    target = np.zeros((2, eng.outputs[0].shape[1]), np.float32)
    out = eng.run({"x": x}, place=lambda buf: (target, target.ctypes.data), rows=2)
    assert out["y"] is target and np.array_equal(target, eng.run({"x": x})["y"])


@needs_torch
def test_transformer_block_equals_ort():
    block = make_transformer_block()
    eng = Engine(block, CPU)
    feed = {"x": np.random.default_rng(0).standard_normal((2, 8, 32)).astype(np.float32),
            "mask": np.ones((2, 8), np.int64)}
    np.testing.assert_allclose(eng.run(feed)["y"], ort_row_by_row(block, feed)[0], rtol=1e-3, atol=1e-4)


@needs_torch
def test_fp16_is_within_its_tolerance():
    from workers._torch_engine import TOLERANCE, TorchEngine, relative_error

    model = make_small_cnn()
    eng = TorchEngine(model, CPU, precision="fp16")
    x = small_cnn_input(2, 9)
    got = eng.run({"x": x})["y"]
    assert got.dtype == np.float32
    err = relative_error(got, ort_row_by_row(model, {"x": x})[0])
    assert 0 < err <= TOLERANCE["fp16"]


@needs_torch
def test_missing_op_names_the_op_and_the_fallback():
    node = helper.make_node("DFT", ["x"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 8, 1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 8, 2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(EngineLoadError, match=r"no converter for op DFT.*provider='cpu'"):
        Engine(model, CPU)


@needs_torch
def test_weights_are_shared_between_engines_of_one_model():
    model = make_small_cnn(seed=3)
    a, b = Engine(model, CPU), Engine(model, CPU)
    assert a.module is b.module and a.shared_weight_bytes() > 0
    c = Engine(model, EngineConfig(provider="torch-cpu", share_weights=False))
    assert c.module is not a.module and c.shared_weight_bytes() == 0


@needs_torch
def test_through_the_batcher():
    model = make_small_cnn(seed=5)
    eng = Engine(model, CPU)

    async def main():
        batcher = Batcher(eng.run_batch, BatcherConfig(max_batch_size=8, max_queue_delay_ms=5))
        xs = [small_cnn_input(1, 100 + i) for i in range(12)]
        outs = await asyncio.gather(*(batcher.submit({"x": x}) for x in xs))
        await batcher.close()
        return xs, outs

    xs, outs = asyncio.run(main())
    for x, out in zip(xs, outs):
        np.testing.assert_allclose(out["y"], ort_row_by_row(model, {"x": x})[0], rtol=1e-4, atol=1e-5)
    assert eng.stats().run_count < 12  # batches formed


@needs_torch
def test_zoo_tail_equals_ort():
    import partitioner

    model = partitioner.load_zoo("squeezenet", random_weights=True)
    graph = partitioner.build_graph(model)
    _, tail = partitioner.split(model, partitioner.prefix_cut(graph, 28), graph=graph)
    eng = Engine(tail.model, EngineConfig(provider="torch-cpu", batch_buckets=(1, 2)))
    feed = eng.random_inputs(1, seed=3)
    for got, want in zip(eng.run(feed).values(), ort_row_by_row(tail.model, feed)):
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)


def _reshape_model(shape_also_added: bool):
    """x [N, 4, 2] -> Reshape to [-1, 8] -> + c; the shape constant is also added to the
    output when ``shape_also_added`` (then something besides Reshape reads it)."""
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [-1, 8])
    c = helper.make_tensor("c", TensorProto.FLOAT, [8], [0.5] * 8)
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("Add", ["r", "c"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])]
    if shape_also_added:
        nodes.append(helper.make_node("Identity", ["shape"], ["s"]))
        outputs.append(helper.make_tensor_value_info("s", TensorProto.INT64, [2]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 2])],
                              outputs, initializer=[shape, c])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@needs_torch
@pytest.mark.parametrize("also_read", [False, True])
def test_shape_constants_are_the_integer_vectors_reshape_reads(also_read) -> None:
    from workers._torch_engine import convert_model, shape_constants

    module = convert_model(_reshape_model(also_read), "m")
    found = shape_constants(module)
    # the float constant is never listed; the copy Identity reads (onnx2torch gives each
    # use its own attribute) is not either
    assert len(found) == 1 and module.get_buffer(found[0]).tolist() == [-1, 8]
    readers = [n for n in module.graph.nodes if n.op == "get_attr" and n.target == found[0]]
    assert [type(module.get_submodule(u.target)).__name__ for u in readers[0].users] == ["OnnxReshape"]
