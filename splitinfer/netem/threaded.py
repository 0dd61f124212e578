"""`ThreadedLinkEmulator`: a `LinkEmulator` on its own event loop, for synchronous callers.

The benchmarks and the chaos tests drive the link from plain threads; this runs the
asyncio proxy in a daemon thread and forwards `set`, `replay`, `stats` and `state` to
that loop, so each call sees the proxy's state as its own loop does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any, Sequence

from splitinfer.netem.link import LinkSetting, NetemError, NetemStats, TraceStep
from splitinfer.netem.proxy import LinkEmulator

__all__ = ["ThreadedLinkEmulator"]

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
