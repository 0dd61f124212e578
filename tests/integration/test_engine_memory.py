"""Weight sharing: 4 engines of one model hold one copy of its weights, not 4.

Each measurement runs in a fresh process so resident memory (RSS) is not muddied by
other tests. The assertions are ratios, never absolute sizes or times.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import onnx
import pytest

from tests.unit._engine_models import make_small_cnn, zoo_model_path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from workers._ort import resident_bytes
    from workers.engine import Engine, EngineConfig

    path, cache, share, count = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
    Engine(path, EngineConfig(cache_dir=cache, provider="cpu", warmup_runs=0)).close()  # build once
    before = resident_bytes()
    engines = [Engine(path, EngineConfig(cache_dir=cache, provider="cpu", share_weights=share)) for _ in range(count)]
    for e in engines:
        e.run({s.name: np.ones([1] + list(s.shape[1:]), s.dtype) for s in e.inputs})
    print(json.dumps({"added": resident_bytes() - before, "weights": engines[0].artefact.weights_bytes}))
    """
)


def _measure(path: str, cache: str, share: bool, count: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, path, cache, "1" if share else "0", str(count)],
        check=True, capture_output=True, text=True, cwd=ROOT,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _check_sharing(path: str, cache: str) -> None:
    shared = _measure(path, cache, True, 4)
    unshared = _measure(path, cache, False, 4)
    weights = shared["weights"]
    # Without sharing every engine holds its own weights; with it, about one copy.
    assert unshared["added"] >= 3 * weights
    assert unshared["added"] / shared["added"] >= 2.5
    assert shared["added"] <= 2 * weights


def test_four_engines_share_one_copy_of_the_weights(tmp_path):
    path = str(tmp_path / "wide_cnn.onnx")
    onnx.save(make_small_cnn(classes=32768), path)  # 32 MiB of Gemm weights
    _check_sharing(path, str(tmp_path / "cache"))


@pytest.mark.slow
def test_four_alexnet_engines_share_one_copy_of_the_weights(tmp_path):
    _check_sharing(zoo_model_path("bvlc_alexnet"), str(tmp_path / "cache"))
