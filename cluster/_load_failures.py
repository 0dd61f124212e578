"""The bookkeeping of models and tails that fail to load ([Note: failed tails] in
cluster/gateway.py): the metric's reason for an error, which errors may pass, the error a
request for a failed tail gets, and the gRPC health of each model."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cluster.errors import DeadlineExceeded, FailedPrecondition, ResourceExhausted, Unavailable

__all__ = ["NoTailLoaded", "failed_tail", "is_transient", "load_failure_reason", "one_line", "service_health"]


def load_failure_reason(e: BaseException, *, cutting: bool = False) -> str:
    """The LOAD_FAILURE_REASONS entry (cluster.metrics) of an error that kept a version or a
    tail from loading; ``cutting``: it was raised while the tail was cut from the model."""
    from workers import errors as W

    if isinstance(e, W.EngineLoadError):
        return e.stage if e.stage in ("optimise", "warmup") else "session"
    if cutting:
        return "cut"
    from cluster.registry import RegistryError

    return "registry" if isinstance(e, RegistryError) else "other"


def is_transient(e: BaseException) -> bool:
    """A pool that could not start for a reason that may pass (workers not placed yet, shutting
    down): not recorded as a failed tail, so its next request tries again."""
    return isinstance(e, (Unavailable, ResourceExhausted, DeadlineExceeded)) and not isinstance(e, FailedPrecondition)


class NoTailLoaded(FailedPrecondition):
    """No frontier tail of a version could start: the version fails as a whole. Its tails
    were counted one by one, with their own reasons, as they failed."""

    def __init__(self, *, reason: str, fix: str) -> None:
        super().__init__(reason=reason, fix=fix)


def failed_tail(key: Any, why: str) -> FailedPrecondition:
    """What a request for the tail ``key`` (model@version@cut) that failed to load gets."""
    return FailedPrecondition(reason=f"the tail {key} failed to load: {why}",
                              fix="use another cut (GET /readyz lists the tails that serve), or fix the model and "
                                  "restart the gateway")


def one_line(e: BaseException) -> str:
    """The first line of an error's message (at most 500 characters): what /readyz shows."""
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:500]


def service_health(detail: Mapping[str, Any]) -> dict[str, bool]:
    """gRPC health service name -> serving, from the gateway's readiness detail: every loaded
    'model' and 'model@version' serves; every failed one, and each failed tail as
    'model@version@cut', does not."""
    out: dict[str, bool] = {}
    for key in detail["failed"]:
        out[key] = False
        out.setdefault(key.split("@")[0], False)
    for key in detail["versions"]:
        out[key] = True
        out[key.split("@")[0]] = True
    return out
