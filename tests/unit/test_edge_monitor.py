"""Link monitor: steps are seen within a few samples, jitter is not chased. Time is passed in."""

import math
import random

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
    mon = LinkMonitor(MonitorConfig(down_ratio=4.0))
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
