"""A circuit breaker for the remote path, as pure functions over a frozen state.

closed --(failures >= threshold)--> open --(open_s elapsed; one probe allowed)--> half_open
half_open --(probe succeeds)--> closed;  half_open --(probe fails)--> open (timer restarts)

While open, every request runs locally without trying the network, so an outage costs
one timeout per `open_s`, not one per request. Time is passed in (`now_s`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace

__all__ = ["BreakerConfig", "BreakerState", "CLOSED", "OPEN", "HALF_OPEN", "allow", "on_success", "on_failure"]

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass(frozen=True)
class BreakerConfig:
    failures: int = 3
    """Consecutive failures that open the breaker."""
    open_s: float = 2.0
    """How long it stays open before one probe may pass."""
    probe_timeout_s: float = 10.0
    """A half-open probe with no outcome after this long counts as failed (lets another through)."""

    def __post_init__(self) -> None:
        if self.failures < 1 or self.open_s <= 0 or self.probe_timeout_s <= 0:
            raise ValueError(f"BreakerConfig needs failures >= 1 (got {self.failures}), open_s > 0 "
                             f"(got {self.open_s}) and probe_timeout_s > 0 (got {self.probe_timeout_s})")


@dataclass(frozen=True)
class BreakerState:
    state: str = CLOSED
    """'closed', 'open' or 'half_open'."""
    failures: int = 0
    """Consecutive failures while closed."""
    opened_s: float | None = None
    """When it last opened."""
    probe_s: float | None = None
    """When the half-open probe was let through (None: none in flight)."""
    transitions: int = 0
    """State changes so far."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> BreakerState:
        return cls(**json.loads(text))


def allow(s: BreakerState, now_s: float, cfg: BreakerConfig) -> tuple[bool, BreakerState]:
    """May a request use the remote path now? A True from open or half-open is the probe."""
    if s.state == CLOSED:
        return True, s
    if s.state == OPEN:
        assert s.opened_s is not None
        if now_s - s.opened_s >= cfg.open_s:
            return True, replace(s, state=HALF_OPEN, probe_s=now_s, transitions=s.transitions + 1)
        return False, s
    # half-open: one probe at a time; a probe lost for too long frees the slot.
    if s.probe_s is None or now_s - s.probe_s >= cfg.probe_timeout_s:
        return True, replace(s, probe_s=now_s)
    return False, s


def on_success(s: BreakerState, now_s: float, cfg: BreakerConfig) -> BreakerState:
    if s.state == CLOSED:
        return s if s.failures == 0 else replace(s, failures=0)
    return BreakerState(CLOSED, 0, None, None, s.transitions + 1)


def on_failure(s: BreakerState, now_s: float, cfg: BreakerConfig) -> BreakerState:
    if s.state == CLOSED:
        n = s.failures + 1
        if n >= cfg.failures:
            return BreakerState(OPEN, n, now_s, None, s.transitions + 1)
        return replace(s, failures=n)
    if s.state == HALF_OPEN:
        return BreakerState(OPEN, s.failures, now_s, None, s.transitions + 1)
    return s  # already open: a straggler from before it opened changes nothing
