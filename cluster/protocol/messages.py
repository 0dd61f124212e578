"""The messages of `splitinfer.v1.Inference`, as frozen dataclasses.

Every message is one msgpack map whose keys are the field names; the schemas
are in docs/protocol.md. Every map carries `v = [major, minor]`. A reader
accepts any minor of a major it speaks and ignores keys it does not know; an
unknown major raises `VersionMismatch` before anything else is read.
Fields added in a later minor must have defaults, so older frames still decode.
"""

from __future__ import annotations

import reprlib
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack
import numpy as np

from cluster.protocol.errors import ProtocolError, VersionMismatch
from cluster.protocol import _small
from cluster.protocol._msgpack import SMALL_FRAME_BYTES, Writer, pack_small, unpackb
from cluster.protocol.tensors import EncodedTensor, read_ext, tensor_nbytes, write_tensor

__all__ = [
    "SERVICE_NAME",
    "PROTOCOL_VERSION",
    "SUPPORTED_MAJORS",
    "Tensor",
    "InferRequest",
    "InferResponse",
    "ErrorInfo",
    "StreamFrame",
    "PlanRequest",
    "PlanResponse",
    "ArtifactsRequest",
    "ArtifactsChunk",
    "ArtifactsResponse",
    "check_version",
    "encode_response_frame",
]

#: The gRPC service every method belongs to.
SERVICE_NAME = "splitinfer.v1.Inference"
#: The version this side writes.
PROTOCOL_VERSION: tuple[int, int] = (1, 0)
#: The majors this side reads.
SUPPORTED_MAJORS: tuple[int, ...] = (1,)

Tensor = np.ndarray | EncodedTensor
_MISSING = object()
# Bad values are shown in errors, but they come from the peer: bound their depth and length.
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60


def _show(x: Any) -> str:
    return _REPR.repr(x)
_KEYS: dict[str, bytes] = {}


def _key(name: str) -> bytes:
    k = _KEYS.get(name)
    if k is None:
        k = _KEYS[name] = msgpack.packb(name)
    return k


def check_version(d: Mapping[Any, Any], where: str) -> tuple[int, int]:
    """Reads `v` and raises VersionMismatch for a major this side does not speak."""
    v = d.get("v", _MISSING)
    if type(v) is list and len(v) == 2:
        major, minor = v
        # The common case in exact types first; anything else takes the checks below.
        if type(major) is int and type(minor) is int and minor >= 0 and major in SUPPORTED_MAJORS:
            return (major, minor)
    if v is _MISSING:
        raise ProtocolError(reason="missing required field 'v' (protocol version [major, minor])", where=where)
    if (
        not isinstance(v, list)
        or len(v) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
    ):
        raise ProtocolError(reason=f"field 'v' must be [major, minor] with two non-negative ints, got {_show(v)}", where=where)
    if v[0] not in SUPPORTED_MAJORS:
        raise VersionMismatch(got=v, supported=SUPPORTED_MAJORS)
    return (v[0], v[1])


# --- field kinds: a checker for decoded values and a writer ------------------------------


def _type_err(where: str, name: str, want: str, got: Any) -> ProtocolError:
    shown = _show(got)
    return ProtocolError(reason=f"field {name!r} must be {want}, got {type(got).__name__} {shown}", where=where)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_str(x: Any, where: str, name: str) -> str:
    if type(x) is not str:
        raise _type_err(where, name, "a str", x)
    return x


def _check_int(x: Any, where: str, name: str) -> int:
    if type(x) is not int and not _is_int(x):
        raise _type_err(where, name, "an int", x)
    return x


def _check_opt_int(x: Any, where: str, name: str) -> int | None:
    return None if x is None else _check_int(x, where, name)


def _check_bytes(x: Any, where: str, name: str) -> bytes:
    if not isinstance(x, bytes):
        raise _type_err(where, name, "bin (bytes)", x)
    return x


def _check_str_map(x: Any, where: str, name: str) -> dict[str, Any]:
    if not isinstance(x, dict):
        raise _type_err(where, name, "a map with str keys", x)
    for k in x:
        if type(k) is not str and not isinstance(k, str):
            raise _type_err(where, name, "a map with str keys", x)
    return x


def _check_tensors(x: Any, where: str, name: str) -> dict[str, Tensor]:
    d = _check_str_map(x, where, name)
    for k, t in d.items():
        if type(t) is not np.ndarray and not isinstance(t, (np.ndarray, EncodedTensor)):
            raise ProtocolError(
                reason=f"{name}[{_show(k)}] must be a tensor ext value (code 1 or 2), got {type(t).__name__}",
                where=where,
            )
    return d


def _check_timings(x: Any, where: str, name: str) -> dict[str, float]:
    d = _check_str_map(x, where, name)
    out = {}
    for k, t in d.items():
        if type(t) is float:
            out[k] = t
            continue
        if not isinstance(t, (int, float)) or isinstance(t, bool):
            raise ProtocolError(reason=f"{name}[{_show(k)}] must be a number of ms, got {_show(t)}", where=where)
        out[k] = float(t)
    return out


def _check_bytes_map(x: Any, where: str, name: str) -> dict[str, bytes]:
    d = _check_str_map(x, where, name)
    for k, b in d.items():
        if not isinstance(b, bytes):
            raise ProtocolError(reason=f"{name}[{_show(k)}] must be bin (bytes), got {type(b).__name__}", where=where)
    return d


def _write_plain(w: Writer, x: Any, where: str) -> None:
    w.value(x, where)


def _check_tensor_names(x: Mapping[str, Tensor], where: str) -> None:
    """Sender-side check, so a bad tensor map fails here rather than at the peer."""
    for k, t in x.items():
        if type(k) is str and type(t) is np.ndarray:
            continue
        if type(k) is not str:
            raise ProtocolError(reason=f"tensor names must be str, got {_show(k)}", where=where)
        if not isinstance(t, (np.ndarray, EncodedTensor)):
            raise ProtocolError(
                reason=f"tensor {_show(k)} must be a numpy array or EncodedTensor, got {type(t).__name__}",
                where=where,
            )


def _write_tensors(w: Writer, x: Mapping[str, Tensor], where: str) -> None:
    _check_tensor_names(x, where)
    w.map_header(len(x))
    for k, t in x.items():
        w.value(k, where)
        write_tensor(w, t, f"{where}[{_show(k)}]")


def _timings_plain(x: Mapping[str, float], where: str) -> dict[str, float]:
    if not x:
        return {}
    try:
        return {k: float(v) for k, v in x.items()}
    except (TypeError, ValueError, AttributeError) as e:
        raise ProtocolError(reason=f"timings must map str to ms numbers: {e}", where=where) from e


def _write_timings(w: Writer, x: Mapping[str, float], where: str) -> None:
    w.value(_timings_plain(x, where), where)


_KINDS = {
    "str": (_check_str, _write_plain),
    "int": (_check_int, _write_plain),
    "opt_int": (_check_opt_int, _write_plain),
    "bytes": (_check_bytes, _write_plain),
    "json": (_check_str_map, _write_plain),
    "tensors": (_check_tensors, _write_tensors),
    "timings": (_check_timings, _write_timings),
    "bytes_map": (_check_bytes_map, _write_plain),
}


class _NoExactType:
    """Never a decoded value's type: fields of other kinds always go through their check."""


class _Message:
    """Shared msgpack mapping of the field-spec messages below.

    `_SPEC` lists (field name, kind, default); `_MISSING` as default means required.
    """

    _SPEC: ClassVar[tuple[tuple[str, str, Any], ...]] = ()
    v: tuple[int, int]

    def tensor_bytes(self) -> int:
        """Total body bytes of the message's tensors."""
        total = 0
        for fname in self._tensor_fields():
            for t in getattr(self, fname).values():
                total += t.nbytes if type(t) is np.ndarray else tensor_nbytes(t)
        return total

    @classmethod
    def _tensor_fields(cls) -> tuple[str, ...]:
        names = cls.__dict__.get("_TENSOR_FIELDS")
        if names is None:
            names = tuple(f for f, kind, _ in cls._SPEC if kind == "tensors")
            cls._TENSOR_FIELDS = names  # type: ignore[attr-defined]
        return names

    def to_plain(self, *, defer: str | None = None) -> dict[str, Any]:
        """The message as a dict for msgpack.packb(default=ext_default); tensors stay objects."""
        fields = self.__dict__
        plain: dict[str, Any] = {"v": list(self.v)}
        for fname, kind, _ in self._SPEC:
            if fname == defer:
                continue
            value = fields[fname]
            if kind == "timings":
                value = _timings_plain(value, f"{type(self).__name__}.{fname}")
            elif kind == "tensors":
                _check_tensor_names(value, f"{type(self).__name__}.{fname}")
            plain[fname] = value
        return plain

    def write(self, w: Writer, *, defer: str | None = None) -> None:
        """Appends the message's map to `w`. With `defer`, that field is left out and
        the caller must append it with `write_field` (the map header counts it)."""
        name = type(self).__name__
        plain = self.to_plain(defer=defer)
        tensor_fields = [f for f, kind, _ in self._SPEC if kind == "tensors" and f != defer]
        for f in tensor_fields:
            del plain[f]
        # Plain fields go through the C packer in one call; tensors follow as ext values.
        w.map_with(plain, len(self._SPEC) + 1, name)
        for fname in tensor_fields:
            w.raw(_key(fname))
            _write_tensors(w, getattr(self, fname), f"{name}.{fname}")

    @classmethod
    def write_field(cls, w: Writer, fname: str, value: Any) -> None:
        """Appends one field (key and value) of this message type to `w`."""
        for name, kind, _ in cls._SPEC:
            if name == fname:
                w.raw(_key(fname))
                _KINDS[kind][1](w, value, f"{cls.__name__}.{fname}")
                return
        raise ProtocolError(reason=f"{cls.__name__} has no field {fname!r}", where=cls.__name__)

    def to_msgpack(self) -> bytes:
        """Encodes the message. Big tensor bodies are copied once, into the frame;
        small frames are packed by the C packer in one call (see _msgpack)."""
        if self.tensor_bytes() <= SMALL_FRAME_BYTES:
            return pack_small(self.to_plain(), type(self).__name__)
        w = Writer()
        self.write(w)
        return w.getvalue()

    @classmethod
    def from_dict(cls, d: Any) -> Any:
        name = cls.__name__
        if type(d) is not dict:
            raise ProtocolError(reason=f"expected a msgpack map, got {type(d).__name__}", where=name)
        kwargs: dict[str, Any] = {"v": check_version(d, name)}
        for fname, check, default, exact in cls._checks():
            x = d.get(fname, _MISSING)
            if type(x) is exact:  # str, int and bytes fields of the exact type need no check
                kwargs[fname] = x
            elif x is _MISSING:
                if default is _MISSING:
                    raise ProtocolError(
                        reason=f"missing required field {fname!r}; every {PROTOCOL_VERSION[0]}.x sender sets it",
                        where=name,
                    )
                kwargs[fname] = default() if callable(default) else default
            else:
                kwargs[fname] = check(x, name, fname)
        # Every field is set and checked above; filling __dict__ skips the frozen
        # dataclass __init__, whose per-field object.__setattr__ shows in profiles.
        obj = cls.__new__(cls)
        obj.__dict__.update(kwargs)
        return obj

    @classmethod
    def _checks(cls) -> tuple[tuple[str, Any, Any, type], ...]:
        checks = cls.__dict__.get("_CHECKS")
        if checks is None:
            exact = {"str": str, "int": int, "bytes": bytes}
            checks = tuple((f, _KINDS[kind][0], default, exact.get(kind, _NoExactType))
                           for f, kind, default in cls._SPEC)
            cls._CHECKS = checks  # type: ignore[attr-defined]
        return checks

    @classmethod
    def from_msgpack(cls, data: bytes) -> Any:
        """Decodes a frame; tensors are read-only views of `data`. Raises ProtocolError."""
        return cls.from_dict(unpackb(data, read_ext))


@dataclass(frozen=True, eq=False, init=False)
class InferRequest(_Message):
    """Boundary tensors of one sample (or batch) for the tail of `model@version` at `cut_id`."""

    request_id: str
    """Unique per client; echoed in the response."""
    model: str
    """Model name in the registry."""
    version: str
    """Model version in the registry."""
    cut_id: str
    """Which tail segment consumes these tensors."""
    deadline_unix_ms: int
    """Absolute deadline, ms since the Unix epoch; the server answers DEADLINE_EXCEEDED after it."""
    tensors: Mapping[str, Tensor]
    """Boundary tensor name -> ndarray or EncodedTensor."""
    priority: int = 0
    """Higher runs first when queues are full."""
    device_id: str = ""
    """The sending device, for quotas and metrics."""
    v: tuple[int, int] = PROTOCOL_VERSION
    """Protocol version [major, minor] of the sender."""

    _SPEC: ClassVar = (
        ("request_id", "str", _MISSING),
        ("model", "str", _MISSING),
        ("version", "str", _MISSING),
        ("cut_id", "str", _MISSING),
        ("deadline_unix_ms", "int", _MISSING),
        ("tensors", "tensors", _MISSING),
        ("priority", "int", 0),
        ("device_id", "str", ""),
    )

    def __init__(self, request_id: str, model: str, version: str, cut_id: str, deadline_unix_ms: int,
                 tensors: Mapping[str, Tensor], priority: int = 0, device_id: str = "",
                 v: tuple[int, int] = PROTOCOL_VERSION) -> None:
        # Written out: the frozen dataclass __init__ pays a setattr per field, per request.
        self.__dict__.update(request_id=request_id, model=model, version=version, cut_id=cut_id,
                             deadline_unix_ms=deadline_unix_ms, tensors=tensors, priority=priority,
                             device_id=device_id, v=v)

    # Small frames take _small's fast path first (see [Note: small-frame fast path]).
    def to_msgpack(self) -> bytes:
        return _small.encode_request(self) or super().to_msgpack()

    @classmethod
    def from_msgpack(cls, data: bytes) -> InferRequest:
        return _small.decode_request(cls, data, SUPPORTED_MAJORS) or super().from_msgpack(data)


@dataclass(frozen=True, eq=False, init=False)
class InferResponse(_Message):
    """The tail's outputs for one InferRequest."""

    request_id: str
    """The request's id."""
    outputs: Mapping[str, Tensor]
    """Output name -> ndarray or EncodedTensor."""
    timings_ms: Mapping[str, float] = field(default_factory=dict)
    """Stages the server measured: 'decode', 'queue', 'compute', 'encode' (ms)."""
    served_by: str = ""
    """'model@version' that answered."""
    v: tuple[int, int] = PROTOCOL_VERSION
    """Protocol version [major, minor] of the sender."""

    _SPEC: ClassVar = (
        ("request_id", "str", _MISSING),
        ("outputs", "tensors", _MISSING),
        ("timings_ms", "timings", dict),
        ("served_by", "str", ""),
    )

    def __init__(self, request_id: str, outputs: Mapping[str, Tensor], timings_ms: Mapping[str, float] | None = None,
                 served_by: str = "", v: tuple[int, int] = PROTOCOL_VERSION) -> None:
        # Written out, as InferRequest's; no timings_ms means a new empty dict.
        self.__dict__.update(request_id=request_id, outputs=outputs,
                             timings_ms={} if timings_ms is None else timings_ms, served_by=served_by, v=v)

    @classmethod
    def from_msgpack(cls, data: bytes) -> InferResponse:
        return _small.decode_response(cls, data, SUPPORTED_MAJORS) or super().from_msgpack(data)


@dataclass(frozen=True)
class ErrorInfo(_Message):
    """A failed stream frame: the gRPC status the request would have had on its own."""

    code: int
    """gRPC status code number (e.g. 5 NOT_FOUND)."""
    error: str
    """Error class name from cluster.protocol.errors, or '' when none applies."""
    message: str
    """Human-readable message."""
    fields: Mapping[str, Any] = field(default_factory=dict)
    """The error's keyword fields, to rebuild it on the client."""
    v: tuple[int, int] = PROTOCOL_VERSION
    """Protocol version [major, minor] of the sender."""

    _SPEC: ClassVar = (
        ("code", "int", _MISSING),
        ("error", "str", _MISSING),
        ("message", "str", _MISSING),
        ("fields", "json", dict),
    )


@dataclass(frozen=True, eq=False)
class StreamFrame:
    """One frame of InferStream. Client frames carry `request`; server frames carry
    `response` or `error`, one per client frame, in the same order."""

    seq: int | None
    """The client's sequence number, echoed; None when the client frame was unreadable."""
    request: InferRequest | None = None
    response: InferResponse | None = None
    error: ErrorInfo | None = None
    v: tuple[int, int] = PROTOCOL_VERSION
    """Protocol version [major, minor] of the sender."""

    def __post_init__(self) -> None:
        n = sum(x is not None for x in (self.request, self.response, self.error))
        if n != 1:
            raise ProtocolError(
                reason=f"a StreamFrame carries exactly one of request/response/error, this one has {n}",
                where="StreamFrame",
            )

    @staticmethod
    def write_header(w: Writer, seq: int | None, kind: str) -> None:
        """Appends a frame's map up to the key of its body; the caller appends the body."""
        w.map_header(3)
        w.raw(_key("v"))
        w.value(list(PROTOCOL_VERSION), "StreamFrame")
        w.raw(_key("seq"))
        w.value(seq, "StreamFrame.seq")
        w.raw(_key(kind))

    def write(self, w: Writer) -> None:
        for name in ("request", "response", "error"):
            body = getattr(self, name)
            if body is not None:
                self.write_header(w, self.seq, name)
                body.write(w)

    def to_msgpack(self) -> bytes:
        if self.request is not None:  # [Note: small-frame fast path] in _small
            plain = _small.request_plain(self.request)
            if plain is not None:
                return pack_small({"v": list(self.v), "seq": self.seq, "request": plain}, "StreamFrame")
        body = self.request or self.response or self.error
        assert body is not None
        kind = "request" if self.request else "response" if self.response else "error"
        if body.tensor_bytes() <= SMALL_FRAME_BYTES:
            return pack_small({"v": list(self.v), "seq": self.seq, kind: body.to_plain()}, "StreamFrame")
        w = Writer()
        self.write(w)
        return w.getvalue()

    @classmethod
    def from_dict(cls, d: Any) -> StreamFrame:
        if not isinstance(d, dict):
            raise ProtocolError(reason=f"expected a msgpack map, got {type(d).__name__}", where="StreamFrame")
        v = check_version(d, "StreamFrame")
        seq = _check_opt_int(d.get("seq"), "StreamFrame", "seq")
        parts = {}
        for name, typ in (("request", InferRequest), ("response", InferResponse), ("error", ErrorInfo)):
            if name in d:
                parts[name] = typ.from_dict(d[name])
        if len(parts) != 1:
            raise ProtocolError(
                reason=f"a StreamFrame carries exactly one of request/response/error, this one has {len(parts)}",
                where="StreamFrame",
            )
        return cls(seq=seq, v=v, **parts)

    @classmethod
    def from_msgpack(cls, data: bytes) -> StreamFrame:
        fast = _small.decode_stream_frame(cls, data, SUPPORTED_MAJORS, InferRequest, InferResponse)
        return fast or cls.from_dict(unpackb(data, read_ext))


def encode_response_frame(resp: InferResponse, decode_ms: float, *, seq: int | None = None,
                          stream: bool = False) -> bytes:
    """The bytes a server sends for `resp`: an InferResponse, or with `stream` the
    StreamFrame answering `seq`. Its timings are `resp.timings_ms` plus 'decode'
    (`decode_ms`) and 'encode' (the time spent here)."""
    t0 = time.perf_counter()
    timings = dict(resp.timings_ms)
    timings["decode"] = decode_ms
    envelope = (lambda p: {"v": list(PROTOCOL_VERSION), "seq": seq, "response": p}) if stream else None
    # [Note: small-frame fast path] in _small; None means the general path.
    fast = _small.encode_response(resp, timings, t0, envelope)
    if fast is not None:
        return fast
    # [Note: encode time] covers framing and packing up to the last step, which
    # packs (small frames) or joins the parts with one copy (big frames): that
    # step makes the bytes that carry the number, so it cannot be in it.
    if resp.tensor_bytes() <= SMALL_FRAME_BYTES:
        plain = resp.to_plain(defer="timings_ms")
        timings["encode"] = (time.perf_counter() - t0) * 1e3
        plain["timings_ms"] = timings
        return pack_small(plain if envelope is None else envelope(plain), "InferResponse")
    w = Writer()
    if stream:
        StreamFrame.write_header(w, seq, "response")
    resp.write(w, defer="timings_ms")
    timings["encode"] = (time.perf_counter() - t0) * 1e3
    InferResponse.write_field(w, "timings_ms", timings)
    return w.getvalue()


@dataclass(frozen=True)
class PlanRequest(_Message):
    """A what-if question for the planner; `query` is JSON-able until the planner's types settle."""

    request_id: str
    query: Mapping[str, Any]
    """JSON-able planner query (model, device, link, objective, constraints)."""
    v: tuple[int, int] = PROTOCOL_VERSION

    _SPEC: ClassVar = (("request_id", "str", _MISSING), ("query", "json", _MISSING))


@dataclass(frozen=True)
class PlanResponse(_Message):
    request_id: str
    plan: Mapping[str, Any]
    """JSON-able plan (cuts, encoding, predicted breakdown)."""
    v: tuple[int, int] = PROTOCOL_VERSION

    _SPEC: ClassVar = (("request_id", "str", _MISSING), ("plan", "json", _MISSING))


@dataclass(frozen=True)
class ArtifactsRequest(_Message):
    """Asks for what a device needs to run `model@version`: segments, profiles, frontier."""

    model: str
    version: str
    device_id: str = ""
    v: tuple[int, int] = PROTOCOL_VERSION

    _SPEC: ClassVar = (("model", "str", _MISSING), ("version", "str", _MISSING), ("device_id", "str", ""))


@dataclass(frozen=True)
class ArtifactsChunk(_Message):
    """One piece of one file of GetArtifacts' server stream."""

    model: str
    version: str
    name: str
    """File name, relative ('segments/head_3.onnx')."""
    offset: int
    """Byte offset of `data` in the file."""
    total_bytes: int
    """Size of the whole file."""
    data: bytes
    v: tuple[int, int] = PROTOCOL_VERSION

    _SPEC: ClassVar = (
        ("model", "str", _MISSING),
        ("version", "str", _MISSING),
        ("name", "str", _MISSING),
        ("offset", "int", _MISSING),
        ("total_bytes", "int", _MISSING),
        ("data", "bytes", _MISSING),
    )


@dataclass(frozen=True)
class ArtifactsResponse(_Message):
    """All files of one model version; sent as ArtifactsChunk frames."""

    model: str
    version: str
    files: Mapping[str, bytes]
    """Relative file name -> content."""
    v: tuple[int, int] = PROTOCOL_VERSION

    _SPEC: ClassVar = (("model", "str", _MISSING), ("version", "str", _MISSING), ("files", "bytes_map", _MISSING))

    def to_chunks(self, chunk_bytes: int = 1 << 20) -> Iterator[ArtifactsChunk]:
        """Splits the files into chunks of at most `chunk_bytes`; an empty file is one empty chunk."""
        if chunk_bytes < 1:
            raise ProtocolError(reason=f"chunk_bytes={chunk_bytes} must be >= 1", where="ArtifactsResponse")
        for name, data in self.files.items():
            total = len(data)
            offset = 0
            while True:
                piece = bytes(data[offset : offset + chunk_bytes])
                yield ArtifactsChunk(
                    model=self.model, version=self.version, name=name, offset=offset, total_bytes=total, data=piece
                )
                offset += len(piece)
                if offset >= total:
                    break

    @classmethod
    def from_chunks(cls, chunks: Iterable[ArtifactsChunk], *, model: str = "", version: str = "") -> ArtifactsResponse:
        """Reassembles chunks; every file must arrive whole and in order."""
        parts: dict[str, list[bytes]] = {}
        sizes: dict[str, tuple[int, int]] = {}  # name -> (received, total)
        for c in chunks:
            model, version = c.model, c.version
            got, total = sizes.get(c.name, (0, c.total_bytes))
            if c.offset != got or c.total_bytes != total or got + len(c.data) > total:
                raise ProtocolError(
                    reason=f"chunk of {c.name!r} at offset {c.offset} ({len(c.data)} bytes, total {c.total_bytes}) "
                    f"does not follow the {got} bytes received of {total}",
                    where="ArtifactsChunk",
                )
            parts.setdefault(c.name, []).append(c.data)
            sizes[c.name] = (got + len(c.data), total)
        for name, (got, total) in sizes.items():
            if got != total:
                raise ProtocolError(
                    reason=f"file {name!r} ended after {got} of {total} bytes", where="ArtifactsChunk"
                )
        return cls(model=model, version=version, files={n: b"".join(p) for n, p in parts.items()})
