"""The direct channel's frames: their formats, the lone frames and their routes, and
:func:`encode_frame`. The package's other modules: the codec of arrays and answers
(codec.py), the socket's sending half (connection.py) and reading half (reader.py), the
shared arenas (arena.py), the worker's end (server.py) and the pool's end (client.py).

Ray places, restarts and kills the workers, and plain actor calls remain the control
path; requests and their answers travel instead over a socket that the worker opens on
request, Unix-domain on its node and TCP across nodes (see [Note: direct channel]).
Nothing here imports Ray.

[Note: direct channel]
A plain Ray actor call carries a request through the caller's and the worker's core
workers and, for arrays over 100 KiB, the object store: 2.9 ms for 4 B and 8.4 ms for
1 MiB each way on 2 cores. A compiled graph cuts that to 0.5 and 0.8 ms but its
readers spin, which on a small machine takes a core from the engines
(an actor holding a graph used 1.9 s of CPU in 3 s while idle). This channel is a plain
socket: one ``sendmsg`` per frame from the sender's memory, arrays received straight
into the buffers that become the receiver's arrays, the reader asleep in the event
loop while nothing arrives (0.31 ms for 4 B, and for 1 MiB each way 0.53 ms with the
shared arenas below or 0.89 ms through the socket alone, measured beside the two above:
``transport`` in bench/results/workers.json).

A frame is ``<u32 meta_bytes><u32 n_buffers><u32 n_released><u32 codec>``, then per buffer
``<u64 bytes><u64 arena_offset>`` (all ones: the buffer follows in the frame), then
``<u64 arena_offset>`` per region of the receiver's arena handed back, the metadata,
and the buffers that follow in the frame. A lone frame (a request of one, or the
answer to one, its arrays all in the sender's arena: [Note: lone frames]) has no
buffers, and its metadata is one fixed struct; a lone request may also say where in
its sender's arena its outputs are to be written ([Note: outputs written in place]). Otherwise the metadata is pickle protocol 5 with
out-of-band buffers, so an array's bytes are never copied into the pickle, or, for the
pool's requests and the worker's answers, a marshal of what surrounds the arrays
(``codec``: [Note: tensor frames]). On a Unix-domain socket the two
ends share arenas (a ``memfd`` each, passed after the token) and large buffers go
through them instead (see [Note: channel arena] in workers/_transport/arena.py). Requests are
``(id, args)``, answered with ``(id, True, handler(*args))`` or ``(id, False, error)``. Many requests are in flight
on one connection at once. The replica pool sends the batches it forms on the caller's
side (``infer_batch_timed``'s arguments), as it would send them by plain calls.

Pickle executes what it reads, so nothing unauthenticated may connect: the socket
lives in a fresh directory of mode 0700, and every connection must first send the
channel's 32-byte random token, which the worker hands out only through Ray (an actor
call, ``open_channel``), i.e. to whoever may call the actor anyway. Workers on other
nodes are reached the same way over TCP on the worker's node address, token first;
like Ray's own traffic between nodes it is not encrypted ([Note: no pickle over TCP]).

[Note: no pickle over TCP]
Across nodes the token travels in clear, so anyone who can watch the cluster network can
replay it, and a pickle executes what it reads. A TCP connection therefore carries
tensor frames, lone frames and route declarations only (marshal of names, dtype strings,
shapes and plain numbers, and structs: nothing that runs code), and both ends refuse a
pickle frame unless the operator opts in (``PoolConfig(tcp_pickle=True)``, which both
ends then use). The sender refuses before anything is sent: the pool's request that
needs pickle (an array of an object or strided dtype, a numpy scalar) goes by a plain
Ray call instead, and so does a request whose answer needs pickle (an error, say): the
worker answers it with a refusal frame (:func:`refusal_frame`) and the pool sends it again
by a plain call, which carries the answer and its error's type through Ray. A pickle
frame that arrives anyway is never unpickled: the worker answers a refusal frame for the
whole connection, closes that connection and keeps serving. The channel has no TLS of
its own; Ray's TLS does not cover it, so on a network others can watch, keep the default
or use ``PoolConfig(direct=False)``.
"""

from __future__ import annotations

import marshal
import pickle
import struct
from typing import Any

import numpy as np

from workers._transport.arena import ARENA_MIN_BYTES, Arena
from workers._transport.codec import _dumps, _encode_answer, _encode_described_answer, _encode_request
from workers.errors import WorkerError

__all__ = ["WRITTEN", "BoundFrame", "ChannelClosedError", "ChannelRefusedError", "encode_frame", "refusal_frame"]

_HEAD = struct.Struct("<IIII")
_BUF = struct.Struct("<QQ")
_LEN = struct.Struct("<Q")
_PICKLE, _REQUEST, _ANSWER, _DESCRIBED_ANSWER, _ROUTE, _LONE_REQUEST, _LONE_ANSWER, _REFUSED = range(8)
"""How a frame's metadata is encoded (see [Note: tensor frames], [Note: answers
described in advance], [Note: lone frames], [Note: no pickle over TCP])."""
_LAST_CODEC = _REFUSED
_REFUSED_HEAD = struct.Struct("<q")
"""A refusal's request id (-1: the whole connection), before its UTF-8 message."""
_MAX_REFUSAL_BYTES = 4096
_LONE_REQUEST_HEAD = struct.Struct("<qqdq")
"""A lone request's route, id, deadline (NaN for none) and priority, before its inputs' offsets."""
_LONE_ANSWER_HEAD = struct.Struct("<qqdd")
"""A lone answer's route, request id, queue and run seconds, before its outputs' offsets."""
_MAX_PREPARED = 16
"""Lone request frames a worker's end of a connection keeps prepared; when full, it
forgets them all ([Note: prepared requests])."""
_IN_FRAME = (1 << 64) - 1
"""A buffer's place when it follows in the frame rather than in the sender's arena."""
_SOCKET_BUFFER_BYTES = 4 << 20
_TOKEN_BYTES = 32
_TOKEN_WAIT_S = 10.0
"""A connection that has not sent its token by then is closed."""
_MAX_FRAME_BYTES = 1 << 31
"""Larger declared sizes mean a garbled frame: refused before anything is allocated."""
_MAX_BUFFERS = 1 << 16
_READ_AHEAD_BYTES = 64 << 10
"""What one read takes from the socket when a frame's next part is smaller ([Note:
reading ahead])."""
_MAX_PARTS_PER_SEND = 256
"""Below the kernel's IOV_MAX (1024); frames with more parts go through the backlog."""


class ChannelClosedError(WorkerError):
    """The connection to the worker was lost with this request in flight (the worker
    died or closed it). Retry-able: the pool sends the request again by a plain call."""

    def __init__(self, message: str, *, path: str, detail: str | None = None) -> None:
        super().__init__(message, detail=detail)
        self.path = path


class ChannelRefusedError(WorkerError):
    """The channel would not carry this request or its answer: it needs pickle, over TCP
    without ``PoolConfig(tcp_pickle=True)`` ([Note: no pickle over TCP]). Not a failure of
    the worker: the pool sends the request by a plain Ray call instead."""

    def __init__(self, message: str, *, request_id: int = -1, detail: str | None = None) -> None:
        super().__init__(message, detail=detail)
        self.request_id = request_id


def refusal_frame(request_id: int, message: str) -> bytes:
    """A frame refusing request ``request_id`` (-1: everything on the connection), with
    ``message``: a struct and UTF-8 text, readable without pickle ([Note: no pickle over TCP])."""
    meta = _REFUSED_HEAD.pack(request_id) + message.encode("utf-8", "replace")[:_MAX_REFUSAL_BYTES]
    return _HEAD.pack(len(meta), 0, 0, _REFUSED) + meta


def decode_refusal(meta: memoryview) -> ChannelRefusedError:
    """The error a refusal frame carries."""
    if len(meta) < _REFUSED_HEAD.size or len(meta) > _REFUSED_HEAD.size + _MAX_REFUSAL_BYTES:
        raise ValueError(f"a refusal frame of {len(meta)} bytes; not a channel frame")
    (request_id,) = _REFUSED_HEAD.unpack_from(meta)
    return ChannelRefusedError(bytes(meta[_REFUSED_HEAD.size:]).decode("utf-8", "replace"), request_id=request_id)


# [Note: lone frames]
# At concurrency 1 every frame is a request of one, with its inputs in the caller's
# arena, or the answer to one, with its outputs in the worker's, and right after an
# engine run each step of reading or writing a frame costs about ten times its warm
# time. Traced through Ray (transformer tail, 1 MiB in and out, its input kept in
# shared memory, p50 of about 280 requests; stamps on both sides), the generic frame
# took the caller 65 us to encode and 140 + 44 us to read and decode the answer, and
# the worker 71 + 38 us to read and decode the request and 91 us to encode the
# answer: the frame's state machine (head, places, metadata, buffers), its
# allocations and its per-buffer bookkeeping, where the floor (bench/_floor.py) reads
# eight bytes. A lone frame is what is left of a frame when everything but where its
# arrays lie is known in advance: the usual head (no buffers in the frame, the
# regions handed back as usual), then one fixed struct: a route, the request id,
# either the deadline and priority or the answer's timing, and one arena offset per
# array. A route, the segment key with the names, dtypes and shapes of a request's
# inputs or of an answer's outputs (Outputs.described), is declared once per
# connection by a _ROUTE frame sent just before its first use. A request of one
# whose arrays all fit in the sender's arena, and an answer to a lone run (batch of
# one, Outputs), go this way; all else, over TCP too, goes as before. The receiver
# decodes a lone frame that its last read brought in whole straight from the
# read-ahead buffer ([Note: reading ahead]), and builds each array on the arena's
# mapping in one call (the worker's end makes it once per region: [Note: arrays made
# once] in workers/_transport/arena.py). Measured on the transformer tail at c1 with its input
# kept in shared memory, the serving overhead (latency minus the worker's run; median
# per 3 s round, old and new code in alternating processes, three pairs of four
# rounds each): the same channel and worker code in two processes without Ray,
# 0.65-0.84 ms before, 0.58-0.70 ms with lone frames; through Ray, the caller on
# asyncio's loop, 0.82-1.02 against 0.72-0.85 ms.


# [Note: outputs written in place]
# A caller may pin arrays in its own arena for a request's outputs too (numpy's
# ``out=``, ONNX Runtime's IO binding of outputs, Triton's registered output regions):
# ``ChannelClient.call(..., outputs=)``, ``ReplicaPool.infer(outputs=)``. A lone
# request then declares the outputs' names, dtypes and shapes after its inputs' in its
# route, and its frame carries their offsets after the inputs'. The worker makes
# arrays over those regions (once per region, like the inputs'), checks them once per
# route against the engine's outputs (workers.engine.Engine.check), and its engine
# binds them as its outputs, so ONNX Runtime writes the answer into the caller's
# memory; the answer is then a lone frame of no arrays, which the caller reads as
# ``WRITTEN``. Where the request is not run alone (it batches with others, or the
# outputs are not pinned, or not in this channel's arena), the answer comes as usual
# and the pool copies it into the outputs. A worker refuses, as garbage, a route that
# declares outputs for an answer, or a frame whose output region overlaps another of
# its arrays. Alone, against an answer in the worker's arena, this changed nothing
# above the noise (the transformer tail, two processes without Ray, alternating
# rounds: 0.514 against 0.501 ms, 8 rounds of 2 s); it is what lets a bound request
# (below) send the same frame every time: no answer arrays to free, no regions to
# hand back.
#
# [Note: bound requests]
# A stream of requests of one segment, each of one frame's worth of inputs in the
# same pinned arrays and with its outputs written in the same pinned arrays
# (``ReplicaPool.bind``, :class:`workers.actors.BoundRequest`), sends the same lone
# frame every time but for the request id, deadline and priority. Once a run has
# declared its route, the caller keeps the route, the struct and the offsets
# (``_Connection.bound_frame``) and each later run packs those three into it and
# sends it (``_Connection.send_bound``), skipping the type checks, the route lookup
# and the arena lookups of ``send``; with regions waiting to go back it takes
# ``send``, which carries them, and so it does once any region of the arena has been
# unpinned since the frame was made (the arena counts them), so that a frame never
# names a region that was freed and perhaps lent again. Measured through Ray on the
# transformer tail at c1 (one process, alternating 3 s rounds, 8 each, median): the pool
# with the input kept in shared memory 0.523 ms, a bound request 0.474 ms; the same
# frame sent by hand on the pool's channel (a lower bound for this) 0.471 ms, against
# the channel client called directly 0.511 ms and the pool 0.541 ms.


# [Note: prepared requests]
# The worker's half of a bound request. Its frames are the same but for the request
# id, deadline and priority, and so is everything the worker works out from them: the
# route, the arrays over the caller's regions, the inputs' check, the engine's binding
# to those addresses, the answer's layout. Once a lone request has been answered at
# once with its outputs written in place, the worker's end of the connection keeps,
# by the frame's route and offsets, a serve prepared for it (SegmentHost.prepare, on
# an engine run bound once: Engine.prepare) and what its answer will look like
# (_Connection.written_answer). The next frame with that route and those offsets, at
# the head of the read-ahead buffer with nothing behind it and no regions waiting to
# go back, is not decoded: the serve checks what infer_now checks (the segment still
# the one it was prepared on, the batcher idle, the priority one of its levels, the
# deadline not passed), runs it, sends the answer, and only then counts it. A request
# it declines (False) goes the usual way, which counts and rejects it as before; an
# unloaded segment's (None) is forgotten; a failed run's error goes back to its
# caller. A route declared again forgets everything prepared, and so does a full table.
# Why: at c1, with the caches cold after each run, every step between a frame's
# arrival and its run, and between the run and the answer's send, costs about ten
# times its warm time; traced (the transformer tail, two processes without Ray, 8 s),
# the worker took 87 us from the frame's arrival to the engine and 95-115 us from the
# engine to the answer's send, 5-20 us per step. Measured (the same harness, old and
# new code alternating, three pairs of 8 s): serving overhead 442-475 -> 342-397 us;
# through Ray (bench/workers.py, transformer only), the bound request's 0.49 -> 0.38 ms.


_NO_DEADLINE = float("nan")
_ROUTE_ID = struct.Struct("<q")
"""The route that a lone frame's fixed part starts with."""


class _Written:
    """The outputs of an answer whose arrays were written where the request asked
    ([Note: outputs written in place]); pickles as the module's one instance."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "WRITTEN"

    def __reduce__(self) -> str:
        return "WRITTEN"


WRITTEN = _Written()
"""In an answer, ``[(WRITTEN, timing)]``: the outputs lie where the request asked."""
_WRITTEN_DESCRIBED: tuple = ((), (), ())
"""The route of an answer written in place: no arrays."""
BoundFrame = tuple[int, struct.Struct, tuple[int, ...], int]
"""A bound request's route, its lone frame's struct, its arrays' offsets, and the
arena's ``unpins`` when they were found pinned ([Note: bound requests])."""


def _route_key(key: str, inputs: dict, outputs: dict | None) -> tuple | None:
    """A request's route as ``_Connection._request_routes`` keeps it: the segment key,
    each input's (name, dtype, shape), and for outputs written in place None and each
    output's; None when an input is no plain array ([Note: lone frames])."""
    route_key: list = [key]
    for name, a in inputs.items():
        if type(a) is not np.ndarray:
            return None
        route_key.append((name, a.dtype, a.shape))
    if outputs is not None:
        route_key.append(None)
        route_key.extend((name, a.dtype, a.shape) for name, a in outputs.items())
    return tuple(route_key)


def _lone_struct(head: struct.Struct, n_arrays: int) -> struct.Struct:
    """A lone frame's fixed part: ``head``, then one arena offset per array."""
    return struct.Struct(head.format + "Q" * n_arrays)


def _route_frame(route_id: int, key: str | None, described: tuple, written: tuple = ()) -> bytes:
    """The _ROUTE frame declaring ``route_id``: ``key`` (None for an answer's route),
    (names, dtype strings, shapes), and for a request whose outputs go where it says,
    the outputs' (names, dtype strings, shapes) ([Note: lone frames], [Note: outputs
    written in place])."""
    meta = marshal.dumps((route_id, key, *described, *written))
    return _HEAD.pack(len(meta), 0, 0, _ROUTE) + meta


def _lone_frame(codec: int, meta: bytes, releases: list[int]) -> bytes:
    return (_lone_head(codec, len(meta), releases) + meta
            if releases else _HEAD.pack(len(meta), 0, 0, codec) + meta)


def _prepared_key(meta: bytes) -> bytes:
    """A lone request's route and offsets: its metadata but for the request id, deadline
    and priority ([Note: prepared requests])."""
    return meta[:_ROUTE_ID.size] + meta[_LONE_REQUEST_HEAD.size:]


def _lone_head(codec: int, meta_bytes: int, releases: list[int]) -> bytes:
    """A lone frame's head and the regions it hands back, before its ``meta_bytes`` of metadata."""
    return _HEAD.pack(meta_bytes, 0, len(releases), codec) + b"".join(map(_LEN.pack, releases))


def encode_frame(obj: Any, arena: Arena | None = None, releases: list[int] | tuple = (), *,
                 pickle_ok: bool = True) -> list:
    """``obj`` as the byte strings of one frame (see [Note: direct channel]); its large
    buffers go into ``arena`` where it has room, and the frame hands back the peer's
    arena regions at ``releases`` (see [Note: channel arena] in workers/_transport/arena.py).
    A pool's requests and a worker's answers go as tensor frames ([Note: tensor
    frames]); anything else is pickled, its arrays by :func:`_reduce_array` ([Note:
    lean array pickling]); where that is not ``pickle_ok``, raises ChannelRefusedError
    ([Note: no pickle over TCP])."""
    codec = _REQUEST
    fast = _encode_request(obj)
    if fast is None:
        codec = _DESCRIBED_ANSWER
        fast = _encode_described_answer(obj)
    if fast is None:
        codec = _ANSWER
        fast = _encode_answer(obj)
    if fast is None:
        if not pickle_ok:
            raise ChannelRefusedError(
                f"{_what(obj)} holds values that only pickle carries (an error, a numpy scalar, an object or "
                "strided array), and this TCP channel carries tensors only; it goes by a plain Ray call. "
                "To send pickle over TCP on a network only the cluster can reach, set PoolConfig(tcp_pickle=True)",
                request_id=_request_id(obj))
        codec = _PICKLE
        buffers: list[pickle.PickleBuffer] = []
        meta = _dumps(obj, buffers.append)
    else:
        meta, arrays = fast
        buffers = [pickle.PickleBuffer(a) for a in arrays]
    places = []
    in_frame = []
    for b in buffers:
        raw = b.raw()
        where = None
        if arena is not None and raw.nbytes >= ARENA_MIN_BYTES:
            where = arena.put(raw)
        if where is None:
            in_frame.append(raw)
            where = _IN_FRAME
        places.append(_BUF.pack(raw.nbytes, where))
    head = (_HEAD.pack(len(meta), len(places), len(releases), codec) + b"".join(places)
            + b"".join(_LEN.pack(r) for r in releases))
    return [head, meta, *in_frame]


def _request_id(obj: Any) -> int:
    return obj[0] if type(obj) is tuple and obj and type(obj[0]) is int else -1


def _what(obj: Any) -> str:
    """A frame's object, named for an error: its request and segment where it has them."""
    if type(obj) is tuple and len(obj) == 2 and type(obj[1]) is tuple and obj[1] and type(obj[1][0]) is str:
        return f"request {obj[0]} for {obj[1][0]}"
    if type(obj) is tuple and len(obj) == 3 and type(obj[0]) is int:
        return f"the answer to request {obj[0]}"
    return "this frame"
