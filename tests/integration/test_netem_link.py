"""The link emulator over loopback TCP: rate, delay, backpressure, outages, live changes.

Accuracy is checked as ratios to the setting (within 10%), never as wall-clock limits.
Delay is measured as the emulated round trip minus the direct round trip, so the cost of
the test's own event loop cancels out. The two are pinged alternately, and each is the
lower quartile of 16 pings: CPU contention from other processes only ever adds delay,
and on a busy 2-core machine it moves the median by several milliseconds (see
docs/netem.md).
"""

import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from bench.netem_accuracy import PING_BYTES, echo_back, ping_rtts_s, read_timed
from splitinfer.netem import LinkEmulator, LinkSetting, OutageMode, ThreadedLinkEmulator, TraceStep

LOOPBACK = "127.0.0.1"


async def _sink(reader, writer):
    """Count bytes; answer with the byte count and the seconds between first and last byte."""
    expected = int.from_bytes(await reader.readexactly(8), "big")
    total, first_len, first_s, last_s = await read_timed(reader, expected)
    report = {"bytes": total, "first": first_len, "first_s": first_s, "last_s": last_s, "span_s": last_s - first_s}
    writer.write(json.dumps(report).encode())
    await writer.drain()
    writer.close()


async def _server(handler):
    server = await asyncio.start_server(handler, LOOPBACK, 0)
    return server, server.sockets[0].getsockname()[1]


async def _added_rtt_s(direct_port, emulated_port, count=16):
    """Lower quartile of emulated minus direct round trips, pinged alternately so both see the same load."""
    rtts = await ping_rtts_s([direct_port, emulated_port], count)
    direct_s, emulated_s = (statistics.quantiles(samples, n=4)[0] for samples in rtts)
    return emulated_s - direct_s


async def _uplink_report(port, nbytes):
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    writer.write(nbytes.to_bytes(8, "big") + b"u" * nbytes)
    await writer.drain()
    report = json.loads(await reader.read())
    writer.close()
    assert report["bytes"] == nbytes
    return report


async def _uplink_rate_bps(port, nbytes):
    """Rate seen by the receiver, from its first to its last byte."""
    report = await _uplink_report(port, nbytes)
    return (report["bytes"] - report["first"]) * 8 / report["span_s"]


def _near(ratio):
    return abs(ratio - 1.0) <= 0.10


def _timed(scenario, accept):
    """Run a timing scenario, and once more if its result misses.

    Contention from other processes can only make the emulator late, never early or
    fast, so a pass in either run shows the emulator keeps its schedule; a fault in the
    emulator misses both.
    """
    result = asyncio.run(scenario())
    return result if accept(result) else asyncio.run(scenario())


def test_rate_and_delay_match_the_setting_within_10_percent():
    async def scenario():
        echo, echo_port = await _server(echo_back)
        sink, sink_port = await _server(_sink)
        setting = LinkSetting.from_mbps(8, 8, 40)
        async with LinkEmulator(upstream=(LOOPBACK, echo_port), setting=setting) as emu:
            # Each ping also pays serialisation of its bytes both ways.
            expected_s = 0.040 + 2 * PING_BYTES * 8 / 8e6
            added_s = await _added_rtt_s(echo_port, emu.port)
        async with LinkEmulator(upstream=(LOOPBACK, sink_port), setting=setting) as emu:
            rate_bps = await _uplink_rate_bps(emu.port, 600_000)
        echo.close()
        sink.close()
        return added_s / expected_s, rate_bps / 8e6

    delay_ratio, rate_ratio = _timed(scenario, lambda r: _near(r[0]) and _near(r[1]))
    assert delay_ratio == pytest.approx(1.0, abs=0.10), "added delay / configured RTT"
    assert rate_ratio == pytest.approx(1.0, abs=0.10), "delivered / configured rate"


def test_downlink_rate_and_a_transfer_combine_serialisation_and_delay():
    """A bulk reply takes bytes / rate + one-way delay, as on a real link."""
    nbytes = 400_000

    async def source(reader, writer):
        await reader.readexactly(1)
        writer.write(b"d" * nbytes)
        await writer.drain()
        writer.close()

    async def scenario():
        server, port = await _server(source)
        setting = LinkSetting.from_mbps(32, 4, 60)
        async with LinkEmulator(upstream=(LOOPBACK, port), setting=setting) as emu:
            reader, writer = await asyncio.open_connection(LOOPBACK, emu.port)
            start_s = time.monotonic()
            writer.write(b"g")
            got = len(await reader.readexactly(nbytes))
            elapsed_s = time.monotonic() - start_s
            writer.close()
            stats = emu.stats()
        server.close()
        return got, elapsed_s, stats

    expected_s = 0.060 + 8 / 32e6 + nbytes * 8 / 4e6
    got, elapsed_s, stats = _timed(scenario, lambda r: _near(r[1] / expected_s))
    assert got == nbytes and stats.bytes_down == nbytes and stats.bytes_up == 1
    assert elapsed_s / expected_s == pytest.approx(1.0, abs=0.10)


def test_connections_share_the_link_bandwidth():
    """Two transfers at once get the link's rate between them, not each."""
    nbytes = 250_000

    async def scenario():
        sink, port = await _server(_sink)
        async with LinkEmulator(upstream=(LOOPBACK, port), setting=LinkSetting.from_mbps(8, 8, 0)) as emu:
            reports = await asyncio.gather(*(_uplink_report(emu.port, nbytes) for _ in range(2)))
        sink.close()
        return reports

    def aggregate_bps(reports):
        first = min(reports, key=lambda r: r["first_s"])
        span_s = max(r["last_s"] for r in reports) - first["first_s"]
        return (sum(r["bytes"] for r in reports) - first["first"]) * 8 / span_s, span_s

    reports = _timed(scenario, lambda r: _near(aggregate_bps(r)[0] / 8e6))
    rate_bps, span_s = aggregate_bps(reports)
    assert rate_bps / 8e6 == pytest.approx(1.0, abs=0.10)
    # Both were served throughout: neither waited for the other to finish.
    assert all(r["span_s"] > 0.5 * span_s for r in reports)


def test_backpressure_reaches_the_sender():
    """A sender on a slow link blocks once the emulator's and the kernel's buffers are full."""

    async def scenario():
        sink, port = await _server(_sink)
        async with LinkEmulator(upstream=(LOOPBACK, port), setting=LinkSetting.from_mbps(1, 1, 0),
                                buffer_bytes=64 * 1024) as emu:
            reader, writer = await asyncio.open_connection(LOOPBACK, emu.port)
            offered = 64 * 1024 * 1024
            writer.write(offered.to_bytes(8, "big"))
            chunk = b"b" * 65536
            sent = 0
            deadline_s = time.monotonic() + 0.5
            while time.monotonic() < deadline_s:
                writer.write(chunk)
                try:
                    await asyncio.wait_for(writer.drain(), max(deadline_s - time.monotonic(), 0.001))
                except asyncio.TimeoutError:
                    break
                sent += len(chunk)
            delivered = emu.stats().bytes_up
            writer.transport.abort()
        sink.close()
        return sent, delivered, offered

    sent, delivered, offered = asyncio.run(scenario())
    # At 1 Mbit/s about 60 kB cross in 0.5 s; the rest of what the sender could push is
    # buffers (emulator queue, socket buffers), not the 64 MB it offered.
    assert delivered < 100_000
    assert sent < 8 * 1024 * 1024 < offered


def test_blackhole_holds_data_and_keeps_the_connection_then_delivers_it():
    async def scenario():
        server, port = await _server(echo_back)
        async with LinkEmulator(upstream=(LOOPBACK, port), setting=LinkSetting.from_mbps(8, 8, 10)) as emu:
            reader, writer = await asyncio.open_connection(LOOPBACK, emu.port)
            writer.write(b"before")
            assert await reader.readexactly(6) == b"before"
            emu.set(up=False)
            writer.write(b"during")
            await writer.drain()
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(reader.readexactly(6), 0.3)
            assert not reader.at_eof()
            # A new connection is accepted but nothing crosses.
            reader2, writer2 = await asyncio.open_connection(LOOPBACK, emu.port)
            writer2.write(b"new")
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(reader2.readexactly(3), 0.2)
            emu.set(up=True)
            held = await asyncio.wait_for(reader.readexactly(6), 2.0)
            fresh = await asyncio.wait_for(reader2.readexactly(3), 2.0)
            stats = emu.stats()
            writer.close()
            writer2.close()
        server.close()
        return held, fresh, stats

    held, fresh, stats = asyncio.run(scenario())
    assert held == b"during" and fresh == b"new"
    assert stats.outages == 1 and stats.connections_reset == 0 and stats.dropped_bytes == 0


def test_reset_mode_resets_connections_and_refuses_new_ones_until_the_link_returns():
    async def scenario():
        server, port = await _server(echo_back)
        async with LinkEmulator(upstream=(LOOPBACK, port), setting=LinkSetting.from_mbps(8, 8, 10),
                                outage_mode=OutageMode.RESET) as emu:
            reader, writer = await asyncio.open_connection(LOOPBACK, emu.port)
            writer.write(b"ping")
            assert await reader.readexactly(4) == b"ping"
            emu.set(down_bps=0.0)
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
                await asyncio.wait_for(reader.readexactly(1), 2.0)
            reader2, writer2 = await asyncio.open_connection(LOOPBACK, emu.port)
            with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
                await asyncio.wait_for(reader2.readexactly(1), 2.0)
            emu.set(down_bps=8e6)
            reader3, writer3 = await asyncio.open_connection(LOOPBACK, emu.port)
            writer3.write(b"back")
            back = await asyncio.wait_for(reader3.readexactly(4), 2.0)
            writer3.close()
            stats = emu.stats()
        server.close()
        return back, stats

    back, stats = asyncio.run(scenario())
    assert back == b"back"
    assert stats.outages == 1 and stats.connections_reset == 1 and stats.connections_refused == 1


def test_live_set_changes_the_rate():
    async def scenario():
        sink, port = await _server(_sink)
        async with LinkEmulator(upstream=(LOOPBACK, port), setting=LinkSetting.from_mbps(8, 8, 0)) as emu:
            fast_bps = await _uplink_rate_bps(emu.port, 300_000)
            emu.set(up_bps=2e6)
            slow_bps = await _uplink_rate_bps(emu.port, 100_000)
        sink.close()
        return fast_bps, slow_bps

    fast_bps, slow_bps = _timed(scenario, lambda r: _near(r[0] / 8e6) and _near(r[1] / 2e6))
    assert fast_bps / 8e6 == pytest.approx(1.0, abs=0.10)
    assert slow_bps / 2e6 == pytest.approx(1.0, abs=0.10)


def test_trace_replay_walks_the_steps_in_order():
    up = LinkSetting.from_mbps(8, 8, 10)
    trace = [TraceStep(0.0, up), TraceStep(0.3, LinkSetting.from_mbps(0, 0, 10, up=False)), TraceStep(0.6, up)]

    async def scenario():
        server, port = await _server(echo_back)
        seen = []
        async with LinkEmulator(upstream=(LOOPBACK, port), trace=trace) as emu:
            for _ in range(18):
                seen.append(emu.setting.is_outage)
                await asyncio.sleep(0.05)
            stats = emu.stats()
        server.close()
        return seen, stats

    seen, stats = asyncio.run(scenario())
    # up, then down, then up again, and nothing else.
    changes = [seen[0]] + [b for a, b in zip(seen, seen[1:]) if a != b]
    assert changes == [False, True, False]
    assert stats.outages == 1


def test_threaded_runner_and_http_control_api():
    with socket.create_server((LOOPBACK, 0)) as upstream:
        port = upstream.getsockname()[1]
        emu = ThreadedLinkEmulator(upstream=(LOOPBACK, port), setting=LinkSetting.from_mbps(8, 8, 20),
                                   control=(LOOPBACK, 0))
        with emu:
            base = f"http://{LOOPBACK}:{emu.control_port}"
            with urllib.request.urlopen(base + "/state", timeout=5) as response:
                state = json.load(response)
            assert state["setting"] == {"up_mbps": 8.0, "down_mbps": 8.0, "rtt_ms": 20.0, "up": True}
            request = urllib.request.Request(base + "/set", data=json.dumps({"up_mbps": 1.1, "up": False}).encode(),
                                             method="POST", headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=5) as response:
                answer = json.load(response)
            assert answer["outage"] is True and answer["setting"]["up_mbps"] == pytest.approx(1.1)
            assert emu.setting.is_outage
            bad = urllib.request.Request(base + "/set", data=b'{"speed": 1}', method="POST")
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(bad, timeout=5)
            assert info.value.code == 400 and "speed" in json.load(info.value)["error"]
            emu.set(up=True, rtt_ms=5.0)
            assert emu.state()["setting"]["rtt_ms"] == 5.0
            # A blocking client through the threaded proxy.
            with socket.create_connection((LOOPBACK, emu.port), timeout=5) as client:
                conn, _ = upstream.accept()
                with conn:
                    client.sendall(b"hello")
                    assert conn.recv(5) == b"hello"
            assert emu.stats().bytes_up == 5
        assert emu.emulator.stats().connections_active == 0


def test_command_line_serves_until_terminated(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text("t_s,up_mbps,down_mbps,rtt_ms,up\n0,8,8,10,1\n")
    with socket.create_server((LOOPBACK, 0)) as upstream:
        port = upstream.getsockname()[1]
        process = subprocess.Popen(
            [sys.executable, "-m", "splitinfer.netem", "--listen", f"{LOOPBACK}:0", "--upstream",
             f"{LOOPBACK}:{port}", "--trace", str(trace), "--control", f"{LOOPBACK}:0", "--log-level", "WARNING"],
            stdout=subprocess.PIPE, text=True)
        try:
            line = process.stdout.readline()
            assert line.startswith("netem listening on 127.0.0.1:")
            listen_port = int(line.split()[3].rsplit(":", 1)[1])
            control_port = int(line.rsplit(":", 1)[1])
            with socket.create_connection((LOOPBACK, listen_port), timeout=5) as client:
                conn, _ = upstream.accept()
                with conn:
                    client.sendall(b"x" * 1000)
                    received = b""
                    while len(received) < 1000:
                        received += conn.recv(4096)
            with urllib.request.urlopen(f"http://{LOOPBACK}:{control_port}/state", timeout=5) as response:
                state = json.load(response)
            assert state["stats"]["bytes_up"] == 1000
        finally:
            process.terminate()
            assert process.wait(timeout=10) == 0


def test_a_rate_change_applies_to_a_transfer_already_under_way():
    """Bytes queued at the old rate do not keep the old schedule: the new rate applies at once."""
    nbytes = 400_000
    slow_s = 0.3

    async def scenario():
        sink, port = await _server(_sink)
        async with LinkEmulator(upstream=(LOOPBACK, port), setting=LinkSetting.from_mbps(1, 1, 0)) as emu:
            start_s = time.monotonic()
            transfer = asyncio.ensure_future(_uplink_rate_bps(emu.port, nbytes))
            await asyncio.sleep(slow_s)
            emu.set(up_bps=16e6)
            await transfer
            elapsed_s = time.monotonic() - start_s
        sink.close()
        return elapsed_s

    expected_s = slow_s + (nbytes + 8 - slow_s * 1e6 / 8) * 8 / 16e6
    elapsed_s = _timed(scenario, lambda r: _near(r / expected_s))
    assert elapsed_s / expected_s == pytest.approx(1.0, abs=0.10)
