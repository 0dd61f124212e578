"""How closely the user-space link emulator matches its setting, and where it stops keeping up.

Run: ``python -m bench.netem_accuracy`` (about three minutes). Writes
``bench/results/netem_accuracy.json``, ``.png`` (fixed links) and
``netem_accuracy_mahimahi.png`` (recorded traces).

Side by side in one run, on loopback:
- rate: delivered uplink and downlink throughput / the configured bandwidth, for the
  DADS link figures and faster ones (the physical limit is the setting itself);
- delay: (round trip through the emulator - direct round trip) / configured RTT, from
  small pings sent alternately on both paths, at the median and the 25th percentile;
- ceiling: throughput through an unshaped emulator / throughput of a direct loopback
  connection, i.e. the fastest link this proxy can emulate on this machine;
- Mahimahi traces: every ``NAME.up``/``NAME.down`` pair in ``--trace-dir`` (default the
  recorded cellular traces in ``../shared/traces`` next to the checkout, skipped when
  absent), first ``--seconds`` of each, both directions saturated at once by one TCP
  connection: bytes delivered per 1-second window / the trace's opportunities x 1500.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import platform
import socket
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from splitinfer.netem import (
    DEFAULT_QUEUE_BYTES,
    PACKET_BYTES,
    LinkEmulator,
    LinkSetting,
    MahimahiTrace,
    ThreadedLinkEmulator,
    load_mahimahi_trace,
)

_LOG = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
RATES_MBPS = [0.13, 1.1, 5.85, 18.88, 50.0, 75.52, 200.0]
RTTS_MS = [5.0, 20.0, 50.0, 100.0]
PING_BYTES = 64
TRANSFER_S = 1.0
UNSHAPED_BPS = 1e12


async def echo_back(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A server handler that sends back what it reads until the peer closes."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def read_timed(reader: asyncio.StreamReader, nbytes: int) -> tuple[int, int, float, float]:
    """Reads up to `nbytes` (less if the peer closes first): the bytes read, the length of the
    first read, and the monotonic times of the first and the last read. A rate is
    (bytes - first) / (last - first): the first read's bytes arrived before its time."""
    total, first_s, first_len, last_s = 0, 0.0, 0, 0.0
    while total < nbytes:
        data = await reader.read(65536)
        if not data:
            break
        now_s = time.monotonic()
        if total == 0:
            first_s, first_len = now_s, len(data)
        total += len(data)
        last_s = now_s
    return total, first_len, first_s, last_s


async def _sink_or_source(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """First 9 bytes: b'u' (client sends N bytes) or b'd' (server sends N bytes), then N.

    Answers a sink report: bytes and the seconds from the first to the last byte.
    """
    mode = await reader.readexactly(1)
    nbytes = int.from_bytes(await reader.readexactly(8), "big")
    if mode == b"d":
        writer.write(b"d" * nbytes)
        await writer.drain()
        writer.close()
        return
    total, first_len, first_s, last_s = await read_timed(reader, nbytes)
    writer.write(json.dumps({"bytes": total, "first": first_len, "span_s": last_s - first_s}).encode())
    await writer.drain()
    writer.close()


async def _uplink_bps(port: int, nbytes: int) -> float:
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    writer.write(b"u" + nbytes.to_bytes(8, "big"))
    chunk = b"x" * 65536
    for offset in range(0, nbytes, len(chunk)):
        writer.write(chunk[: min(len(chunk), nbytes - offset)])
        await writer.drain()
    report = json.loads(await reader.read())
    writer.close()
    return (report["bytes"] - report["first"]) * 8 / report["span_s"]


async def _downlink_bps(port: int, nbytes: int) -> float:
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    writer.write(b"d" + nbytes.to_bytes(8, "big"))
    total, first_len, first_s, last_s = await read_timed(reader, nbytes)
    writer.close()
    return (total - first_len) * 8 / (last_s - first_s)


async def ping_rtts_s(ports: list[int], count: int) -> list[list[float]]:
    """Round trips of a PING_BYTES ping to the echo server on each port, `count` per port,
    pinged in turn so that all see the same CPU load."""
    conns = [await asyncio.open_connection(LOOPBACK, port) for port in ports]
    rtts: list[list[float]] = [[] for _ in ports]
    for _ in range(count):
        for (reader, writer), samples in zip(conns, rtts):
            start_s = time.monotonic()
            writer.write(b"p" * PING_BYTES)
            await writer.drain()
            await reader.readexactly(PING_BYTES)
            samples.append(time.monotonic() - start_s)
    for _, writer in conns:
        writer.close()
    return rtts


def _quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q * 100) - 1]


async def _run(pings: int) -> dict[str, Any]:
    echo = await asyncio.start_server(echo_back, LOOPBACK, 0)
    echo_port = echo.sockets[0].getsockname()[1]
    bulk = await asyncio.start_server(_sink_or_source, LOOPBACK, 0)
    bulk_port = bulk.sockets[0].getsockname()[1]

    rate_rows = []
    for rate_mbps in RATES_MBPS:
        rate_bps = rate_mbps * 1e6
        nbytes = max(int(rate_bps / 8 * TRANSFER_S), 16 * 1024)
        setting = LinkSetting(up_bps=rate_bps, down_bps=rate_bps, rtt_ms=0.0)
        async with LinkEmulator(upstream=(LOOPBACK, bulk_port), setting=setting) as emu:
            up_bps = await _uplink_bps(emu.port, nbytes)
            down_bps = await _downlink_bps(emu.port, nbytes)
        rate_rows.append({"setting_mbps": rate_mbps, "bytes": nbytes, "uplink_mbps": up_bps / 1e6,
                          "downlink_mbps": down_bps / 1e6, "uplink_ratio": up_bps / rate_bps,
                          "downlink_ratio": down_bps / rate_bps})
        _LOG.info("rate %s", rate_rows[-1])

    delay_rows = []
    direct_all: list[float] = []
    for rtt_ms in RTTS_MS:
        setting = LinkSetting(up_bps=18.88e6, down_bps=18.88e6, rtt_ms=rtt_ms)
        serialisation_s = 2 * PING_BYTES * 8 / 18.88e6
        async with LinkEmulator(upstream=(LOOPBACK, echo_port), setting=setting) as emu:
            direct, rtts = await ping_rtts_s([echo_port, emu.port], pings)
        direct_all += direct
        expected_s = rtt_ms / 1e3 + serialisation_s
        added_median_s = statistics.median(rtts) - statistics.median(direct)
        added_p25_s = _quantile(rtts, 0.25) - _quantile(direct, 0.25)
        delay_rows.append({"setting_rtt_ms": rtt_ms, "pings": pings,
                           "added_median_ms": added_median_s * 1e3, "added_p25_ms": added_p25_s * 1e3,
                           "added_p90_ms": (_quantile(rtts, 0.90) - _quantile(direct, 0.90)) * 1e3,
                           "median_ratio": added_median_s / expected_s, "p25_ratio": added_p25_s / expected_s})
        _LOG.info("delay %s", delay_rows[-1])

    # Ceiling: the same transfer direct and through an emulator that shapes nothing.
    nbytes = 64 * 1024 * 1024
    direct_bps = await _uplink_bps(bulk_port, nbytes)
    async with LinkEmulator(upstream=(LOOPBACK, bulk_port),
                            setting=LinkSetting(up_bps=UNSHAPED_BPS, down_bps=UNSHAPED_BPS)) as emu:
        proxied_bps = await _uplink_bps(emu.port, nbytes)
    ceiling = {"bytes": nbytes, "direct_mbps": direct_bps / 1e6, "emulator_unshaped_mbps": proxied_bps / 1e6,
               "ratio": proxied_bps / direct_bps}
    _LOG.info("ceiling %s", ceiling)
    echo.close()
    bulk.close()
    return {"rate": rate_rows, "delay": delay_rows, "ceiling": ceiling,
            "direct_rtt_median_ms": statistics.median(direct_all) * 1e3}


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    rates = [r["setting_mbps"] for r in result["rate"]]
    left.plot(rates, [r["uplink_ratio"] for r in result["rate"]], "o-", label="uplink")
    left.plot(rates, [r["downlink_ratio"] for r in result["rate"]], "s-", label="downlink")
    left.axhspan(0.9, 1.1, color="0.9", label="±10%")
    left.set_xscale("log")
    left.set_xlabel("configured bandwidth (Mbit/s)")
    left.set_ylabel("delivered / configured")
    left.set_title("throughput")
    left.legend()
    rtts = [r["setting_rtt_ms"] for r in result["delay"]]
    right.plot(rtts, [r["median_ratio"] for r in result["delay"]], "o-", label="median")
    right.plot(rtts, [r["p25_ratio"] for r in result["delay"]], "s-", label="25th percentile")
    right.axhspan(0.9, 1.1, color="0.9", label="±10%")
    right.set_xlabel("configured RTT (ms)")
    right.set_ylabel("added / configured")
    right.set_title("delay (18.88 Mbit/s)")
    right.legend()
    ceiling = result["ceiling"]
    fig.suptitle(f"netem accuracy; unshaped ceiling {ceiling['emulator_unshaped_mbps']:.0f} Mbit/s "
                 f"= {ceiling['ratio']:.2f} x direct loopback")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- Mahimahi traces -----------------------------------------------------------------


def _shared_traces_dir() -> Path:
    return Path(__file__).resolve().parents[1].parent / "shared" / "traces"


def _saturate(sock: socket.socket, stop: threading.Event) -> None:
    chunk = b"x" * 65536
    with contextlib.suppress(OSError):
        while not stop.is_set():
            sock.sendall(chunk)


def _record(sock: socket.socket, stop: threading.Event, arrivals: list[tuple[float, int]]) -> None:
    with contextlib.suppress(OSError):
        while not stop.is_set():
            data = sock.recv(65536)
            if not data:
                return
            arrivals.append((time.monotonic(), len(data)))


def _windows(trace: MahimahiTrace, arrivals: list[tuple[float, int]], origin_s: float,
             first_s: int, end_s: int) -> dict[str, Any]:
    """Per 1-second window of trace time: delivered bytes / the trace's opportunities x 1500."""
    delivered = [0] * end_s
    for t_s, nbytes in arrivals:
        index = math.floor(t_s - origin_s)
        if 0 <= index < end_s:
            delivered[index] += nbytes
    rows = []
    for second in range(first_s, end_s):
        expected = trace.count_between(second * 1000, (second + 1) * 1000) * PACKET_BYTES
        rows.append({"t_s": second, "expected_bytes": expected, "delivered_bytes": delivered[second]})
    ratios = [r["delivered_bytes"] / r["expected_bytes"] for r in rows if r["expected_bytes"] > 0]
    empty = [r for r in rows if r["expected_bytes"] == 0]
    summary: dict[str, Any] = {
        "windows": len(ratios), "empty_windows": len(empty),
        "bytes_delivered_in_empty_windows": sum(r["delivered_bytes"] for r in empty),
        "expected_bytes": sum(r["expected_bytes"] for r in rows),
        "delivered_bytes": sum(r["delivered_bytes"] for r in rows), "per_second": rows}
    if ratios:
        summary["median_ratio"] = statistics.median(ratios)
        summary["p10_ratio"] = _quantile(ratios, 0.10) if len(ratios) > 1 else ratios[0]
        summary["p90_ratio"] = _quantile(ratios, 0.90) if len(ratios) > 1 else ratios[0]
        summary["min_ratio"] = min(ratios)
        summary["max_ratio"] = max(ratios)
        summary["share_within_5pct"] = sum(abs(r - 1.0) <= 0.05 for r in ratios) / len(ratios)
    return summary


def measure_mahimahi(trace_up: MahimahiTrace, trace_down: MahimahiTrace, *, seconds: int, rtt_ms: float = 40.0,
                     skip_s: int = 1) -> dict[str, Any]:
    """Saturate both directions of one connection through the emulator on these traces.

    Bytes are counted where they arrive, per 1-second window of trace time, shifted by
    the one-way delay (rtt/2); windows [skip_s, seconds) are compared with the trace.
    """
    listener = socket.create_server((LOOPBACK, 0))
    stop = threading.Event()
    up_arrivals: list[tuple[float, int]] = []
    down_arrivals: list[tuple[float, int]] = []
    threads: list[threading.Thread] = []
    conns: list[socket.socket] = []

    def _serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = listener.accept()
            conns.append(conn)
            for target, args in ((_record, (conn, stop, up_arrivals)), (_saturate, (conn, stop))):
                thread = threading.Thread(target=target, args=args, daemon=True)
                thread.start()
                threads.append(thread)

    acceptor = threading.Thread(target=_serve, daemon=True)
    acceptor.start()
    emu = ThreadedLinkEmulator(upstream=(LOOPBACK, listener.getsockname()[1]), trace_up=trace_up,
                               trace_down=trace_down, rtt_ms=rtt_ms).start()
    cpu_start_s = time.process_time()
    try:
        origin_s = time.monotonic() - emu.emulator.trace_elapsed_s + rtt_ms / 2000.0
        client = socket.create_connection((LOOPBACK, emu.port))
        conns.append(client)
        for target, args in ((_record, (client, stop, down_arrivals)), (_saturate, (client, stop))):
            thread = threading.Thread(target=target, args=args, daemon=True)
            thread.start()
            threads.append(thread)
        time.sleep(max(origin_s + seconds - time.monotonic(), 0.0))
        stats = emu.stats()
    finally:
        cpu_s = time.process_time() - cpu_start_s
        stop.set()
        for sock in conns:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        emu.stop()
        listener.close()
        for thread in threads:
            thread.join(5.0)
    return {"up": _windows(trace_up, up_arrivals, origin_s, skip_s, seconds),
            "down": _windows(trace_down, down_arrivals, origin_s, skip_s, seconds),
            "rtt_ms": rtt_ms, "seconds": seconds, "queue_bytes": DEFAULT_QUEUE_BYTES,
            "emulator_bytes_up": stats.bytes_up, "emulator_bytes_down": stats.bytes_down,
            "process_cpu_s": cpu_s}


def run_mahimahi(trace_dir: Path, seconds: int, rtt_ms: float) -> dict[str, Any]:
    traces = {}
    for up_path in sorted(trace_dir.glob("*.up")):
        down_path = up_path.with_suffix(".down")
        if not down_path.is_file():
            continue
        _LOG.info("mahimahi %s: %d s", up_path.stem, seconds)
        result = measure_mahimahi(load_mahimahi_trace(up_path), load_mahimahi_trace(down_path),
                                  seconds=seconds, rtt_ms=rtt_ms)
        traces[up_path.stem] = result
        _LOG.info("%s: up median %.3f (p10 %.3f, p90 %.3f); down median %.3f (p10 %.3f, p90 %.3f); cpu %.1f s",
                  up_path.stem, *(result[d].get(k, math.nan) for d in ("up", "down")
                                  for k in ("median_ratio", "p10_ratio", "p90_ratio")), result["process_cpu_s"])
    return {"seconds": seconds, "rtt_ms": rtt_ms, "window_s": 1.0, "traces": traces}


def _plot_mahimahi(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(result["traces"])
    fig, axes = plt.subplots(len(names), 2, figsize=(12, 2.8 * len(names)), squeeze=False)
    for row, name in zip(axes, names):
        for ax, direction in zip(row, ("up", "down")):
            data = result["traces"][name][direction]
            t = [r["t_s"] for r in data["per_second"]]
            ax.step(t, [r["expected_bytes"] * 8e-6 for r in data["per_second"]], where="post", label="trace")
            ax.step(t, [r["delivered_bytes"] * 8e-6 for r in data["per_second"]], where="post",
                    linestyle="--", label="delivered")
            ax.set_title(f"{name}.{direction}: median {data.get('median_ratio', math.nan):.3f}, "
                         f"p10 {data.get('p10_ratio', math.nan):.3f}, p90 {data.get('p90_ratio', math.nan):.3f}",
                         fontsize=9)
            ax.set_ylabel("Mbit/s (1 s windows)")
            ax.legend(fontsize=8)
        row[0].set_xlabel("trace time (s)")
        row[1].set_xlabel("trace time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--pings", type=int, default=40)
    parser.add_argument("--only", choices=["all", "fixed", "mahimahi"], default="all",
                        help="run one part; the other part's results already in the JSON are kept")
    parser.add_argument("--trace-dir", type=Path, default=_shared_traces_dir(),
                        help="folder of Mahimahi NAME.up/NAME.down pairs (default ../shared/traces)")
    parser.add_argument("--seconds", type=int, default=30, help="first N seconds of each trace (default 30)")
    parser.add_argument("--rtt-ms", type=float, default=40.0, help="RTT added on the Mahimahi traces (default 40)")
    args = parser.parse_args(argv)
    if args.seconds < 2:
        parser.error(f"--seconds must be >= 2 (the first second is skipped), got {args.seconds}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("splitinfer").setLevel(logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "netem_accuracy.json"
    result: dict[str, Any] = json.loads(json_path.read_text()) if json_path.is_file() else {}
    if args.only in ("all", "fixed"):
        result.update(asyncio.run(_run(args.pings)))
        _plot(result, args.out / "netem_accuracy.png")
    if args.only in ("all", "mahimahi"):
        if args.trace_dir.is_dir():
            result["mahimahi"] = run_mahimahi(args.trace_dir, args.seconds, args.rtt_ms)
            _plot_mahimahi(result["mahimahi"], args.out / "netem_accuracy_mahimahi.png")
        else:
            _LOG.warning("no trace folder at %s: Mahimahi part skipped", args.trace_dir)
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                         "load_avg_1m": os.getloadavg()[0]}
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "mahimahi"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
