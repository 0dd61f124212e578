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
        every such step runs with cold caches. The c1 serving overhead through a Ray
        worker (p50 per 2 s round, a reader task and this alternating): 1.47-1.68 ms
        with a reader task against 0.86-1.41 ms read here for the transformer tail (1 MiB
        in and out), 0.66-0.75 against 0.58-0.63 ms for DenseNet121's; ResNet50's
        0.80-1.08 against 0.56-1.03 ms, no difference above this machine's noise. Frames
        are read as a state machine: ``_want`` is what the current step still waits for,
        ``_step`` what runs once it is in; a frame's large in-frame buffers are received
        straight into their own memory.
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
                ahead = self._ahead_end - self._ahead_at
                if ahead:  # bytes read ahead: take them first
                    if want is self._head_view and ahead >= _HEAD.size:
                        self._frame_in_ahead()  # [Note: frames read where they lie]
                        while not self._want and self._reading:
                            self._step()
                        continue
                    n = min(len(want), ahead)
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

    def _frame_in_ahead(self) -> None:
        """Reads a frame whose head lies whole in the bytes read ahead, and its places,
        released regions and metadata from there too when they lie there whole.

        [Note: frames read where they lie]
        A frame's head, places and metadata nearly always come in one read ([Note:
        reading ahead]); they are then unpacked where they lie in ``_ahead`` rather than
        copied into a head buffer and a fresh ``bytearray`` of the rest first, and the
        frame goes on to its buffers in the same call; a small buffer that follows in the
        frame and lies whole in ``_ahead`` is taken from there too. Only what outlives the
        next read into ``_ahead`` is copied: a pickle frame's metadata while buffers of it
        are still to come in the frame. Counted by callgrind (a lone request of 1 MiB in
        and out through the channel, both ends in one process, the interpreter's
        instructions per request): 360k reading every frame through the head buffer,
        337k this way. A tensor frame whose arrays all lie in the peer's arena, or in the
        frame and whole in ``_ahead`` (a small answer), is then decoded and handed on in
        that same step, with no state kept for its buffers: 314k -> 305k with the input
        copied, 299k -> 287k with it kept in shared memory, for arrays in the arena; with a
        1 KiB answer in the frame (1 MiB in, copied), 3578 -> 3469 bytecodes per request
        (opcode trace events), with its state kept only for a frame still to be read.
        Paired, 10 pairs (bench/results/transport_layers_fewer_steps.json): ResNet50 c1 with
        the input in shared memory 0.142 -> 0.127 ms, beyond the pairs' spread.
        """
        at = self._ahead_at
        self._check_head(_HEAD.unpack_from(self._ahead, at))
        start = at + _HEAD.size
        end = start + self._rest_bytes
        if end > self._ahead_end:  # the rest comes in later reads: into a buffer of its own
            self._ahead_at = start
            self._want_rest()
            return
        self._ahead_at = end
        self._got_rest(self._ahead_view[start:end])

    def _got_head(self) -> None:
        self._check_head(_HEAD.unpack(self._head))
        self._want_rest()

    def _want_rest(self) -> None:
        self._rest = bytearray(self._rest_bytes)  # places, releases, metadata
        self._want = memoryview(self._rest)
        self._step = self._got_rest

    def _check_head(self, counts: tuple[int, int, int, int]) -> None:
        meta_bytes, n, n_released, codec = self._counts = counts
        if meta_bytes > _MAX_FRAME_BYTES or n > _MAX_BUFFERS or n_released > _MAX_BUFFERS or codec > _LAST_CODEC:
            raise ValueError(f"frame head declares {meta_bytes} metadata bytes, {n} buffers, {n_released} "
                             f"released regions and codec {codec}; not a channel frame")
        if codec == _PICKLE and not self.pickle_ok:
            # Refused at the head: nothing of it is read or allocated ([Note: no pickle over TCP]).
            raise ChannelRefusedError(
                "a pickle frame came over TCP, where the channel carries tensor frames only; never unpickled. "
                "Send tensors (dicts of plain arrays), or set PoolConfig(tcp_pickle=True) on both ends where only "
                "the cluster can reach this network")
        self._rest_bytes = _BUF.size * n + _LEN.size * n_released + meta_bytes

    def _got_rest(self, rest: memoryview | None = None) -> None:
        """The frame's places, released regions and metadata are in: ``rest`` where they
        lie in ``_ahead`` ([Note: frames read where they lie]), else ``_rest``."""
        _, n, n_released, codec = self._counts
        if rest is None:
            rest = memoryview(self._rest)
        places_end = _BUF.size * n
        meta_at = places_end + _LEN.size * n_released
        places = list(_BUF.iter_unpack(rest[:places_end]))
        in_frame = 0
        for size, where in places:
            if where == _IN_FRAME:
                in_frame += size
        if in_frame > _MAX_FRAME_BYTES:
            raise ValueError(f"frame declares {in_frame} buffer bytes (limit {_MAX_FRAME_BYTES}); not a channel frame")
        if n_released:
            self._release_regions(rest[places_end:meta_at])
        meta = rest[meta_at:]
        layout = None
        if codec == _REQUEST or codec == _ANSWER:
            # A tensor frame's metadata comes before its buffers: each array is made
            # where its bytes land ([Note: arrays made once] in workers/_transport/arena.py).
            head, layout = (request_layout if codec == _REQUEST else answer_layout)(meta)
            if len(layout) != n:
                raise ValueError(f"a tensor frame's {n} buffers do not match the {len(layout)} arrays its metadata "
                                 "declares; not a channel frame")
            at = self._ahead_at
            if in_frame <= self._ahead_end - at:
                # Every array lies in the peer's arena or whole in ``_ahead``: the frame is whole now.
                self._held = held = []
                arrays = []
                for spec, (size, where) in zip(layout, places):
                    if spec[3] != size:
                        raise ValueError(f"a tensor frame's buffer of {size} bytes does not match the {spec[3]} bytes "
                                         "its metadata declares; not a channel frame")
                    if where == _IN_FRAME:
                        at += size
                        arrays.append(np.frombuffer(bytearray(self._ahead_view[at - size:at]), spec[1]).reshape(spec[2]))
                    else:
                        arrays.append(self._in_arena(size, where, spec))
                self._ahead_at = at
                self._start_frame()
                self._on_frame((make_request if codec == _REQUEST else make_answer)(head, arrays), held)
                return
            self._head_obj = head
        elif in_frame and rest.obj is self._ahead:
            meta = memoryview(bytes(meta))  # later reads into _ahead would overwrite it
        self._meta, self._layout, self._buffers, self._held = meta, layout, [], []
        self._places, self._in_frame = places, in_frame
        self._next_buffer()

    def _next_buffer(self) -> None:
        """Places the frame's next buffers; once all are in, decodes and hands on the frame."""
        buffers, places, layout = self._buffers, self._places, self._layout
        for i in range(len(buffers), len(places)):
            size, where = places[i]
            if layout is not None and layout[i][3] != size:
                raise ValueError(f"a tensor frame's buffer {i} of {size} bytes does not match the {layout[i][3]} "
                                 "bytes its metadata declares; not a channel frame")
            if where != _IN_FRAME:
                buffers.append(self._in_arena(size, where, None if layout is None else layout[i]))
            elif self._ahead_end - self._ahead_at >= size:  # read ahead whole: taken from there
                at = self._ahead_at = self._ahead_at + size
                buffers.append(bytearray(self._ahead_view[at - size:at]))
            else:
                buffer = bytearray(size)
                buffers.append(buffer)
                self._want = memoryview(buffer)
                self._step = self._next_buffer
                return
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
            if self._in_frame:
                for i, b in enumerate(buffers):
                    if type(b) is not np.ndarray:  # received in the frame
                        buffers[i] = np.frombuffer(b, layout[i][1]).reshape(layout[i][2])
            obj = (make_request if codec == _REQUEST else make_answer)(self._head_obj, buffers)
        self._on_frame(obj, held)

    def _in_arena(self, size: int, where: int, spec: tuple | None) -> Any:
        """A buffer of the frame that lies in the peer's arena, as the array ``spec``
        (name, dtype, shape, bytes) declares, or as bytes for a pickle frame."""
        peer = self.peer
        if peer is None:
            raise ValueError("frame places a buffer in an arena, but none was shared; not a channel frame")
        if not self._views_until_freed:
            self._held.append(where)  # handed back with the answer ([Note: channel arena])
            return peer.region(where, size) if spec is None else peer.array(where, size, spec[1], spec[2])
        # The arrays read the region in place; when the last of them is freed, the region
        # goes back with the next frame (see [Note: channel arena]). Each is made anew,
        # never a view of one made once: numpy makes the first array that lies over a
        # buffer the base of every view of it, so a caller's slice keeps this one, and the
        # region, alive.
        peer.check(where, size)
        if spec is None:
            buffer = np.ndarray((size,), np.uint8, buffer=peer.buffer, offset=where)
        else:
            buffer = np.ndarray(spec[2], spec[1], buffer=peer.buffer, offset=where)
        # A bare weak reference, not weakref.finalize: a third of the cost.
        ref = weakref.ref(buffer, self._freed)
        self._watched[id(ref)] = (ref, where)
        return buffer
