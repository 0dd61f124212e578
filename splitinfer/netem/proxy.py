"""The proxy of the link emulator: `LinkEmulator` on asyncio, and its control API.

`tc netem` needs root and a kernel module; neither is available on every developer
machine or CI runner, so the demo, the adaptation benchmark and the chaos tests put this
proxy between the edge agent and the gateway instead. It is a byte pipe, so gRPC/HTTP2
passes through unchanged.

[Note: timing model]
Each direction (uplink = client -> upstream, downlink = upstream -> client) owns one
`TokenBucket`, shared by every connection, as a real link is. Data read from a socket is
cut into segments of about 5 ms of transmission each. A segment reserves its bytes in
the bucket when the link is nearly free (see [Note: just-in-time reservation]); the
bucket returns when its serialisation ends, and the segment is delivered at
``serialisation end + rtt/2``. Delay is added to the schedule, not waited out per chunk,
so a 40 ms link still carries its full rate (the bytes in flight are the
bandwidth-delay product) and throughput and delay combine as on a real link.

Backpressure: while the link is busy the proxy stops reading, so the kernel socket
buffers fill and the sender blocks, as behind a real bottleneck. Scheduled but
undelivered bytes are capped at ``buffer_bytes`` plus one bandwidth-delay product per
connection and direction, which only binds when the receiver is slower than the link.

On Mahimahi traces (``trace_up``/``trace_down``) a direction's `OpportunityLink`
replaces its token bucket and data is queued as soon as it is read, up to the link's
drop-tail bound; see [Note: opportunity link] in `splitinfer.netem.mahimahi`.

Outages (``up`` false, or a direction's bandwidth 0): in ``blackhole`` mode nothing is
read or delivered, connections stay open and held data flows once the link returns
(as TCP retransmission would deliver it); in ``reset`` mode every connection is reset
(RST) and new ones are accepted then reset at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import struct
import time
from collections import deque
from pathlib import Path
from typing import Any, Sequence

from splitinfer.netem.control import handle_control_request, serve_control_connection
from splitinfer.netem.link import (
    LinkSetting,
    NetemError,
    NetemStats,
    OutageMode,
    TokenBucket,
    TraceStep,
    load_trace,
    trace_position,
)
from splitinfer.netem.mahimahi import (
    DEFAULT_QUEUE_BYTES,
    PACKET_BYTES,
    MahimahiTrace,
    OpportunityLink,
    load_mahimahi_trace,
)

__all__ = ["LinkEmulator"]

_LOG = logging.getLogger(__name__)

_READ_BYTES = 64 * 1024
_MIN_SEGMENT_BYTES = 1500
_MAX_SEGMENT_BYTES = 64 * 1024
_SEGMENT_S = 0.005
_RESERVE_AHEAD_S = 0.005
_MAX_CATCH_UP_S = 0.1
_TIMER_SLACK_S = 0.0005
_LINGER_RST = struct.pack("ii", 1, 0)


def _segment_bytes(rate_bps: float) -> int:
    return int(min(max(rate_bps / 8.0 * _SEGMENT_S, _MIN_SEGMENT_BYTES), _MAX_SEGMENT_BYTES))


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with RST (SO_LINGER 0), as a link reset looks to TCP."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    writer.transport.abort()


def _tune_socket(sock: Any, buffer_bytes: int) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes > 0:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)


# -- the proxy ---------------------------------------------------------------------


class _Pipe:
    """One direction of one connection: a FIFO of (delivery time, bytes) segments."""

    def __init__(self, emu: LinkEmulator, direction: str, src: asyncio.StreamReader,
                 dst: asyncio.StreamWriter) -> None:
        self._emu = emu
        self._direction = direction
        self._src = src
        self._dst = dst
        self._queue: deque[tuple[float, bytes | None]] = deque()  # None is end of stream
        self.queued_bytes = 0
        self._changed = asyncio.Condition()

    async def wake(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _limit_bytes(self) -> float:
        # The bytes on the wire (one bandwidth-delay product) must not count against
        # the buffer, or a long link could never reach its rate.
        setting = self._emu.setting
        rate_bps = setting.up_bps if self._direction == "up" else setting.down_bps
        limit = self._emu.buffer_bytes + rate_bps / 8.0 * setting.rtt_ms / 2000.0
        if self._emu.opportunity_link(self._direction) is not None:
            limit += self._emu.queue_bytes
        return limit

    async def _wait_for_room(self) -> None:
        await self._emu.wait_link_up()
        async with self._changed:
            await self._changed.wait_for(lambda: self.queued_bytes <= self._limit_bytes())

    async def pump_in(self) -> None:
        emu = self._emu
        bucket = emu.bucket(self._direction)
        while True:
            data = await self._src.read(_READ_BYTES)
            ready_s = time.monotonic()
            if emu.opportunity_link(self._direction) is not None:
                await self._feed_trace(data, ready_s)
                if not data:
                    return
                continue
            offset = 0
            while offset < len(data) or not data:
                if not emu.link_is_up or self.queued_bytes > self._limit_bytes():
                    await self._wait_for_room()
                    ready_s = time.monotonic()
                    continue
                # [Note: just-in-time reservation] A segment reserves the link only when
                # the link is nearly free. Bytes not yet reserved wait here, in the read
                # chunk and in the kernel's socket buffer, so a rate change applies to
                # all of them at once instead of after a backlog scheduled at the old
                # rate. A late wake-up is not lost link time: the reservation is
                # backdated to when the data was ready (bounded by _MAX_CATCH_UP_S), so
                # the bucket serialises it from when the link became free.
                now_s = time.monotonic()
                busy_s = bucket.backlog_bytes(now_s=now_s) * 8.0 / bucket.rate_bps - _RESERVE_AHEAD_S
                if busy_s > 0:
                    await asyncio.sleep(busy_s)
                    continue
                ready_s = max(ready_s, now_s - _MAX_CATCH_UP_S)
                delay_s = emu.setting.rtt_ms / 2000.0
                if not data:
                    await self._push((bucket.reserve(0, now_s=now_s, ready_s=ready_s) + delay_s, None))
                    return
                segment = data[offset:offset + _segment_bytes(bucket.rate_bps)]
                offset += len(segment)
                await self._push((bucket.reserve(len(segment), now_s=now_s, ready_s=ready_s) + delay_s, segment))

    async def _feed_trace(self, data: bytes, ready_s: float) -> None:
        """Queue a read chunk on the Mahimahi link (see [Note: opportunity link]).

        A full link queue stops the reading: the bytes wait in the socket buffers and
        enter the queue when the trace has made room, which is when they count as
        arrived, however late this task wakes (within _MAX_CATCH_UP_S).
        """
        emu = self._emu
        link = emu.opportunity_link(self._direction)
        assert link is not None
        offset = 0
        while True:
            if not emu.link_is_up or self.queued_bytes > self._limit_bytes():
                await self._wait_for_room()
                ready_s = time.monotonic()
                continue
            now_s = time.monotonic()
            room = emu.queue_bytes - link.backlog_bytes(now_s=now_s)
            if data and room <= 0:
                room_s = link.room_at_s(emu.queue_bytes - PACKET_BYTES, now_s=now_s)
                await asyncio.sleep(max(room_s - now_s, 0.0))
                ready_s = max(ready_s, room_s)
                continue
            piece = data[offset:offset + room]
            offset += len(piece)
            delay_s = emu.setting.rtt_ms / 2000.0
            items: list[tuple[float, bytes | None]] = []
            start = 0
            for leave_s, nbytes in link.reserve(len(piece), arrival_s=max(ready_s, now_s - _MAX_CATCH_UP_S)):
                items.append((leave_s + delay_s, piece[start:start + nbytes] if piece else None))
                start += nbytes
            await self._push(*items)
            if offset >= len(data):
                return

    async def _push(self, *items: tuple[float, bytes | None]) -> None:
        async with self._changed:
            for deliver_s, segment in items:
                self._queue.append((deliver_s, segment))
                self.queued_bytes += len(segment or b"")
            self._changed.notify_all()

    async def pump_out(self) -> None:
        emu = self._emu
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: bool(self._queue))
            if not emu.link_is_up:
                await emu.wait_link_up()
                # Held data cannot arrive before the link is back plus one delay.
                earliest_s = time.monotonic() + emu.setting.rtt_ms / 2000.0
                self._queue = deque((max(t, earliest_s), d) for t, d in self._queue)
                continue
            wait_s = self._queue[0][0] - time.monotonic()
            if wait_s > _TIMER_SLACK_S:
                await asyncio.sleep(wait_s - _TIMER_SLACK_S)
                continue
            # [Note: timer slack] epoll rounds timeouts up to whole milliseconds, so a
            # sleep wakes up to 1 ms late. Sleeping to 0.5 ms early and delivering what
            # is due within 0.5 ms keeps each hop within +-0.5 ms of its schedule
            # instead of 0 to 1 ms late.
            due_s = time.monotonic() + _TIMER_SLACK_S
            written = 0
            while self._queue and self._queue[0][0] <= due_s:
                _, data = self._queue.popleft()
                if data is None:
                    if written:
                        self._delivered(written)
                    with contextlib.suppress(OSError, RuntimeError):
                        if self._dst.can_write_eof():
                            self._dst.write_eof()
                    return
                self._dst.write(data)
                written += len(data)
            self._delivered(written)
            await self.wake()
            await self._dst.drain()

    def _delivered(self, nbytes: int) -> None:
        self.queued_bytes -= nbytes
        self._emu.count_delivered(self._direction, nbytes)


class _Connection:
    """A client socket, its upstream socket and the two pipes between them."""

    def __init__(self, emu: LinkEmulator, client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                 upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        self.client_writer = client[1]
        self.upstream_writer = upstream[1]
        self.pipes = (_Pipe(emu, "up", client[0], upstream[1]), _Pipe(emu, "down", upstream[0], client[1]))
        self._tasks: list[asyncio.Task[None]] = []

    async def run(self) -> None:
        self._tasks = [asyncio.ensure_future(p.pump_in()) for p in self.pipes]
        self._tasks += [asyncio.ensure_future(p.pump_out()) for p in self.pipes]
        outs = set(self._tasks[2:])
        pending = set(self._tasks)
        try:
            # Each direction ends at its own EOF (half-close); an error in any pump
            # (a peer's reset) tears down both sides.
            while pending and not outs.isdisjoint(pending):
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    if not task.cancelled() and task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]
        except (OSError, RuntimeError) as e:
            _LOG.debug("connection closed by error: %r", e)
            self.abort()
        finally:
            for task in self._tasks:
                task.cancel()
            for writer in (self.client_writer, self.upstream_writer):
                with contextlib.suppress(Exception):
                    writer.close()

    def abort(self) -> int:
        """Reset both sides; returns the queued bytes thrown away."""
        dropped = sum(p.queued_bytes for p in self.pipes)
        for task in self._tasks:
            task.cancel()
        _abort(self.client_writer)
        _abort(self.upstream_writer)
        return dropped

    async def wake(self) -> None:
        for pipe in self.pipes:
            await pipe.wake()


class LinkEmulator:
    """A TCP proxy on asyncio that shapes traffic like a link (see [Note: timing model]).

    Use ``async with LinkEmulator(listen=..., upstream=..., trace=steps) as emu`` and
    connect to ``emu.port``; or `ThreadedLinkEmulator` from synchronous code. A trace
    replays from `start`; `set` overrides it live (and stops the replay), `replay`
    starts it again.

    Arguments: ``upstream`` and ``listen`` are (host, port); port 0 picks a free port,
    read back from ``port``. Exactly one of ``setting`` (a fixed link) or ``trace``
    (steps, or a trace file or shipped name as `load_trace` takes; replayed, in a loop if
    ``loop``). Or, instead of both, ``trace_up`` and ``trace_down``: Mahimahi
    packet-delivery traces (`MahimahiTrace` values or file paths), which always repeat,
    with ``rtt_ms`` added and a drop-tail queue of ``queue_bytes`` per direction (see
    [Note: opportunity link]). ``outage_mode``: blackhole or reset.
    ``control``: (host, port) for the HTTP/JSON control API, or None. ``buffer_bytes``:
    see [Note: timing model]. ``socket_buffer_bytes``: SO_RCVBUF/SO_SNDBUF of the
    proxy's sockets, kept small so that backpressure reaches the sender promptly (0
    keeps the kernel's autotuning). ``burst_bytes``: token bucket depth; 0 makes each
    byte pay its serialisation time, as on a physical link.
    """

    def __init__(self, *, upstream: tuple[str, int], listen: tuple[str, int] = ("127.0.0.1", 0),
                 setting: LinkSetting | None = None, trace: Sequence[TraceStep] | str | Path | None = None,
                 loop: bool = False, outage_mode: OutageMode | str = OutageMode.BLACKHOLE,
                 control: tuple[str, int] | None = None, buffer_bytes: int = 256 * 1024,
                 socket_buffer_bytes: int = 64 * 1024, burst_bytes: int = 0,
                 trace_up: MahimahiTrace | str | Path | None = None,
                 trace_down: MahimahiTrace | str | Path | None = None,
                 rtt_ms: float | None = None, queue_bytes: int = DEFAULT_QUEUE_BYTES) -> None:
        if isinstance(trace, (str, Path)):
            trace = load_trace(trace)
        if (trace_up is None) != (trace_down is None):
            raise NetemError("LinkEmulator needs both trace_up= and trace_down= or neither",
                             fix="pass a Mahimahi trace for each direction")
        mahimahi = None
        if trace_up is not None and trace_down is not None:
            mahimahi = tuple(t if isinstance(t, MahimahiTrace) else load_mahimahi_trace(t)
                             for t in (trace_up, trace_down))
        if (setting is not None) + bool(trace) + (mahimahi is not None) != 1:
            raise NetemError("LinkEmulator needs exactly one of setting=, trace= or trace_up= with trace_down=",
                             fix="pass setting=LinkSetting(...) for a fixed link, trace=load_trace(path) for a "
                                 "CSV trace, or trace_up=/trace_down= for Mahimahi traces")
        if rtt_ms is not None and mahimahi is None:
            raise NetemError("rtt_ms= goes with trace_up=/trace_down= only",
                             fix="put the RTT in the LinkSetting or the trace CSV")
        if isinstance(queue_bytes, bool) or not isinstance(queue_bytes, int) or queue_bytes < PACKET_BYTES:
            raise NetemError(f"queue_bytes must be an integer >= {PACKET_BYTES} (one packet), got {queue_bytes!r}",
                             fix=f"pass e.g. {DEFAULT_QUEUE_BYTES} (100 packets)")
        try:
            self.outage_mode = OutageMode(outage_mode)
        except ValueError as e:
            raise NetemError(f"unknown outage_mode {outage_mode!r}", fix="use 'blackhole' or 'reset'") from e
        if buffer_bytes <= 0:
            raise NetemError(f"buffer_bytes must be > 0, got {buffer_bytes!r}", fix="pass e.g. 262144")
        self.listen = listen
        self.upstream = upstream
        self.control = control
        self.buffer_bytes = buffer_bytes
        self._socket_buffer_bytes = socket_buffer_bytes
        self._trace = list(trace or [])
        self._loop_trace = loop
        self.queue_bytes = queue_bytes
        self._mahimahi: tuple[MahimahiTrace, ...] | None = mahimahi
        self._opportunity_links: dict[str, OpportunityLink] | None = None
        if mahimahi is not None:
            setting = LinkSetting(up_bps=mahimahi[0].mean_bps, down_bps=mahimahi[1].mean_bps, rtt_ms=rtt_ms or 0.0)
        self._setting = setting if setting is not None else self._trace[0].setting
        now_s = time.monotonic()
        self._buckets = {d: TokenBucket(self._rate_bps(d), now_s=now_s, burst_bytes=burst_bytes) for d in ("up", "down")}
        self._link_up = asyncio.Event()
        self._counters = dict(NetemStats().to_json())
        self._conns: set[_Connection] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._replay_task: asyncio.Task[None] | None = None
        self._trace_index: int | None = None
        self._manual = False
        self._replay_start_s: float | None = None
        self._server: asyncio.base_events.Server | None = None
        self._control_server: asyncio.base_events.Server | None = None
        self.port = 0
        self.control_port = 0

    # -- state ---------------------------------------------------------------------

    @property
    def setting(self) -> LinkSetting:
        return self._setting

    @property
    def link_is_up(self) -> bool:
        return not self._setting.is_outage

    @property
    def trace_elapsed_s(self) -> float | None:
        """Seconds since the current trace replay started; None when none has."""
        if self._replay_start_s is None:
            return None
        return time.monotonic() - self._replay_start_s

    def bucket(self, direction: str) -> TokenBucket:
        return self._buckets[direction]

    def opportunity_link(self, direction: str) -> OpportunityLink | None:
        """The Mahimahi link of ``direction`` while it shapes the traffic; None otherwise."""
        if self._opportunity_links is None or self._manual:
            return None
        return self._opportunity_links[direction]

    def _start_mahimahi(self) -> None:
        assert self._mahimahi is not None
        now_s = self._replay_start_s = time.monotonic()
        self._manual = False
        self._opportunity_links = {d: OpportunityLink(t, start_s=now_s) for d, t in zip(("up", "down"), self._mahimahi)}
        _LOG.info("link follows Mahimahi traces %s (up) and %s (down)", *(t.path for t in self._mahimahi))

    def stats(self) -> NetemStats:
        counters = dict(self._counters, connections_active=len(self._conns))
        return NetemStats(**counters)

    def count_delivered(self, direction: str, nbytes: int) -> None:
        self._counters["bytes_up" if direction == "up" else "bytes_down"] += nbytes

    async def wait_link_up(self) -> None:
        if not self.link_is_up:
            await self._link_up.wait()

    def _rate_bps(self, direction: str) -> float:
        if self._setting.is_outage:
            return 0.0
        return self._setting.up_bps if direction == "up" else self._setting.down_bps

    def state(self) -> dict[str, Any]:
        """What GET /state answers."""
        s = self._setting
        return {
            "setting": {"up_mbps": s.up_bps / 1e6, "down_mbps": s.down_bps / 1e6, "rtt_ms": s.rtt_ms, "up": s.up},
            "outage": s.is_outage,
            "outage_mode": self.outage_mode.value,
            "trace": {"steps": len(self._trace), "loop": self._loop_trace, "index": self._trace_index,
                      "replaying": self._replay_task is not None and not self._replay_task.done(),
                      "elapsed_s": self.trace_elapsed_s},
            "mahimahi": None if self._mahimahi is None else {
                "up": self._mahimahi[0].to_json(), "down": self._mahimahi[1].to_json(),
                "queue_bytes": self.queue_bytes, "shaping": self._opportunity_links is not None and not self._manual},
            "stats": self.stats().to_json(),
            "listen": [self.listen[0], self.port],
            "upstream": list(self.upstream),
        }

    # -- changing the link ---------------------------------------------------------

    def set(self, setting: LinkSetting | None = None, *, up_bps: float | None = None, down_bps: float | None = None,
            rtt_ms: float | None = None, up: bool | None = None) -> LinkSetting:
        """Change the link now; fields left None keep their value. Stops a trace replay.

        On Mahimahi traces the link becomes the fixed setting (the traces' mean rates
        and the RTT, with these changes) until `replay`.
        """
        base = setting if setting is not None else self._setting
        changes = {k: v for k, v in (("up_bps", up_bps), ("down_bps", down_bps), ("rtt_ms", rtt_ms), ("up", up))
                   if v is not None}
        new = LinkSetting(**dict(base.to_json(), **changes))
        self._manual = True
        if self._replay_task is not None:
            self._replay_task.cancel()
            self._replay_task = None
        self._apply(new, "set()")
        return new

    def replay(self, trace: Sequence[TraceStep] | None = None, *, loop: bool | None = None) -> None:
        """Replay ``trace`` (default: the one given at construction) from its start.

        On Mahimahi traces, with no ``trace``, restarts them from time 0.
        """
        if trace is None and self._mahimahi is not None:
            self._start_mahimahi()
            self._apply(dataclasses.replace(self._setting, up_bps=self._mahimahi[0].mean_bps,
                                            down_bps=self._mahimahi[1].mean_bps, up=True), "replay()")
            return
        if trace is not None:
            self._opportunity_links = None
            self._trace = list(trace)
        if loop is not None:
            self._loop_trace = loop
        if not self._trace:
            raise NetemError("no trace to replay", fix="pass trace= here or to LinkEmulator()")
        if self._replay_task is not None:
            self._replay_task.cancel()
        self._replay_task = asyncio.ensure_future(self._run_replay(list(self._trace), self._loop_trace))

    async def _run_replay(self, steps: list[TraceStep], loop: bool) -> None:
        start_s = self._replay_start_s = time.monotonic()
        while True:
            index, next_s = trace_position(steps, time.monotonic() - start_s, loop=loop)
            if index != self._trace_index or steps[index].setting != self._setting:
                self._trace_index = index
                self._apply(steps[index].setting, f"trace step {index} (t_s={steps[index].t_s:g})")
            if next_s is None:
                return
            # A microsecond past the boundary so float rounding cannot spin on it.
            await asyncio.sleep(max(start_s + next_s - time.monotonic(), 0.0) + 1e-6)

    def _apply(self, new: LinkSetting, source: str) -> None:
        old = self._setting
        self._setting = new
        now_s = time.monotonic()
        for direction, bucket in self._buckets.items():
            bucket.set_rate(self._rate_bps(direction), now_s=now_s)
        _LOG.info("link %s -> %s (from %s)", old.describe(), new.describe(), source)
        if new.is_outage and not old.is_outage:
            self._counters["outages"] += 1
            self._link_up.clear()
            if self.outage_mode is OutageMode.RESET:
                for conn in list(self._conns):
                    self._counters["dropped_bytes"] += conn.abort()
                    self._counters["connections_reset"] += 1
        elif not new.is_outage:
            self._link_up.set()
        for conn in list(self._conns):
            self._spawn(conn.wake())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- serving -------------------------------------------------------------------

    async def start(self) -> LinkEmulator:
        loop = asyncio.get_running_loop()
        family, _, _, _, address = (await loop.getaddrinfo(*self.listen, type=socket.SOCK_STREAM))[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted sockets inherit the listener's buffer sizes.
        _tune_socket(sock, self._socket_buffer_bytes)
        try:
            sock.bind(address)
        except OSError as e:
            sock.close()
            raise NetemError(f"cannot listen on {self.listen[0]}:{self.listen[1]}: {e}",
                             fix="pick a free port, or port 0 for any") from e
        self._server = await asyncio.start_server(self._on_client, sock=sock)
        self.port = sock.getsockname()[1]
        if self.control is not None:
            try:
                self._control_server = await asyncio.start_server(self._on_control, *self.control)
            except OSError as e:
                await self.stop()
                raise NetemError(f"cannot serve the control API on {self.control[0]}:{self.control[1]}: {e}",
                                 fix="pick a free port, or port 0 for any") from e
            self.control_port = self._control_server.sockets[0].getsockname()[1]
        self._apply(self._setting, "start")
        if self._trace and not self._manual and self._replay_task is None:
            self.replay()
        if self._mahimahi is not None and not self._manual and self._opportunity_links is None:
            self._start_mahimahi()
        _LOG.info("netem listening on %s:%d -> %s:%d (%s, outages: %s)", self.listen[0], self.port,
                  self.upstream[0], self.upstream[1], self._setting.describe(), self.outage_mode.value)
        return self

    async def stop(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
        for server in (self._server, self._control_server):
            if server is not None:
                server.close()
        for conn in list(self._conns):
            conn.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for server in (self._server, self._control_server):
            if server is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(server.wait_closed(), 1.0)
        self._server = self._control_server = None

    async def __aenter__(self) -> LinkEmulator:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def serve_forever(self) -> None:
        await self.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.stop()

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        # asyncio's stream server logs a cancelled handler task as an error, and `stop`
        # cancels these, so a cancellation ends the handler quietly.
        with contextlib.suppress(asyncio.CancelledError):
            await self._serve_client(reader, writer)

    async def _serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._counters["connections_accepted"] += 1
        _tune_socket(writer.get_extra_info("socket"), 0)
        if not self.link_is_up:
            if self.outage_mode is OutageMode.RESET:
                self._counters["connections_refused"] += 1
                _abort(writer)
                return
            await self.wait_link_up()
        try:
            upstream = await self._open_upstream()
        except OSError as e:
            self._counters["upstream_failures"] += 1
            _LOG.warning("cannot reach upstream %s:%d (%s); resetting the client", *self.upstream, e)
            _abort(writer)
            return
        conn = _Connection(self, (reader, writer), upstream)
        self._conns.add(conn)
        try:
            await conn.run()
        finally:
            self._conns.discard(conn)

    async def _open_upstream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        loop = asyncio.get_running_loop()
        family, _, _, _, address = (await loop.getaddrinfo(*self.upstream, type=socket.SOCK_STREAM))[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        _tune_socket(sock, self._socket_buffer_bytes)
        try:
            await loop.sock_connect(sock, address)
        except BaseException:
            sock.close()
            raise
        return await asyncio.open_connection(sock=sock)

    # -- control API ---------------------------------------------------------------

    def handle_control(self, method: str, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
        """Answer one control request: GET /state, POST /set, POST /replay. Returns (status, JSON)."""
        return handle_control_request(self, method, path, body)

    async def _on_control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await serve_control_connection(self, reader, writer)
