"""``splitinfer netem`` (and ``python -m splitinfer.netem``): run the link emulator until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import signal
import sys
from typing import Any

from splitinfer.netem.link import LinkSetting, NetemError, OutageMode, load_trace, shipped_trace_names
from splitinfer.netem.mahimahi import DEFAULT_QUEUE_BYTES, PACKET_BYTES, load_mahimahi_trace
from splitinfer.netem.proxy import LinkEmulator
from splitinfer.units import parse_args, parse_duration_ms, parse_rate_bps

__all__ = ["main"]


def _hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT such as 127.0.0.1:50051, got {text!r}")
    return host, int(port)


def _arg(parse: Any) -> Any:
    def wrapped(text: str) -> float:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e
    wrapped.__name__ = parse.__name__
    return wrapped


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitinfer netem",
        description="User-space link emulator: a TCP proxy with bandwidth, delay and outages.")
    parser.add_argument("--listen", type=_hostport, required=True, metavar="HOST:PORT",
                        help="where clients connect (port 0: any free port, printed at start)")
    parser.add_argument("--upstream", type=_hostport, required=True, metavar="HOST:PORT",
                        help="where connections are forwarded (e.g. the gateway)")
    parser.add_argument("--trace", metavar="CSV|NAME",
                        help="trace CSV (t_s,up_mbps,down_mbps,rtt_ms,up) or a shipped name, from any directory: "
                             + ", ".join(shipped_trace_names()))
    parser.add_argument("--trace-up", metavar="FILE",
                        help="Mahimahi trace of the uplink (one line per 1500-byte delivery opportunity, "
                             "a time in ms; it repeats); needs --trace-down")
    parser.add_argument("--trace-down", metavar="FILE", help="Mahimahi trace of the downlink; needs --trace-up")
    parser.add_argument("--rate-scale", type=float, default=1.0, metavar="K",
                        help="replay the Mahimahi traces at K times their rate, dips and outages in place "
                             "(default 1)")
    queue = parser.add_mutually_exclusive_group()
    queue.add_argument("--queue-bytes", type=int, metavar="BYTES",
                       help=f"drop-tail queue per direction on Mahimahi traces; when full the emulator stops "
                            f"reading from the sender (default {DEFAULT_QUEUE_BYTES})")
    queue.add_argument("--queue-packets", type=int, metavar="N",
                       help=f"the same queue in {PACKET_BYTES}-byte packets "
                            f"(default {DEFAULT_QUEUE_BYTES // PACKET_BYTES})")
    parser.add_argument("--up", type=_arg(parse_rate_bps), metavar="RATE", help="uplink rate, e.g. 18.88mbit")
    parser.add_argument("--down", type=_arg(parse_rate_bps), metavar="RATE", help="downlink rate (default: 4x --up)")
    parser.add_argument("--rtt", type=_arg(parse_duration_ms), default=0.0, metavar="DURATION",
                        help="round-trip time added, e.g. 20ms (default 0)")
    parser.add_argument("--loop", action="store_true", help="replay the trace in a loop")
    parser.add_argument("--control", type=_hostport, metavar="HOST:PORT",
                        help="serve the HTTP/JSON control API (GET /state, POST /set, POST /replay)")
    parser.add_argument("--outage-mode", choices=[m.value for m in OutageMode], default="blackhole",
                        help="blackhole: hold data, keep connections; reset: reset connections (default blackhole)")
    parser.add_argument("--buffer", type=int, default=256 * 1024, metavar="BYTES",
                        help="bytes scheduled but not yet delivered, beyond one bandwidth-delay product, "
                             "per connection and direction; binds when the receiver is slow (default 262144)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def main(argv: list[str] | None = None) -> int:
    """``splitinfer netem``: run the emulator until SIGINT/SIGTERM. Returns the exit status."""
    parser = _build_parser()
    args = parse_args(parser, argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    mahimahi = args.trace_up is not None or args.trace_down is not None
    if args.trace and (args.up is not None or args.down is not None or args.rtt):
        parser.error("give either --trace or --up/--down/--rtt, not both")
    if mahimahi and (args.trace or args.up is not None or args.down is not None or args.loop):
        parser.error("--trace-up/--trace-down take only --rtt and --queue-bytes/--queue-packets; "
                     "drop --trace, --up, --down and --loop (a Mahimahi trace always repeats)")
    if mahimahi and (args.trace_up is None or args.trace_down is None):
        parser.error("give both --trace-up FILE and --trace-down FILE")
    if not (math.isfinite(args.rate_scale) and args.rate_scale > 0):
        parser.error(f"--rate-scale is {args.rate_scale!r}; it must be a number > 0 (e.g. 3: three times the rate)")
    if not mahimahi and args.rate_scale != 1.0:
        parser.error("--rate-scale scales Mahimahi traces only; add --trace-up and --trace-down")
    if not mahimahi and (args.queue_bytes is not None or args.queue_packets is not None):
        parser.error("--queue-bytes/--queue-packets shape Mahimahi traces only; add --trace-up and --trace-down")
    queue_bytes = DEFAULT_QUEUE_BYTES
    if args.queue_bytes is not None:
        queue_bytes = args.queue_bytes
    elif args.queue_packets is not None:
        queue_bytes = args.queue_packets * PACKET_BYTES
    if queue_bytes < PACKET_BYTES:
        parser.error(f"the queue must hold at least one packet ({PACKET_BYTES} bytes), got {queue_bytes} bytes")
    setting = trace = None
    extra: dict[str, Any] = {}
    try:
        if mahimahi:
            extra = {"trace_up": load_mahimahi_trace(args.trace_up).scaled(args.rate_scale),
                     "trace_down": load_mahimahi_trace(args.trace_down).scaled(args.rate_scale),
                     "rtt_ms": args.rtt, "queue_bytes": queue_bytes}
        elif args.trace:
            trace = load_trace(args.trace)
        elif args.up is not None:
            down_bps = args.down if args.down is not None else 4 * args.up
            setting = LinkSetting(up_bps=args.up, down_bps=down_bps, rtt_ms=args.rtt)
        else:
            parser.error("give --trace CSV, or --up RATE (with optional --down and --rtt), "
                         "or --trace-up FILE with --trace-down FILE (Mahimahi traces)")
        emu = LinkEmulator(listen=args.listen, upstream=args.upstream, setting=setting, trace=trace,
                           loop=args.loop, outage_mode=args.outage_mode, control=args.control,
                           buffer_bytes=args.buffer, **extra)
    except NetemError as e:
        print(f"splitinfer netem: error: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(emu))
    except NetemError as e:
        print(f"splitinfer netem: error: {e}", file=sys.stderr)
        return 1


async def _serve(emu: LinkEmulator) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    async with emu:
        control = f", control on {emu.control[0]}:{emu.control_port}" if emu.control else ""
        # One line on stdout so a parent process can learn the ports it asked 0 for.
        print(f"netem listening on {emu.listen[0]}:{emu.port} -> {emu.upstream[0]}:{emu.upstream[1]}{control}",
              flush=True)
        await stop.wait()
    return 0

