"""Circuit breaker: every transition, with time passed in."""

import pytest

from edge_agent.breaker import CLOSED, HALF_OPEN, OPEN, BreakerConfig, BreakerState, allow, on_failure, on_success

CFG = BreakerConfig(failures=3, open_s=2.0, probe_timeout_s=5.0)


def _open(now: float = 10.0) -> BreakerState:
    s = BreakerState()
    for _ in range(3):
        s = on_failure(s, now, CFG)
    return s


def test_closed_allows_and_counts_failures():
    s = BreakerState()
    ok, s = allow(s, 0.0, CFG)
    assert ok and s.state == CLOSED
    s = on_failure(on_failure(s, 0.0, CFG), 0.0, CFG)
    assert s.state == CLOSED and s.failures == 2
    assert on_success(s, 0.0, CFG).failures == 0


def test_closed_to_open_after_threshold():
    s = _open()
    assert s.state == OPEN and s.opened_s == 10.0 and s.transitions == 1


def test_open_refuses_until_open_s_then_one_probe():
    s = _open(10.0)
    ok, s = allow(s, 11.9, CFG)
    assert not ok and s.state == OPEN
    ok, s = allow(s, 12.0, CFG)
    assert ok and s.state == HALF_OPEN and s.probe_s == 12.0
    ok2, s = allow(s, 12.1, CFG)
    assert not ok2  # one probe at a time


def test_half_open_success_closes():
    _, s = allow(_open(10.0), 12.0, CFG)
    s = on_success(s, 12.5, CFG)
    assert s.state == CLOSED and s.failures == 0 and s.transitions == 3


def test_half_open_failure_reopens_with_new_timer():
    _, s = allow(_open(10.0), 12.0, CFG)
    s = on_failure(s, 12.5, CFG)
    assert s.state == OPEN and s.opened_s == 12.5
    assert allow(s, 14.0, CFG)[0] is False and allow(s, 14.5, CFG)[0] is True


def test_lost_probe_frees_the_slot():
    _, s = allow(_open(10.0), 12.0, CFG)
    ok, s = allow(s, 17.0, CFG)
    assert ok and s.state == HALF_OPEN and s.probe_s == 17.0


def test_failure_while_open_changes_nothing():
    s = _open(10.0)
    assert on_failure(s, 11.0, CFG) == s


def test_state_json_and_config_checks():
    s = _open()
    assert BreakerState.from_json(s.to_json()) == s
    with pytest.raises(ValueError, match="failures"):
        BreakerConfig(failures=0)
