"""The rule that turns timed rounds into an engine count (workers/profile/instances.py)."""

from __future__ import annotations

import pytest

from workers.profile.instances import InstanceTiming, choose_instances


def _timing(instances: int, ratios: list[float]) -> InstanceTiming:
    return InstanceTiming(instances, 2 // instances or 1, tuple(100.0 * r for r in ratios), tuple(ratios))


def test_a_setting_that_beats_one_engine_by_the_margin_is_chosen() -> None:
    count, reason = choose_instances([_timing(2, [1.31, 1.12, 1.45, 0.98, 1.37])], margin=0.05)
    assert count == 2
    assert "1.31x" in reason and "rounds 0.98-1.45" in reason and "4 of 5" in reason


def test_a_gain_under_the_margin_keeps_one_engine() -> None:
    count, reason = choose_instances([_timing(2, [1.03, 0.97, 1.04, 1.08, 1.01])], margin=0.05)
    assert count == 1
    assert "1.03x" in reason and "not 5% faster" in reason


def test_the_best_median_wins_among_several_settings() -> None:
    timings = [_timing(2, [1.2, 1.3, 1.25]), _timing(4, [1.1, 1.6, 1.15])]
    assert choose_instances(timings, margin=0.05)[0] == 2  # 4's best round does not outvote its median
    assert choose_instances(timings, margin=0.3)[0] == 1


def test_an_even_number_of_rounds_uses_the_middle_pair() -> None:
    assert _timing(2, [1.0, 1.04, 1.08, 1.3]).median_ratio == pytest.approx(1.06)
    assert choose_instances([_timing(2, [1.0, 1.04, 1.08, 1.3])], margin=0.05)[0] == 2
    assert choose_instances([_timing(2, [1.0, 1.02, 1.06, 1.3])], margin=0.05)[0] == 1


def test_nothing_but_one_engine_timed() -> None:
    assert choose_instances([], margin=0.05) == (1, "no setting other than one engine was timed")
