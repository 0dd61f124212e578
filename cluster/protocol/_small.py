"""Fast paths for small Infer frames: the common case, checked in exact types.

[Note: small-frame fast path]
At 4 KiB the tensor bytes cost nothing to copy; what shows in a round trip is
the number of Python calls per frame, and on a busy server each call costs
several times what a warm micro-benchmark says (the interpreter's caches are
cold after the gRPC threads ran). So the small InferRequest and InferResponse
frames get one function each way that does the whole job in one frame:
one C unpack (or pack) call, exact-type checks of every field, tensors built
straight from the ext payload.

These functions never raise for bad input. When anything is not the common
case (a missing or mistyped field, an unknown ext code, a big-endian or
strided array, an encoded tensor the fast hook does not read) they return
None, and the caller takes the general path in `messages`, which accepts the
same frames and raises the precise `ProtocolError` for bad ones. So the fast
path accepts a subset of what the general path accepts and builds the same
values, and the wire bytes it writes are the ones the general path writes.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from cluster.protocol._msgpack import SMALL_FRAME_BYTES, pack_small
from cluster.protocol.tensors import EXT_TENSOR, EncodedTensor, read_ext
from cluster.protocol.tensors import _CODE_OF_DTYPE, _DTYPE_OF_CODE, _LAYOUT, _MAX_NDIM  # noqa: PLC2701 - same package

__all__ = [
    "decode_request",
    "decode_response",
    "decode_stream_frame",
    "encode_request",
    "encode_response",
    "request_plain",
    "small_ext_tensors",
]

# Header and shape of a raw tensor ext in one struct per ndim (layout, dtype, ndim, pad, dims...).
_HEADS = [struct.Struct(f"<BBBB{n}Q") for n in range(_MAX_NDIM + 1)]
_DIMS = [struct.Struct(f"<{n}Q") for n in range(_MAX_NDIM + 1)]
_ExtType = msgpack.ExtType
# ExtType's own __new__ is Python code that re-checks a code and a bytes body we
# just built; tuple.__new__ makes the same namedtuple, which the C packer takes.
_new_tuple = tuple.__new__
_unpackb = msgpack.unpackb
_ndarray = np.ndarray
_frombuffer = np.frombuffer
_perf_counter = time.perf_counter


_ABSENT = object()


class _NotCommon(Exception):
    """Raised inside the ext hook: leave this frame to the general path."""


def _ext_hook(code: int, data: bytes) -> Any:
    if code == EXT_TENSOR:
        n = len(data)
        if n >= 4 and data[0] == _LAYOUT:
            ndim = data[2]
            dtype = _DTYPE_OF_CODE.get(data[1])
            start = 4 + 8 * ndim + data[3]
            if dtype is not None and ndim <= _MAX_NDIM and n >= start:
                shape = _DIMS[ndim].unpack_from(data, 4)
                count = 1
                for d in shape:
                    count *= d
                if n - start == count * dtype.itemsize:
                    # A view of the unpacker's bytes: read-only, as the general path's.
                    arr = _frombuffer(data, dtype, count, start)
                    return arr if ndim == 1 else arr.reshape(shape)
        raise _NotCommon
    try:
        return read_ext(code, memoryview(data), -1)
    except Exception as e:  # noqa: BLE001 - the general path raises the precise error
        raise _NotCommon from e


def _versioned(d: Any, majors: tuple[int, ...]) -> bool:
    """Whether `d` is a map whose `v` is [major, minor] of a major this side reads;
    if so, `v` becomes the tuple the messages hold."""
    if type(d) is not dict:
        return False
    v = d.get("v")
    if type(v) is not list or len(v) != 2:
        return False
    major, minor = v
    if type(major) is not int or type(minor) is not int or major not in majors or minor < 0:
        return False
    d["v"] = (major, minor)
    return True


def _unpack(raw: Any, majors: tuple[int, ...]) -> Any:
    if type(raw) is not bytes or not 0 < len(raw) <= SMALL_FRAME_BYTES:
        return None
    try:
        d = _unpackb(raw, ext_hook=_ext_hook, raw=False, strict_map_key=True)
    except Exception:  # noqa: BLE001 - the general path raises the precise error
        return None
    return d if _versioned(d, majors) else None


def _tensor_map(x: Any) -> bool:
    if type(x) is not dict:
        return False
    for k, t in x.items():
        if type(k) is not str or (type(t) is not _ndarray and type(t) is not EncodedTensor):
            return False
    return True


_REQUEST_KEYS = 9  # the eight InferRequest fields and v
_RESPONSE_KEYS = 5  # the four InferResponse fields and v


def _as_instance(cls: type, d: dict[str, Any], nkeys: int, names: tuple[str, ...]) -> Any:
    obj = cls.__new__(cls)
    # Every field is set and checked by the caller; the frozen __init__'s setattr
    # per field shows in profiles. The frame's own map becomes the instance's
    # __dict__ unless it carries keys of a later minor, which must not become attributes.
    if len(d) != nkeys:
        d = {k: d[k] for k in names}
    object.__setattr__(obj, "__dict__", d)
    return obj


_REQUEST_NAMES = ("request_id", "model", "version", "cut_id", "deadline_unix_ms", "tensors", "priority", "device_id", "v")
_RESPONSE_NAMES = ("request_id", "outputs", "timings_ms", "served_by", "v")


def _request(cls: type, d: dict[str, Any]) -> Any:
    get = d.get
    if "priority" not in d:
        d["priority"] = 0
    if "device_id" not in d:
        d["device_id"] = ""
    if (
        type(get("request_id")) is not str
        or type(get("model")) is not str
        or type(get("version")) is not str
        or type(get("cut_id")) is not str
        or type(get("deadline_unix_ms")) is not int
        or type(d["priority"]) is not int
        or type(d["device_id"]) is not str
        or not _tensor_map(get("tensors"))
    ):
        return None
    return _as_instance(cls, d, _REQUEST_KEYS, _REQUEST_NAMES)


def _response(cls: type, d: dict[str, Any]) -> Any:
    if "served_by" not in d:
        d["served_by"] = ""
    timings = d.get("timings_ms", _ABSENT)
    if timings is _ABSENT:
        d["timings_ms"] = {}
    elif type(timings) is not dict:
        return None
    else:
        for k, t in timings.items():
            if type(k) is not str or type(t) is not float:
                return None
    if type(d.get("request_id")) is not str or type(d["served_by"]) is not str or not _tensor_map(d.get("outputs")):
        return None
    return _as_instance(cls, d, _RESPONSE_KEYS, _RESPONSE_NAMES)


def decode_request(cls: type, raw: Any, majors: tuple[int, ...]) -> Any:
    """An InferRequest from a small frame, or None when the general path must decide."""
    d = _unpack(raw, majors)
    return None if d is None else _request(cls, d)


def decode_response(cls: type, raw: Any, majors: tuple[int, ...]) -> Any:
    """An InferResponse from a small frame, or None when the general path must decide."""
    d = _unpack(raw, majors)
    return None if d is None else _response(cls, d)


def decode_stream_frame(cls: type, raw: Any, majors: tuple[int, ...], request_cls: type, response_cls: type) -> Any:
    """A StreamFrame carrying a request or a response from a small frame, or None when
    the general path must decide (error frames always go there)."""
    d = _unpack(raw, majors)
    if d is None or "error" in d:
        return None
    seq = d.get("seq")
    if seq is not None and type(seq) is not int:
        return None
    if "request" in d:
        if "response" in d:
            return None
        body = d["request"]
        msg = _request(request_cls, body) if _versioned(body, majors) else None
        return None if msg is None else cls(seq=seq, request=msg, v=d["v"])
    body = d.get("response")
    msg = _response(response_cls, body) if _versioned(body, majors) else None
    return None if msg is None else cls(seq=seq, response=msg, v=d["v"])


def small_ext_tensors(tensors: Mapping[str, Any]) -> dict[str, Any] | None:
    """Tensor name -> ExtType for plain C-contiguous little-endian arrays whose bodies
    total at most SMALL_FRAME_BYTES; None when any tensor is not one of those."""
    if type(tensors) is not dict:
        return None
    out = {}
    total = 0
    for k, arr in tensors.items():
        if type(k) is not str or type(arr) is not _ndarray:
            return None
        code = _CODE_OF_DTYPE.get(arr.dtype)
        if code is None or not arr.flags.c_contiguous:
            return None
        nd = arr.ndim
        if nd > _MAX_NDIM:
            return None
        total += arr.nbytes
        if total > SMALL_FRAME_BYTES:  # before any copy: big frames go to the single-copy writer
            return None
        # The same bytes as tensors.ext_default: header without padding, then the body.
        out[k] = _new_tuple(_ExtType, (EXT_TENSOR, b"".join((_HEADS[nd].pack(_LAYOUT, code, nd, 0, *arr.shape), arr))))
    return out


def request_plain(req: Any) -> dict[str, Any] | None:
    """The map of a small InferRequest with its tensors as ExtType, ready for
    pack_small, or None for the general path."""
    exts = small_ext_tensors(req.tensors)
    if exts is None:
        return None
    f = req.__dict__
    return {
        "v": list(f["v"]), "request_id": f["request_id"], "model": f["model"], "version": f["version"],
        "cut_id": f["cut_id"], "deadline_unix_ms": f["deadline_unix_ms"], "tensors": exts,
        "priority": f["priority"], "device_id": f["device_id"],
    }


def encode_request(req: Any) -> bytes | None:
    """The small-frame bytes of an InferRequest, or None for the general path."""
    plain = request_plain(req)
    return None if plain is None else pack_small(plain, "InferRequest")


def encode_response(resp: Any, timings_ms: dict[str, float], t0: float, envelope: Any = None) -> bytes | None:
    """The small-frame bytes of an InferResponse with `timings_ms` in place of its own,
    or None for the general path. Sets timings_ms['encode'] to the ms since `t0`
    (perf_counter) just before the final pack; `envelope(plain)` wraps the map
    (stream frames)."""
    exts = small_ext_tensors(resp.outputs)
    if exts is None:
        return None
    f = resp.__dict__
    plain = {"v": list(f["v"]), "request_id": f["request_id"], "outputs": exts, "timings_ms": timings_ms,
             "served_by": f["served_by"]}
    timings_ms["encode"] = (_perf_counter() - t0) * 1e3
    return pack_small(plain if envelope is None else envelope(plain), "InferResponse")
