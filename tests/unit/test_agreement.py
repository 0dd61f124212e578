"""workers.agreement: each metric on constructed arrays with exact expected values, and
the picker on class vectors, sequences, dense maps and regressions."""

from __future__ import annotations

import numpy as np
import pytest

from workers.agreement import (
    AccuracyStats,
    OutputAgreement,
    argmax_agreement,
    compare_runs,
    exact_agreement,
    iou_agreement,
    iou_threshold,
    measure_output,
    pick_metric,
    relative_l2,
    summarize,
    top1_agreement,
)
from workers.errors import QuantizeConfigError


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return (e / e.sum(axis=axis, keepdims=True)).astype(np.float32)


RNG = np.random.default_rng(0)


# -- the metrics ------------------------------------------------------------------------


def test_top1_counts_samples_with_the_same_argmax():
    ref = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]], np.float32)
    cand = np.array([[0.2, 0.8], [0.4, 0.6], [0.1, 0.9], [0.5, 0.5]], np.float32)
    # Sample 1 flips (0 -> 1); sample 3 ties, and argmax takes the first: 0, as fp32.
    assert top1_agreement(ref, cand) == 0.75
    # [N, C, 1, 1] is a class vector too.
    assert top1_agreement(ref[:, :, None, None], cand[:, :, None, None]) == 0.75


def test_argmax_per_position_over_the_last_axis():
    ref = np.zeros((2, 3, 4), np.float32)
    ref[..., 0] = 1.0  # every position picks class 0
    cand = ref.copy()
    cand[0, 1] = [0, 0, 1, 0]
    cand[1, 2] = [0, 1, 0, 0]
    assert argmax_agreement(ref, cand) == 4 / 6
    # A per-pixel class map [N, C, H, W]: arg-max over axis 1.
    seg = np.zeros((1, 3, 2, 2), np.float32)
    seg[0, 0] = 1.0
    seg_c = seg.copy()
    seg_c[0, :, 1, 1] = [0, 0, 1]
    assert argmax_agreement(seg, seg_c, axis=1) == 0.75


def test_iou_of_the_thresholded_maps_per_sample():
    ref = np.zeros((2, 1, 4, 4), np.float32)
    cand = np.zeros_like(ref)
    ref[0, 0, :2, :2] = 0.9  # 4 pixels on
    cand[0, 0, :2, :3] = 0.8  # 6 pixels on, 4 shared: IoU 4/6
    # Sample 1: both maps empty, which agrees fully.
    assert iou_agreement(ref, cand) == pytest.approx((4 / 6 + 1.0) / 2)
    assert iou_threshold(ref) == 0.5  # values in [0, 1]
    # A threshold can be given: at 0.85 the candidate's 0.8 is off, IoU 0 for sample 0.
    assert iou_agreement(ref, cand, threshold=0.85) == 0.5


def test_iou_threshold_of_an_unbounded_map_is_its_mean():
    ref = np.array([[[-4.0, -4.0], [4.0, 8.0]]], np.float32)
    assert iou_threshold(ref) == 1.0
    cand = np.array([[[-4.0, 2.0], [4.0, 0.5]]], np.float32)
    # Above 1.0: fp32 at (1,0) and (1,1), the candidate at (0,1) and (1,0): IoU 1/3.
    assert iou_agreement(ref, cand) == pytest.approx(1 / 3)


def test_relative_l2_and_exact():
    ref = np.array([[3.0, 4.0]], np.float32)  # norm 5
    cand = np.array([[3.0, 4.5]], np.float32)  # error norm 0.5
    assert relative_l2(ref, cand) == pytest.approx(0.1)
    assert relative_l2(np.zeros(3), np.zeros(3)) == 0.0
    assert relative_l2(np.zeros(3), np.ones(3)) == float("inf")
    assert exact_agreement(np.array([1, 2, 3, 4]), np.array([1, 2, 0, 4])) == 0.75


def test_shapes_that_differ_are_refused():
    with pytest.raises(QuantizeConfigError, match=r"shape \(2, 3\) but the reference has \(2, 4\)"):
        top1_agreement(np.zeros((2, 4)), np.zeros((2, 3)))


# -- the picker -------------------------------------------------------------------------


def test_picker_class_vectors():
    probs = _softmax(RNG.standard_normal((8, 10)), axis=1)
    assert pick_metric(probs) == "top1"
    assert pick_metric(probs[:, :, None, None]) == "top1"
    assert pick_metric(RNG.standard_normal((8, 1000)).astype(np.float32)) == "top1"  # logits
    assert pick_metric(probs[:, :2] / probs[:, :2].sum(1, keepdims=True)) == "top1"  # binary


def test_picker_sequences():
    seq = _softmax(RNG.standard_normal((2, 25, 97)), axis=-1)  # [N, T, C]
    assert pick_metric(seq) == "argmax_per_position"
    assert pick_metric(np.log(seq.transpose(1, 0, 2))) == "argmax_per_position"  # [T, N, C] log-probs


def test_picker_dense_maps():
    prob_map = (1 / (1 + np.exp(-RNG.standard_normal((2, 1, 32, 32))))).astype(np.float32)
    assert pick_metric(prob_map) == "iou"
    assert pick_metric(prob_map[:, 0]) == "iou"  # [N, H, W]
    # Unbounded maps are judged by rel_l2: a spectrogram or an image is not a map of regions.
    assert pick_metric(RNG.standard_normal((2, 1, 32, 32)).astype(np.float32)) == "rel_l2"
    assert pick_metric((RNG.random((2, 3, 32, 32)) * 255).astype(np.float32)) == "rel_l2"
    seg = _softmax(RNG.standard_normal((2, 21, 16, 16)), axis=1)
    assert pick_metric(seg) == "argmax_per_position"


def test_picker_regressions():
    assert pick_metric(RNG.standard_normal((8, 1)).astype(np.float32)) == "rel_l2"  # one value
    assert pick_metric(RNG.standard_normal(8).astype(np.float32)) == "rel_l2"
    boxes = (RNG.random((8, 4)) * 600).astype(np.float32)
    assert pick_metric(boxes) == "rel_l2"
    emb = RNG.standard_normal((8, 128))
    assert pick_metric((emb / np.linalg.norm(emb, axis=1, keepdims=True)).astype(np.float32)) == "rel_l2"
    yolo = np.concatenate([RNG.random((1, 100, 4)) * 640, RNG.random((1, 100, 81))], axis=-1)
    assert pick_metric(yolo.astype(np.float32)) == "rel_l2"
    features = RNG.standard_normal((2, 256, 7, 7)).astype(np.float32)
    assert pick_metric(features) == "rel_l2"
    assert pick_metric(np.array([3, 1, 2], np.int64)) == "exact"


# -- over runs, and the summary ---------------------------------------------------------


def test_measure_output_over_runs_of_different_shapes():
    # A dense map with dynamic H/W: runs of 8x8 and 4x4.
    r1 = np.zeros((1, 1, 8, 8), np.float32)
    r1[0, 0, :4, :4] = 1.0
    c1 = r1.copy()
    c1[0, 0, 0, :4] = 0.0  # 12 of 16 left: IoU 0.75
    r2 = np.zeros((1, 1, 4, 4), np.float32)
    c2 = r2.copy()
    entry = measure_output("map", [r1, r2], [c1, c2])
    assert entry.metric == "iou" and entry.threshold == 0.5
    assert entry.value == pytest.approx((0.75 + 1.0) / 2) and entry.agreement == entry.value
    assert entry.num_samples == 2 and entry.max_abs_error == 1.0
    assert entry.mean_abs_error == pytest.approx(4 / 80)


def test_measure_output_named_metric_and_rel_l2_agreement():
    ref = [np.array([[3.0, 4.0]], np.float32)]
    cand = [np.array([[3.0, 4.5]], np.float32)]
    entry = measure_output("y", ref, cand, metric="rel_l2")
    assert entry.value == pytest.approx(0.1) and entry.agreement == pytest.approx(0.9)
    with pytest.raises(QuantizeConfigError, match="'psnr' for output 'y' is not one of"):
        measure_output("y", ref, cand, metric="psnr")


def test_summary_names_the_worst_output_and_reads_the_older_form():
    a = measure_output("probs", [np.eye(4, dtype=np.float32)], [np.eye(4, dtype=np.float32)])
    b = measure_output("boxes", [np.full((4, 4), 2.0, np.float32)], [np.full((4, 4), 2.2, np.float32)])
    stats = summarize([a, b], num_samples=4)
    assert stats.worst_output == "boxes" and stats.agreement == pytest.approx(0.9)
    assert stats.output("probs").metric == "top1" and stats.output("boxes").metric == "rel_l2"
    assert AccuracyStats.from_dict(stats.to_dict()) == stats
    legacy = {"num_samples": 3, "output_name": "y", "top1_agreement": 0.5,
              "max_abs_error": 0.25, "mean_abs_error": 0.125}
    read = AccuracyStats.from_dict(legacy)
    assert read.worst_output == "y" and read.agreement == 0.5
    assert read.outputs == (OutputAgreement("y", "top1", 0.5, 0.5, None, 3, 0.25, 0.125),)
    assert AccuracyStats.from_dict({**legacy, "top1_agreement": None}).outputs == ()


def test_compare_runs_measures_every_output_of_every_run():
    probs = _softmax(RNG.standard_normal((4, 3)), axis=1)
    flipped = probs.copy()
    flipped[0] = np.roll(probs[0], 1)  # its arg-max moves
    labels = np.array([0, 1, 2, 1])
    ref = [{"probs": probs, "label": labels}, {"probs": probs, "label": labels}]
    cand = [{"probs": flipped, "label": labels}, {"probs": probs, "label": np.array([0, 1, 0, 0])}]
    stats = compare_runs(ref, cand)
    assert stats.num_samples == 8
    assert stats.output("probs").metric == "top1" and stats.output("probs").value == 7 / 8
    assert stats.output("label").metric == "exact" and stats.output("label").value == 6 / 8
    assert stats.worst_output == "label" and stats.agreement == 0.75
    with pytest.raises(QuantizeConfigError, match=r"candidate #0 has outputs \['probs'\]"):
        compare_runs(ref, [{"probs": probs}, {"probs": probs}])
    with pytest.raises(QuantizeConfigError, match="1 candidate runs against 2 reference runs"):
        compare_runs(ref, cand[:1])
