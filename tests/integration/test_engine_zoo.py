"""The engine on zoo architectures with random weights: batching must not mix samples.

With the zoo's constant weights every input gives the same output, so these tests use
the partitioner's seeded random weights, where a wrong batch rewrite would show.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from partitioner.zoo import load_zoo
from workers.engine import Engine, EngineConfig


@pytest.mark.parametrize("name, rewrites", [("shufflenet", 33), ("inception_v1", 1)])
def test_batched_zoo_model_equals_plain_onnxruntime(tmp_path, name, rewrites):
    model = load_zoo(name, random_weights=True, seed=0)
    eng = Engine(model, EngineConfig(cache_dir=str(tmp_path), provider="cpu"))
    assert eng.batch_safe, eng.batch_reason
    assert len(eng.artefact.batch_rewrites) == rewrites
    plain = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (inp,), (out,) = eng.inputs, eng.outputs
    rng = np.random.default_rng(1)
    requests = [{inp.name: rng.standard_normal((1, 3, 224, 224)).astype(np.float32)} for _ in range(3)]
    expected = [plain.run(None, r)[0] for r in requests]
    assert not np.allclose(expected[0], expected[1], rtol=0, atol=1e-9)  # outputs depend on inputs
    for got, want in zip(eng.run_batch(requests), expected):
        np.testing.assert_allclose(got[out.name], want, rtol=1e-4, atol=1e-6)
