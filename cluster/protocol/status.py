"""The one table between cluster errors and gRPC status codes, both ways.

The server turns a raised error into (code, message, trailing metadata) with
`to_status`; the client turns a status back into the same class with
`from_status`. Several classes share a code (three kinds of NOT_FOUND), so the
class name and its keyword fields travel in trailing metadata; a status without
them (one made by gRPC itself, e.g. an oversized message or a lost connection)
becomes the default class of its code.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import grpc
import msgpack

from cluster.protocol import errors as E

__all__ = [
    "STATUS_OF",
    "CLASS_OF_STATUS",
    "ERROR_KEY",
    "FIELDS_KEY",
    "status_of",
    "to_status",
    "from_status",
    "rebuild_error",
    "trailing_metadata",
    "code_number",
    "code_of_number",
]

logger = logging.getLogger(__name__)

#: Error class -> gRPC status code. Subclasses inherit their parent's code.
STATUS_OF: dict[type[E.ClusterError], grpc.StatusCode] = {
    E.ProtocolError: grpc.StatusCode.INVALID_ARGUMENT,
    E.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    E.EncodingError: grpc.StatusCode.INVALID_ARGUMENT,
    E.VersionMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    E.UnknownModelError: grpc.StatusCode.NOT_FOUND,
    E.UnknownVersionError: grpc.StatusCode.NOT_FOUND,
    E.UnknownCutError: grpc.StatusCode.NOT_FOUND,
    E.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    E.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    E.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    E.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    E.Unavailable: grpc.StatusCode.UNAVAILABLE,
    E.NotSupported: grpc.StatusCode.UNIMPLEMENTED,
    E.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    E.InternalError: grpc.StatusCode.INTERNAL,
}

#: Status code -> the class a client raises when the server named none.
CLASS_OF_STATUS: dict[grpc.StatusCode, type[E.ClusterError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: E.ProtocolError,
    grpc.StatusCode.FAILED_PRECONDITION: E.VersionMismatch,
    grpc.StatusCode.NOT_FOUND: E.UnknownModelError,
    grpc.StatusCode.DEADLINE_EXCEEDED: E.DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: E.Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: E.PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: E.ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: E.Unavailable,
    grpc.StatusCode.UNIMPLEMENTED: E.NotSupported,
    grpc.StatusCode.INTERNAL: E.InternalError,
    grpc.StatusCode.CANCELLED: E.Unavailable,
    grpc.StatusCode.UNKNOWN: E.InternalError,
    grpc.StatusCode.ABORTED: E.Unavailable,
    grpc.StatusCode.DATA_LOSS: E.InternalError,
    grpc.StatusCode.OUT_OF_RANGE: E.ProtocolError,
    grpc.StatusCode.ALREADY_EXISTS: E.ProtocolError,
}

#: gRPC refuses trailers larger than its header limit (8 KiB by default); stay well below it.
MAX_DETAILS_CHARS = 2000
MAX_FIELDS_BYTES = 2048
ERROR_KEY = "splitinfer-error"
FIELDS_KEY = "splitinfer-error-fields-bin"
_CODE_OF_NUMBER = {c.value[0]: c for c in grpc.StatusCode}
_CLASSES = {c.__name__: c for c in STATUS_OF}
_GENERIC_INTERNAL = "internal error"


def status_of(exc: BaseException) -> grpc.StatusCode:
    """The status code of an error: its class's entry, else its nearest parent's, else INTERNAL."""
    for cls in type(exc).__mro__:
        code = STATUS_OF.get(cls)  # type: ignore[call-overload]
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL


def _plain(fields: dict[str, Any]) -> dict[str, Any]:
    """Keeps the fields msgpack can carry; an error's fields are small values by design."""
    out = {}
    for k, v in fields.items():
        try:
            msgpack.packb(v)
        except (TypeError, ValueError, OverflowError):
            v = repr(v)
        out[k] = v
    return out


def to_status(exc: BaseException, *, where: str = "") -> tuple[grpc.StatusCode, str, str, dict[str, Any]]:
    """(code, message, error class name, fields) for a raised error.

    A ClusterError keeps its message and fields. Anything else is a bug on this
    side: it is logged with its traceback and the peer only learns 'internal error'.
    """
    if isinstance(exc, E.ClusterError):
        cls = type(exc)
        while cls.__name__ not in _CLASSES and cls is not E.ClusterError:
            cls = cls.__base__  # type: ignore[assignment]
        name = cls.__name__ if cls.__name__ in _CLASSES else ""
        fields = _plain(exc.fields()) if cls is type(exc) else {}
        message = exc.message
        if len(message) > MAX_DETAILS_CHARS:
            message = message[: MAX_DETAILS_CHARS - 3] + "..."
        return status_of(exc), message, name, fields
    logger.error("unexpected error in %s", where or "handler", exc_info=exc)
    return grpc.StatusCode.INTERNAL, _GENERIC_INTERNAL, "InternalError", {}


def trailing_metadata(name: str, fields: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    if not name:
        return ()
    packed = msgpack.packb(fields)
    if len(packed) > MAX_FIELDS_BYTES:
        # Too big for a trailer: the client rebuilds the class from the message alone.
        return ((ERROR_KEY, name),)
    return ((ERROR_KEY, name), (FIELDS_KEY, packed))


def rebuild_error(code: grpc.StatusCode, message: str, name: str = "", fields: dict[str, Any] | None = None) -> E.ClusterError:
    """The client's side of the table: the same class and fields when named, else the code's default."""
    cls = _CLASSES.get(name)
    if cls is not None and STATUS_OF[cls] == code and fields is not None:
        try:
            return cls(**fields)
        except TypeError:
            logger.debug("server sent fields %s that do not rebuild %s", sorted(fields), name)
    cls = CLASS_OF_STATUS.get(code, E.InternalError)
    # The peer's message is all we know; build the class around it without its fields.
    err = cls.__new__(cls)
    E.ClusterError.__init__(err, message or code.name)
    err.status_code = code  # type: ignore[attr-defined]
    return err


def from_status(code: grpc.StatusCode, details: str | None, metadata: Iterable[tuple[str, Any]] | None) -> E.ClusterError:
    """Rebuilds the error a server sent as a status and trailing metadata."""
    name = ""
    fields: dict[str, Any] | None = None
    for key, value in metadata or ():
        if key == ERROR_KEY:
            name = value if isinstance(value, str) else value.decode("utf-8", "replace")
        elif key == FIELDS_KEY:
            try:
                loaded = msgpack.unpackb(value, raw=False)
                fields = loaded if isinstance(loaded, dict) else None
            except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, TypeError):
                fields = None
    return rebuild_error(code, details or "", name, fields)


def code_number(code: grpc.StatusCode) -> int:
    return code.value[0]


def code_of_number(n: int) -> grpc.StatusCode:
    return _CODE_OF_NUMBER.get(n, grpc.StatusCode.UNKNOWN)
