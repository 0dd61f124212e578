"""The what-if core: typed request and resolved tiers in, typed answer out. Pure: no
I/O, no clocks; `Workspace` resolves names to graphs and profiles and calls these."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from partitioner import Cut, LayerGraph
from planner.accuracy import AccuracyTable
from planner.budget import best_codec, solve_within_budget
from planner.costmodel import evaluate
from planner.errors import InfeasibleError, PlannerError
from planner.frontier import Frontier
from planner.frontier import frontier as make_frontier
from planner.profile import Profile
from planner.solvers import solve
from planner.types import Breakdown, Encoding, Link, LinkRange, Objective
from planner.whatif.answers import PlanAnswer, Summary
from planner.whatif.requests import FrontierRequest, PlanRequest

__all__ = ["plan", "frontier", "metric_of", "metric_value", "require_finite"]

logger = logging.getLogger(__name__)

_MAY_BE_INFINITE = frozenset({"throughput_rps"})
"""Answer fields where inf means something (nothing limits the rate) and null says it."""


def metric_of(objective: Objective) -> str:
    """The name of the number each objective minimises, as answers report it."""
    return {Objective.LATENCY: "total_ms", Objective.THROUGHPUT: "period_ms",
            Objective.ENERGY: "energy_mj"}[objective]


def metric_value(objective: Objective, b: Breakdown | Summary | Mapping[str, Any]) -> float:
    """That number for a breakdown or summary (or a dict with total_ms, period_ms, energy_j)."""
    d = b if isinstance(b, Mapping) else b.to_dict()
    if objective is Objective.LATENCY:
        return float(d["total_ms"])
    if objective is Objective.THROUGHPUT:
        return float(d["period_ms"])
    return float(d["energy_j"]) * 1000.0


def _non_finite(x: Any, path: str = "") -> str | None:
    """The path of the first inf or NaN in ``x`` outside `_MAY_BE_INFINITE`, or None."""
    if isinstance(x, float):
        return None if math.isfinite(x) else path
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, (list, tuple)) else ()
    for k, v in items:
        if k in _MAY_BE_INFINITE:
            continue
        hit = _non_finite(v, f"{path}.{k}" if path else str(k))
        if hit is not None:
            return hit
    return None


def require_finite(out: Mapping[str, Any]) -> None:
    """A plan is numbers: profiles whose times, corrections or watts add up past a float
    would answer null where a number is promised; say so instead."""
    where = _non_finite(dict(out))
    if where is not None:
        raise PlannerError(
            f"the answer's {where} is not a finite number: the tiers' profiles have times, corrections "
            "or watts too large to add up; check the edge and cloud profiles", field="(profiles)")


def plan(request: PlanRequest, graph: LayerGraph, profiles: Sequence[Profile],
         accuracy: AccuracyTable | None = None) -> PlanAnswer:
    """The best plan for ``request`` on ``graph`` with [device, cloud] ``profiles``, and the
    edge-only and cloud-only baselines on the same link and encoding (fp32 when the plan's
    encoding is a lossy codec, which is priced only at its measured cut). With the scenario's
    ``min_agreement``, the plan is the best within that budget (planner.budget) on the
    model's ``accuracy`` table, and the frame sent as an image at the quality that meets
    the budget is a third baseline where the table measured one."""
    sc = request.scenario
    link = Link(request.up_bps, request.down_bps or request.up_bps, sc.rtt_ms, sc.loss)
    try:
        if sc.min_agreement is not None:
            best = solve_within_budget(graph, profiles, link, sc.objective, sc.constraints, sc.encodings,
                                       accuracy=accuracy, min_agreement=sc.min_agreement)
        else:
            best = solve(graph, profiles, link, sc.objective, sc.constraints, sc.encodings)
    except InfeasibleError:
        logger.info("no feasible plan for %s", request.to_dict())
        raise
    everything, nothing = Cut(frozenset(range(len(graph)))), Cut(frozenset())
    # A lossy codec is priced only at the cut it was measured at: the baselines then send fp32
    # (the frame as an image is the third baseline).
    base_enc = Encoding() if best.encoding.lossy_codec else best.encoding
    edge_only = Summary.of(evaluate(graph, everything, profiles, link, base_enc))
    cloud_only = Summary.of(evaluate(graph, nothing, profiles, link, base_enc))
    ours = metric_value(sc.objective, best.breakdown)

    def gain(base: Summary) -> float | None:
        return metric_value(sc.objective, base) / ours if ours > 0 else None

    image = None if sc.min_agreement is None else best_codec(graph, profiles, link, accuracy, sc.min_agreement,
                                                             objective=sc.objective)
    image_summary = None if image is None else Summary.of(image.breakdown)
    answer = PlanAnswer(
        plan=best, edge_only=edge_only, cloud_only=cloud_only, metric=metric_of(sc.objective),
        gain_vs_edge_only=gain(edge_only), gain_vs_cloud_only=gain(cloud_only),
        edge_device=profiles[0].device, cloud_device=profiles[1].device, layers=len(graph),
        boundary_bytes=graph.bytes_total(best.boundary).known,  # solve() refuses a boundary of unknown size
        cloud_only_image=image_summary, cloud_only_image_encoding=None if image is None else image.encoding,
        cloud_only_image_agreement=None if image is None else image.agreement,
        gain_vs_cloud_only_image=None if image_summary is None else gain(image_summary),
    )
    require_finite(answer.to_dict())
    return answer


def frontier(request: FrontierRequest, graph: LayerGraph, profiles: Sequence[Profile],
             accuracy: AccuracyTable | None = None) -> Frontier:
    """The plans optimal somewhere in the request's uplink range (`planner.frontier`),
    within the scenario's ``min_agreement`` on the model's ``accuracy`` table."""
    sc = request.scenario
    rng = LinkRange(request.up_lo_bps, request.up_hi_bps, request.down_ratio, sc.rtt_ms, sc.loss)
    f = make_frontier(graph, profiles, rng, sc.objective, sc.constraints, sc.encodings, accuracy=accuracy,
                      min_agreement=sc.min_agreement)
    require_finite(f.to_dict())
    return f
