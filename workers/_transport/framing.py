"""The direct channel's frame: its one format, :func:`encode_frame`, and the refusal
frame. The package's other modules: the codec of the metadata (codec.py), the socket's
sending half (connection.py) and reading half (reader.py), the shared arenas
(arena.py), the worker's end (server.py) and the pool's end (client.py).

Ray places, restarts and kills the workers, and plain actor calls remain the control
path; requests and their answers travel instead over a socket that the worker opens on
request, Unix-domain on its node and TCP across nodes (see [Note: direct channel]).
Nothing here imports Ray.

[Note: direct channel]
A plain Ray actor call carries a request through the caller's and the worker's core
workers and, for arrays over 100 KiB, the object store: a round trip takes 1.0 ms for
4 B and 2.8 ms for 1 MiB each way on this 2-core machine. A compiled graph takes 0.08
and 0.33 ms, but its readers spin, which on a small machine takes a core from the
engines. This channel is a plain socket: one ``sendmsg`` per frame from the sender's
memory, arrays received straight into the buffers that become the receiver's arrays,
the reader asleep in the event loop while nothing arrives: 0.08 and 0.15 ms (0.26 ms
for 1 MiB through the socket alone, without the shared arenas below), measured beside
the two above (``transport`` in bench/results/workers.json).

Every frame has one format: ``<u32 meta_bytes><u32 n_buffers><u32 n_released><u32 codec>``,
then per buffer ``<u64 bytes><u64 arena_offset>`` (all ones: the buffer follows in the
frame), then ``<u64 arena_offset>`` per region of the receiver's arena handed back, the
metadata, and the buffers that follow in the frame; the sender joins everything up to
the metadata into one part of its ``sendmsg`` and sends each buffer from where it lies.
``codec`` says how the metadata
reads: a tensor frame's marshal of a pool's request or a worker's answer
(:mod:`workers._transport.codec`), a pickle (protocol 5, its arrays out of band) of
anything else, or a refusal (a control frame: :func:`refusal_frame`). On a Unix-domain
socket the two ends share arenas (a ``memfd`` each, passed after the token) and large
buffers go through them instead (see [Note: channel arena] in
workers/_transport/arena.py). Requests are ``(id, args)``, answered with
``(id, True, handler(*args))`` or ``(id, False, error)``. Many requests are in flight on
one connection at once. The replica pool sends the batches it forms on the caller's
side (``infer_batch_timed``'s arguments), as it would send them by plain calls.
Against a second, fixed-struct format for a request of one and its answer, this one
format costs 0.01-0.03 ms of serving overhead at concurrency 1 and nothing at 32
(bench/results/transport_layers.json, 20 alternating pairs: input copied, transformer
+0.014 ms, within the pairs' spread, ResNet50 +0.013 ms, beyond it; input kept in
shared memory +0.034 / +0.011 ms); the channel keeps one format.

Pickle executes what it reads, so nothing unauthenticated may connect: the socket
lives in a fresh directory of mode 0700, and every connection must first send the
channel's 32-byte random token, which the worker hands out only through Ray (an actor
call, ``open_channel``), i.e. to whoever may call the actor anyway. Workers on other
nodes are reached the same way over TCP on the worker's node address, token first
([Note: no pickle over TCP]).

[Note: no pickle over TCP]
Across nodes the token travels in clear, so anyone who can watch the cluster network can
replay it, and a pickle executes what it reads. A TCP connection therefore carries
tensor frames only (marshal of names, dtype strings, shapes and plain numbers: nothing
that runs code), and both ends refuse a pickle frame unless the operator opts in
(``PoolConfig(tcp_pickle=True)``, which both ends then use). The sender refuses before
anything is sent: the pool's request that needs pickle (an array of an object or
strided dtype, a numpy scalar) goes by a plain Ray call instead, and so does a request
whose answer needs pickle (an error, say): the worker answers it with a refusal frame
and the pool sends it again by a plain call, which carries the answer and its error's
type through Ray. A pickle frame that arrives anyway is never unpickled: the worker
answers a refusal frame for the whole connection, closes that connection and keeps
serving. The channel has no TLS of its own; Ray's TLS does not cover it, so on a
network others can watch, keep the default or use ``PoolConfig(direct=False)``.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

from workers._transport.arena import ARENA_MIN_BYTES, Arena
from workers._transport.codec import encode_answer, encode_request
from workers.errors import WorkerError

__all__ = ["ChannelClosedError", "ChannelRefusedError", "encode_frame", "refusal_frame"]

_HEAD = struct.Struct("<IIII")
_BUF = struct.Struct("<QQ")
_LEN = struct.Struct("<Q")
_PICKLE, _REQUEST, _ANSWER, _REFUSED = range(4)
"""How a frame's metadata reads: pickle, a tensor frame's request or answer, a refusal."""
_LAST_CODEC = _REFUSED
_REFUSED_HEAD = struct.Struct("<q")
"""A refusal's request id (-1: the whole connection), before its UTF-8 message."""
_MAX_REFUSAL_BYTES = 4096
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


def encode_frame(obj: Any, arena: Arena | None = None, releases: list[int] | tuple = (), *,
                 pickle_ok: bool = True) -> list:
    """``obj`` as the byte strings of one frame (see [Note: direct channel]); its large
    buffers go into ``arena`` where it has room, and the frame hands back the peer's
    arena regions at ``releases`` (see [Note: channel arena] in workers/_transport/arena.py).
    A pool's request or a worker's answer of plain arrays goes as a tensor frame
    ([Note: tensor frames] in workers/_transport/codec.py); anything else is pickled, or,
    where that is not ``pickle_ok``, raises ChannelRefusedError ([Note: no pickle over TCP])."""
    # An answer has three items and a request two: each frame tries the one codec it can be.
    if type(obj) is tuple and len(obj) == 3:
        codec, tensors = _ANSWER, encode_answer(obj)
    else:
        codec, tensors = _REQUEST, encode_request(obj)
    if tensors is not None:
        meta, buffers = tensors
    elif not pickle_ok:
        raise ChannelRefusedError(
            f"{_what(obj)} holds values that only pickle carries (an error, a numpy scalar, an object or "
            "strided array), and this TCP channel carries tensors only; it goes by a plain Ray call. "
            "To send pickle over TCP on a network only the cluster can reach, set PoolConfig(tcp_pickle=True)",
            request_id=_request_id(obj))
    else:
        codec = _PICKLE
        buffers = []
        meta = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    parts = [b""]
    places = []
    for b in buffers:
        # An array placed or pinned in the arena is found by identity ([Note: arrays made
        # once] in workers/_transport/arena.py); any other buffer is copied there.
        where = arena.take(b) if arena is not None and codec != _PICKLE else None
        if where is None:
            b = b.raw() if codec == _PICKLE else pickle.PickleBuffer(b).raw()
            if arena is not None and b.nbytes >= ARENA_MIN_BYTES:
                where = arena.put(b)
            if where is None:
                parts.append(b)
                where = _IN_FRAME
        places.append(_BUF.pack(b.nbytes, where))
    parts[0] = b"".join((_HEAD.pack(len(meta), len(places), len(releases), codec), *places,
                         *map(_LEN.pack, releases), meta))
    return parts


def _request_id(obj: Any) -> int:
    return obj[0] if type(obj) is tuple and obj and type(obj[0]) is int else -1


def _what(obj: Any) -> str:
    """A frame's object, named for an error: its request and segment where it has them."""
    if type(obj) is tuple and len(obj) == 2 and type(obj[1]) is tuple and obj[1] and type(obj[1][0]) is str:
        return f"request {obj[0]} for {obj[1][0]}"
    if type(obj) is tuple and len(obj) == 3 and type(obj[0]) is int:
        return f"the answer to request {obj[0]}"
    return "this frame"
