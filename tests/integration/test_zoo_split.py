"""Every zoo architecture, cut at every chain point and at 25 random valid cuts:
head then tail equals the whole model (rtol 1e-4, atol 1e-5).

The zoo files fill every weight with one constant, so the models are re-weighted with
seeded random values first (partitioner.zoo.randomize_weights). Deep ones still
saturate their final softmax, so the check compares every tensor a segment hands on
(each boundary tensor and each model output) with the whole model's value of it, not
only the final output. Weights go to an external-data file, which also exercises the
path that models over 2 GB take.
"""

from __future__ import annotations

import random

import numpy as np
import onnx
import pytest

from partitioner import (
    ZOO_MODELS,
    boundary,
    build_graph,
    chain_points,
    make_inputs,
    make_tiers,
    prefix_cut,
    random_cut,
    split,
    split_tiers,
)
from partitioner.export import reference_outputs, run_segments
from partitioner.zoo import load_zoo

pytestmark = pytest.mark.slow
RTOL, ATOL = 1e-4, 1e-5


def _load_external(name, tmp_path_factory):
    d = tmp_path_factory.mktemp(name)
    onnx.save_model(
        load_zoo(name, random_weights=True, seed=0),
        str(d / "model.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="weights.bin",
        size_threshold=1024,
    )
    model = onnx.load(str(d / "model.onnx"), load_external_data=False)
    return model, str(d)


@pytest.mark.parametrize("name", ZOO_MODELS)
def test_head_then_tail_equals_whole_model(name, tmp_path_factory) -> None:
    model, base = _load_external(name, tmp_path_factory)
    g = build_graph(model, name=name)
    rng = random.Random(1234)
    cuts = {prefix_cut(g, v) for v in chain_points(g)}
    chain_count = len(cuts)
    cuts |= {random_cut(g, rng) for _ in range(25)}
    cuts = sorted(cuts, key=lambda c: (len(c), sorted(c.device)))
    assert chain_count == len(chain_points(g))  # every chain point gives a distinct cut

    x = make_inputs(model, g, seed=7)
    names = sorted({b for c in cuts for b in boundary(g, c)} | set(g.outputs))
    want = reference_outputs(model, names, x, base_dir=base)
    for cut in cuts:
        head, tail = split(model, cut, graph=g)
        assert tail.inputs == boundary(g, cut)
        got = run_segments([head, tail], x, base_dir=base)
        for t in list(head.outputs) + list(tail.outputs):
            np.testing.assert_allclose(got[t], want[t], rtol=RTOL, atol=ATOL, err_msg=f"{name} cut {sorted(cut.device)[-3:]} tensor {t}")


@pytest.mark.parametrize("name", ["resnet50", "inception_v1", "densenet121"])
def test_three_tier_split(name, tmp_path_factory) -> None:
    model, base = _load_external(name, tmp_path_factory)
    g = build_graph(model, name=name)
    pts = chain_points(g)
    a, b = pts[len(pts) // 3], pts[2 * len(pts) // 3]
    tiers = make_tiers(g, [prefix_cut(g, a).device, prefix_cut(g, b).device])
    segs = split_tiers(model, tiers, graph=g)
    assert len(segs) == 3
    x = make_inputs(model, g, seed=3)
    names = sorted({t for s in segs for t in s.outputs})
    want = reference_outputs(model, names, x, base_dir=base)
    got = run_segments(segs, x, base_dir=base)
    for t in names:
        np.testing.assert_allclose(got[t], want[t], rtol=RTOL, atol=ATOL)
