"""The errors of the wire protocol: one root, one class per status a peer can see.

`ClusterError` is the one root. Each subclass takes keyword-only fields, keeps
them as attributes and builds a message that states the values and the fix.
`fields()` returns those keyword arguments, so an error raised in the server
is rebuilt with the same class and fields in the client (the table is
`cluster.protocol.status`). They live in the protocol, not in the server,
because both ends raise and catch them: the edge agent imports them from here
without the rest of `cluster/`. `cluster.errors` re-exports them for the
cloud tier's own code.
"""

from __future__ import annotations

import reprlib
from collections.abc import Sequence
from typing import Any, ClassVar

__all__ = [
    "ClusterError",
    "ProtocolError",
    "InvalidArgument",
    "EncodingError",
    "VersionMismatch",
    "UnknownModelError",
    "UnknownVersionError",
    "UnknownCutError",
    "DeadlineExceeded",
    "Unauthenticated",
    "PermissionDenied",
    "ResourceExhausted",
    "Unavailable",
    "NotSupported",
    "FailedPrecondition",
    "InternalError",
]


_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother = 80, 80


def _r(value: Any) -> str:
    """repr() cut to a readable length: names in errors may come from a peer."""
    return _REPR.repr(value)


def _names(values: Sequence[Any], limit: int = 8) -> str:
    """Lists known names for a message, cut short so a huge registry stays readable."""
    shown = ", ".join(_r(v) for v in list(values)[:limit])
    more = len(values) - limit
    if not values:
        return "none"
    return shown + (f" and {more} more" if more > 0 else "")


class ClusterError(Exception):
    """Root of every error the cloud tier raises on purpose.

    Subclasses pass their finished message up; their own fields are keyword-only.
    """

    #: A client may retry the same request later (after backing off).
    retryable: ClassVar[bool] = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def fields(self) -> dict[str, Any]:
        """The keyword fields that rebuild this error: `type(e)(**e.fields())`."""
        return {k: v for k, v in vars(self).items() if k != "message" and not k.startswith("_")}


class ProtocolError(ClusterError):
    """A frame or message that does not follow the wire protocol."""

    def __init__(self, *, reason: str, where: str = "") -> None:
        self.reason = reason
        self.where = where
        at = f"{where}: " if where else ""
        super().__init__(f"malformed message: {at}{reason}")


class InvalidArgument(ClusterError):
    """A well-formed message with a value the server cannot use (a Plan query's link, device, SLO)."""

    def __init__(self, *, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"invalid {field}: {reason}")


class EncodingError(ClusterError):
    """A tensor that cannot be encoded with the asked precision or compression."""

    def __init__(self, *, reason: str, fix: str) -> None:
        self.reason = reason
        self.fix = fix
        super().__init__(f"cannot encode tensor: {reason}; {fix}")


class VersionMismatch(ClusterError):
    """The peer speaks a protocol major version this side does not."""

    def __init__(self, *, got: Sequence[int], supported: Sequence[int]) -> None:
        self.got = list(got)
        self.supported = list(supported)
        got_s = ".".join(str(x) for x in self.got)
        sup_s = ", ".join(f"{m}.x" for m in self.supported)
        super().__init__(
            f"protocol version {got_s} is not supported; this server speaks {sup_s}. "
            f"Upgrade the older side or pin a client that speaks {sup_s}"
        )


class UnknownModelError(ClusterError):
    """The request names a model the server does not serve."""

    def __init__(self, *, model: str, known: Sequence[str] = ()) -> None:
        self.model = model
        self.known = list(known)
        super().__init__(
            f"unknown model {_r(model)}; this server serves {_names(self.known)}. "
            "Fix the model name or register the model first"
        )


class UnknownVersionError(ClusterError):
    """The model exists but not at the asked version."""

    def __init__(self, *, model: str, version: str, known: Sequence[str] = ()) -> None:
        self.model = model
        self.version = version
        self.known = list(known)
        super().__init__(
            f"model {_r(model)} has no version {_r(version)}; known versions: {_names(self.known)}. "
            "Ask for a known version or register this one"
        )


class UnknownCutError(ClusterError):
    """The model version has no tail segment for the asked cut."""

    def __init__(self, *, model: str, version: str, cut_id: str, known: Sequence[str] = ()) -> None:
        self.model = model
        self.version = version
        self.cut_id = cut_id
        self.known = list(known)
        super().__init__(
            f"model {_r(model)}@{_r(version)} has no cut {_r(cut_id)}; served cuts: {_names(self.known)}. "
            "Fetch the current frontier with GetArtifacts and re-plan"
        )


class DeadlineExceeded(ClusterError):
    """The request's deadline passed before an answer was ready."""

    def __init__(self, *, where: str, overdue_ms: float = 0.0) -> None:
        self.where = where
        self.overdue_ms = float(overdue_ms)
        super().__init__(
            f"deadline exceeded {where} ({self.overdue_ms:.1f} ms late); "
            "give the request more time or run it locally"
        )


class Unauthenticated(ClusterError):
    """No credentials, or credentials that do not check out."""

    def __init__(self, *, reason: str) -> None:
        self.reason = reason
        super().__init__(
            f"unauthenticated: {reason}; send 'authorization: Bearer <token>' metadata "
            "with a valid token"
        )


class PermissionDenied(ClusterError):
    """Valid credentials that may not do this."""

    def __init__(self, *, principal: str, action: str) -> None:
        self.principal = principal
        self.action = action
        super().__init__(
            f"{_r(principal)} may not {action}; ask an operator to grant it"
        )


class ResourceExhausted(ClusterError):
    """A queue, quota or size limit is full; retry later or send less."""

    retryable = True

    def __init__(self, *, resource: str, limit: float | int | None = None, retry_after_ms: float | None = None) -> None:
        self.resource = resource
        self.limit = limit
        self.retry_after_ms = retry_after_ms
        lim = f" (limit {limit})" if limit is not None else ""
        after = f" after {retry_after_ms:.0f} ms" if retry_after_ms is not None else " later"
        super().__init__(f"{resource} exhausted{lim}; retry{after} or send less")


class Unavailable(ClusterError):
    """The server or its workers cannot take requests right now."""

    retryable = True

    def __init__(self, *, reason: str) -> None:
        self.reason = reason
        super().__init__(f"unavailable: {reason}; retry with backoff or run locally")


class NotSupported(ClusterError):
    """The server does not implement this method or option."""

    def __init__(self, *, what: str) -> None:
        self.what = what
        super().__init__(f"{what} is not supported by this server; use a server that offers it")


class FailedPrecondition(ClusterError):
    """The request is fine but the server lacks what it needs to answer it (a missing registry file)."""

    def __init__(self, *, reason: str, fix: str) -> None:
        self.reason = reason
        self.fix = fix
        super().__init__(f"{reason}; {fix}")


class InternalError(ClusterError):
    """An unexpected failure in the server; its details are only in the server log."""

    def __init__(self, *, detail: str = "internal error") -> None:
        self.detail = detail
        super().__init__(f"{detail}; see the server log")
