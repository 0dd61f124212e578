"""Link monitor: a call's hidden fixed time is not read as transfer time, and samples that
the fixed time dominates weigh little. Time is passed in."""

import math

import pytest

from edge_agent.monitor import LinkMonitor, MonitorConfig

RATE_BPS = 18.88e6
RTT_MS, SERVER_MS, HIDDEN_MS = 5.0, 5.0, 15.0


def _call(mon: LinkMonitor, up_bytes: int, now_s: float, rate_bps: float = RATE_BPS) -> bool:
    elapsed_s = (RTT_MS + SERVER_MS + HIDDEN_MS) / 1e3 + 8.0 * up_bytes / rate_bps
    return mon.observe_transfer(up_bytes, 0, elapsed_s, SERVER_MS, now_s)


def _demo(config: MonitorConfig, sizes: list[int]) -> float:
    """Calls of these sizes in turn, 10 a second for 6 s, at 18.88 Mbit/s with 15 ms of hidden fixed time."""
    mon = LinkMonitor(config)
    mon.observe_rtt(RTT_MS, 0.0)
    for i in range(60):
        _call(mon, sizes[i % len(sizes)], 0.1 + i / 10)
    est = mon.estimate()
    assert est.up_bps is not None
    return est.up_bps


def test_small_transfers_of_mixed_sizes_measure_the_rate_not_the_fixed_time():
    sizes = [16_000] * 4 + [150_000]  # the split's boundary, and now and then a larger plan's
    fitted = _demo(MonitorConfig(), sizes)
    unfitted = _demo(MonitorConfig(fit_span=0), sizes)
    assert 0.85 < fitted / RATE_BPS < 1.15
    assert unfitted / RATE_BPS < 0.6  # the fixed time read as bytes' time: the defect this fixes


def test_one_size_cannot_tell_the_fixed_time_from_the_bytes():
    # 16 kB alone: 22 ms past the RTT, whatever the split between bytes and fixed time. Nothing is
    # subtracted, and the level is that of the calls (5.9 Mbit/s), as with the fit off.
    assert math.isclose(_demo(MonitorConfig(), [16_000]), _demo(MonitorConfig(fit_span=0), [16_000]), rel_tol=1e-9)


def test_a_fitted_fixed_time_is_kept_for_later_calls_of_one_size():
    mon = LinkMonitor()
    mon.observe_rtt(RTT_MS, 0.0)
    for i in range(10):
        _call(mon, 150_000 if i % 2 else 16_000, 0.1 + i / 10)
    for i in range(100):  # 10 s of the small plan alone: the window no longer spans two sizes
        _call(mon, 16_000, 1.1 + i / 10)
    assert 0.85 < mon.estimate().up_bps / RATE_BPS < 1.15
    # and a transfer's predicted time includes it
    predicted_s = mon.transfer_s(16_000)
    assert math.isclose(predicted_s, (RTT_MS + HIDDEN_MS) / 1e3 + 8 * 16_000 / RATE_BPS, rel_tol=0.15)


def test_a_call_the_fixed_time_dominates_pulls_the_level_less():
    def drop(up_bytes: int) -> float:
        mon = LinkMonitor(MonitorConfig(fit_span=0))
        mon.observe_rtt(40.0, 0.0)
        for i in range(20):
            mon.observe_rate(10e6, 0.1 + i / 10)
        # Both calls measure 5 Mbit/s past the RTT and the server's 20 ms.
        mon.observe_transfer(up_bytes, 0, 0.060 + 8.0 * up_bytes / 5e6, 20.0, 3.0)
        return math.log(10e6 / mon.estimate().up_bps)

    small, large = drop(10_000), drop(500_000)  # 16 ms of bytes in a 76 ms call; 800 ms in 860
    assert 0 < small < 0.6 * large


def test_a_step_seen_by_large_transfers_is_still_seen_at_once():
    mon = LinkMonitor()
    mon.observe_rtt(RTT_MS, 0.0)
    for i in range(30):
        _call(mon, 150_000 if i % 3 == 0 else 16_000, 0.1 + i / 10)
    assert _call(mon, 150_000, 3.2, rate_bps=1.1e6)  # a step, at the first sample
    est = mon.estimate()
    assert est.changes == 1 and 0.7 < est.up_bps / 1.1e6 < 1.4


@pytest.mark.parametrize("knob,value", [("fit_span", 1.0), ("fit_span", -2.0), ("fit_samples", 2), ("fit_sigmas", -1.0),
                                        ("full_weight_share", 0.0), ("full_weight_share", 1.5)])
def test_bad_fit_settings_are_refused_by_name(knob, value):
    with pytest.raises(ValueError, match=knob):
        MonitorConfig(**{knob: value})


def test_a_jittered_link_without_hidden_time_gets_none_subtracted():
    # Rate jittered by e^0.2 around 5 Mbit/s, sizes of 16 and 150 kB, no hidden time: the slope's
    # error would fit an intercept of a few ms; one under two standard errors counts as 0.
    import random

    worst = 0.0
    for seed in range(40):
        rng, fitted, unfitted = random.Random(seed), LinkMonitor(), LinkMonitor(MonitorConfig(fit_span=0))
        for mon in (fitted, unfitted):
            mon.observe_rtt(40.0, 0.0)
        gap = []
        for i in range(200):
            size, rate = (150_000 if i % 5 == 0 else 16_000), 5e6 * rng.lognormvariate(0, 0.2)
            for mon in (fitted, unfitted):
                mon.observe_transfer(size, 0, 0.045 + 8.0 * size / rate, 5.0, 0.1 + i / 1.6)
            if i > 50:
                gap.append(math.log(fitted.estimate().up_bps / unfitted.estimate().up_bps))
        worst = max(worst, abs(sum(gap) / len(gap)))
    assert worst < 0.1
