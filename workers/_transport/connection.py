"""A direct data channel from a replica pool to a worker.

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
like Ray's own traffic between nodes it is not encrypted, so a cluster network that
others can watch needs Ray's TLS and ``PoolConfig(direct=False)``.
"""

from __future__ import annotations

import asyncio
import collections
import copyreg
import hmac
import io
import itertools
import logging
import marshal
import math
import operator
import os
import pickle
import secrets
import shutil
import socket
import struct
import tempfile
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from workers._transport.arena import ARENA_MIN_BYTES, Arena, PeerArena, arenas_supported
from workers._pool import RequestTiming, new_timing
from workers.batcher import NOT_NOW
from workers.engine import Outputs, PlacedInputs
from workers.errors import WorkerError

__all__ = ["ChannelClient", "ChannelClosedError", "ChannelServer", "open_channel_server"]

logger = logging.getLogger(__name__)

_HEAD = struct.Struct("<IIII")
_BUF = struct.Struct("<QQ")
_LEN = struct.Struct("<Q")
_PICKLE, _REQUEST, _ANSWER, _DESCRIBED_ANSWER, _ROUTE, _LONE_REQUEST, _LONE_ANSWER = range(7)
"""How a frame's metadata is encoded (see [Note: tensor frames], [Note: answers
described in advance], [Note: lone frames])."""
_LAST_CODEC = _LONE_ANSWER
_LONE_REQUEST_HEAD = struct.Struct("<qqdq")
"""A lone request's route, id, deadline (NaN for none) and priority, before its inputs' offsets."""
_LONE_ANSWER_HEAD = struct.Struct("<qqdd")
"""A lone answer's route, request id, queue and run seconds, before its outputs' offsets."""
_DESCRIBED_HEAD = struct.Struct("<qddq?")
"""A described answer's request id and RequestTiming, before its outputs' description."""
_MAX_KEPT = 256
"""Entries each of this module's caches keeps (descriptions decoded per connection,
:func:`_made_once`); a full cache forgets them all when another comes."""
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

Handler = Callable[..., Awaitable[Any]]
"""Called with a request's arguments; its result or error goes back to the caller."""
NowHandler = Callable[..., Any]
"""Called first, synchronously, for a request with nothing behind it in the socket: its
result goes back at once, or it returns ``NOT_NOW`` (workers.batcher) for ``Handler``.
Called with the request's arguments and ``place``: None, or ``Arena.place`` of the
connection's arena, where the handler may write the answer's large arrays so that they
go back without a copy ([Note: outputs placed] in workers/engine.py)."""
PrepareHandler = Callable[[str, Any, Callable[[int, float, float], None]], Callable[[int, float, int], Any] | None]
"""``prepare(key, inputs, answer)``: see :meth:`workers._worker.SegmentHost.prepare`."""


class ChannelClosedError(WorkerError):
    """The connection to the worker was lost with this request in flight (the worker
    died or closed it). Retry-able: the pool sends the request again by a plain call."""

    def __init__(self, message: str, *, path: str, detail: str | None = None) -> None:
        super().__init__(message, detail=detail)
        self.path = path


_DTYPES: dict[str, np.dtype] = {}


def _plain(a: Any) -> bool:
    """A C-contiguous ndarray of a built-in, non-object dtype: sent as buffer, dtype
    string and shape."""
    return type(a) is np.ndarray and a.dtype.isbuiltin == 1 and not a.dtype.hasobject and a.flags.c_contiguous


def _dtype(name: str) -> np.dtype:
    dt = _DTYPES.get(name)
    if dt is None:
        dt = _DTYPES[name] = np.dtype(name)
    return dt


def _rebuild_array(buffer: Any, dtype: str, shape: tuple) -> np.ndarray:
    """Unpickles an array that :func:`_reduce_array` sent."""
    return np.frombuffer(buffer, _dtype(dtype)).reshape(shape)


def _reduce_array(a: np.ndarray) -> tuple:
    """Pickles a C-contiguous array of a plain dtype as its buffer, dtype string and shape.

    [Note: lean array pickling]
    NumPy's own reduction pickles the dtype as an object (a constructor call and a
    ``__setstate__`` on load) and rebuilds the array through a Python function of
    NumPy's; here the dtype is a short string, parsed once per process. Measured in a
    loop (best of 7), a lone request's answer (a 1 MiB array in its outputs dict, and
    its RequestTiming): 16.4 us to pickle and 10.6 us to unpickle with NumPy's
    reduction, 12.9 and 8.0 us this way; the request: 8.0 and 5.9 us against 4.9 and
    3.3 us. That is CPU the caller's event loop spends per request at high
    concurrency. At concurrency 1, right after an engine run, the same steps take ten
    times as long with the caches cold, and there the saving did not show above the
    noise (a traced transformer request, p50 of about 370: the answer's pickling 109
    and 158 us before, 110-142 us after). Other arrays (object, structured or
    byte-swapped dtypes, non-contiguous) take NumPy's reduction.
    """
    if _plain(a):
        return _rebuild_array, (pickle.PickleBuffer(a), a.dtype.str, a.shape)
    return a.__reduce_ex__(5)


class _Dispatch(dict):
    """Our reductions first, then copyreg's as they stand when pickling (errors register
    theirs when a worker starts: workers._worker.register_error_pickling)."""

    def __missing__(self, cls: type) -> Any:
        return copyreg.dispatch_table[cls]


_DISPATCH = _Dispatch({np.ndarray: _reduce_array})


def _dumps(obj: Any, buffer_callback: Callable[[pickle.PickleBuffer], None]) -> bytes:
    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=5, buffer_callback=buffer_callback)
    pickler.dispatch_table = _DISPATCH
    pickler.dump(obj)
    return out.getvalue()


# -- frames of tensors --------------------------------------------------------------
#
# [Note: tensor frames]
# Nearly every frame is a replica pool's request, ``(id, (key, [inputs], [deadline],
# [priority]))``, or a worker's answer, ``(id, True, [(outputs, RequestTiming)])``, with
# dicts of plain arrays. Those go as their arrays' buffers and, as the metadata, a
# marshal of names, dtype strings, shapes and the plain values around them: no pickler,
# no class looked up by name, no reduction called. The head's codec field says which
# (_REQUEST, _ANSWER); any other frame, or one holding anything else (an error, a
# strided array, a numpy scalar), is pickled (_PICKLE). Types are checked exactly,
# since marshal writes any object with a buffer, a numpy scalar say, as bytes. In a
# loop (best of 7) a transformer answer took 8.2 us to pickle and 6.1 us to unpickle
# with [Note: lean array pickling], 3.6 and 3.0 us this way. Traced through Ray at c1
# (p50 of about 370 requests, two runs each, alternating): the answer's encoding
# 102-130 -> 38-70 us, its decoding by the caller 53-62 -> 23-33 us, the request's
# 43-52 -> 32-38 us and 25-30 -> 16-19 us; the c1 serving overhead end to end read
# 0.81-1.11 ms before and 0.93-1.04 ms after (three 3 s rounds of each, twice,
# alternating): no change above this machine's noise.


def _made_once(made: dict[int, tuple[Any, Any]], obj: Any, make: Callable[[Any], Any]) -> Any:
    """``make(obj)``, made once per object: kept in ``made`` by the object's id, the
    object beside it so that the id stays its own while it is there."""
    entry = made.get(id(obj))
    if entry is None or entry[0] is not obj:
        if len(made) >= _MAX_KEPT:
            made.clear()
        entry = made[id(obj)] = (obj, make(obj))
    return entry[1]


_DTYPE_STRS: dict[int, tuple[np.dtype, str]] = {}
"""``dtype.str`` (:func:`_made_once`): it formats the string on every call, 0.4 us in a
loop here and about 30 us right after an engine run."""
_dtype_str = operator.attrgetter("str")


def _describe_arrays(named: Any, arrays: list) -> tuple | None:
    """``named`` (a dict of plain arrays) as (names, dtype strings, shapes), its arrays
    appended to ``arrays``; None when it is anything else."""
    if type(named) is not dict and type(named) is not Outputs:
        return None
    for name, a in named.items():
        if type(name) is not str or not _plain(a):
            return None
    arrays.extend(named.values())
    return (tuple(named), tuple(_made_once(_DTYPE_STRS, a.dtype, _dtype_str) for a in named.values()),
            tuple(a.shape for a in named.values()))


def _encode_request(obj: Any) -> tuple[bytes, list] | None:
    """A replica pool's request, ``(id, (key, [inputs], [deadline], [priority]))``."""
    if type(obj) is not tuple or len(obj) != 2 or type(obj[1]) is not tuple or len(obj[1]) != 4:
        return None
    request_id, (key, requests, deadlines, priorities) = obj
    if (type(key) is not str or type(request_id) is not int or type(requests) is not list
            or type(deadlines) is not list or type(priorities) is not list
            or not all(d is None or type(d) is float for d in deadlines)
            or not all(type(p) is int for p in priorities)):
        # marshal writes any object with a buffer (a numpy scalar, say) as bytes: only
        # exact types go this way; the rest is pickled.
        return None
    arrays: list = []
    specs = []
    for inputs in requests:
        spec = _describe_arrays(inputs, arrays)
        if spec is None:
            return None
        specs.append(spec)
    return marshal.dumps((request_id, key, specs, deadlines, priorities)), arrays


def _encode_answer(obj: Any) -> tuple[bytes, list] | None:
    """A worker's answer, ``(id, True, [(outputs, RequestTiming | None)])``."""
    if (type(obj) is not tuple or len(obj) != 3 or type(obj[0]) is not int or obj[1] is not True
            or type(obj[2]) is not list):
        return None
    arrays: list = []
    items = []
    for result in obj[2]:
        if type(result) is not tuple or len(result) != 2:
            return None
        spec = _describe_arrays(result[0], arrays)
        timing = result[1]
        if spec is None or not (timing is None or type(timing) is RequestTiming):
            return None
        items.append((*spec, None if timing is None else (float(timing.queue_s), float(timing.compute_s),
                                                          int(timing.batch_size), bool(timing.first_in_batch))))
    return marshal.dumps((obj[0], items)), arrays


# [Note: answers described in advance]
# A lone request's answer is nearly always the same outputs of the same engine bucket
# at the same batch size. The engine describes them once per bucket (Outputs.described
# in workers/engine.py); its marshal is made once per description, and a
# described answer's metadata is the request id and timing in a fixed struct followed
# by those bytes (_made_once). The receiver decodes each distinct description once per connection
# and then only checks that the bytes match. Right after an engine run every step costs
# about ten times its warm time, and this takes the per-array checks, the dtype strings,
# the marshal of the whole answer and its decoding off both ends. The transformer tail's
# c1 serving overhead through Ray (input kept in shared memory; the median of four 3 s
# rounds per process, old and new code in alternate processes, 13 pairs; scripts not
# committed): 0.73-0.94 ms, median 0.83, before; 0.66-0.83 ms, median 0.75, after;
# lower in 10 of the 13 pairs.

_DESCRIPTIONS: dict[int, tuple[tuple, bytes]] = {}
"""Outputs.described's marshal (:func:`_made_once`)."""


def _encode_described_answer(obj: Any) -> tuple[bytes, list] | None:
    """A worker's answer to one request, ``(id, True, [(Outputs, RequestTiming)])``."""
    if (type(obj) is not tuple or len(obj) != 3 or type(obj[0]) is not int or obj[1] is not True
            or type(obj[2]) is not list or len(obj[2]) != 1):
        return None
    result = obj[2][0]
    if type(result) is not tuple or len(result) != 2:
        return None
    outputs, timing = result
    if type(outputs) is not Outputs or type(timing) is not RequestTiming:
        return None
    head = _DESCRIBED_HEAD.pack(obj[0], timing.queue_s, timing.compute_s, timing.batch_size, timing.first_in_batch)
    return head + _made_once(_DESCRIPTIONS, outputs.described, marshal.dumps), list(outputs.values())


def _decode_described_answer(meta: memoryview, buffers: list, known: dict[bytes, list]) -> tuple:
    request_id, queue_s, compute_s, batch_size, first = _DESCRIBED_HEAD.unpack_from(meta)
    description = bytes(meta[_DESCRIBED_HEAD.size:])
    arrays = known.get(description)
    if arrays is None:
        names, dtypes, shapes = marshal.loads(description)
        arrays = [(str(name), _dtype(dtype), tuple(shape)) for name, dtype, shape in zip(names, dtypes, shapes)]
        if not len(arrays) == len(names) == len(dtypes) == len(shapes):
            raise ValueError("a described answer's names, dtypes and shapes differ in number; not a channel frame")
        if len(known) >= _MAX_KEPT:
            known.clear()
        known[description] = arrays
    if len(arrays) != len(buffers):
        raise ValueError(f"a described answer has {len(buffers)} buffers for {len(arrays)} arrays; "
                         "not a channel frame")
    outputs = {name: np.frombuffer(b, dtype).reshape(shape) for (name, dtype, shape), b in zip(arrays, buffers)}
    return request_id, True, [(outputs, new_timing((queue_s, compute_s, batch_size, first)))]


def _arrays(specs: Any, buffers: Any) -> dict[str, np.ndarray]:
    names, dtypes, shapes = specs
    return {name: _rebuild_array(next(buffers), dtype, shape) for name, dtype, shape in zip(names, dtypes, shapes)}


def _decode_request(meta: memoryview, buffers: list) -> tuple:
    request_id, key, specs, deadlines, priorities = marshal.loads(meta)
    it = iter(buffers)
    return request_id, (key, [_arrays(s, it) for s in specs], deadlines, priorities)


def _decode_answer(meta: memoryview, buffers: list) -> tuple:
    request_id, items = marshal.loads(meta)
    it = iter(buffers)
    return request_id, True, [(_arrays(item[:3], it), None if item[3] is None else RequestTiming(*item[3]))
                              for item in items]


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


def encode_frame(obj: Any, arena: Arena | None = None, releases: list[int] | tuple = ()) -> list:
    """``obj`` as the byte strings of one frame (see [Note: direct channel]); its large
    buffers go into ``arena`` where it has room, and the frame hands back the peer's
    arena regions at ``releases`` (see [Note: channel arena] in workers/_transport/arena.py).
    A pool's requests and a worker's answers go as tensor frames ([Note: tensor
    frames]); anything else is pickled, its arrays by :func:`_reduce_array` ([Note:
    lean array pickling])."""
    codec = _REQUEST
    fast = _encode_request(obj)
    if fast is None:
        codec = _DESCRIBED_ANSWER
        fast = _encode_described_answer(obj)
    if fast is None:
        codec = _ANSWER
        fast = _encode_answer(obj)
    if fast is None:
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


class _Connection:
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

    def __init__(self, sock: socket.socket, *, views_until_freed: bool) -> None:
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
        """Queues one frame; raises OSError when the connection has failed. ``outputs``:
        for a request, arrays this end pinned where the answer's outputs should be
        written ([Note: outputs written in place])."""
        if self.error is not None:
            raise self.error
        # Finalizers append on any thread: each popleft is atomic; no Python frame per send.
        releases = list(itertools.starmap(self._releases.popleft, itertools.repeat((), len(self._releases))))
        parts = None
        if self.arena is not None:
            parts = self._encode_lone(obj, releases, outputs)
        if parts is None:
            parts = [memoryview(p).cast("B") for p in encode_frame(obj, self.arena, releases)]
        self._send_parts(parts)

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
        else:
            obj = (_decode_request if codec == _REQUEST else _decode_answer)(meta, buffers)
        self._on_frame(obj, held)

    def close(self) -> None:
        self.stop_reading()
        if self.peer is not None:
            self.peer.close()
        self.sock.close()
        if self.arena is not None:
            self.arena.close()


def _in_place(value: list, written: dict[str, tuple[np.ndarray, int]]) -> list:
    """``[(WRITTEN, timing)]`` for the answer to a request whose outputs ran where it
    asked; ``value`` unchanged otherwise (batched, say: the caller copies them)."""
    result = value[0]
    if type(result) is tuple and len(result) == 2 and isinstance(result[0], dict):
        outputs = result[0]
        if len(outputs) == len(written) and all(outputs.get(name) is a for name, (a, _) in written.items()):
            return [(WRITTEN, result[1])]
    return value


class ChannelServer:
    """A worker's end: answers each request on its connections with ``handler``."""

    def __init__(self, handler: Handler, directory: str, now: NowHandler | None = None,
                 prepare: PrepareHandler | None = None) -> None:
        self._handler = handler
        self._now = now
        self._prepare = prepare
        self._directory = directory
        self.path = os.path.join(directory, "channel.sock")
        self.tcp_address: tuple[str, int] | None = None
        """Where the TCP listener is, when one was asked for."""
        self.token = secrets.token_bytes(_TOKEN_BYTES)
        """What every connection must send first; hand it out only over an authenticated path."""
        self._listeners: list[socket.socket] = []
        self._tasks: set[asyncio.Task] = set()
        self._connections: set[_Connection] = set()

    @property
    def arena_lent_bytes(self) -> int:
        """Bytes of this worker's arenas that callers have not handed back yet."""
        return sum(c.arena.lent_bytes for c in self._connections if c.arena is not None)

    def _spawn(self, coro: Awaitable) -> None:
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start(self, tcp_host: str | None) -> None:
        listeners = [(socket.AF_UNIX, self.path)]
        if tcp_host is not None:
            listeners.append((socket.AF_INET6 if ":" in tcp_host else socket.AF_INET, (tcp_host, 0)))
        for family, address in listeners:
            listener = socket.socket(family, socket.SOCK_STREAM)
            self._listeners.append(listener)
            listener.bind(address)
            listener.listen(64)
            listener.setblocking(False)
            if family != socket.AF_UNIX:
                self.tcp_address = listener.getsockname()[:2]
            self._spawn(self._accept(listener))

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(listener)
            self._spawn(self._serve(_Connection(sock, views_until_freed=False)))

    async def _serve(self, conn: _Connection) -> None:
        self._connections.add(conn)
        try:
            token = bytearray(_TOKEN_BYTES)
            await asyncio.wait_for(conn._recv_into(memoryview(token)), _TOKEN_WAIT_S)
            if not hmac.compare_digest(bytes(token), self.token):
                logger.warning("direct channel %s: a connection sent a wrong token; closed", self.path)
                return
            if conn.sock.family == socket.AF_UNIX:
                await asyncio.wait_for(conn.share_arenas(offer=False), _TOKEN_WAIT_S)
            lost: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
            if self._prepare is not None and self._now is not None:
                conn.prepared = {}
            conn.read_frames(lambda request, held: self._handle(conn, request, held),
                             lambda e: lost.done() or lost.set_result(e))
            why = await lost
            if not isinstance(why, ConnectionError):
                logger.error("direct channel %s: a frame did not decode (%r); closing that connection", self.path, why)
        except (ConnectionError, TimeoutError):
            pass  # the pool closed it, or died, or never sent its token
        except Exception as e:  # noqa: BLE001 - a garbled handshake ends its connection, never the worker
            logger.error("direct channel %s: a connection's handshake failed (%r); closing it", self.path, e)
        finally:
            self._connections.discard(conn)
            conn.close()

    def _handle(self, conn: _Connection, request: Any, held: list[int]) -> None:
        """One request, in the connection's reader ([Note: frames in the reader])."""
        request_id, args = request
        if self._now is not None and not conn.more_waiting:
            # [Note: answered at once]
            # A request with nothing behind it may be answered right here, with no task
            # and no event-loop iteration (its batcher runs it inline anyway: [Note: run
            # now] in workers/batcher.py). With more frames waiting it goes the usual
            # way, so that they can batch with it.
            arena = conn.arena
            try:
                ok, value = True, self._now(*args, place=arena.place if arena is not None else None)
            except Exception as e:  # noqa: BLE001 - as in _answer
                ok, value = False, e
            if value is not NOT_NOW:  # NOT_NOW: nothing ran, nothing was reserved
                written = self._reply(conn, request_id, args, ok, value, held)
                if arena is not None:
                    arena.unreserve()  # what the answer did not carry (an error, say)
                if written and conn.prepared is not None and args[1][0].frame_key not in conn.prepared:
                    self._keep_prepared(conn, args[0], args[1][0], held)
                return
        self._spawn(self._answer(conn, request_id, args, held))

    async def _answer(self, conn: _Connection, request_id: Any, args: tuple, held: list[int]) -> None:
        try:
            ok, value = True, await self._handler(*args)
        except Exception as e:  # noqa: BLE001 - every error goes back to its caller as a value
            ok, value = False, e
        self._reply(conn, request_id, args, ok, value, held)

    def _keep_prepared(self, conn: _Connection, key: str, inputs: PlacedInputs, held: list[int]) -> None:
        """Prepares the next requests of the lone frame that ``inputs`` came in, just
        answered at once with its outputs written in place ([Note: prepared requests])."""
        prepared = conn.prepared
        assert prepared is not None and self._prepare is not None
        if len(prepared) >= _MAX_PREPARED:
            prepared.clear()
        answer = conn.written_answer(held)
        serve = None
        if answer is not None:
            try:
                serve = self._prepare(key, inputs, answer)
            except Exception as e:  # noqa: BLE001 - then its requests go the usual way
                logger.debug("direct channel %s: requests of %s not prepared (%r)", self.path, key, e)

        def fail(request_id: int, e: Exception) -> None:
            self._reply(conn, request_id, (key,), False, e, held)

        prepared[inputs.frame_key] = None if serve is None else (serve, fail)

    @staticmethod
    def _reply(conn: _Connection, request_id: Any, args: tuple, ok: bool, value: Any, held: list[int]) -> bool:
        """Sends the handler's result (``ok``) or error to the caller of ``request_id``;
        returns whether the answer says its outputs were written in place."""
        written = False
        if not ok:
            value.__traceback__ = value.__context__ = value.__cause__ = None
        if ok and type(value) is list and len(value) == 1 and type(args[1]) is list and len(args[1]) == 1:
            inputs = args[1][0]
            if type(inputs) is PlacedInputs and inputs.outputs is not None:
                answer = _in_place(value, inputs.outputs)
                written, value = answer is not value, answer
        reply = (request_id, ok, value)
        # The request's arrays are done with once it is answered (see [Note: channel arena]).
        conn.hand_back(held)
        try:
            try:
                conn.send(reply)
            except (pickle.PicklingError, TypeError, AttributeError) as e:
                key = str(args[0]) if args else None
                conn.send((request_id, False, WorkerError(
                    f"the answer to request {request_id} for {key} could not be sent ({e!r}); "
                    "report this: worker results must be picklable", model=key, detail=repr(e))))
                written = False
        except OSError:
            pass  # the pool went away; it has counted this request already
        return written

    def close(self) -> None:
        for listener in self._listeners:
            listener.close()
        for task in self._tasks:
            task.cancel()
        shutil.rmtree(self._directory, ignore_errors=True)


async def open_channel_server(
    handler: Handler, *, now: NowHandler | None = None, prepare: PrepareHandler | None = None,
    tcp_host: str | None = None,
) -> ChannelServer:
    """Listens on a new socket in a private directory (``server.path``) and, given
    ``tcp_host``, on a TCP port of that address too (``server.tcp_address``). ``now``, if
    given, is tried first for requests with nothing behind them (see [Note: answered at once]);
    ``prepare``, if given with it, prepares lone requests that it answered with their
    outputs written in place (see [Note: prepared requests])."""
    directory = tempfile.mkdtemp(prefix="splitinfer-ch-")  # mode 0700: see [Note: direct channel]
    server = ChannelServer(handler, directory, now, prepare)
    try:
        await server._start(tcp_host)
    except BaseException:
        server.close()
        raise
    return server


class ChannelClient:
    """A pool's end of one worker's channel; use from the event loop that connected it."""

    def __init__(self, path: str, conn: _Connection) -> None:
        self.path = path
        self.loop = asyncio.get_running_loop()
        self._conn = conn
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self.closed = False
        self.late_answers = 0
        """Answers that arrived after their caller stopped waiting (cancelled)."""
        conn.read_frames(self._deliver, self._lost)

    @classmethod
    async def connect(
        cls, address: str | tuple[str, int], token: bytes, *, shared_memory: bool = True
    ) -> ChannelClient:
        """Connects to a socket path, or a ``(host, port)`` over TCP, and sends the token;
        over a socket path, offers to share arenas unless ``shared_memory`` is False."""
        if isinstance(address, str):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            address = (address[0], int(address[1]))
            sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_STREAM)
        loop = asyncio.get_running_loop()
        conn = None
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
            await loop.sock_sendall(sock, token)
            conn = _Connection(sock, views_until_freed=True)
            if sock.family == socket.AF_UNIX:
                try:
                    await conn.share_arenas(offer=True, share=shared_memory)
                except ConnectionError as e:
                    raise ChannelClosedError(
                        f"the worker closed the direct channel {address} at its handshake ({e!r}): a wrong "
                        "token, or the worker is going away; the pool sends by plain calls meanwhile",
                        path=address, detail=repr(e)) from e
        except BaseException:
            if conn is not None:
                conn.close()
            sock.close()
            raise
        return cls(address if isinstance(address, str) else f"{address[0]}:{address[1]}", conn)

    @property
    def arena_lent_bytes(self) -> int:
        """Bytes of this end's arena that the worker holds (requests it has not answered)."""
        return self._conn.arena.lent_bytes if self._conn.arena is not None else 0

    def pin_array(self, shape: tuple, dtype: Any) -> np.ndarray | None:
        """An array of ``shape`` and ``dtype`` in this end's arena that the caller keeps
        for its inputs ([Note: inputs kept in the arena] in workers/_transport/arena.py), which a
        request then carries without asking where it lies ([Note: arrays made once]);
        None over TCP, with shared memory off, or when the arena has no room."""
        arena = self._conn.arena
        return None if arena is None or self.closed else arena.pin_array(shape, dtype)

    def unpin(self, region: np.ndarray) -> None:
        """Frees a region that :meth:`pin_array` gave; no request that reads it may be in
        flight."""
        if self._conn.arena is not None:
            self._conn.arena.unpin(region)

    @property
    def unpins(self) -> int:
        """How many regions :meth:`unpin` has freed ([Note: bound requests])."""
        return self._conn.arena.unpins if self._conn.arena is not None else -1

    @property
    def arena_fallbacks(self) -> int:
        """Large buffers sent in the frame because the arena was full."""
        return self._conn.arena.fallbacks if self._conn.arena is not None else 0

    def _deliver(self, answer: tuple, held: list[int]) -> None:
        # The connection's on_frame, with no lambda in between.
        request_id, ok, value = answer
        fut = self._pending.pop(request_id, None)
        if fut is None or fut.done():
            self.late_answers += 1
        elif ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def _lost(self, exc: BaseException | None) -> None:
        if self.closed:
            return
        self.closed = True
        self._conn.close()
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(ChannelClosedError(
                    f"the direct channel {self.path} closed with the request in flight (the worker died or "
                    "restarted); retry-able: the pool sends it again by a plain call",
                    path=self.path, detail=repr(exc) if exc else None))

    def bound_frame(self, key: str, inputs: dict, outputs: dict) -> BoundFrame | None:
        """See :meth:`_Connection.bound_frame` ([Note: bound requests])."""
        return None if self.closed else self._conn.bound_frame(key, inputs, outputs)

    async def call(self, *args: Any, outputs: dict | None = None, bound: BoundFrame | None = None) -> Any:
        """The worker's ``handler(*args)``; raises the worker's error, or
        ChannelClosedError when the connection is lost meanwhile. ``outputs``: for a
        request of one, arrays of :meth:`pin_array` where the worker may write its
        outputs; its answer is then ``[(WRITTEN, timing)]`` ([Note: outputs written in
        place]), or the outputs as usual where the worker did not. ``bound``: the
        request's frame as :meth:`bound_frame` gave it, sent as it stands where it can be
        ([Note: bound requests])."""
        if self.closed:
            raise ChannelClosedError(f"the direct channel {self.path} is closed; reconnect or send by a plain call",
                                     path=self.path)
        request_id = next(self._ids)
        fut = self.loop.create_future()
        self._pending[request_id] = fut
        try:
            try:
                if bound is None or not self._conn.send_bound(bound, request_id, args[2][0], args[3][0]):
                    self._conn.send((request_id, args), outputs)
            except OSError as e:
                del self._pending[request_id]  # failed below, by the raise, not by _lost
                self._lost(e)
                raise ChannelClosedError(f"sending on the direct channel {self.path} failed ({e!r}); "
                                         "retry-able: the pool sends it again by a plain call",
                                         path=self.path, detail=repr(e)) from e
            return await fut
        finally:
            self._pending.pop(request_id, None)

    def close(self) -> None:
        """Stops reading; callers still waiting get ChannelClosedError."""
        self._lost(None)
