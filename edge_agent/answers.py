"""What a request gets back (`Answer`), and what the runner counts of its requests (`Counters`)."""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Answer", "Counters"]

_WINDOW = 2048
"""Recent latencies per path that `Counters` keeps."""


@dataclass(frozen=True)
class Answer:
    """What the app gets back."""

    request_id: str
    outputs: Mapping[str, np.ndarray]
    served_by: str
    """'remote', 'local' (whole model) or 'local_tail' (head here, tail here after a remote failure)."""
    cut_id: str
    """The cut used ('' when the whole model ran locally)."""
    latency_ms: float
    fallback_reason: str = ""
    """Why a request planned for the cloud finished locally."""
    encoding: str = "fp32"
    """How the boundary crossed the link (`planner.Encoding.key`) when the cloud answered;
    fp32 otherwise (a local tail reads the head's own output)."""


@dataclass
class Counters:
    requests: int = 0
    answered: int = 0
    failed: int = 0
    remote: int = 0
    local: int = 0
    local_tail: int = 0
    late_dropped: int = 0
    """Remote answers that came after the local one."""
    local_dropped: int = 0
    """Local tails that finished after the remote answer had won the race."""
    local_cancelled: int = 0
    """Local runs stopped unfinished: tails whose remote answer won, and whole-model runs started
    before the policy sent their request to the cloud ([Note: local runs cancelled])."""
    hedges: int = 0
    """Requests whose local tail started beside a late remote call (see [Note: hedge] in hedge.py)."""
    remote_errors: dict[str, int] = field(default_factory=dict)
    switches: int = 0
    probes: int = 0
    trials: int = 0
    """Requests sent remote as trials while local was the plan."""
    held_local: int = 0
    """Requests run here in a held drop while a remote plan stayed in use ([Note: risk] in policy.py)."""
    reachability_failures: int = 0
    """Idle-link health checks that got no answer."""
    gateway_warmups: int = 0
    """Boundaries of zeros sent at start-up to load cuts the gateway had not preloaded
    ([Note: cuts the gateway has not loaded] in probing.py)."""
    inflight: int = 0
    latency_ms: dict[str, collections.deque] = field(default_factory=dict)

    def observe(self, served_by: str, ms: float) -> None:
        self.latency_ms.setdefault(served_by, collections.deque(maxlen=_WINDOW)).append(ms)

    def to_dict(self) -> dict[str, Any]:
        lat = {k: {"count": len(v), "p50_ms": float(np.percentile(v, 50)), "p90_ms": float(np.percentile(v, 90))}
               for k, v in self.latency_ms.items() if v}
        return {k: v for k, v in vars(self).items() if k != "latency_ms"} | {"latency": lat}
