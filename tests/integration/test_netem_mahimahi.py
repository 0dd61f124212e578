"""The link emulator on Mahimahi traces over loopback TCP: delivery follows the trace.

A saturating sender pushes both directions of one connection through the emulator on a
short generated trace whose rate changes every second; the bytes that arrive in each
1-second window of trace time are compared with the trace's opportunities x 1500. The
measurement is the benchmark's own (`bench.netem_accuracy.measure_mahimahi`).
"""

import subprocess
import sys
from pathlib import Path

import pytest

from bench.netem_accuracy import measure_mahimahi
from splitinfer.netem import MahimahiTrace, load_mahimahi_trace

SHARED_TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"


def _generated(packets_per_second):
    """Evenly spaced opportunities, packets_per_second[i] of them in second i."""
    times = []
    for second, count in enumerate(packets_per_second):
        times += [second * 1000 + (i * 1000) // count for i in range(count)]
    times.append(len(packets_per_second) * 1000)
    return MahimahiTrace(path="generated", opportunities_ms=tuple(times))


def test_delivery_follows_a_varying_trace_within_5_percent_per_second():
    up = _generated([400, 100, 800, 300])     # 4.8, 1.2, 9.6, 3.6 Mbit/s
    down = _generated([200, 600, 50, 500])
    result = measure_mahimahi(up, down, seconds=4, rtt_ms=40.0)
    for direction in ("up", "down"):
        windows = result[direction]
        assert windows["windows"] == 3
        assert windows["median_ratio"] == pytest.approx(1.0, abs=0.05), windows["per_second"]
        # The slow second really is slow: delivery is not the mean rate.
        rates = [w["delivered_bytes"] for w in windows["per_second"]]
        assert max(rates) > 4 * min(rates)


def test_a_second_without_opportunities_delivers_nothing():
    up = _generated([300, 1, 300])
    gap = MahimahiTrace(path="gap", opportunities_ms=up.opportunities_ms[:300] + up.opportunities_ms[301:])
    result = measure_mahimahi(gap, up, seconds=3, rtt_ms=20.0)
    seconds = result["up"]["per_second"]
    # At most the packets due in the last few ms before the gap, late by timer jitter.
    assert seconds[0]["expected_bytes"] == 0 and seconds[0]["delivered_bytes"] <= 2 * 1500
    assert seconds[1]["delivered_bytes"] == pytest.approx(seconds[1]["expected_bytes"], rel=0.05)


def test_netem_command_serves_mahimahi_traces_from_the_shared_folder(tmp_path):
    if not (SHARED_TRACES / "TMobile-LTE-short.up").is_file():
        pytest.skip(f"no shared traces at {SHARED_TRACES}")
    up, down = SHARED_TRACES / "TMobile-LTE-short.up", SHARED_TRACES / "TMobile-LTE-short.down"
    assert load_mahimahi_trace(up).period_ms == 140000
    process = subprocess.Popen(
        [sys.executable, "-m", "splitinfer.netem", "--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:9",
         "--trace-up", str(up), "--trace-down", str(down), "--rtt", "40ms", "--queue-packets", "50"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("netem listening on 127.0.0.1:")
    finally:
        process.terminate()
        _, err = process.communicate(timeout=10)
    assert process.returncode == 0, err
    assert "Mahimahi traces" in err and "TMobile-LTE-short.up" in err
