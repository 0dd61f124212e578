"""The one segment host (workers.segment.HostedSegment) as the gateway's in-process pool
uses it: requests that were not checked batch apart by names, shapes and dtypes, every
request gets its batch's timing, and a tail that cannot batch runs batches of one, as
on a Ray worker."""

from __future__ import annotations

import asyncio

import numpy as np
import onnxruntime as ort
import pytest

from cluster.gateway import LocalPool, PoolKey
from cluster.metrics import GatewayMetrics
from cluster.registry import ModelConfig
from tests.onnx_models import C, H, W, conv_bn_relu_chain, write
from tests.unit._engine_models import make_batch_mixing_model
from workers._worker import SegmentHost
from workers.engine import EngineConfig
from workers.errors import InputError


def _pool(path: str, tmp_path, **config) -> LocalPool:
    return LocalPool(PoolKey("m", "1", "c0"), path, ModelConfig(intra_op_threads=1, **config), GatewayMetrics(),
                     cache_dir=str(tmp_path / "cache"), provider="cpu")


def test_an_unchecked_request_of_another_dtype_batches_apart_and_fails_alone(tmp_path):
    path = write(conv_bn_relu_chain(2), tmp_path / "chain.onnx")
    pool = _pool(path, tmp_path, max_batch_size=8, max_queue_delay_ms=200.0)
    rng = np.random.default_rng(0)
    good = [{"x": rng.standard_normal((1, C, H, W)).astype(np.float32)} for _ in range(3)]
    bad = {"x": good[0]["x"].astype(np.float64)}

    async def main():
        try:
            return await asyncio.gather(*(pool.run(x, deadline_s=None, priority=0) for x in (*good, bad)),
                                        return_exceptions=True)
        finally:
            await pool.close()

    *answers, failed = asyncio.run(main())
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for x, answer in zip(good, answers):
        np.testing.assert_allclose(answer.outputs["y"], sess.run(None, x)[0], rtol=1e-4, atol=1e-5)
        assert answer.batch_size == 3 and answer.compute_s > 0 and answer.queue_s >= 0
    assert isinstance(failed, InputError) and "float64" in str(failed)
    assert pool.batches == 1  # the failed batch is not counted
    assert pool.batcher.stats().batch_size_histogram == {3: 1, 1: 1}


def test_a_tail_that_cannot_batch_runs_batches_of_one_in_process_as_on_a_ray_worker(tmp_path):
    path = write(make_batch_mixing_model(), tmp_path / "mixing.onnx")
    pool = _pool(path, tmp_path, max_batch_size=8, max_queue_delay_ms=200.0)
    host = SegmentHost({"m@1@c0": path}, engine_config=EngineConfig(cache_dir=str(tmp_path / "cache"),
                                                                      provider="cpu", loop_fallback=True))
    xs = [{"x": np.random.default_rng(i).standard_normal((1, 16)).astype(np.float32)} for i in range(3)]

    async def main():
        try:
            return await asyncio.gather(*(pool.run(x, deadline_s=None, priority=0) for x in xs))
        finally:
            await pool.close()

    answers = asyncio.run(main())
    assert [a.batch_size for a in answers] == [1, 1, 1] and pool.batches == 3
    assert all(np.allclose(a.outputs["y"], 0.0) for a in answers)  # x - mean(x) over a batch of one
    assert pool.batcher.config.max_batch_size == host._hosted["m@1@c0"].batcher.config.max_batch_size == 1


@pytest.mark.parametrize("replicas", [1, 3])
def test_in_process_replicas_are_equal_engines_and_no_lone_engine(tmp_path, replicas):
    path = write(conv_bn_relu_chain(1), tmp_path / "chain.onnx")
    pool = _pool(path, tmp_path, replicas=replicas)
    try:
        assert len(pool.engines) == replicas
        assert [e.config.intra_op_threads for e in pool.engines] == [1] * replicas
        assert pool.batcher.config.max_concurrent_batches == replicas
    finally:
        asyncio.run(pool.close())
