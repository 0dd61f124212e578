"""One end of a direct channel's socket: the arena handshake, frames out with one
``sendmsg`` each, and (from :class:`workers._transport.reader._Reader`) frames in.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import socket
import weakref
from typing import Any

from workers._transport.arena import Arena, PeerArena, arenas_supported
from workers._transport.framing import (_HEAD, _MAX_PARTS_PER_SEND, _READ_AHEAD_BYTES, _SOCKET_BUFFER_BYTES,
                                        ChannelRefusedError, encode_frame, refusal_frame)
from workers._transport.reader import _Reader

logger = logging.getLogger(__name__)


class _Connection(_Reader):
    """One connected socket: frames out without awaiting, frames in by the event loop's
    reader callback (:meth:`read_frames`, [Note: frames in the reader]).

    Plain sockets with the loop's reader callbacks rather than a transport: CPython's
    selector transport joins ``writelines`` into one copy and then buffers whatever the
    kernel did not take in a bytearray that it shifts after every send (measured: 4 ms
    for a 1 MiB round trip, against 0.9 ms on uvloop); here each buffer is received in
    place. A frame is sent with one ``sendmsg`` of all its parts, from the sender's
    memory, at once: nothing awaits, so a cancelled caller cannot leave half a frame on
    the stream. What the kernel does not take goes to a backlog that one writer task
    drains in order; later frames queue behind it.
    """

    def __init__(self, sock: socket.socket, *, views_until_freed: bool, pickle_ok: bool = True) -> None:
        sock.setblocking(False)
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            # The default (~200 KiB) splits a 1 MiB frame into several wake-ups of both
            # processes; the kernel caps this at net.core.wmem_max / rmem_max.
            sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER_BYTES)
        self.sock = sock
        self._loop = asyncio.get_running_loop()
        self._backlog: collections.deque[memoryview] = collections.deque()
        self._writer: asyncio.Task | None = None
        self.error: OSError | None = None
        """Why sending failed, once it has: the connection is then unusable."""
        self.arena: Arena | None = None
        self.peer: PeerArena | None = None
        self._views_until_freed = views_until_freed
        self.pickle_ok = pickle_ok
        """Whether pickle frames may be sent and read here ([Note: no pickle over TCP])."""
        self._releases: collections.deque[int] = collections.deque()
        """Regions of the peer's arena this end is done with; they go back with the next
        frame. A deque: finalizers append to it whenever an answer's arrays are freed."""
        self._reading = False
        self._head = bytearray(_HEAD.size)
        self._head_view = memoryview(self._head)
        self._ahead = bytearray(_READ_AHEAD_BYTES)
        self._ahead_view = memoryview(self._ahead)
        self._ahead_at = self._ahead_end = 0
        """Bytes read from the socket beyond what the current step wanted: [Note: reading ahead]."""
        self._drained = False
        """Whether the last read emptied the socket (it took less than it could)."""
        self._watched: dict[int, tuple[weakref.ref, int]] = {}
        """Per answer array read in the peer's arena: its weak reference and region."""

    def _freed(self, ref: weakref.ref) -> None:
        # Called by the garbage collector, on whichever thread freed the array.
        _, where = self._watched.pop(id(ref))
        self._releases.append(where)

    async def share_arenas(self, *, offer: bool, share: bool = True) -> None:
        """The arena handshake on a Unix-domain socket, right after the token: the
        connecting end (``offer``) sends its arena's fd, or "none" (``share=False``), and
        gets the other's back; arenas are shared only where both ends offer one."""
        can = share and arenas_supported()
        if offer:
            self._send_arena(can)
            self.peer = await self._recv_arena()
            if self.peer is None and self.arena is not None:
                # The worker declined (or could not map ours): nothing may go through it.
                self.arena.close()
                self.arena = None
        else:
            self.peer = await self._recv_arena()
            self._send_arena(can and self.peer is not None)

    def _send_arena(self, share: bool) -> None:
        # One byte (and the fd) on a fresh connection: the socket buffer takes it at once.
        if share:
            try:
                self.arena = Arena()
            except OSError as e:  # e.g. memfd_create refused by a sandbox: the socket carries everything
                logger.warning("direct channel: no shared arena (%r); arrays go through the socket", e)
        if self.arena is not None:
            socket.send_fds(self.sock, [b"A"], [self.arena.fd])
        else:
            self.sock.send(b"N")

    async def _recv_arena(self) -> PeerArena | None:
        while True:
            try:
                marker, fds, _, _ = socket.recv_fds(self.sock, 1, 1)
                break
            except (BlockingIOError, InterruptedError):
                ready = self._loop.create_future()
                self._loop.add_reader(self.sock.fileno(), lambda: ready.done() or ready.set_result(None))
                try:
                    await ready
                finally:
                    self._loop.remove_reader(self.sock.fileno())
        if marker == b"A" and len(fds) == 1:
            try:
                return PeerArena(fds[0])
            except OSError as e:  # answered "N": the peer then sends everything through the socket
                logger.warning("direct channel: the peer's arena could not be mapped (%r); not shared", e)
                return None
        for fd in fds:
            os.close(fd)
        if marker == b"N":
            return None
        raise ConnectionResetError(f"arena handshake sent {marker!r}, not b'A' with one fd or b'N'")

    def hand_back(self, regions: list[int]) -> None:
        """Returns regions of the peer's arena with the next frame this end sends."""
        self._releases.extend(regions)

    def send(self, obj: Any) -> None:
        """Queues one frame; raises OSError when the connection has failed, and
        ChannelRefusedError, having sent nothing, when ``obj`` needs pickle and this end
        may not send it ([Note: no pickle over TCP])."""
        if self.error is not None:
            raise self.error
        # Finalizers append on any thread: each popleft is atomic; no Python frame per send.
        releases = list(itertools.starmap(self._releases.popleft, itertools.repeat((), len(self._releases))))
        try:
            frame = encode_frame(obj, self.arena, releases, pickle_ok=self.pickle_ok)
        except ChannelRefusedError:
            self._releases.extend(releases)  # they go back with the next frame
            raise
        self._send_parts(frame)  # bytes and byte-format views: sendmsg and slicing take them as they are

    def send_refusal(self, request_id: int, message: str) -> None:
        """Refuses request ``request_id`` (-1: the whole connection) with ``message``
        ([Note: no pickle over TCP]); raises OSError when the connection has failed."""
        if self.error is not None:
            raise self.error
        self._send_parts([refusal_frame(request_id, message)])

    def _send_parts(self, parts: list) -> None:
        if not self._backlog and len(parts) <= _MAX_PARTS_PER_SEND:
            try:
                sent = self.sock.sendmsg(parts)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as e:
                self.error = e
                raise
            while parts and sent >= len(parts[0]):
                sent -= len(parts.pop(0))
            if not parts:
                return
            parts[0] = parts[0][sent:]
        # The backlog outlives this call, and a part may be a view of memory its owner
        # reuses once the frame is sent (an engine's output buffer: [Note: answered at
        # once]): the backlog keeps copies.
        self._backlog.extend(memoryview(bytes(p)) for p in parts)
        if self._writer is None:
            self._writer = self._loop.create_task(self._drain())

    async def _drain(self) -> None:
        try:
            while self._backlog:
                await self._loop.sock_sendall(self.sock, self._backlog[0])
                self._backlog.popleft()
        except OSError as e:
            self.error = e
            self._backlog.clear()
            self.sock.close()  # the reader sees it and fails what is in flight
        finally:
            self._writer = None

    async def _recv_into(self, view: memoryview) -> None:
        while view:
            n = await self._loop.sock_recv_into(self.sock, view)
            if not n:
                raise ConnectionResetError("the peer closed the direct channel")
            view = view[n:]

    def close(self) -> None:
        self.stop_reading()
        if self.peer is not None:
            self.peer.close()
        self.sock.close()
        if self.arena is not None:
            self.arena.close()
