"""bench.ray_load's summary: each key's median error against the waits met, and a key that an
older gateway did not report stays out."""

import pytest

from bench.ray_load import _summary


def test_each_key_is_scored_against_the_waits_met():
    rows = [(10.0, 12.0, 30.0), (20.0, 19.0, 30.0), (40.0, 44.0, 30.0), (80.0, 80.0, 30.0)]
    s = _summary(rows)
    assert s["requests"] == 4 and s["wait_p50_ms"] == pytest.approx(30.0)
    assert s["predicted_wait"]["abs_error_p50_ms"] == pytest.approx(1.5)  # errors 2, 1, 4, 0
    assert s["predicted_wait"]["correlation"] > 0.99
    assert s["expected_wait"]["abs_error_p50_ms"] == pytest.approx(15.0)  # errors 20, 10, 10, 50
    assert s["expected_wait"]["correlation"] is None  # a constant says nothing of the waits


def test_a_key_an_older_gateway_did_not_report_is_left_out():
    s = _summary([(1.0, None, 2.0), (3.0, None, 2.5)])
    assert s["predicted_wait"] is None and s["expected_wait"]["abs_error_p50_ms"] == pytest.approx(0.75)
