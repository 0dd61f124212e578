"""Fitting the segment corrections of a profile. Pure: numbers in, numbers out.

[Note: fitting corrections]
`planner.profile` times a non-empty segment as ``scale * sum(layer ms) + offset_ms +
fixed_ms`` (see [Note: segment time] there). We time real head and tail segments,
each in its own session as the tiers will run them, and fit

    measured_ms ~= scale * additive_ms + c,        c = offset_ms + fixed_ms >= 0

by least squares on the *relative* residual ((prediction - measured) / measured),
i.e. with weights 1 / measured^2: the planner compares cuts whose segments range
from a millisecond to the whole model, and a plain fit would spend all its freedom on
the largest segments. ``c >= 0`` is what the profile format requires (offset_ms >=
-fixed_ms); when the free fit breaks it, the fit is redone with c = 0.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from partitioner.cuts import Cut, chain_points, prefix_cut, random_cut
from partitioner.graph import LayerGraph
from planner.profile import Corrections
from workers.profile._trace import ProfilingError

__all__ = ["SegmentTiming", "fit_corrections", "calibration_cuts", "spread_cuts", "add_random_cuts"]


@dataclass(frozen=True)
class SegmentTiming:
    """One real segment timed against the additive prediction."""

    cut: str
    """Key of the cut (`Cut.key`)."""
    side: str
    """``head`` (device side) or ``tail`` (cloud side)."""
    layers: int
    """Number of layers in the segment."""
    additive_ms: float
    """Sum of the profile's per-layer ms over the segment."""
    measured_ms: float
    """Median wall ms of one run of the segment in its own session."""
    p90_ms: float
    """90th-percentile wall ms."""

    def to_dict(self) -> dict[str, Any]:
        return {"cut": self.cut, "side": self.side, "layers": self.layers,
                "additive_ms": self.additive_ms, "measured_ms": self.measured_ms, "p90_ms": self.p90_ms}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SegmentTiming:
        return cls(cut=d["cut"], side=d["side"], layers=int(d["layers"]), additive_ms=float(d["additive_ms"]),
                   measured_ms=float(d["measured_ms"]), p90_ms=float(d["p90_ms"]))


def fit_corrections(points: Sequence[tuple[float, float]], fixed_ms: float) -> Corrections:
    """Scale and offset from (additive_ms, measured_ms) pairs; see [Note: fitting corrections]."""
    pts = [(float(x), float(y)) for x, y in points]
    bad = [p for p in pts if not (math.isfinite(p[0]) and math.isfinite(p[1]) and p[0] >= 0 and p[1] > 0)]
    if bad:
        raise ProfilingError(
            f"segment timing {bad[0]} is not (additive_ms >= 0, measured_ms > 0); drop failed runs before fitting",
            setting="segments",
        )
    if not pts:
        raise ProfilingError("no segment timings to fit corrections to; time at least one segment",
                             setting="segments")
    if not math.isfinite(fixed_ms) or fixed_ms < 0:
        raise ProfilingError(f"fixed_ms is {fixed_ms!r}; it must be a finite number >= 0", setting="fixed_ms")
    x = np.array([p[0] for p in pts])
    y = np.array([p[1] for p in pts])
    w = 1.0 / y**2
    scale, c = _weighted_line(x, y, w)
    if c < 0.0 or scale <= 0.0:
        c = 0.0
        sxx = float((w * x * x).sum())
        scale = float((w * x * y).sum()) / sxx if sxx > 0 else 1.0
    if scale <= 0.0 or not math.isfinite(scale):
        scale = 1.0
        c = max(0.0, float(np.median(y - x)))
    return Corrections(scale=float(scale), offset_ms=float(c - fixed_ms), segments=len(pts))


def _weighted_line(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, float]:
    """Slope and intercept minimising sum(w * (a x + b - y)^2); slope only if x is constant."""
    sw, sx, sy = w.sum(), (w * x).sum(), (w * y).sum()
    sxx, sxy = (w * x * x).sum(), (w * x * y).sum()
    det = sw * sxx - sx * sx
    if len(x) < 2 or det <= 1e-12 * max(sw * sxx, 1e-300):
        return (float(sxy / sxx) if sxx > 0 else 1.0), 0.0
    a = (sw * sxy - sx * sy) / det
    b = (sy - a * sx) / sw
    return float(a), float(b)


def spread_cuts(graph: LayerGraph, count: int, *, phase: float = 0.5) -> list[Cut]:
    """``count`` distinct non-trivial cuts spread over the model.

    Chain points (only one tensor crosses) at evenly spaced positions, ``phase`` in
    [0, 1) shifting where in each stretch the pick falls; where the model has too few,
    prefix cuts (the down-closure of a layer) fill in. Empty and full cuts are left out.
    """
    n = len(graph)
    full = frozenset(range(n))
    out: list[Cut] = []
    seen: set[frozenset[int]] = {frozenset(), full}
    chain = [v for v in chain_points(graph) if v < n - 1]
    for pool in (chain, list(range(n - 1))):
        if not pool:
            continue
        for i in range(count):
            if len(out) >= count:
                break
            v = pool[min(len(pool) - 1, int((i + phase) * len(pool) / count))]
            cut = prefix_cut(graph, v)
            if cut.device not in seen:
                seen.add(cut.device)
                out.append(cut)
    return out


def calibration_cuts(graph: LayerGraph, count: int = 4, *, seed: int = 7) -> list[Cut]:
    """Cuts for fitting corrections: the first and the last chain point (so that the
    smallest heads and tails, which pin the offset, are among the timed segments),
    chain points spread in between, and one random DAG cut."""
    n = len(graph)
    chain = [v for v in chain_points(graph) if v < n - 1]
    ends = [prefix_cut(graph, chain[0]), prefix_cut(graph, chain[-1])] if chain and count >= 3 else []
    cuts: list[Cut] = []
    seen = {frozenset(), frozenset(range(n))}
    middle = spread_cuts(graph, max(1, count - 1 - len(ends)), phase=0.5)
    for c in ends + middle + spread_cuts(graph, max(1, count - 1), phase=0.25):
        if len(cuts) < max(1, count - 1) and c.device not in seen:
            seen.add(c.device)
            cuts.append(c)
    return add_random_cuts(graph, cuts, seen, count, seed=seed, tries=50)


def add_random_cuts(graph: LayerGraph, cuts: list[Cut], seen: set[frozenset[int]], count: int, *,
                    seed: int, tries: int) -> list[Cut]:
    """`cuts` with random valid DAG cuts (`random_cut`, seeded) whose device sides are not in
    `seen` appended until it holds `count`, or `tries` draws are spent; `seen` takes theirs."""
    rng = random.Random(seed)
    for _ in range(tries):
        if len(cuts) >= count:
            break
        c = random_cut(graph, rng)
        if c.device not in seen:
            seen.add(c.device)
            cuts.append(c)
    return cuts
