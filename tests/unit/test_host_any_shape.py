"""A segment worker (the class Ray runs, here without Ray) serving a tail over symbolic
H and W: it warms up on the sample inputs that travel with the segment, and batches
requests of one shape together, never across shapes."""

from __future__ import annotations

import asyncio

import numpy as np
import onnxruntime as ort

from tests.serving_models import any_hw_model
from workers._worker import SegmentHost, SegmentSource
from workers.engine import EngineConfig

KEY = "hw@1@L"


def test_a_worker_warms_up_on_the_segments_samples_and_batches_within_shape(tmp_path):
    model = any_hw_model()
    samples = {"x": np.ones((1, 4, 6, 6), np.float32)}
    host = SegmentHost({KEY: SegmentSource(model.SerializeToString(), samples)},
                       engine_config=EngineConfig(cache_dir=str(tmp_path), intra_op_threads=1))
    rng = np.random.default_rng(0)
    xs = [{"x": rng.standard_normal(shape).astype(np.float32)}
          for shape in ((1, 4, 3, 3), (1, 4, 5, 2), (1, 4, 3, 3), (1, 4, 5, 2))]

    async def main():
        return await host.infer_batch(KEY, xs, [None] * 4, [0] * 4), (await host.stats()).segments[0]

    assert host._hosted[KEY].engine.warmed_up == "samples"
    answers, stats = asyncio.run(main())
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for x, answer in zip(xs, answers):
        np.testing.assert_allclose(answer["y"], sess.run(None, x)[0], rtol=1e-4, atol=1e-5)
    assert dict(stats.batch_size_histogram) == {2: 2}  # one batch per shape
