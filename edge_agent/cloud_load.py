"""What the agent knows of the cloud's load, per cut: the waits it reported and its refusals.

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

That instantaneous wait is 0 unless every worker is busy, so a device sending one frame
every few seconds would read a 90%-busy cloud as idle. The gateway therefore also
reports its utilisation (`timings_ms['utilisation']`, arrivals over capacity) and the
mean wait at that utilisation (`timings_ms['expected_wait']`, [Note: expected wait] in
workers/_batch_policy.py). A load, unlike a queue, lasts: `CloudLoad` keeps the expected
wait and decays it by exp(-age / `tau_s`), so a device that sends rarely still knows the
cloud is busy, and one that moved off the cloud (and so hears nothing more) comes back
after a few time constants, when its next answer or trial reports the load again. The
wait the policy prices is the larger of the two. Answers from a gateway without these
keys leave only the instantaneous wait.

The gateway serves urgent requests first ([Note: priority under overload] in
edge_agent/hedge.py), so it reports both figures for them too
(`timings_ms['urgent_predicted_wait']` and `['urgent_expected_wait']`), which `CloudLoad`
keeps alike: `queue_ms(now_s, urgent=True)` is what the policy prices a remote option at
whose requests would go urgent. A cut with no urgent figures (an older gateway, a pool
that cannot tell) gives the priority-0 figure there, the longer. Time is passed in
(monotonic seconds).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["BUSY_UTILISATION", "CloudLoad", "DEFAULT_RETRY_AFTER_MS", "DEFAULT_TAU_S", "MAX_RETRY_AFTER_MS"]

DEFAULT_RETRY_AFTER_MS = 1000.0
"""Hold-off after a refusal that gave no retry-after."""
MAX_RETRY_AFTER_MS = 30_000.0
"""The longest hold-off a hint can ask for: a wrong or hostile hint must not keep the device off the cloud for good."""
DEFAULT_TAU_S = 10.0
"""Time constant of a reported load: a few frames' spacing for a device at 0.3-1 fps, short
beside the minutes over which a fleet's load moves (edge.yaml `policy: {cloud_load_tau_s}`)."""
BUSY_UTILISATION = 0.8
"""A pool reported at least this busy is, once the device has left it, tried again only by a
trial (see [Note: cloud load] in edge_agent/policy.py): from here the expected wait climbs
steeply (Erlang C), so a faded figure under-reads it most."""
_FORGET = 0.01
"""A decayed load under this share of its report is dropped."""


class CloudLoad:
    """Per cut id: the latest reported queue wait (drained since), the latest reported load
    (decayed since) and the end of the latest retry-after."""

    def __init__(self, tau_s: float = DEFAULT_TAU_S) -> None:
        if not (isinstance(tau_s, (int, float)) and math.isfinite(tau_s) and tau_s > 0):
            raise ValueError(f"cloud_load_tau_s={tau_s!r} must be a finite number of seconds > 0 "
                             f"(default {DEFAULT_TAU_S})")
        self.tau_s = float(tau_s)
        self._waits: dict[tuple[str, bool], tuple[float, float]] = {}
        """(cut id, urgent) -> (reported wait ms, reported at s)."""
        self._loads: dict[tuple[str, bool], tuple[float, float, float]] = {}
        """(cut id, urgent) -> (expected wait ms, utilisation, reported at s)."""
        self._urgent_told: set[str] = set()
        """Cut ids that reported urgent figures."""
        self._refused_until: dict[str, float] = {}
        self.refusals = 0
        """Refusals for load so far."""

    def observe_wait(self, cut_id: str, wait_ms: float, now_s: float, *, urgent: bool = False) -> None:
        """An answer at `cut_id` reported this predicted queue wait (of an urgent request); a bad figure
        is ignored."""
        if isinstance(wait_ms, (int, float)) and math.isfinite(wait_ms) and wait_ms >= 0:
            self._waits[cut_id, urgent] = (float(wait_ms), now_s)
            if urgent:
                self._urgent_told.add(cut_id)

    def observe_load(self, cut_id: str, expected_wait_ms: float, utilisation: float | None, now_s: float, *,
                     urgent: bool = False) -> None:
        """An answer at `cut_id` reported this expected wait (of an urgent request) and utilisation; a
        bad figure is ignored."""
        if not (isinstance(expected_wait_ms, (int, float)) and math.isfinite(expected_wait_ms)
                and expected_wait_ms >= 0):
            return
        ok = isinstance(utilisation, (int, float)) and math.isfinite(utilisation) and utilisation >= 0
        util = float(utilisation) if ok else math.nan  # type: ignore[arg-type]
        self._loads[cut_id, urgent] = (float(expected_wait_ms), util, now_s)
        if urgent:
            self._urgent_told.add(cut_id)

    def observe_timings(self, cut_id: str, timings_ms: Mapping[str, float], now_s: float) -> None:
        """Reads the load keys of a gateway answer's `timings_ms`; an older gateway's lack them."""
        for urgent, prefix in ((False, ""), (True, "urgent_")):
            wait_ms = timings_ms.get(prefix + "predicted_wait")
            if wait_ms is not None:
                self.observe_wait(cut_id, wait_ms, now_s, urgent=urgent)
            expected_ms = timings_ms.get(prefix + "expected_wait")
            if expected_ms is not None:
                self.observe_load(cut_id, expected_ms, timings_ms.get("utilisation"), now_s, urgent=urgent)

    def refuse(self, cut_id: str, retry_after_ms: float | None, now_s: float) -> float:
        """The cloud refused a request at `cut_id` for load; returns the hold-off in ms."""
        ok = isinstance(retry_after_ms, (int, float)) and math.isfinite(retry_after_ms) and retry_after_ms >= 0
        hold_ms = min(float(retry_after_ms), MAX_RETRY_AFTER_MS) if ok else DEFAULT_RETRY_AFTER_MS  # type: ignore[arg-type]
        self.refusals += 1
        self._refused_until[cut_id] = max(self._refused_until.get(cut_id, -math.inf), now_s + hold_ms / 1e3)
        self.observe_wait(cut_id, max(hold_ms, self.queue_ms(now_s).get(cut_id, 0.0)), now_s)
        return hold_ms

    def queue_ms(self, now_s: float, *, urgent: bool = False) -> dict[str, float]:
        """Predicted queue wait per cut for a request sent at `now_s` (an urgent one: where the cut
        reported urgent figures): the larger of the instantaneous wait drained since its report and
        the expected wait decayed since its report."""
        out: dict[tuple[str, bool], float] = {}
        for key, (wait_ms, at_s) in list(self._waits.items()):
            left = wait_ms - max(0.0, now_s - at_s) * 1e3
            if left > 0:
                out[key] = left
            else:
                del self._waits[key]
        for key, (expected_ms, _, at_s) in list(self._loads.items()):
            share = self._share(at_s, now_s)
            if share < _FORGET:
                del self._loads[key]
            elif expected_ms * share > out.get(key, 0.0):
                out[key] = expected_ms * share
        told = self._urgent_told if urgent else set()
        return {cut_id: ms for (cut_id, u), ms in out.items() if u == (cut_id in told)}

    def utilisation(self, now_s: float) -> dict[str, float]:
        """The reported utilisation per cut, decayed as the expected wait is."""
        return {k: u * self._share(at_s, now_s) for (k, urgent), (_, u, at_s) in self._loads.items()
                if not urgent and math.isfinite(u) and self._share(at_s, now_s) >= _FORGET}

    def busy_cuts(self, now_s: float) -> frozenset[str]:
        """Cuts whose latest remembered load report had a utilisation of at least `BUSY_UTILISATION`
        (the policy's `Health.unconfirmed`)."""
        return frozenset(k for (k, urgent), (_, u, at_s) in self._loads.items()
                         if not urgent and u >= BUSY_UTILISATION and self._share(at_s, now_s) >= _FORGET)

    def _share(self, at_s: float, now_s: float) -> float:
        return math.exp(-max(0.0, now_s - at_s) / self.tau_s)

    def refused_until_s(self, now_s: float) -> dict[str, float]:
        """Cuts still inside a retry-after, with when it ends."""
        for cut_id in [k for k, t in self._refused_until.items() if t <= now_s]:
            del self._refused_until[cut_id]
        return dict(self._refused_until)

    def to_dict(self, now_s: float) -> dict[str, Any]:
        return {"queue_ms": self.queue_ms(now_s), "utilisation": self.utilisation(now_s), "refusals": self.refusals,
                "retry_after_ms": {k: (t - now_s) * 1e3 for k, t in self.refused_until_s(now_s).items()}}
