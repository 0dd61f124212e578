"""The sweep: the objective against the uplink rate for four placements.

Edge-only, cloud-only, the Neurosurgeon chain scan (best topological prefix) and the
DAG optimum, on log-spaced uplink rates. The DAG optimum comes from the plan frontier
(exact, a handful of solves) where its semantics hold: latency or energy, and a
downlink proportional to the uplink (planner.frontier's [Note: frontier]); otherwise
from one `solve` per point, and the breakpoints are then placed between the two
sampled rates where the plan changes. Pure: no I/O.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from partitioner import Cut, LayerGraph
from planner.accuracy import AccuracyTable
from planner.budget import solve_within_budget
from planner.costmodel import evaluate
from planner.errors import InfeasibleError
from planner.frontier import frontier
from planner.profile import Profile
from planner.solvers import solve, solve_chain_scan
from planner.types import Encoding, Link, LinkRange, Objective, Plan
from planner.whatif.answers import Breakpoint, PlanInfo, SweepAnswer
from planner.whatif.core import metric_of, metric_value
from planner.whatif.requests import SweepRequest

__all__ = ["sweep"]

logger = logging.getLogger(__name__)

_metric = metric_value


def _affine_fill(xs: Sequence[float], i: int, j: int, vi: float, vj: float) -> list[float]:
    """The line through (xs[i], vi) and (xs[j], vj) at xs[i..j]; exact ends."""
    if xs[j] == xs[i]:  # a range of one rate
        return [vi] * (j - i + 1)
    slope = (vj - vi) / (xs[j] - xs[i])
    out = [vi + slope * (x - xs[i]) for x in xs[i:j + 1]]
    out[0], out[-1] = vi, vj
    return out


def _envelope(n: int, best_at: Any) -> list[Plan]:
    """The optimal plan at each of n samples of a lower envelope of affine functions of
    x = 1/up (latency or energy of a fixed set of placements).

    Where one plan is optimal at both ends of a run of samples it is optimal on the
    whole run (the envelope is concave and lies below that plan's line, which touches
    it at both ends), so bisection needs O(plans x log n) oracle calls instead of n.
    """
    plans: list[Plan | None] = [None] * n

    def rec(i: int, j: int, pi: Plan, pj: Plan) -> None:
        if pi.key == pj.key or j - i <= 1:
            plans[i], plans[j] = pi, pj
            for k in range(i + 1, j):
                plans[k] = pi
            return
        m = (i + j) // 2
        pm = best_at(m)
        rec(i, m, pi, pm)
        rec(m, j, pm, pj)

    first = best_at(0)
    rec(0, n - 1, first, best_at(n - 1) if n > 1 else first)
    return [p for p in plans if p is not None]


def _fill_plans(plans: Sequence[Plan], xs: Sequence[float], value_at: Any) -> list[float]:
    """Each sample's value under its plan, from two evaluations per run of one plan."""
    out: list[float] = []
    i = 0
    while i < len(plans):
        j = i
        while j + 1 < len(plans) and plans[j + 1].key == plans[i].key:
            j += 1
        out += _affine_fill(xs, i, j, value_at(plans[i], i), value_at(plans[i], j) if j > i else 0.0)
        i = j + 1
    return out


def sweep(request: SweepRequest, graph: LayerGraph, profiles: Sequence[Profile],
          accuracy: AccuracyTable | None = None) -> SweepAnswer:
    """The four series and the DAG optimum's breakpoints for ``request`` on ``graph`` with
    [device, cloud] ``profiles``. With the scenario's ``min_agreement`` every series keeps
    to the budget on the model's ``accuracy`` table: the DAG optimum is solved per point
    within it (planner.budget; through the frontier where it applies), cloud-only takes
    only the encodings that meet it at the empty cut, and the chain scan is
    Neurosurgeon's fp32."""
    req = request
    sc = req.scenario
    obj = sc.objective
    encodings = sc.encodings
    if sc.min_agreement is not None:
        empty = Cut(frozenset())
        within = tuple(e for e in encodings if e.precision == "fp32" or (
            accuracy is not None and (accuracy.agreement(empty, e) or 0.0) >= sc.min_agreement))
        encodings = within or (Encoding(compression=sc.compression),)
    ups = np.geomspace(req.up_lo_bps, req.up_hi_bps, req.points)
    ups[0], ups[-1] = req.up_lo_bps, req.up_hi_bps  # exact ends (and one rate when lo == hi)
    if req.up_lo_bps == req.up_hi_bps:
        ups[:] = req.up_lo_bps
    links = [Link(float(u), req.down_bps if req.down_bps is not None else float(u) * req.down_ratio,
                  sc.rtt_ms, sc.loss) for u in ups]
    everything, nothing = Cut(frozenset(range(len(graph)))), Cut(frozenset())
    xs = [1.0 / link.up_bps for link in links]
    affine = obj is not Objective.THROUGHPUT

    def along(value_at: Any) -> list[float]:
        """value_at(i) at every sample: from two evaluations where it is affine in 1/up."""
        if not affine or len(links) < 3:
            return [value_at(i) for i in range(len(links))]
        return _affine_fill(xs, 0, len(xs) - 1, value_at(0), value_at(len(xs) - 1))

    edge_only = along(
        lambda i: _metric(obj, evaluate(graph, everything, profiles, links[i], encodings[0])))
    # each encoding is affine in 1/up; their minimum is not, so take it per sample
    per_encoding = [along(lambda i, enc=enc: _metric(obj, evaluate(graph, nothing, profiles, links[i], enc)))
                    for enc in encodings]
    cloud_only = [min(vals) for vals in zip(*per_encoding)]
    chain_encodings = encodings if sc.min_agreement is None else (Encoding(compression=sc.compression),)
    if affine:
        scan = _envelope(len(links), lambda i: solve_chain_scan(graph, profiles, links[i], obj, chain_encodings))
        chain = _fill_plans(scan, xs, lambda p, i: _metric(obj, evaluate(graph, p, profiles, links[i])))
    else:
        chain = [_metric(obj, solve_chain_scan(graph, profiles, link, obj, chain_encodings).breakdown)
                 for link in links]

    dag: list[Plan | None] = []
    method, solves = "per-point", 0
    breakpoints: list[Breakpoint] = []
    if obj is not Objective.THROUGHPUT and req.down_bps is None:
        rng = LinkRange(req.up_lo_bps, req.up_hi_bps, req.down_ratio, sc.rtt_ms, sc.loss)
        try:
            f = frontier(graph, profiles, rng, obj, sc.constraints, sc.encodings, accuracy=accuracy,
                         min_agreement=sc.min_agreement)
        except InfeasibleError as e:
            logger.info("frontier infeasible somewhere in the range (%s); solving per point", e.message)
        else:
            method, solves = "frontier", f.solves
            dag = [f.plan_at(link.up_bps) for link in links]
            for a, b in zip(f.entries, f.entries[1:]):
                breakpoints.append(Breakpoint(b.up_lo_bps, PlanInfo.of(a.plan), PlanInfo.of(b.plan), True))
    if method == "per-point":
        for link in links:
            solves += 1
            try:
                if sc.min_agreement is None:
                    dag.append(solve(graph, profiles, link, obj, sc.constraints, sc.encodings))
                else:
                    dag.append(solve_within_budget(graph, profiles, link, obj, sc.constraints, sc.encodings,
                                                   accuracy=accuracy, min_agreement=sc.min_agreement))
            except InfeasibleError:
                dag.append(None)
        for i in range(1, len(dag)):
            a, b = dag[i - 1], dag[i]
            if a is not None and b is not None and a.key != b.key:
                breakpoints.append(Breakpoint(math.sqrt(links[i - 1].up_bps * links[i].up_bps),
                                              PlanInfo.of(a), PlanInfo.of(b), False))
    dag_values = [None if p is None else _metric(obj, p.breakdown) for p in dag]

    def best_gain(base: Sequence[float | None]) -> float | None:
        gains = [x / y for x, y in zip(base, dag_values) if x is not None and y is not None and y > 0]
        return max(gains) if gains else None

    return SweepAnswer(
        request=req, model=graph.model, objective=obj, metric=metric_of(obj),
        edge_device=profiles[0].device, cloud_device=profiles[1].device, rtt_ms=sc.rtt_ms,
        uplink_bps=tuple(link.up_bps for link in links), downlink_bps=tuple(link.down_bps for link in links),
        edge_only=tuple(edge_only), cloud_only=tuple(cloud_only), chain=tuple(chain), dag=tuple(dag_values),
        dag_edge_layers=tuple(None if p is None else len(p.edge_layers) for p in dag),
        breakpoints=tuple(breakpoints), method=method, solves=solves,
        max_gain_vs_chain=best_gain(chain),
        max_gain_vs_best_single_tier=best_gain([min(e, c) for e, c in zip(edge_only, cloud_only)]),
    )
