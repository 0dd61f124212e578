"""What the agent knows of the cloud's load, per cut: the queue wait it reported and its refusals.

The gateway puts its pool's predicted queue wait for a request arriving now in every
answer (`timings_ms['predicted_wait']`) and refuses overload with RESOURCE_EXHAUSTED
and `retry_after_ms`. `CloudLoad` keeps the latest of each per cut id and turns them
into the policy's `Health.queue_ms` and `Health.refused_until_s` (see [Note: cloud load]
in edge_agent/policy.py).

A reported wait drains at one millisecond per millisecond: it is the work queued ahead
of a request sent at that moment, and with no new arrivals that work is done after it.
Other devices' arrivals keep a real queue longer; the next answer at that cut (a request
or a trial) reports the wait again. Draining is what brings a device that moved local
back: without it, a device that no longer sends would keep the last, loaded figure for
good. A refusal counts as a wait of its retry-after (the queue ahead ends then).
Time is passed in (monotonic seconds).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["CloudLoad", "DEFAULT_RETRY_AFTER_MS", "MAX_RETRY_AFTER_MS"]

DEFAULT_RETRY_AFTER_MS = 1000.0
"""Hold-off after a refusal that gave no retry-after."""
MAX_RETRY_AFTER_MS = 30_000.0
"""The longest hold-off a hint can ask for: a wrong or hostile hint must not keep the device off the cloud for good."""


class CloudLoad:
    """Per cut id: the latest reported queue wait (drained since) and the end of the latest retry-after."""

    def __init__(self) -> None:
        self._waits: dict[str, tuple[float, float]] = {}
        """cut id -> (reported wait ms, reported at s)."""
        self._refused_until: dict[str, float] = {}
        self.refusals = 0
        """Refusals for load so far."""

    def observe_wait(self, cut_id: str, wait_ms: float, now_s: float) -> None:
        """An answer at `cut_id` reported this predicted queue wait; a bad figure is ignored."""
        if isinstance(wait_ms, (int, float)) and math.isfinite(wait_ms) and wait_ms >= 0:
            self._waits[cut_id] = (float(wait_ms), now_s)

    def refuse(self, cut_id: str, retry_after_ms: float | None, now_s: float) -> float:
        """The cloud refused a request at `cut_id` for load; returns the hold-off in ms."""
        ok = isinstance(retry_after_ms, (int, float)) and math.isfinite(retry_after_ms) and retry_after_ms >= 0
        hold_ms = min(float(retry_after_ms), MAX_RETRY_AFTER_MS) if ok else DEFAULT_RETRY_AFTER_MS  # type: ignore[arg-type]
        self.refusals += 1
        self._refused_until[cut_id] = max(self._refused_until.get(cut_id, -math.inf), now_s + hold_ms / 1e3)
        self.observe_wait(cut_id, max(hold_ms, self.queue_ms(now_s).get(cut_id, 0.0)), now_s)
        return hold_ms

    def queue_ms(self, now_s: float) -> dict[str, float]:
        """Predicted queue wait per cut for a request sent at `now_s`: each report drained since."""
        out = {}
        for cut_id, (wait_ms, at_s) in list(self._waits.items()):
            left = wait_ms - max(0.0, now_s - at_s) * 1e3
            if left > 0:
                out[cut_id] = left
            else:
                del self._waits[cut_id]
        return out

    def refused_until_s(self, now_s: float) -> dict[str, float]:
        """Cuts still inside a retry-after, with when it ends."""
        for cut_id in [k for k, t in self._refused_until.items() if t <= now_s]:
            del self._refused_until[cut_id]
        return dict(self._refused_until)

    def to_dict(self, now_s: float) -> dict[str, Any]:
        return {"queue_ms": self.queue_ms(now_s), "refusals": self.refusals,
                "retry_after_ms": {k: (t - now_s) * 1e3 for k, t in self.refused_until_s(now_s).items()}}
