"""The torch-cuda backend on a CUDA GPU: equality with ONNX Runtime, FP16, CUDA graphs,
tensors kept on the device, shared weights and ``auto``. Skips cleanly without torch or
without a CUDA device."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from tests.unit._engine_models import make_small_cnn, make_transformer_block, ort_row_by_row, small_cnn_input
from workers._torch_engine import TOLERANCE, relative_error, torch_available

_why = torch_available()
if _why is None:
    import torch

    if not torch.cuda.is_available():
        _why = f"torch {torch.__version__} sees no CUDA device"

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_why is not None, reason=_why or "")]

from workers.engine import Engine, EngineConfig  # noqa: E402

GPU = EngineConfig(provider="torch-cuda", batch_buckets=(1, 2, 4, 8))


def test_torch_cuda_equals_ort_and_batches():
    model = make_small_cnn()
    eng = Engine(model, GPU)
    assert type(eng).__name__ == "TorchEngine" and eng.provider == "torch-cuda" and eng.batch_safe
    x = small_cnn_input(3, 0)
    assert relative_error(eng.run({"x": x})["y"], ort_row_by_row(model, {"x": x})[0]) <= TOLERANCE["fp32"]
    outs = eng.run_batch([{"x": small_cnn_input(1, i)} for i in range(5)])
    for i, out in enumerate(outs):
        assert relative_error(out["y"], ort_row_by_row(model, {"x": small_cnn_input(1, i)})[0]) <= TOLERANCE["fp32"]


def test_fp16_and_cuda_graphs():
    from workers._torch_engine import TorchEngine

    model = make_small_cnn(seed=2)
    eng = TorchEngine(model, GPU, precision="fp16", cuda_graphs=True)
    for rows in (1, 3, 8):
        x = small_cnn_input(rows, rows)
        assert relative_error(eng.run({"x": x})["y"], ort_row_by_row(model, {"x": x})[0]) <= TOLERANCE["fp16"]
    assert set(eng._graphs) == set(eng.buckets)


def test_tensors_stay_on_the_device():
    import torch

    model = make_small_cnn(seed=4)
    eng = Engine(model, GPU)
    x = torch.from_numpy(small_cnn_input(2, 1)).cuda()
    y = eng.run_tensors({"x": x})["y"]
    assert y.is_cuda
    assert relative_error(y.cpu().numpy(), ort_row_by_row(model, {"x": small_cnn_input(2, 1)})[0]) <= TOLERANCE["fp32"]


def test_transformer_block_on_the_gpu():
    block = make_transformer_block()
    eng = Engine(block, GPU)
    feed = {"x": np.random.default_rng(0).standard_normal((2, 8, 32)).astype(np.float32),
            "mask": np.ones((2, 8), np.int64)}
    assert relative_error(eng.run(feed)["y"], ort_row_by_row(block, feed)[0]) <= TOLERANCE["fp32"]


def test_shared_weights_cost_no_second_copy():
    import torch

    model = make_small_cnn(seed=6)
    first = Engine(model, GPU)
    before = torch.cuda.memory_allocated()
    second = Engine(model, GPU)
    assert second.module is first.module
    assert torch.cuda.memory_allocated() - before < first.weight_bytes()


def test_auto_takes_torch_where_onnxruntime_has_no_gpu():
    eng = Engine(make_small_cnn(), EngineConfig(provider="auto"))
    gpu_ort = {"CUDAExecutionProvider", "TensorrtExecutionProvider"} & set(ort.get_available_providers())
    assert eng.provider == ("torch-cuda" if not gpu_ort else eng.provider)
    assert eng.provider in ("torch-cuda", "cuda", "tensorrt")
