"""bench.fleet's planner accuracy: the planner's absolute error against the simulation, in points."""

import pytest

from bench.fleet import _accuracy


def test_errors_are_absolute_and_in_points():
    points = [{"load": "80%", "workers": 4, "planner_within_slo": 0.80, "sim_within_slo": 0.83},
              {"load": "80%", "workers": 8, "planner_within_slo": 0.91, "sim_within_slo": 0.90}]
    a = _accuracy(points)
    assert a["points"] == points
    assert a["mean_abs_error_points"] == pytest.approx(2.0)  # 3 and 1 points
    assert a["max_abs_error_points"] == pytest.approx(3.0)


def test_no_points_give_no_error():
    assert _accuracy([]) == {"points": [], "mean_abs_error_points": None, "max_abs_error_points": None}
