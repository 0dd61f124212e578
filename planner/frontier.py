"""The plan frontier: the few plans that are optimal somewhere across a bandwidth range.

[Note: frontier]
On links where down = down_ratio * up and RTT and loss are fixed, a plan's latency
and its device energy are affine in x = 1/up: a + b * x (b holds the bits it sends
and receives). The optimum over all plans is their lower envelope, a concave
piecewise-affine function of x. `frontier` computes it exactly with the solver as an
oracle (Eisner-Severance): solve at both ends; where the optima differ, solve again
where their lines cross; if nothing beats the two lines there, the crossing is a
breakpoint, otherwise recurse on both sides of the new plan. That takes 2 * (number
of plans) - 1 solves. With an SLO or a memory limit the solver may use its sound
(not exact) search on big graphs, and the frontier inherits that.

The frontier is a value: small, JSON round-trips exactly, and `plan_at` looks a link
up (binary search) and rescales the stored plan's breakdown to it without a graph.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from partitioner.graph import LayerGraph
from planner.accuracy import AccuracyTable
from planner.budget import solve_within_budget
from planner.costmodel import _stage_names
from planner.errors import PlannerError
from planner.profile import Profile
from planner.solvers import DEFAULT_EXACT_LIMIT, solve
from planner.types import Breakdown, Constraints, Encoding, LinkRange, Objective, Plan, _Json

__all__ = ["Frontier", "FrontierEntry", "frontier"]

_MAX_SOLVES = 257


@dataclass(frozen=True)
class FrontierEntry(_Json):
    """One plan and the uplink rates where it is optimal."""

    up_lo_bps: float
    """Lowest uplink rate where it is optimal."""
    up_hi_bps: float
    """Highest uplink rate where it is optimal."""
    plan: Plan
    """The plan, with its breakdown at the rate it was solved at."""

    def to_dict(self) -> dict[str, Any]:
        return {"up_lo_bps": self.up_lo_bps, "up_hi_bps": self.up_hi_bps, "plan": self.plan.to_dict()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FrontierEntry:
        return cls(d["up_lo_bps"], d["up_hi_bps"], Plan.from_dict(d["plan"]))


@dataclass(frozen=True)
class Frontier(_Json):
    """The optimal plans across ``link_range``, by ascending uplink rate."""

    model: str
    """The model's name."""
    objective: Objective
    """What the plans minimise (latency or energy)."""
    link_range: LinkRange
    """The links covered."""
    entries: tuple[FrontierEntry, ...]
    """Ascending and contiguous: entries[i].up_hi_bps == entries[i+1].up_lo_bps."""
    compute_w: float = 0.0
    """The device's power figures, to rescale energy in `plan_at`."""
    radio_tx_w: float = 0.0
    idle_w: float = 0.0
    solves: int = 0
    """How many solver calls building it took."""

    @property
    def breakpoints_bps(self) -> tuple[float, ...]:
        return tuple(e.up_lo_bps for e in self.entries[1:])

    @property
    def plans(self) -> tuple[Plan, ...]:
        return tuple(e.plan for e in self.entries)

    def plan_at(self, up_bps: float) -> Plan:
        """The optimal plan at ``up_bps``, its breakdown rescaled to that link.

        Outside the range, the nearest end's plan (it is still a valid plan, but
        no longer known to be optimal).
        """
        if not up_bps > 0:
            raise PlannerError(f"up_bps is {up_bps!r}; it must be > 0", field="up_bps")
        i = bisect.bisect_right(self._los, up_bps) - 1
        entry = self.entries[max(0, min(i, len(self.entries) - 1))]
        link = self.link_range.at(up_bps)
        b = _rescale(entry.plan, link, self.compute_w, self.radio_tx_w, self.idle_w)
        return dataclasses.replace(entry.plan, link=link, breakdown=b)

    @property
    def _los(self) -> list[float]:
        cached = self.__dict__.get("_los_cache")
        if cached is None:
            cached = [e.up_lo_bps for e in self.entries]
            object.__setattr__(self, "_los_cache", cached)
        return cached

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "splitinfer.frontier/1",
            "model": self.model,
            "objective": self.objective.value,
            "link_range": self.link_range.to_dict(),
            "entries": [e.to_dict() for e in self.entries],
            "compute_w": self.compute_w,
            "radio_tx_w": self.radio_tx_w,
            "idle_w": self.idle_w,
            "solves": self.solves,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Frontier:
        return cls(
            model=d["model"],
            objective=Objective.parse(d["objective"]),
            link_range=LinkRange.from_dict(d["link_range"]),
            entries=tuple(FrontierEntry.from_dict(e) for e in d["entries"]),
            compute_w=d.get("compute_w", 0.0),
            radio_tx_w=d.get("radio_tx_w", 0.0),
            idle_w=d.get("idle_w", 0.0),
            solves=int(d.get("solves", 0)),
        )


def _rescale(plan: Plan, link: Any, compute_w: float, radio_tx_w: float, idle_w: float) -> Breakdown:
    """The plan's breakdown on another first-hop link (same RTT; batch 1)."""
    b = plan.breakdown
    old = plan.link
    up_bits = b.hop_up_ms[0] / 1000.0 * old.up_goodput_bps
    down_bits = b.hop_down_ms[0] / 1000.0 * old.down_goodput_bps
    up0 = up_bits / link.up_goodput_bps * 1000.0
    down0 = down_bits / link.down_goodput_bps * 1000.0
    hop_up = (up0,) + b.hop_up_ms[1:]
    hop_down = (down0,) + b.hop_down_ms[1:]
    rtt = b.rtt_ms - (old.rtt_ms - link.rtt_ms if b.rtt_ms > 0 else 0.0)
    uplink, downlink = sum(hop_up), sum(hop_down)
    total = b.edge_ms + b.encode_ms + uplink + rtt + b.queue_ms + b.cloud_ms + downlink
    busy = b.tier_ms[0] + b.tier_codec_ms[0]
    energy = (compute_w * busy + radio_tx_w * up0 + idle_w * (total - busy - up0)) / 1000.0
    k = len(b.tier_ms)
    stages = [b.tier_ms[i] + b.tier_codec_ms[i] for i in range(k)] + list(hop_up) + list(hop_down)
    j = max(range(len(stages)), key=lambda i: (stages[i], -i))
    return dataclasses.replace(b, uplink_ms=uplink, downlink_ms=downlink, rtt_ms=rtt, total_ms=total,
                               energy_j=energy, hop_up_ms=hop_up, hop_down_ms=hop_down,
                               period_ms=stages[j], bottleneck=_stage_names(k)[j])


def frontier(
    graph: LayerGraph,
    profiles: Sequence[Profile],
    link_range: LinkRange,
    objective: Objective | str = Objective.LATENCY,
    constraints: Constraints | None = None,
    encodings: Sequence[Encoding] = (Encoding(),),
    *,
    next_links: Sequence[Any] = (),
    exact_limit: int = DEFAULT_EXACT_LIMIT,
    accuracy: AccuracyTable | None = None,
    min_agreement: float | None = None,
) -> Frontier:
    """Every plan that is optimal somewhere in ``link_range``; see [Note: frontier].

    ``next_links`` are the later hops' links for multi-tier plans (fixed). With
    ``min_agreement`` every probe is solved within that accuracy budget on the
    ``accuracy`` table (planner.budget: each candidate is a fixed cut and encoding, so
    its cost stays affine in 1/up and the envelope is still exact over them).
    """
    obj = Objective.parse(objective)
    if obj is Objective.THROUGHPUT:
        raise PlannerError(
            "the frontier covers the latency and energy objectives (affine in 1/bandwidth); "
            "for throughput call solve() at each link",
            model=graph.model, field="objective",
        )
    dev = profiles[0]
    power = (dev.compute_w, dev.radio_tx_w, dev.idle_w)
    solves = 0

    def probe(x: float) -> Plan:
        nonlocal solves
        solves += 1
        link = link_range.at(1.0 / x)
        if min_agreement is not None:
            return solve_within_budget(graph, profiles, (link, *next_links), obj, constraints, encodings,
                                       accuracy=accuracy, min_agreement=min_agreement)
        return solve(graph, profiles, (link, *next_links), obj, constraints, encodings, exact_limit=exact_limit)

    def value(plan: Plan, x: float) -> float:
        b = _rescale(plan, link_range.at(1.0 / x), *power)
        return b.total_ms if obj is Objective.LATENCY else b.energy_j

    def line(plan: Plan, xa: float, xb: float) -> tuple[float, float]:
        va, vb = value(plan, xa), value(plan, xb)
        slope = (vb - va) / (xb - xa) if xb > xa else 0.0
        return va - slope * xa, slope

    x_lo, x_hi = 1.0 / link_range.up_hi_bps, 1.0 / link_range.up_lo_bps

    def rec(xa: float, pa: Plan, xb: float, pb: Plan) -> list[tuple[Plan, float, float]]:
        if pa.key == pb.key or solves >= _MAX_SOLVES:
            return [(pa, xa, xb)] if pa.key == pb.key else [(pa, xa, (xa + xb) / 2), (pb, (xa + xb) / 2, xb)]
        a1, b1 = line(pa, x_lo, x_hi)
        a2, b2 = line(pb, x_lo, x_hi)
        if b1 <= b2:  # pb cannot overtake pa inside (xa, xb): split where they tie
            xs = xb
        else:
            xs = min(max((a2 - a1) / (b1 - b2), xa), xb)
        if xs <= xa or xs >= xb:
            return [(pa, xa, xs), (pb, xs, xb)] if xa < xs < xb else (
                [(pb, xa, xb)] if xs <= xa else [(pa, xa, xb)])
        p = probe(xs)
        v = value(p, xs)
        v_line = a1 + b1 * xs
        if p.key in (pa.key, pb.key) or v >= v_line - 1e-9 * max(1.0, abs(v_line)):
            return [(pa, xa, xs), (pb, xs, xb)]
        left = rec(xa, pa, xs, p)
        right = rec(xs, p, xb, pb)
        if left[-1][0].key == right[0][0].key:
            left[-1] = (left[-1][0], left[-1][1], right[0][2])
            right = right[1:]
        return left + right

    p_lo = probe(x_lo)
    p_hi = probe(x_hi) if x_hi > x_lo else p_lo
    segs = rec(x_lo, p_lo, x_hi, p_hi) if x_hi > x_lo else [(p_lo, x_lo, x_hi)]
    # drop empty segments and merge neighbours holding the same plan
    merged: list[tuple[Plan, float, float]] = []
    for p, xa, xb in segs:
        if merged and merged[-1][0].key == p.key:
            merged[-1] = (merged[-1][0], merged[-1][1], xb)
        elif xb > xa or not merged:
            merged.append((p, xa, xb))
    entries = tuple(
        FrontierEntry(up_lo_bps=1.0 / xb, up_hi_bps=1.0 / xa, plan=p) for p, xa, xb in reversed(merged)
    )
    # exact ends, not 1/(1/x)
    entries = (
        (dataclasses.replace(entries[0], up_lo_bps=link_range.up_lo_bps),)
        + entries[1:]
    )
    entries = entries[:-1] + (dataclasses.replace(entries[-1], up_hi_bps=link_range.up_hi_bps),)
    return Frontier(graph.model, obj, link_range, entries, *power, solves=solves)
