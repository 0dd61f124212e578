"""The engine on the CUDA execution provider. Skips cleanly where ORT has no CUDA."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from tests.unit._engine_models import make_small_cnn, make_transformer_block
from workers.engine import Engine, EngineConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        "CUDAExecutionProvider" not in ort.get_available_providers(),
        reason="onnxruntime has no CUDAExecutionProvider here (install onnxruntime-gpu on a CUDA host)",
    ),
]


def _x(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 3, 8, 8)).astype(np.float32)


def test_cuda_engine_matches_cpu_and_batches(tmp_path):
    model = make_small_cnn()
    gpu = Engine(model, EngineConfig(provider="cuda", cache_dir=str(tmp_path)))
    cpu = Engine(model, EngineConfig(provider="cpu", cache_dir=str(tmp_path)))
    assert gpu.provider == "cuda" and gpu.batch_safe
    x = _x(3, 0)
    np.testing.assert_allclose(gpu.run({"x": x})["y"], cpu.run({"x": x})["y"], rtol=1e-3, atol=1e-5)
    requests = [{"x": _x(1, i)} for i in range(5)]
    for got, want in zip(gpu.run_batch(requests), cpu.run_batch(requests)):
        np.testing.assert_allclose(got["y"], want["y"], rtol=1e-3, atol=1e-5)


def test_cuda_engine_reuses_its_output_buffer(tmp_path):
    eng = Engine(make_small_cnn(), EngineConfig(provider="cuda", cache_dir=str(tmp_path)))
    a = eng.run({"x": _x(1, 1)})["y"]
    b = eng.run({"x": _x(1, 2)})["y"]
    assert a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    assert eng.stats().run_count == 2


def test_auto_prefers_a_gpu_provider(tmp_path):
    eng = Engine(make_small_cnn(), EngineConfig(provider="auto", cache_dir=str(tmp_path)))
    assert eng.provider in ("cuda", "tensorrt")


def test_cuda_transformer_block(tmp_path):
    block = make_transformer_block()
    gpu = Engine(block, EngineConfig(provider="cuda", cache_dir=str(tmp_path)))
    feed = {"x": np.random.default_rng(0).standard_normal((2, 8, 32)).astype(np.float32), "mask": np.ones((2, 8), np.int64)}
    ref = ort.InferenceSession(block.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    np.testing.assert_allclose(gpu.run(feed)["y"], ref, rtol=1e-2, atol=1e-3)
