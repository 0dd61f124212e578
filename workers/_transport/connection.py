"""One end of a direct channel's socket: the arena handshake, frames out with one
``sendmsg`` each, lone frames and their routes encoded, and (from
:class:`workers._transport.reader._Reader`) frames in.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import pickle
import socket
import struct
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from workers._pool import RequestTiming
from workers._transport.arena import Arena, PeerArena, arenas_supported
from workers._transport.codec import _MAX_KEPT, _describe_arrays
from workers._transport.framing import (_HEAD, _LONE_ANSWER, _LONE_ANSWER_HEAD, _LONE_REQUEST, _LONE_REQUEST_HEAD,
                                        _MAX_PARTS_PER_SEND, _NO_DEADLINE, _READ_AHEAD_BYTES,
                                        _SOCKET_BUFFER_BYTES, _WRITTEN_DESCRIBED, WRITTEN, BoundFrame,
                                        ChannelRefusedError, _lone_frame,
                                        _lone_head, _lone_struct, _route_frame, _route_key, encode_frame,
                                        refusal_frame)
from workers._transport.reader import _Reader
from workers._engine_types import Outputs

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
        self._descriptions: dict[bytes, list] = {}
        """Described answers' descriptions as decoded ([Note: answers described in advance])."""
        self._fresh = False
        """Whether nothing of the current frame has been read yet ([Note: lone frames])."""
        self._routes_in: dict[int, tuple[str | None, list[tuple[str, np.dtype, tuple, int]], struct.Struct]] = {}
        """Routes the peer declared: key, (name, dtype, shape, bytes) per array, and the
        struct of a lone frame's fixed part ([Note: lone frames])."""
        self._request_routes: dict[tuple, tuple[int, struct.Struct]] = {}
        """Routes this end declared for its requests, by key and (name, dtype, shape) per input."""
        self._answer_routes: dict[int, tuple[tuple, int, struct.Struct]] = {}
        """Routes this end declared for its answers, by the id of Outputs.described (kept beside it)."""
        self._watched: dict[int, tuple[weakref.ref, int]] = {}
        """Per answer array read in the peer's arena: its weak reference and region."""
        self.prepared: dict[bytes, tuple[Callable, Callable] | None] | None = None
        """At a worker's end that prepares requests: per lone request frame's route and
        offsets, its prepared serve and how to answer its errors, or None where it could
        not be prepared ([Note: prepared requests])."""

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

    def send(self, obj: Any, outputs: dict | None = None) -> None:
        """Queues one frame; raises OSError when the connection has failed, and
        ChannelRefusedError, having sent nothing, when ``obj`` needs pickle and this end
        may not send it ([Note: no pickle over TCP]). ``outputs``: for a request, arrays
        this end pinned where the answer's outputs should be written ([Note: outputs
        written in place])."""
        if self.error is not None:
            raise self.error
        # Finalizers append on any thread: each popleft is atomic; no Python frame per send.
        releases = list(itertools.starmap(self._releases.popleft, itertools.repeat((), len(self._releases))))
        parts = None
        if self.arena is not None:
            parts = self._encode_lone(obj, releases, outputs)
        if parts is None:
            try:
                frame = encode_frame(obj, self.arena, releases, pickle_ok=self.pickle_ok)
            except ChannelRefusedError:
                self._releases.extend(releases)  # they go back with the next frame
                raise
            parts = [memoryview(p).cast("B") for p in frame]
        self._send_parts(parts)

    def send_refusal(self, request_id: int, message: str) -> None:
        """Refuses request ``request_id`` (-1: the whole connection) with ``message``
        ([Note: no pickle over TCP]); raises OSError when the connection has failed."""
        if self.error is not None:
            raise self.error
        self._send_parts([refusal_frame(request_id, message)])

    def send_bound(self, bound: BoundFrame, request_id: int, deadline: float | None, priority: int) -> bool:
        """Sends a request of a :meth:`bound_frame` as it stands, with the id, deadline
        and priority filled in; False, having sent nothing, when regions wait to go back
        (:meth:`send` carries them), or when a region of this end's arena was unpinned
        since the frame was made ([Note: bound requests])."""
        route_id, layout, offsets, unpins = bound
        if self._releases or self.arena.unpins != unpins:  # type: ignore[union-attr]
            return False  # send() finds what is still pinned, and carries the releases
        if self.error is not None:
            raise self.error
        meta = layout.pack(route_id, request_id, _NO_DEADLINE if deadline is None else deadline, priority, *offsets)
        self._send_parts([_HEAD.pack(len(meta), 0, 0, _LONE_REQUEST) + meta])
        return True

    def bound_frame(self, key: str, inputs: dict, outputs: dict) -> BoundFrame | None:
        """What :meth:`send_bound` needs for requests of ``inputs`` and ``outputs``, all
        arrays pinned in this end's arena, once :meth:`send` has declared their route
        ([Note: bound requests]); None otherwise."""
        if self.arena is None:
            return None
        ins, outs = self._pinned_offsets(inputs), self._pinned_offsets(outputs)
        route = self._request_routes.get(_route_key(key, inputs, outputs)) if ins and outs else None
        return None if route is None else (route[0], route[1], (*ins, *outs), self.arena.unpins)  # type: ignore[misc]

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

    def _encode_lone(self, obj: Any, releases: list[int], outputs: dict | None = None) -> list | None:
        """``obj`` as a lone frame, after the _ROUTE frame declaring its route when it is
        new; None when it is no request or answer of one, or its arrays do not all fit
        in the arena ([Note: lone frames])."""
        if type(obj) is not tuple:
            return None
        if len(obj) == 2:
            return self._encode_lone_request(obj, releases, outputs)
        if len(obj) == 3 and obj[1] is True:
            return self._encode_lone_answer(obj, releases)
        return None

    def _encode_lone_request(self, obj: tuple, releases: list[int], outputs: dict | None) -> list | None:
        request_id, args = obj
        if type(request_id) is not int or type(args) is not tuple or len(args) != 4:
            return None
        key, requests, deadlines, priorities = args
        if (type(key) is not str or type(requests) is not list or len(requests) != 1 or type(deadlines) is not list
                or len(deadlines) != 1 or type(priorities) is not list or len(priorities) != 1):
            return None
        inputs, deadline, priority = requests[0], deadlines[0], priorities[0]
        if (type(inputs) is not dict or not (deadline is None or type(deadline) is float)
                or type(priority) is not int):
            return None
        written = self._pinned_offsets(outputs) if outputs is not None else None
        if not written or len(set(written)) != len(written):
            written = None  # not all pinned, or one region twice: the answer comes as usual
        route_key = _route_key(key, inputs, outputs if written else None)
        if route_key is None:
            return None
        parts = []
        route = self._request_routes.get(route_key)
        if route is None:
            arrays: list = []
            described = _describe_arrays(inputs, arrays)
            out_described = _describe_arrays(outputs, arrays) if written else ()
            route_id = self._new_route_id()
            if described is None or out_described is None or route_id is None:
                return None
            route = (route_id, _lone_struct(_LONE_REQUEST_HEAD, len(arrays)))
            parts.append(_route_frame(route[0], key, described, out_described))
        offsets = self._put_all(inputs.values())
        if offsets is None:
            return None
        if written:
            if not set(offsets).isdisjoint(written):  # an input lies in an output's region
                for offset in offsets:
                    self.arena.release(offset)  # type: ignore[union-attr]
                return None
            offsets += written
        if parts:  # declared only now that the declaration goes out
            self._request_routes[route_key] = route
        meta = route[1].pack(route[0], request_id, _NO_DEADLINE if deadline is None else deadline, priority, *offsets)
        parts.append(_lone_frame(_LONE_REQUEST, meta, releases))
        return parts

    def _encode_lone_answer(self, obj: tuple, releases: list[int]) -> list | None:
        request_id, _, results = obj
        if type(request_id) is not int or type(results) is not list or len(results) != 1:
            return None
        result = results[0]
        if type(result) is not tuple or len(result) != 2:
            return None
        outputs, timing = result
        if ((type(outputs) is not Outputs and outputs is not WRITTEN) or type(timing) is not RequestTiming
                or timing.batch_size != 1 or timing.first_in_batch is not True):
            return None
        if outputs is WRITTEN:
            outputs, described = {}, _WRITTEN_DESCRIBED
        else:
            described = outputs.described
        parts = []
        entry = self._answer_routes.get(id(described))
        if entry is None or entry[0] is not described:
            arrays: list = []
            route_id = self._new_route_id()
            if _describe_arrays(outputs, arrays) != described or route_id is None:
                return None
            entry = (described, route_id, _lone_struct(_LONE_ANSWER_HEAD, len(arrays)))
            parts.append(_route_frame(entry[1], None, described))
        offsets = self._put_all(outputs.values())
        if offsets is None:
            return None
        if parts:  # declared only now that the declaration goes out
            self._answer_routes[id(described)] = entry
        meta = entry[2].pack(entry[1], request_id, timing.queue_s, timing.compute_s, *offsets)
        parts.append(_lone_frame(_LONE_ANSWER, meta, releases))
        return parts

    def _pinned_offsets(self, named: dict) -> list[int] | None:
        """Where each array of ``named`` lies, when they all are arrays that this end
        pinned in its arena ([Note: outputs written in place]); else None."""
        arena = self.arena
        offsets = []
        for name, a in named.items():
            plain = type(name) is str and type(a) is np.ndarray
            where = arena.pinned_at(a) if plain else None  # type: ignore[union-attr]
            if where is None:
                return None
            offsets.append(where)
        return offsets

    def _new_route_id(self) -> int | None:
        """The id the next route this end declares takes; None once it has declared all
        it may (the rest go the usual way)."""
        declared = len(self._request_routes) + len(self._answer_routes)
        return declared if declared < _MAX_KEPT else None

    def _put_all(self, arrays: Any) -> list[int] | None:
        """Each array's offset in this end's arena (copied there unless it lies there
        already); None, with nothing left lent, when one does not fit or is not
        contiguous."""
        arena = self.arena
        offsets: list[int] = []
        for a in arrays:
            # Placed or pinned, found by identity ([Note: arrays made once]); else put()
            # looks where it lies or copies it. A miss is not counted as a fallback: the
            # usual frame tries again.
            where = arena.take(a)  # type: ignore[union-attr]
            if where is None:
                try:
                    where = arena.put(pickle.PickleBuffer(a).raw(), counted=False)  # type: ignore[union-attr]
                except BufferError:  # not contiguous: the usual frame copes
                    pass
            if where is None:
                for offset in offsets:
                    arena.release(offset)  # type: ignore[union-attr]
                return None
            offsets.append(where)
        return offsets

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

    def written_answer(self, held: list[int]) -> Callable[[int, float, float], None] | None:
        """What sends the answer to a lone request whose outputs were written in place,
        handing back the regions ``held``, given its id and timing; None before this
        end's first such answer has declared its route ([Note: prepared requests])."""
        entry = self._answer_routes.get(id(_WRITTEN_DESCRIBED))
        if entry is None:
            return None
        _, route_id, layout = entry
        head = _lone_head(_LONE_ANSWER, layout.size, held)
        send = self._send_parts

        def answer(request_id: int, queue_s: float, compute_s: float) -> None:
            send([head + layout.pack(route_id, request_id, queue_s, compute_s)])

        return answer

    def close(self) -> None:
        self.stop_reading()
        if self.peer is not None:
            self.peer.close()
        self.sock.close()
        if self.arena is not None:
            self.arena.close()
