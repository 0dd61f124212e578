"""Closing a Ray pool closes its caller-side batchers: no task is left pending when the
event loop ends ("Task was destroyed but it is pending", and the GeneratorExit traceback
of the batcher's scheduling loop, ended every Ray run before)."""

from __future__ import annotations

import asyncio
import gc
import logging

import numpy as np
import onnxruntime as ort
import pytest

from tests.integration._edge_support import write_model
from tests.integration._squeezenet_tail import ray_local  # noqa: F401 - fixture

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]


def _run_and_close_loop(coro_fn):
    """Runs on a loop closed without cancelling what is left, as a server thread's loop ends:
    a task still pending there is destroyed, and asyncio logs it."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro_fn())
    finally:
        loop.close()
        gc.collect()


def test_ray_pool_close_leaves_no_pending_batcher_task(ray_local, tmp_path, caplog):
    from cluster.gateway import PoolKey
    from cluster.registry import ModelConfig
    from cluster.ray_cluster import RayPool

    path = write_model(tmp_path)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    x = np.random.default_rng(0).standard_normal([d if isinstance(d, int) else 1 for d in
                                                  sess.get_inputs()[0].shape]).astype(np.float32)
    want = sess.run(None, {name: x})[0]
    pool = RayPool(PoolKey("chain", "1", "full"), path, ModelConfig(replicas=1, max_batch_size=4))
    batchers = []

    async def main():
        outs = await asyncio.gather(*(pool.run({name: x}, deadline_s=None, priority=0) for _ in range(6)))
        batchers.extend(b for _, b in pool.pool._batchers.values())
        await pool.close()
        return outs

    with caplog.at_level(logging.DEBUG):
        outs = _run_and_close_loop(main)
    for out in outs:
        np.testing.assert_allclose(next(iter(out.outputs.values())), want, rtol=1e-4, atol=1e-5)
    assert batchers, "the pool used no caller-side batcher: the test would prove nothing"
    assert all(b._loop_task is None or b._loop_task.done() for b in batchers)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "Task was destroyed but it is pending" not in text
    assert "GeneratorExit" not in caplog.text and "scheduling loop failed" not in text
    assert "left the caller-side batchers" not in text
