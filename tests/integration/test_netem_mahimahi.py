"""The link emulator on Mahimahi traces over loopback TCP: delivery follows the trace.

A saturating sender pushes both directions of one connection through the emulator on a
short generated trace whose rate changes every second; the bytes that arrive in each
1-second window of trace time are compared with the trace's opportunities x 1500. The
measurement is the benchmark's own (`bench.netem_accuracy.measure_mahimahi`).
"""

import asyncio
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from bench.netem_accuracy import echo_back, measure_mahimahi
from splitinfer.netem import LinkEmulator, MahimahiTrace, load_mahimahi_trace

LOOPBACK = "127.0.0.1"
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


async def _ping_s(port, count):
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    samples = []
    for _ in range(count):
        start_s = time.monotonic()
        writer.write(b"p" * 64)
        await writer.drain()
        await reader.readexactly(64)
        samples.append(time.monotonic() - start_s)
    writer.close()
    return statistics.median(samples)


def test_queueing_delay_grows_under_load_up_to_the_queue_bound():
    """A saturated 1.2 Mbit/s uplink with a 30-packet queue delays a ping by the queue's 0.3 s drain time."""
    uplink = _generated([100] * 4)    # 100 packets/s
    downlink = _generated([2000] * 4)
    queue_packets = 30

    async def scenario():
        echo = await asyncio.start_server(echo_back, LOOPBACK, 0)
        async with LinkEmulator(upstream=(LOOPBACK, echo.sockets[0].getsockname()[1]), trace_up=uplink,
                                trace_down=downlink, rtt_ms=20.0, queue_bytes=queue_packets * 1500) as emu:
            idle_s = await _ping_s(emu.port, 5)
            _, bulk = await asyncio.open_connection(LOOPBACK, emu.port)
            chunk = b"x" * 65536

            async def saturate():
                while True:
                    bulk.write(chunk)
                    await bulk.drain()

            sender = asyncio.ensure_future(saturate())
            await asyncio.sleep(0.5)  # fill the queue
            loaded_s = await _ping_s(emu.port, 3)
            queued = emu.opportunity_link("up").backlog_bytes(now_s=time.monotonic())
            sender.cancel()
            bulk.close()
        echo.close()
        return idle_s, loaded_s, queued

    idle_s, loaded_s, queued = asyncio.run(scenario())
    drain_s = queue_packets / 100
    assert queued <= queue_packets * 1500
    assert loaded_s - idle_s == pytest.approx(drain_s, rel=0.25)


def test_connections_share_one_link_per_direction():
    """Two saturating uploads together get the trace's opportunities, not twice them."""
    uplink = _generated([300, 600, 300])
    arrivals = []

    async def sink(reader, writer):
        while data := await reader.read(65536):
            arrivals.append((time.monotonic(), len(data)))
        writer.close()

    async def scenario():
        server = await asyncio.start_server(sink, LOOPBACK, 0)
        async with LinkEmulator(upstream=(LOOPBACK, server.sockets[0].getsockname()[1]), trace_up=uplink,
                                trace_down=uplink, rtt_ms=10.0) as emu:
            origin_s = time.monotonic() - emu.trace_elapsed_s + 0.005
            writers = [(await asyncio.open_connection(LOOPBACK, emu.port))[1] for _ in range(2)]

            async def saturate(writer):
                while True:
                    writer.write(b"x" * 65536)
                    await writer.drain()

            senders = [asyncio.ensure_future(saturate(w)) for w in writers]
            await asyncio.sleep(max(origin_s + 3.0 - time.monotonic(), 0.0))
            for task in senders:
                task.cancel()
            for writer in writers:
                writer.close()
        server.close()
        return origin_s

    origin_s = asyncio.run(scenario())
    per_second = [0, 0, 0]
    for t_s, nbytes in arrivals:
        if 0 <= t_s - origin_s < 3:
            per_second[int(t_s - origin_s)] += nbytes
    assert per_second[1] == pytest.approx(600 * 1500, rel=0.05)
    assert per_second[2] == pytest.approx(300 * 1500, rel=0.05)


@pytest.mark.parametrize("scale", [1, 3])
def test_netem_command_applies_the_queue_bound_and_reports_it_on_the_control_api(tmp_path, scale):
    up, down = tmp_path / "x.up", tmp_path / "x.down"
    up.write_text("".join(f"{t}\n" for t in range(10, 1010, 10)))
    down.write_text("".join(f"{t}\n" for t in range(5, 1005, 5)))
    process = subprocess.Popen(
        [sys.executable, "-m", "splitinfer.netem", "--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:9",
         "--trace-up", str(up), "--trace-down", str(down), "--rtt", "30ms", "--queue-packets", "50",
         "--control", "127.0.0.1:0"] + (["--rate-scale", str(scale)] if scale != 1 else []),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        control = line.rsplit("control on ", 1)[1].strip()
        with urllib.request.urlopen(f"http://{control}/state", timeout=10) as answer:
            state = json.load(answer)
    finally:
        process.terminate()
        process.communicate(timeout=10)
    assert state["mahimahi"]["queue_bytes"] == 50 * 1500 and state["mahimahi"]["shaping"] is True
    assert state["mahimahi"]["up"]["opportunities"] == 100 * scale and state["mahimahi"]["down"]["period_ms"] == 1000
    assert state["setting"]["up_mbps"] == pytest.approx(1.2 * scale) and state["setting"]["rtt_ms"] == 30.0
