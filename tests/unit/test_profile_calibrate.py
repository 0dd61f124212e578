"""Fitting corrections and choosing calibration cuts (workers.profile._calibrate)."""

from __future__ import annotations

import math

import pytest

from partitioner import build_graph, is_down_closed
from partitioner.synthetic import make_random_graph
from planner.profile import Corrections, Profile
from tests.onnx_models import conv_bn_relu_chain
from workers.profile import ProfilingError, SegmentTiming, calibration_cuts, fit_corrections, spread_cuts


def test_fit_recovers_scale_and_offset_from_exact_segments():
    fixed = 0.5
    pts = [(x, 0.8 * x + 1.5) for x in (1.0, 3.0, 10.0, 40.0)]
    c = fit_corrections(pts, fixed)
    assert c.scale == pytest.approx(0.8)
    assert c.offset_ms == pytest.approx(1.0)  # 1.5 - fixed
    assert c.segments == 4


def test_fit_weights_relative_error_so_small_segments_count():
    # One large segment off by 10%; small ones exact on y = x + 1. A relative fit keeps
    # the small ones close, where an absolute fit would bend towards the large one.
    pts = [(1.0, 2.0), (2.0, 3.0), (4.0, 5.0), (1000.0, 1100.0)]
    c = fit_corrections(pts, 0.0)
    for x, y in pts[:3]:
        assert abs(c.scale * x + c.offset_ms - y) / y < 0.1


def test_fit_never_gives_a_negative_segment_constant():
    # measured = 2x - 3 would need c = -3 < 0: refit through the origin instead.
    pts = [(2.0, 1.0), (4.0, 5.0), (8.0, 13.0)]
    c = fit_corrections(pts, 0.25)
    assert c.offset_ms == pytest.approx(-0.25)  # c = offset + fixed = 0
    assert c.scale > 0
    # the result is a valid profile field
    p = Profile(device="d", layers={}, fixed_ms=0.25, corrections=c)
    assert Profile.from_json(p.to_json()).corrections == c


def test_fit_with_one_point_is_a_pure_scale():
    c = fit_corrections([(4.0, 6.0)], 0.0)
    assert c.scale == pytest.approx(1.5) and c.offset_ms == pytest.approx(0.0)


@pytest.mark.parametrize("pts, fixed, words", [
    ([], 0.0, "no segment timings"),
    ([(1.0, 0.0)], 0.0, "measured_ms > 0"),
    ([(-1.0, 2.0)], 0.0, "additive_ms >= 0"),
    ([(1.0, math.nan)], 0.0, "measured_ms"),
    ([(1.0, 2.0)], -1.0, "fixed_ms"),
])
def test_fit_rejects_bad_input(pts, fixed, words):
    with pytest.raises(ProfilingError, match=words):
        fit_corrections(pts, fixed)


def test_segment_timing_round_trips():
    s = SegmentTiming(cut="abc", side="head", layers=3, additive_ms=1.0, measured_ms=1.2, p90_ms=1.5)
    assert SegmentTiming.from_dict(s.to_dict()) == s


def test_spread_and_calibration_cuts_are_distinct_valid_and_non_trivial():
    g = make_random_graph(30, seed=3)
    n = len(g)
    for cuts in (spread_cuts(g, 5), calibration_cuts(g, 4)):
        keys = [c.device for c in cuts]
        assert len(set(keys)) == len(keys)
        assert all(0 < len(c) < n for c in cuts)
        assert all(is_down_closed(g, c.device) for c in cuts)
    assert 1 <= len(calibration_cuts(g, 4)) <= 4


def test_spread_cuts_on_a_chain_use_chain_points_spread_over_the_model():
    g = build_graph(conv_bn_relu_chain(4))
    cuts = spread_cuts(g, 3)
    sizes = sorted(len(c) for c in cuts)
    assert len(sizes) == 3 and sizes[0] < sizes[-1]


def test_corrections_type_is_the_planners():
    assert isinstance(fit_corrections([(1.0, 1.0), (2.0, 2.0)], 0.0), Corrections)



def test_calibration_cuts_include_the_smallest_head_and_the_smallest_tail():
    from partitioner import chain_points, prefix_cut

    g = build_graph(conv_bn_relu_chain(4))
    chain = [v for v in chain_points(g) if v < len(g) - 1]
    cuts = {c.device for c in calibration_cuts(g, 4)}
    assert prefix_cut(g, chain[0]).device in cuts
    assert prefix_cut(g, chain[-1]).device in cuts
