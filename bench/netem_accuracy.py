"""How closely the user-space link emulator matches its setting, and where it stops keeping up.

Run: ``python -m bench.netem_accuracy`` (about a minute). Writes
``bench/results/netem_accuracy.json`` and ``.png``.

Side by side in one run, on loopback:
- rate: delivered uplink and downlink throughput / the configured bandwidth, for the
  DADS link figures and faster ones (the physical limit is the setting itself);
- delay: (round trip through the emulator - direct round trip) / configured RTT, from
  small pings sent alternately on both paths, at the median and the 25th percentile;
- ceiling: throughput through an unshaped emulator / throughput of a direct loopback
  connection, i.e. the fastest link this proxy can emulate on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from splitinfer.netem import LinkEmulator, LinkSetting

_LOG = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
RATES_MBPS = [0.13, 1.1, 5.85, 18.88, 50.0, 75.52, 200.0]
RTTS_MS = [5.0, 20.0, 50.0, 100.0]
PING_BYTES = 64
TRANSFER_S = 1.0
UNSHAPED_BPS = 1e12


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


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
    writer.close()
    return (total - first_len) * 8 / (last_s - first_s)


async def _rtts_s(ports: list[int], count: int) -> list[list[float]]:
    """Round trips to each port, pinged in turn so that all see the same CPU load."""
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
    echo = await asyncio.start_server(_echo, LOOPBACK, 0)
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
            direct, rtts = await _rtts_s([echo_port, emu.port], pings)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--pings", type=int, default=40)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("splitinfer").setLevel(logging.WARNING)
    result = asyncio.run(_run(args.pings))
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                         "load_avg_1m": os.getloadavg()[0]}
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "netem_accuracy.json"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, args.out / "netem_accuracy.png")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
