"""The reading half of a direct channel's connection: the frame state machine that
runs in the event loop's reader callback ([Note: frames in the reader], [Note: reading
ahead]) and the decoding of route declarations and lone frames ([Note: lone frames]).
:class:`workers._transport.connection._Connection` is the whole connection; the
attributes used here are set in its ``__init__``.
"""

from __future__ import annotations

import marshal
import math
import pickle
import socket
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from workers._pool import new_timing
from workers._transport.codec import _MAX_KEPT, _decode_answer, _decode_described_answer, _decode_request, _dtype
from workers._transport.framing import (_BUF, _DESCRIBED_ANSWER, _HEAD, _IN_FRAME, _LAST_CODEC, _LEN, _LONE_ANSWER,
                                        _LONE_ANSWER_HEAD, _LONE_REQUEST, _LONE_REQUEST_HEAD, _MAX_BUFFERS,
                                        _MAX_FRAME_BYTES, _PICKLE, _READ_AHEAD_BYTES, _REQUEST, _ROUTE,
                                        _ROUTE_ID, _REFUSED, WRITTEN, ChannelRefusedError, _lone_struct,
                                        _prepared_key, decode_refusal)
from workers._engine_types import PlacedInputs


class _Reader:
    """Frames in: :meth:`read_frames` and the steps it runs."""

    def _declare(self, meta: memoryview) -> None:
        """Keeps the route a _ROUTE frame declares ([Note: lone frames])."""
        try:
            route_id, key, *groups = marshal.loads(meta)
        except (EOFError, ValueError, TypeError) as e:
            raise ValueError(f"a route declaration does not decode ({e!r}); not a channel frame") from None
        # Its inputs' (or an answer's outputs') names, dtypes and shapes; a request's
        # route may add those of outputs to write in place ([Note: outputs written in place]).
        if (type(route_id) is not int or not 0 <= route_id < _MAX_KEPT or not (key is None or type(key) is str)
                or len(groups) not in ((3, 6) if key is not None else (3,))
                or not all(type(g) is tuple for g in groups)
                or not all(len(names) == len(dtypes) == len(shapes)
                           for names, dtypes, shapes in zip(groups[::3], groups[1::3], groups[2::3]))):
            raise ValueError(f"route declaration {route_id!r} is malformed; not a channel frame")
        specs = self._declared_arrays(route_id, *groups[:3])
        written = self._declared_arrays(route_id, *groups[3:]) if len(groups) == 6 else None
        head = _LONE_REQUEST_HEAD if key is not None else _LONE_ANSWER_HEAD
        n = len(specs) + (len(written) if written is not None else 0)
        if route_id in self._routes_in and self.prepared:
            self.prepared.clear()  # prepared for what the route meant before
        self._routes_in[route_id] = (key, specs, _lone_struct(head, n), written)

    @staticmethod
    def _declared_arrays(route_id: int, names: tuple, dtypes: tuple, shapes: tuple) -> list:
        specs = []
        for name, dtype, shape in zip(names, dtypes, shapes):
            try:
                dt = _dtype(dtype) if type(dtype) is str else None
            except TypeError:
                dt = None
            if (type(name) is not str or dt is None or dt.hasobject or type(shape) is not tuple
                    or not all(type(d) is int and d >= 0 for d in shape)):
                raise ValueError(f"route declaration {route_id} declares {name!r} as {dtype!r} {shape!r}; "
                                 "not a channel frame")
            specs.append((name, dt, shape, math.prod(shape) * dt.itemsize))
        return specs

    def _decode_lone(self, codec: int, meta: memoryview) -> tuple[Any, list[int]]:
        """A lone frame's request or answer, and the regions of the peer's arena that its
        arrays hold (none where they go back by themselves once freed)."""
        route = self._routes_in.get(_ROUTE_ID.unpack_from(meta)[0]) if len(meta) >= _ROUTE_ID.size else None
        if route is None or (route[0] is None) != (codec == _LONE_ANSWER) or len(meta) != route[2].size:
            raise ValueError(f"a lone frame of {len(meta)} bytes names an undeclared or other route; "
                             "not a channel frame")
        key, specs, layout, written = route
        _, request_id, a, b, *offsets = layout.unpack_from(meta)
        peer = self.peer
        if peer is None:
            raise ValueError("a lone frame places arrays in an arena, but none was shared; not a channel frame")
        if self._views_until_freed:
            # The caller's end: each array goes back once freed ([Note: channel arena]).
            # Each is made anew over the arena's buffer, not as a view of an array made
            # once: numpy gives a view of a view the first array that owns its memory or
            # lies over a buffer as its base, so a caller's slice would skip ours, and the
            # region would go back while the slice still reads it.
            arrays = {} if specs else WRITTEN  # no arrays: [Note: outputs written in place]
            for (name, dtype, shape, nbytes), where in zip(specs, offsets):
                peer.check(where, nbytes)
                arrays[name] = array = np.ndarray(shape, dtype, buffer=peer.buffer, offset=where)
                ref = weakref.ref(array, self._freed)
                self._watched[id(ref)] = (ref, where)
            held: list[int] = []
        else:
            # The worker's end: the regions go back with the answer, so the arrays over
            # them are made once ([Note: arrays made once] in workers/_transport/arena.py).
            arrays = PlacedInputs()
            arrays.route = route
            arrays.addresses = {}
            arrays.outputs = None
            for (name, dtype, shape, nbytes), where in zip(specs, offsets):
                peer.check(where, nbytes)
                arrays[name] = peer.array(where, dtype, shape)
                arrays.addresses[name] = peer.base + where
            held = offsets
            if self.prepared is not None:
                arrays.frame_key = _prepared_key(bytes(meta))
            if written is not None:
                held = offsets[:len(specs)]  # the caller keeps the outputs' regions (pinned)
                arrays.outputs = self._written_at(specs, written, offsets)
        if key is None:
            return (request_id, True, [(arrays, new_timing((a, b, 1, True)))]), held
        return (request_id, (key, [arrays], [None if a != a else a], [b])), held

    def _written_at(self, specs: list, written: list, offsets: list[int]) -> dict[str, tuple[np.ndarray, int]]:
        """A request's outputs to write in place: per output, its array over the
        caller's arena and address. Raises ValueError when a region lies outside the
        arena or overlaps another array's ([Note: outputs written in place])."""
        peer = self.peer
        spans = [(where, where + nbytes) for (*_, nbytes), where in zip(specs + written, offsets)]
        for i in range(len(specs), len(spans)):  # inputs may share regions; an output shares none
            start, end = spans[i]
            if any(start < other_end and other_start < end
                   for j, (other_start, other_end) in enumerate(spans) if j != i):
                raise ValueError("a lone request's output region overlaps another of its arrays; not a channel frame")
        out = {}
        for (name, dtype, shape, nbytes), where in zip(written, offsets[len(specs):]):
            peer.check(where, nbytes)  # type: ignore[union-attr]
            out[name] = (peer.array(where, dtype, shape), peer.base + where)  # type: ignore[union-attr]
        return out

    def read_frames(self, on_frame: Callable[[Any, list[int]], None],
                    on_lost: Callable[[BaseException], None]) -> None:
        """Reads frames from now on, in the event loop's reader callback for the socket.

        [Note: frames in the reader]
        Each decoded frame goes to ``on_frame`` with the regions of the peer's arena that
        its arrays use in place (to :meth:`hand_back` when done; none where they go back
        by themselves once freed); once, when the connection ends, ``on_lost`` gets why:
        ConnectionError when the peer went away, ValueError (or what unpickling raised)
        for garbage. A reader task awaiting ``sock_recv_into`` instead costs one more
        event-loop iteration per frame (the future it waits on wakes the task a turn
        later) and two ``epoll_ctl`` calls each time it waits; right after an engine run
        every such step runs with cold caches. Read here instead, on both ends, the c1
        serving overhead through a Ray worker (p50 per 2 s round, a reader task and this
        alternating) went from 1.47-1.68 ms to 0.86-1.41 ms for
        the transformer tail (1 MiB in and out) and from 0.66-0.75 ms to 0.58-0.63 ms
        for DenseNet121's; ResNet50's read 0.56-1.03 ms against 0.80-1.08 ms, no change
        above this machine's noise. Frames are read as a state machine:
        ``_want`` is what the current step still waits for, ``_step`` what runs once it
        is in; a frame's in-frame buffers are received straight into their own memory,
        as before.
        """
        self._on_frame, self._on_lost = on_frame, on_lost
        self._reading = True
        self._start_frame()
        self._loop.add_reader(self.sock.fileno(), self._readable)

    @property
    def more_waiting(self) -> bool:
        """Whether more bytes wait behind the frame just decoded: read ahead with it, or
        still in the socket ([Note: reading ahead])."""
        if self._ahead_end > self._ahead_at:
            return True
        if self._drained:
            return False
        try:
            return bool(self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True  # let the reader meet the error in its usual place

    def stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self.sock.fileno())

    def _readable(self) -> None:
        """Reads what the socket holds into the current step's ``_want``, running steps
        as they fill.

        [Note: reading ahead]
        A part of a frame smaller than 64 KiB (its head, its places and metadata, a
        small buffer in the frame) is not read on its own: one read takes up to 64 KiB
        into ``_ahead``, and the steps copy from there. A frame's head and metadata then
        come in one ``recv`` instead of two, and so do the frames of a burst. Whether
        more waits behind a frame (:attr:`more_waiting`, which decides [Note: answered
        at once]) is then known without asking the kernel, unless the last read filled
        ``_ahead`` or went straight into a large buffer. Traced through Ray at c1 (p50 of
        about 370 transformer requests, two runs each, alternating): the worker's check
        for more 34 -> 2 us, the caller's read of an answer's rest 25 -> 16-18 us.

        [Note: no read that would block]
        Once the frames read are handed on, and the last read took less than it could
        (the socket held no more then), this returns without reading again: that read
        would find the socket empty, and raising and catching its BlockingIOError costs
        57 us right after a transformer run (7 us for an empty call; median of 40, timed
        one at a time). On the caller's end it lies between the answer's future being
        set and the caller's task waking. Bytes that came meanwhile are not missed: the
        event loop's poll is level-triggered, so it calls this again while any wait.
        The transformer tail's c1 serving overhead with its input kept in shared memory,
        our worker and caller in two processes without Ray (reading until it would
        block and returning, in alternating processes, six pairs of four 3 s rounds,
        median): 0.500 -> 0.464 ms. Through Ray (bench/workers.py, input kept) whole
        runs of the bench differ by more than this (0.50-0.58 ms).
        """
        self._drained = False  # called again: the socket holds bytes, or its end
        try:
            while self._reading:
                if self._fresh:
                    ahead = self._ahead_end - self._ahead_at
                    if ahead >= _HEAD.size:
                        self._fresh = False
                        if self._read_lone():
                            continue
                    elif not ahead and self._drained:
                        return  # [Note: no read that would block]
                want = self._want
                if self._ahead_end > self._ahead_at:  # bytes read ahead: take them first
                    self._fresh = False
                    n = min(len(want), self._ahead_end - self._ahead_at)
                    want[:n] = self._ahead_view[self._ahead_at:self._ahead_at + n]
                    self._ahead_at += n
                else:
                    try:
                        if len(want) < _READ_AHEAD_BYTES:
                            # [Note: reading ahead]
                            got = self.sock.recv_into(self._ahead)
                            if got:
                                self._ahead_at, self._ahead_end = 0, got
                                self._drained = got < _READ_AHEAD_BYTES
                                continue
                            n = 0
                        else:
                            n = self.sock.recv_into(want)
                            self._drained = False
                    except (BlockingIOError, InterruptedError):
                        return
                    if not n:
                        raise ConnectionResetError("the peer closed the direct channel")
                self._want = want[n:]
                while not self._want and self._reading:
                    self._step()
        except Exception as e:  # noqa: BLE001 - the connection ends either way; its owner learns why
            if self._reading:
                self.stop_reading()
                self._on_lost(e)

    def _start_frame(self) -> None:
        # One head buffer for every frame: it is unpacked as soon as it is full.
        self._want = self._head_view
        self._step = self._got_head
        self._fresh = True

    def _read_lone(self) -> bool:
        """Decodes and hands on a lone frame that lies whole in the bytes read ahead;
        False, having read nothing, for any other frame ([Note: lone frames])."""
        at = self._ahead_at
        meta_bytes, n, n_released, codec = _HEAD.unpack_from(self._ahead, at)
        if n or not _LONE_REQUEST <= codec <= _LONE_ANSWER or n_released > _MAX_BUFFERS:
            return False
        start = at + _HEAD.size + _LEN.size * n_released
        end = start + meta_bytes
        if end > self._ahead_end:
            return False
        self._ahead_at = end
        if n_released:
            self._release_regions(self._ahead_view[at + _HEAD.size:start])
        if codec == _LONE_REQUEST and self.prepared and self._serve_prepared(self._ahead_view[start:end]):
            self._start_frame()
            return True
        obj, held = self._decode_lone(codec, self._ahead_view[start:end])
        self._start_frame()
        self._on_frame(obj, held)
        return True

    def _serve_prepared(self, meta: memoryview) -> bool:
        """Serves a lone request whose route and offsets were prepared, when its serve
        takes it now; False, having done nothing, otherwise ([Note: prepared requests])."""
        frame = bytes(meta)
        key = _prepared_key(frame)
        entry = self.prepared.get(key)  # type: ignore[union-attr]
        if entry is None or self._releases or self.more_waiting:
            return False
        _, request_id, deadline, priority = _LONE_REQUEST_HEAD.unpack_from(frame)
        try:
            served = entry[0](request_id, deadline, priority)
        except Exception as e:  # noqa: BLE001 - the run failed: its caller gets the error
            entry[1](request_id, e)
            return True
        if served is None:  # its segment was unloaded or reloaded since
            del self.prepared[key]  # type: ignore[union-attr]
        return bool(served)

    def _release_regions(self, offsets: memoryview) -> None:
        if self.arena is None:
            raise ValueError("frame releases arena regions, but this end lent none; not a channel frame")
        for (offset,) in _LEN.iter_unpack(offsets):
            self.arena.release(offset)

    def _got_head(self) -> None:
        meta_bytes, n, n_released, codec = self._counts = _HEAD.unpack(self._head)
        if meta_bytes > _MAX_FRAME_BYTES or n > _MAX_BUFFERS or n_released > _MAX_BUFFERS or codec > _LAST_CODEC:
            raise ValueError(f"frame head declares {meta_bytes} metadata bytes, {n} buffers, {n_released} "
                             f"released regions and codec {codec}; not a channel frame")
        if codec == _PICKLE and not self.pickle_ok:
            # Refused at the head: nothing of it is read or allocated ([Note: no pickle over TCP]).
            raise ChannelRefusedError(
                "a pickle frame came over TCP, where the channel carries tensor frames only; never unpickled. "
                "Send tensors (dicts of plain arrays), or set PoolConfig(tcp_pickle=True) on both ends where only "
                "the cluster can reach this network")
        self._rest = bytearray(_BUF.size * n + _LEN.size * n_released + meta_bytes)  # places, releases, metadata
        self._want = memoryview(self._rest)
        self._step = self._got_rest

    def _got_rest(self) -> None:
        _, n, n_released, _ = self._counts
        rest = memoryview(self._rest)
        places_end = _BUF.size * n
        released_end = places_end + _LEN.size * n_released
        self._places = list(_BUF.iter_unpack(rest[:places_end]))
        in_frame = sum(size for size, where in self._places if where == _IN_FRAME)
        if in_frame > _MAX_FRAME_BYTES:
            raise ValueError(f"frame declares {in_frame} buffer bytes (limit {_MAX_FRAME_BYTES}); not a channel frame")
        if n_released:
            self._release_regions(rest[places_end:released_end])
        self._meta = rest[released_end:]
        self._buffers: list = []
        self._held: list[int] = []
        self._next_buffer()

    def _next_buffer(self) -> None:
        """Places the frame's next buffer; once all are in, decodes and hands on the frame."""
        while len(self._buffers) < len(self._places):
            size, where = self._places[len(self._buffers)]
            if where == _IN_FRAME:
                buffer = bytearray(size)
                self._buffers.append(buffer)
                self._want = memoryview(buffer)
                self._step = self._next_buffer
                return
            if self.peer is None:
                raise ValueError("frame places a buffer in an arena, but none was shared; not a channel frame")
            if self._views_until_freed:
                # The arrays read the region in place; when the last of them is freed,
                # the region goes back with the next frame (see [Note: channel arena]).
                buffer = np.frombuffer(self.peer.region(where, size), np.uint8)
                # A bare weak reference, not weakref.finalize: a third of the cost.
                ref = weakref.ref(buffer, self._freed)
                self._watched[id(ref)] = (ref, where)
            else:
                buffer = self.peer.region(where, size)
                self._held.append(where)
            self._buffers.append(buffer)
        meta, buffers, held, codec = self._meta, self._buffers, self._held, self._counts[3]
        self._meta = self._buffers = self._held = self._rest = None  # type: ignore[assignment]
        self._start_frame()
        if codec == _ROUTE:
            self._declare(meta)
            return
        if codec == _LONE_REQUEST or codec == _LONE_ANSWER:
            if buffers:
                raise ValueError(f"a lone frame carries {len(buffers)} buffers; not a channel frame")
            obj, held = self._decode_lone(codec, meta)
        elif codec == _DESCRIBED_ANSWER:
            obj = _decode_described_answer(meta, buffers, self._descriptions)
        elif codec == _PICKLE:
            obj = pickle.loads(meta, buffers=buffers)
        elif codec == _REFUSED:
            refusal = decode_refusal(meta)
            if not self._views_until_freed:
                raise ValueError("a refusal frame came to a worker's end; not a channel frame")
            if refusal.request_id < 0:
                raise refusal  # the whole connection: its owner fails what is in flight with it
            obj = (refusal.request_id, False, refusal)
        else:
            obj = (_decode_request if codec == _REQUEST else _decode_answer)(meta, buffers)
        self._on_frame(obj, held)
