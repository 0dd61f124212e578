"""The policy's knobs: edge.yaml's `policy:` section, checked as it is read. What each knob
does is in edge_agent/policy.py ([Note: policy], [Note: risk]) and edge_agent/hedge.py ([Note: hedge])."""

from __future__ import annotations

import math
from dataclasses import dataclass

from edge_agent.cloud_load import DEFAULT_TAU_S
from planner.costmodel import HEDGE_MARGIN

__all__ = ["OBJECTIVES", "PolicyConfig"]

OBJECTIVES = ("latency", "energy", "throughput")


@dataclass(frozen=True)
class PolicyConfig:
    """The policy's knobs (edge.yaml's `policy:` section; see [Note: policy] for their roles)."""

    objective: str = "latency"
    """'latency', 'energy' or 'throughput' (plans as latency: one device sends one request at a time)."""
    slo_ms: float | None = None
    """Per-request latency target; requests whose remote path would miss it run locally. None: none."""
    hysteresis: float = 0.15
    """A new option must be predicted this fraction cheaper than the current one to switch (< 1)."""
    dwell_s: float = 1.0
    """Least time between switches unless forced."""
    initial_up_bps: float | None = None
    """Rate assumed before the first sample; None: the frontier range's geometric middle."""
    urgent_ratio: float = 0.5
    """A target costing at most this fraction of the current option switches even inside the dwell (0: never)."""
    flap_window_s: float = 10.0
    """Holding an option this long beyond its back-off dwell clears the reversals."""
    max_backoff: int = 4
    """The dwell before a return doubles per reversal, at most 2**max_backoff times."""
    trial_ratio: float = 1.5
    """While local, a remote target predicted this many times faster gets trial requests (>= 1)."""
    trial_every_s: float = 2.0
    """Least time between two trials."""
    switch_cost_ms: float = 50.0
    """What one switch is charged, in ms of one request's latency (times one plus the switches of
    the last `switch_window_s`); a candidate must save more over one dwell's requests. See [Note: risk]."""
    switch_window_s: float = 60.0
    """Switches this recent make the next one dearer (60: the switches of the last minute, the unit in
    which a switch rate is judged)."""
    risk_tie: float = 0.05
    """Chances of missing the SLO within this of the best count as equal; the objective decides."""
    hedge_tail: float = 0.1
    """A request whose remote time, all but this share of its predicted times, nears the deadline
    starts its local run at once (0: only at the last safe moment). See [Note: hedge] in edge_agent/hedge.py."""
    hedge_margin: float = HEDGE_MARGIN
    """The local run starts, at the latest, this fraction of its own time before the last moment at
    which it still meets the deadline."""
    cloud_load_tau_s: float = DEFAULT_TAU_S
    """Time constant over which a load the cloud reported fades (`edge_agent.cloud_load.CloudLoad`):
    a device that sends rarely still knows the cloud is busy; see [Note: cloud load]."""

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective={self.objective!r} must be one of {list(OBJECTIVES)}")
        for name, ok, want in (
            ("slo_ms", self.slo_ms is None or (_finite(self.slo_ms) and self.slo_ms > 0), "> 0 ms, or absent"),
            ("hysteresis", _finite(self.hysteresis) and 0 <= self.hysteresis < 1, ">= 0 and < 1"),
            ("dwell_s", _finite(self.dwell_s) and self.dwell_s >= 0, ">= 0"),
            ("initial_up_bps", self.initial_up_bps is None
             or (_finite(self.initial_up_bps) and self.initial_up_bps > 0), "> 0 bit/s, or absent"),
            ("urgent_ratio", _finite(self.urgent_ratio) and 0 <= self.urgent_ratio <= 1, "in [0, 1]"),
            ("flap_window_s", _finite(self.flap_window_s) and self.flap_window_s >= 0, ">= 0"),
            ("switch_window_s", _finite(self.switch_window_s) and self.switch_window_s >= 0, ">= 0 s"),
            ("max_backoff", isinstance(self.max_backoff, int) and not isinstance(self.max_backoff, bool)
             and 0 <= self.max_backoff <= 30, "an integer in [0, 30]"),
            ("trial_ratio", _finite(self.trial_ratio) and self.trial_ratio >= 1, ">= 1"),
            ("trial_every_s", _finite(self.trial_every_s) and self.trial_every_s > 0, "> 0"),
            ("switch_cost_ms", _finite(self.switch_cost_ms) and self.switch_cost_ms >= 0, ">= 0 ms"),
            ("risk_tie", _finite(self.risk_tie) and 0 <= self.risk_tie < 1, ">= 0 and < 1"),
            ("hedge_tail", _finite(self.hedge_tail) and 0 <= self.hedge_tail <= 0.5, "in [0, 0.5]"),
            ("hedge_margin", _finite(self.hedge_margin) and self.hedge_margin >= 0, ">= 0"),
            ("cloud_load_tau_s", _finite(self.cloud_load_tau_s) and self.cloud_load_tau_s > 0, "> 0 s"),
        ):
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} must be {want}")


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
