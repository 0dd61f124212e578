"""The reading half of a direct channel's connection: the frame state machine that
runs in the event loop's reader callback ([Note: frames in the reader], [Note: reading
ahead]). :class:`workers._transport.connection._Connection` is the whole connection;
the attributes used here are set in its ``__init__``.
"""

from __future__ import annotations

import pickle
import socket
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from workers._transport.codec import answer_layout, make_answer, make_request, request_layout
from workers._transport.framing import (_BUF, _HEAD, _IN_FRAME, _LAST_CODEC, _LEN, _MAX_BUFFERS, _MAX_FRAME_BYTES,
                                        _ANSWER, _PICKLE, _READ_AHEAD_BYTES, _REFUSED, _REQUEST, ChannelRefusedError,
                                        decode_refusal)


class _Reader:
    """Frames in: :meth:`read_frames` and the steps it runs."""

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
                want = self._want
                if self._ahead_end > self._ahead_at:  # bytes read ahead: take them first
                    n = min(len(want), self._ahead_end - self._ahead_at)
                    want[:n] = self._ahead_view[self._ahead_at:self._ahead_at + n]
                    self._ahead_at += n
                else:
                    if self._drained and want is self._head_view:
                        return  # [Note: no read that would block]
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
        self._places = places = list(_BUF.iter_unpack(rest[:places_end]))
        in_frame = 0
        for size, where in places:
            if where == _IN_FRAME:
                in_frame += size
        if in_frame > _MAX_FRAME_BYTES:
            raise ValueError(f"frame declares {in_frame} buffer bytes (limit {_MAX_FRAME_BYTES}); not a channel frame")
        if n_released:
            self._release_regions(rest[places_end:released_end])
        meta = rest[released_end:]
        codec = self._counts[3]
        self._layout = None
        if codec == _REQUEST or codec == _ANSWER:
            # A tensor frame's metadata comes before its buffers: each array is made
            # where its bytes land ([Note: arrays made once] in workers/_transport/arena.py).
            self._head_obj, layout = (request_layout if codec == _REQUEST else answer_layout)(meta)
            ok = len(layout) == n
            if ok:
                for spec, place in zip(layout, places):
                    ok = ok and spec[3] == place[0]
            if not ok:
                raise ValueError(f"a tensor frame's {n} buffers do not match the arrays its metadata declares; "
                                 "not a channel frame")
            self._layout = layout
        self._meta = meta
        self._buffers: list = []
        self._held: list[int] = []
        self._next_buffer()

    def _next_buffer(self) -> None:
        """Places the frame's next buffer; once all are in, decodes and hands on the frame."""
        layout = self._layout
        while len(self._buffers) < len(self._places):
            size, where = self._places[len(self._buffers)]
            if where == _IN_FRAME:
                buffer = bytearray(size)
                self._buffers.append(buffer)
                self._want = memoryview(buffer)
                self._step = self._next_buffer
                return
            peer = self.peer
            if peer is None:
                raise ValueError("frame places a buffer in an arena, but none was shared; not a channel frame")
            if self._views_until_freed:
                # The arrays read the region in place; when the last of them is freed,
                # the region goes back with the next frame (see [Note: channel arena]).
                # Each is made anew, never a view of one made once: numpy makes the first
                # array that lies over a buffer the base of every view of it, so a
                # caller's slice keeps this one, and the region, alive.
                peer.check(where, size)
                if layout is None:
                    buffer = np.ndarray((size,), np.uint8, buffer=peer.buffer, offset=where)
                else:
                    _, dtype, shape, _ = layout[len(self._buffers)]
                    buffer = np.ndarray(shape, dtype, buffer=peer.buffer, offset=where)
                # A bare weak reference, not weakref.finalize: a third of the cost.
                ref = weakref.ref(buffer, self._freed)
                self._watched[id(ref)] = (ref, where)
            else:
                if layout is None:
                    buffer = peer.region(where, size)
                else:
                    _, dtype, shape, _ = layout[len(self._buffers)]
                    buffer = peer.array(where, size, dtype, shape)
                self._held.append(where)
            self._buffers.append(buffer)
        meta, buffers, held, codec = self._meta, self._buffers, self._held, self._counts[3]
        self._meta = self._buffers = self._held = self._rest = None  # type: ignore[assignment]
        self._start_frame()
        if codec == _PICKLE:
            obj = pickle.loads(meta, buffers=buffers)
        elif codec == _REFUSED:
            refusal = decode_refusal(meta)
            if not self._views_until_freed:
                raise ValueError("a refusal frame came to a worker's end; not a channel frame")
            if refusal.request_id < 0:
                raise refusal  # the whole connection: its owner fails what is in flight with it
            obj = (refusal.request_id, False, refusal)
        else:
            for i, b in enumerate(buffers):
                if type(b) is not np.ndarray:  # received in the frame
                    buffers[i] = np.frombuffer(b, layout[i][1]).reshape(layout[i][2])
            obj = (make_request if codec == _REQUEST else make_answer)(self._head_obj, layout, buffers)
        self._on_frame(obj, held)
