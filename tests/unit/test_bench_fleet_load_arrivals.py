"""bench.fleet_load's arrivals: Poisson at the steady rate, and three times it in the burst, even
where a device's mean gap (30 s here) is longer than the burst (10 s)."""

import numpy as np
import pytest

from bench.fleet_load import next_arrival


def test_the_burst_runs_at_three_times_the_steady_rate():
    rng, fps, burst_s, end_s = np.random.default_rng(1), 0.033, 30.0, 40.0
    sends = []
    for _ in range(3000):
        t = next_arrival(0.0, fps, burst_s, rng)
        while t < end_s:
            sends.append(t)
            t = next_arrival(t, fps, burst_s, rng)
    sends = np.array(sends)
    steady = ((sends >= 5.0) & (sends < burst_s)).sum() / (burst_s - 5.0) / 3000
    burst = (sends >= burst_s).sum() / (end_s - burst_s) / 3000
    assert steady == pytest.approx(fps, rel=0.05)
    assert burst == pytest.approx(3 * fps, rel=0.05)
