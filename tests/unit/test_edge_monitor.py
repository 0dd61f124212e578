"""Link monitor: steps are seen within a few samples, jitter is not chased. Time is passed in."""

import math
import random

import numpy as np
import pytest

from edge_agent.monitor import LinkEstimate, LinkMonitor, MonitorConfig

HZ = 10.0  # samples per second: one request per frame at 10 fps


def _feed(mon: LinkMonitor, rates, t0: float = 0.0) -> list[bool]:
    return [mon.observe_rate(r, t0 + i / HZ) for i, r in enumerate(rates)]


def test_step_down_seen_within_a_second_of_samples():
    mon = LinkMonitor()
    rng = random.Random(1)
    _feed(mon, [18.88e6 * rng.lognormvariate(0, 0.15) for _ in range(50)])
    after = [1.1e6 * rng.lognormvariate(0, 0.15) for _ in range(20)]
    hits = _feed(mon, after, t0=5.0)
    first = hits.index(True)
    assert first + 1 <= HZ  # within one second of samples (typically the second sample)
    est = mon.estimate()
    assert 0.7 < est.up_bps / 1.1e6 < 1.4
    assert est.changes == 1 and est.last_change_s == 5.0 + first / HZ


def test_step_up_seen_too():
    mon = LinkMonitor()
    _feed(mon, [1.1e6] * 30)
    hits = _feed(mon, [5.85e6] * 10, t0=3.0)
    assert True in hits[:5]
    assert math.isclose(mon.estimate().up_bps, 5.85e6, rel_tol=0.05)


def test_jitter_is_not_chased():
    mon = LinkMonitor()
    rng = random.Random(7)
    hits = _feed(mon, [18.88e6 * rng.lognormvariate(0, 0.2) for _ in range(600)])
    assert sum(hits) == 0
    assert 0.8 < mon.estimate().up_bps / 18.88e6 < 1.25


def test_one_outlier_does_not_move_the_level_much():
    mon = LinkMonitor()
    _feed(mon, [10e6] * 20)
    assert mon.observe_rate(1e6, 3.0) is False
    assert mon.estimate().up_bps > 6e6


def test_transfer_sample_subtracts_server_time_and_rtt():
    mon = LinkMonitor(down_ratio=4.0)
    mon.observe_rtt(20.0, 0.0)
    # 125000 bytes up (1 Mbit) + 40000 down (= 10000 up-equivalent bytes): 1.08 Mbit in 0.5 s of payload.
    mon.observe_transfer(125_000, 40_000, elapsed_s=0.5 + 0.020 + 0.030, server_ms=30.0, now_s=1.0)
    assert math.isclose(mon.estimate().up_bps, 1.08e6 / 0.5, rel_tol=1e-6)


def test_rtt_dominated_call_only_raises_a_low_level():
    mon = LinkMonitor()
    mon.observe_rtt(50.0, 0.0)
    mon.observe_rate(1e5, 0.1)
    # 1 kB in 51 ms with a 50 ms RTT: mostly RTT; says the rate is at least 8000/(0.25*0.051).
    mon.observe_transfer(1000, 0, 0.051, 0.0, 0.2)
    assert mon.estimate().up_bps > 1e5
    high = LinkMonitor()
    high.observe_rtt(50.0, 0.0)
    high.observe_rate(100e6, 0.1)
    high.observe_transfer(1000, 0, 0.051, 0.0, 0.2)
    assert math.isclose(high.estimate().up_bps, 100e6) and high.estimate().samples == 1


def test_timeout_is_a_ceiling():
    mon = LinkMonitor()
    mon.observe_rate(18.88e6, 0.0)
    mon.observe_timeout(100_000, 2.0, 1.0)  # 0.4 Mbit/s at most
    assert mon.estimate().up_bps < 18.88e6
    before = mon.estimate().up_bps
    mon.observe_timeout(100_000, 1e-6, 2.0)  # a ceiling above the level says nothing
    assert mon.estimate().up_bps == before


def test_rtt_is_the_windowed_minimum_and_estimate_json():
    mon = LinkMonitor(MonitorConfig(rtt_window=3))
    mon.observe_rtt(220.0, 0.0)  # the first check also paid a reconnect
    mon.observe_rtt(20.0, 0.1)
    mon.observe_rtt(40.0, 0.2)
    est = mon.estimate()
    assert est.rtt_ms == 20.0 and est.up_bps is None
    for i in range(3):
        mon.observe_rtt(100.0, 1.0 + i)  # the path really got longer: seen once the window turns over
    assert mon.estimate().rtt_ms == 100.0
    assert LinkEstimate.from_json(est.to_json()) == est


def test_bad_samples_are_ignored():
    mon = LinkMonitor()
    assert mon.observe_rate(0.0, 0.0) is False and mon.observe_rate(float("nan"), 0.0) is False
    mon.observe_rtt(-1.0, 0.0)
    assert mon.estimate().samples == 0 and mon.estimate().rtt_ms is None


# -- upper bounds: stuck transfers and timeouts ----------------------------------------------

BOUNDARY_BYTES = 602_112  # ResNet50's fp32 input, the demo's cloud-only boundary


def _demo_monitor() -> LinkMonitor:
    """At 18.88 Mbit/s with a 20 ms RTT and 340 ms of server time, as in the demo's first phase."""
    mon = LinkMonitor()
    mon.observe_rtt(20.0, 0.0)
    for i in range(5):
        payload_s = 8 * BOUNDARY_BYTES / 18.88e6
        mon.observe_transfer(BOUNDARY_BYTES, 4000, payload_s + 0.020 + 0.340, 340.0, 0.5 * i)
    return mon


def test_stuck_transfer_drops_the_estimate_before_it_completes_or_times_out():
    mon = _demo_monitor()
    assert 0.9 < mon.estimate().up_bps / 18.88e6 < 1.1
    after_s = mon.stall_after_s(BOUNDARY_BYTES)
    # twice the expected time of bytes, RTT and server time
    assert after_s == pytest.approx(2 * (8 * BOUNDARY_BYTES / mon.estimate().up_bps + 0.36), rel=0.05)
    # The link stepped to 1.1 Mbit/s when the transfer started (t=10): it needs 4.4 s.
    t0 = 10.0
    assert mon.observe_stall(BOUNDARY_BYTES, 0.8 * after_s, t0 + 0.8 * after_s) is False  # still on time
    assert mon.observe_stall(BOUNDARY_BYTES, after_s, t0 + after_s) is True
    est = mon.estimate()
    assert est.changes == 1 and est.last_change_s == pytest.approx(t0 + after_s)
    # The first bound already halves the estimate, within about a second and a quarter of the step.
    assert after_s < 1.3 and est.up_bps < 18.88e6 / 2
    levels = [est.up_bps]
    for t in np.arange(after_s + 0.2, 4.0, 0.2):
        mon.observe_stall(BOUNDARY_BYTES, t, t0 + t)
        levels.append(mon.estimate().up_bps)
    # Each later check may tighten the bound (by more than the dead band): the level keeps
    # falling toward the truth, never below it.
    assert all(b <= a for a, b in zip(levels, levels[1:])) and levels[-1] < levels[0] / 1.4
    assert 1.1e6 < levels[-1] < 2 * 1.1e6


def test_a_transfer_slower_only_by_jitter_bounds_nothing():
    mon = _demo_monitor()
    before = mon.estimate()
    expected_s = mon.stall_after_s(BOUNDARY_BYTES) / mon.config.stall_factor
    for k in (1.2, 1.5, 1.9):
        assert mon.observe_stall(BOUNDARY_BYTES, k * expected_s, 20.0) is False
    assert mon.estimate() == before


def test_timeout_bound_replaces_the_level_at_once():
    # The demo's 2 s budget with two 602 kB uploads in flight: at most 4.8 Mbit/s. A sample
    # through the CUSUM (log ratio 1.4) would need two more; a bound is proof and acts now.
    mon = _demo_monitor()
    assert mon.observe_timeout(2 * BOUNDARY_BYTES, 2.0, 12.0) is True
    assert mon.estimate().up_bps == pytest.approx(8 * 2 * BOUNDARY_BYTES / 2.0)


def test_step_up_after_the_outage_seen_at_the_second_sample():
    mon = LinkMonitor()
    _feed(mon, [1.1e6] * 20)
    hits = _feed(mon, [5.85e6] * 3, t0=5.0)
    assert hits == [False, True, False]
    assert math.isclose(mon.estimate().up_bps, 5.85e6, rel_tol=0.01)


def test_rtt_from_a_small_answered_call():
    mon = LinkMonitor()
    mon.observe_rate(10e6, 0.0)
    # 1 kB (0.8 ms at 10 Mbit/s) answered in 60.8 ms with 10 ms of server time: a 50 ms RTT.
    mon.observe_transfer(1000, 0, 0.0608, 10.0, 1.0)
    assert mon.estimate().rtt_ms == pytest.approx(50.0, abs=0.1)


def test_stall_factor_must_exceed_one():
    with pytest.raises(ValueError, match="stall_factor=1"):
        MonitorConfig(stall_factor=1.0)


def test_an_old_rtt_minimum_ages_out():
    mon = LinkMonitor(MonitorConfig(rtt_window=5, rtt_max_age_s=10.0))
    mon.observe_rtt(1.0, 0.0)  # measured on the install link, before the path got longer
    mon.observe_rtt(20.0, 5.0)
    assert mon.estimate().rtt_ms == 1.0
    mon.observe_rtt(25.0, 12.0)  # the 1 ms sample is 12 s old: it no longer counts
    assert mon.estimate().rtt_ms == 20.0


def test_the_first_measurement_after_a_bound_replaces_it_either_side():
    mon = _demo_monitor()
    mon.observe_timeout(2 * BOUNDARY_BYTES, 2.0, 12.0)  # at most 4.8 Mbit/s
    mon.observe_rate(1.1e6, 13.0)  # a probe that got through at the true rate
    assert mon.estimate().up_bps == pytest.approx(1.1e6) and mon.estimate().changes == 1
    # From there on it is a level like any other: one outlier does not move it much.
    mon.observe_rate(0.2e6, 14.0)
    assert mon.estimate().up_bps > 0.8e6
    # After the outage the bound was too tight: the link came back at 5.85 Mbit/s.
    mon.observe_stall(BOUNDARY_BYTES, 30.0, 40.0)
    assert mon.estimate().up_bps < 0.5e6
    mon.observe_rate(5.85e6, 45.0)
    assert mon.estimate().up_bps == pytest.approx(5.85e6)


# -- silence during an outage, and the return ------------------------------------------------

def test_silence_on_an_idle_link_decays_the_estimate_towards_zero_and_the_return_is_a_step_up():
    mon = LinkMonitor()
    _feed(mon, [1.1e6] * 20, t0=12.0)
    before = mon.estimate()
    changed = [mon.observe_unreachable(24.0 + 0.5 * i) for i in range(20)]
    assert changed[0] and not any(changed[1:])  # one change: the silence began
    ups = []
    mon2 = LinkMonitor()
    _feed(mon2, [1.1e6] * 20, t0=12.0)
    for i in range(3):
        mon2.observe_unreachable(24.0 + 0.5 * i)
        ups.append(mon2.estimate().up_bps)
    assert ups == pytest.approx([1.1e6 / 2, 1.1e6 / 4, 1.1e6 / 8])
    est = mon.estimate()
    assert est.unreachable == 20 and est.changes == before.changes + 1 and est.last_change_s == 24.0
    assert est.up_bps == pytest.approx(MonitorConfig().floor_bps)  # 1.1e6 / 2^20 is below the floor
    assert LinkEstimate.from_json(est.to_json()) == est
    # The link answers again: a health check ends the run of failures but says nothing of the rate.
    mon.observe_rtt(50.0, 34.2)
    assert mon.estimate().unreachable == 0 and mon.estimate().up_bps == est.up_bps
    # The probe's measurement replaces the decayed bound, and it is a step up (a change).
    assert mon.observe_rate(5.85e6, 34.4) is True
    est = mon.estimate()
    assert est.up_bps == pytest.approx(5.85e6) and est.changes == before.changes + 2 and est.last_change_s == 34.4


def test_a_link_that_fails_its_first_check_starts_at_the_floor_and_its_first_measurement_replaces_it():
    mon = LinkMonitor()
    assert mon.estimate().up_bps is None
    assert mon.observe_unreachable(0.5) is True  # the silence began: a change
    est = mon.estimate()
    assert est.up_bps == pytest.approx(MonitorConfig().floor_bps) and est.unreachable == 1
    assert est.rates_bps() == pytest.approx((MonitorConfig().floor_bps,))
    mon.observe_unreachable(1.0)
    assert mon.estimate().up_bps == pytest.approx(MonitorConfig().floor_bps)  # no lower than the floor
    mon.observe_rtt(50.0, 12.0)
    assert mon.observe_rate(8e6, 12.4) is True  # the link came: a step up from the bound
    assert mon.estimate().up_bps == pytest.approx(8e6)


def test_a_measurement_below_a_bound_refines_it_without_a_new_change():
    mon = _demo_monitor()
    mon.observe_timeout(2 * BOUNDARY_BYTES, 2.0, 12.0)
    changes = mon.estimate().changes
    assert mon.observe_rate(1.1e6, 13.0) is False and mon.estimate().changes == changes


def test_an_rtt_dominated_first_call_gives_a_level_from_below():
    mon = LinkMonitor()
    mon.observe_rtt(40.0, 0.0)
    mon.observe_transfer(32_928, 100, 0.048, 0.1, 0.1)  # 32 kB in 48 ms with a 40 ms RTT
    up = mon.estimate().up_bps
    assert up is not None and up >= 8 * 32_928 / 0.048


def test_bad_decay_settings_are_refused():
    with pytest.raises(ValueError, match="outage_decay"):
        MonitorConfig(outage_decay=0.5)


def test_a_stuck_upload_keeps_tightening_its_own_bound_within_about_a_second():
    """ResNet50's int8 input (150 kB) at 18.88 Mbit/s, 20 ms RTT and 200 ms server time; the link
    steps to 1.1 Mbit/s as it is sent. Once the first bound is set, each 0.2 s check tightens it
    (the margin covers only the fixed time), so the estimate is near 1.1 Mbit/s ~1.2 s in."""
    mon = LinkMonitor()
    mon.observe_rtt(20.0, 0.0)
    for i in range(10):
        mon.observe_transfer(150_528, 4000, 150_528 * 8 / 18.88e6 + 0.22, 200.0, float(i))
    first = mon.stall_after_s(150_528)
    assert mon.observe_stall(150_528, first + 0.05, 12.0 + first) is True
    ups = [mon.estimate().up_bps]
    for k in range(1, 4):
        mon.observe_stall(150_528, first + 0.05 + 0.2 * k, 12.0 + first + 0.2 * k)
        ups.append(mon.estimate().up_bps)
    assert ups[-1] < ups[0] / 2 and ups[-1] < 1.5e6  # about 1.2 s into the upload
    assert all(b <= a for a, b in zip(ups, ups[1:]))


def test_a_transfer_begun_before_the_bound_cannot_lift_it_but_a_later_one_can():
    mon = _demo_monitor()
    mon.observe_stall(BOUNDARY_BYTES, 3.0, 13.0)  # the step to 1.1 Mbit/s, bounded at t=13
    bound = mon.estimate().up_bps
    assert bound < 2.5e6
    # A call sent at t=11.9, mostly before the step, completes at 13.2 averaging 8 Mbit/s: stale.
    assert mon.observe_transfer(BOUNDARY_BYTES, 4000, 1.3, 340.0, 13.2) is False
    assert mon.estimate().up_bps == bound
    # One sent after the bound measures the link as it is now, either side of the bound.
    mon.observe_transfer(BOUNDARY_BYTES, 4000, 8 * BOUNDARY_BYTES / 5.85e6 + 0.36, 340.0, 16.0)
    assert mon.estimate().up_bps == pytest.approx(5.85e6, rel=0.05)


def test_a_transfer_begun_before_the_bound_and_slower_tightens_it_and_the_next_one_sets_the_level():
    """A dip from 8 to 1.1 Mbit/s: the stalled upload bounds the rate; the call sent before the
    dip then completes at a rate that averages both sides. It is a tighter bound, so the first
    call sent after the link came back at 20 Mbit/s sets the level in one sample."""
    mon = _demo_monitor()
    mon.observe_stall(BOUNDARY_BYTES, 3.0, 13.0)
    bound = mon.estimate().up_bps
    changes = mon.estimate().changes
    # Sent at t=11, it completes at 14 averaging 1.6 Mbit/s: below the bound.
    assert mon.observe_transfer(BOUNDARY_BYTES, 4000, 8 * BOUNDARY_BYTES / 1.6e6 + 0.36, 340.0, 14.0) is False
    tighter = mon.estimate()
    assert tighter.up_bps < bound and tighter.up_bps == pytest.approx(1.6e6, rel=0.1)
    assert tighter.changes == changes
    assert mon.observe_transfer(BOUNDARY_BYTES, 4000, 8 * BOUNDARY_BYTES / 20e6 + 0.36, 340.0, 15.0) is True
    assert mon.estimate().up_bps == pytest.approx(20e6, rel=0.05)
    assert mon.estimate().changes == changes + 1


def test_a_sample_past_the_dead_band_begins_a_rise_until_a_step_completes_it():
    mon = LinkMonitor()
    _feed(mon, [2e6] * 10)
    mon.observe_rate(2.4e6, 1.0)  # log 1.2 = 0.18: within the dead band
    assert not mon.rising
    mon.observe_rate(16e6, 1.1)  # 8x: begun, not yet a step
    assert mon.rising and mon.estimate().changes == 0
    mon.observe_rate(16e6, 1.2)  # the second completes it
    assert not mon.rising and mon.estimate().changes == 1
    assert mon.estimate().up_bps == pytest.approx(16e6)
