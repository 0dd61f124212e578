"""Errors of the cloud tier: the wire errors, under the name the cloud tier's code uses.

Every error the gateway, the registry and the server raise on purpose reaches a
client as a gRPC status, so each one is a class of `cluster.protocol.errors`,
defined once there with its status in `cluster.protocol.status`. This module
re-exports them so `cluster/` imports its errors from `cluster.errors`.
"""

from __future__ import annotations

from cluster.protocol.errors import (
    ClusterError,
    DeadlineExceeded,
    EncodingError,
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    NotSupported,
    PermissionDenied,
    ProtocolError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    UnknownCutError,
    UnknownModelError,
    UnknownVersionError,
    VersionMismatch,
)

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
