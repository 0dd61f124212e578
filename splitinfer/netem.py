"""User-space link emulator: a TCP proxy with per-direction bandwidth, delay and outages.

`tc netem` needs root and a kernel module; neither is available on every developer
machine or CI runner, so the demo, the adaptation benchmark and the chaos tests put this
proxy between the edge agent and the gateway instead. It is a byte pipe, so gRPC/HTTP2
passes through unchanged. How bandwidth, delay and outages are modelled is in
[Note: timing model] in `splitinfer.netem_proxy`.

This module is the public entry point: the values and traces (`splitinfer.netem_link`),
the asyncio `LinkEmulator` (`splitinfer.netem_proxy`), a threaded runner for
synchronous callers, and ``main`` for ``splitinfer netem``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import logging
import signal
import sys
import threading
from typing import Any, Sequence

from splitinfer.netem_link import (
    TRACE_HEADER,
    LinkSetting,
    NetemError,
    NetemStats,
    OutageMode,
    TokenBucket,
    TraceFormatError,
    TraceStep,
    load_trace,
    resolve_trace,
    setting_at,
    shipped_trace_names,
    shipped_trace_path,
    trace_position,
)
from splitinfer.netem_proxy import LinkEmulator
from splitinfer.units import parse_args, parse_duration_ms, parse_rate_bps

__all__ = [
    "TRACE_HEADER",
    "LinkEmulator",
    "LinkSetting",
    "NetemError",
    "NetemStats",
    "OutageMode",
    "ThreadedLinkEmulator",
    "TokenBucket",
    "TraceFormatError",
    "TraceStep",
    "load_trace",
    "main",
    "resolve_trace",
    "setting_at",
    "shipped_trace_names",
    "shipped_trace_path",
    "trace_position",
]

_LOG = logging.getLogger(__name__)


class ThreadedLinkEmulator:
    """A `LinkEmulator` on its own event loop in a background thread, for synchronous callers.

    ``with ThreadedLinkEmulator(upstream=..., setting=...) as emu: emu.port``; takes the
    same keyword arguments as `LinkEmulator`.
    """

    def __init__(self, **kwargs: Any) -> None:
        self.emulator = LinkEmulator(**kwargs)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None

    @property
    def port(self) -> int:
        return self.emulator.port

    @property
    def control_port(self) -> int:
        return self.emulator.control_port

    def start(self, timeout_s: float = 10.0) -> ThreadedLinkEmulator:
        started: "concurrent.futures.Future[None]" = concurrent.futures.Future()

        async def _main() -> None:
            self._stop = asyncio.Event()
            try:
                await self.emulator.start()
            except BaseException as e:
                started.set_exception(e)
                return
            started.set_result(None)
            try:
                await self._stop.wait()
            finally:
                await self.emulator.stop()

        def _run() -> None:
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(_main())
            finally:
                self._loop.close()

        self._thread = threading.Thread(target=_run, name="netem", daemon=True)
        self._thread.start()
        started.result(timeout_s)
        return self

    def _call(self, fn: Any, timeout_s: float = 10.0) -> Any:
        if self._loop is None or self._thread is None or not self._thread.is_alive():
            raise NetemError("the emulator thread is not running", fix="call start() first")

        async def _run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(_run(), self._loop).result(timeout_s)

    def set(self, setting: LinkSetting | None = None, **changes: Any) -> LinkSetting:
        return self._call(lambda: self.emulator.set(setting, **changes))

    def replay(self, trace: Sequence[TraceStep] | None = None, *, loop: bool | None = None) -> None:
        self._call(lambda: self.emulator.replay(trace, loop=loop))

    @property
    def setting(self) -> LinkSetting:
        return self.emulator.setting

    def stats(self) -> NetemStats:
        return self._call(self.emulator.stats)

    def state(self) -> dict[str, Any]:
        return self._call(self.emulator.state)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._loop is not None and self._stop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                _LOG.warning("netem thread did not stop within %.1f s", timeout_s)
        self._thread = None

    def __enter__(self) -> ThreadedLinkEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

# -- command line ------------------------------------------------------------------


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
    if args.trace and (args.up is not None or args.down is not None or args.rtt):
        parser.error("give either --trace or --up/--down/--rtt, not both")
    setting = trace = None
    try:
        if args.trace:
            trace = load_trace(args.trace)
        elif args.up is not None:
            down_bps = args.down if args.down is not None else 4 * args.up
            setting = LinkSetting(up_bps=args.up, down_bps=down_bps, rtt_ms=args.rtt)
        else:
            parser.error("give --trace CSV, or --up RATE (with optional --down and --rtt)")
        emu = LinkEmulator(listen=args.listen, upstream=args.upstream, setting=setting, trace=trace,
                           loop=args.loop, outage_mode=args.outage_mode, control=args.control,
                           buffer_bytes=args.buffer)
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


if __name__ == "__main__":
    sys.exit(main())
