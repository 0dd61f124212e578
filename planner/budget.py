"""Plans within an accuracy budget: no plan agrees with the fp32 model less than asked.

[Note: accuracy budget]
A plan's agreement is known in three cases:

* fp32 crosses every cut without loss (segments are verified equal to the model), and an
  edge-only plan sends nothing: agreement 1, at any cut;
* a lossy encoding (fp16, int8, int8 per channel) at a cut the accuracy table measured:
  the table's figure (`planner.accuracy.AccuracyTable`, from ``splitinfer calibrate``);
* anything else is unknown, and refused under a budget.

So `solve_within_budget` solves the lossless encodings over every placement (the exact
solver, as without a budget), and each lossy encoding over the measured cuts whose
agreement meets the budget (each evaluated with the cost model and checked against
the constraints), plus that encoding's unconstrained optimum when its agreement is
known. The best of these wins. Lossy encodings are placed on two tiers only: the
table measures one boundary, and the errors of two lossy hops compound.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from partitioner.cuts import Cut, boundary, make_cut
from partitioner.errors import PartitionError
from partitioner.graph import LayerGraph
from planner.accuracy import AccuracyTable
from planner.costmodel import evaluate
from planner.errors import InfeasibleError, PlannerError
from planner.memory import head_memory_bytes
from planner.profile import Profile
from planner.solvers import _pins, solve
from planner.types import Constraints, Encoding, Link, Objective, Plan

__all__ = ["check_budget", "plan_agreement", "solve_within_budget"]

CALIBRATE_HINT = "measure it with: splitinfer calibrate MODEL (or the registry entry, --registry ROOT)"


def check_budget(min_agreement: float) -> float:
    """The budget as a float in (0, 1]; PlannerError naming it otherwise."""
    if isinstance(min_agreement, bool) or not isinstance(min_agreement, (int, float)) \
            or not math.isfinite(min_agreement) or not 0.0 < min_agreement <= 1.0:
        raise PlannerError(f"min_agreement is {min_agreement!r}; it must be a fraction in (0, 1], e.g. 0.99",
                           field="min_agreement")
    return float(min_agreement)


def _sends_nothing(graph: LayerGraph, plan: Plan) -> bool:
    return len(plan.cut.device) == len(graph)


def plan_agreement(graph: LayerGraph, plan: Plan, accuracy: AccuracyTable | None) -> float | None:
    """The plan's predicted agreement with the fp32 model ([Note: accuracy budget])."""
    if plan.encoding.precision == "fp32" or _sends_nothing(graph, plan):
        return 1.0
    if accuracy is None or len(plan.cuts) != 1:
        return None
    return accuracy.agreement(plan.cut, plan.encoding)


def _value(obj: Objective, plan: Plan) -> float:
    b = plan.breakdown
    return {Objective.LATENCY: b.total_ms, Objective.ENERGY: b.energy_j, Objective.THROUGHPUT: b.period_ms}[obj]


def _fixed_plan(graph: LayerGraph, profiles: Sequence[Profile], link: Link, obj: Objective, c: Constraints,
                cut: Cut, enc: Encoding, agreement: float) -> Plan | None:
    """The plan of this cut and encoding, or None when it breaks a constraint."""
    pinned = _pins(graph, c)
    if any(pinned[v] and v not in cut.device for v in range(len(graph))):
        return None
    mem_limit = c.device_memory_bytes if c.device_memory_bytes is not None else profiles[0].memory_bytes
    if mem_limit is not None and head_memory_bytes(graph, sorted(cut.device)) > mem_limit:
        return None
    b = evaluate(graph, cut, profiles, link, enc)
    if c.latency_slo_ms is not None and b.total_ms > c.latency_slo_ms * (1 + 1e-12):
        return None
    return Plan(graph.model, (cut,), enc, obj, link, b, boundary(graph, cut), (), agreement)


def _measured_cut(graph: LayerGraph, cut_id: str) -> Cut | None:
    named = Cut.from_key(cut_id)
    if named is None:
        return None  # a hashed id names no layers; only its registry knows it
    try:
        return make_cut(graph, named.device)
    except PartitionError:
        return None


def solve_within_budget(
    graph: LayerGraph,
    profiles: Sequence[Profile],
    link: Link | Sequence[Link],
    objective: Objective | str = Objective.LATENCY,
    constraints: Constraints | None = None,
    encodings: Sequence[Encoding] = (Encoding(),),
    *,
    accuracy: AccuracyTable | None,
    min_agreement: float,
) -> Plan:
    """The best plan whose predicted agreement is at least ``min_agreement``
    ([Note: accuracy budget]); its ``agreement`` field says the figure. Raises
    InfeasibleError (constraint 'min_agreement') naming the calibrate command when no
    encoding meets the budget because none was measured."""
    budget = check_budget(min_agreement)
    obj = Objective.parse(objective)
    c = constraints or Constraints()
    if not encodings:
        raise PlannerError("encodings is empty; give at least one, e.g. (Encoding(),)", field="encodings")
    lossless = [e for e in encodings if e.precision == "fp32"]
    lossy = [e for e in encodings if e.precision != "fp32"]
    candidates: list[Plan] = []
    errors: list[InfeasibleError] = []
    unmeasured: list[str] = []
    for group in [lossless] + [[e] for e in lossy]:
        if not group:
            continue
        try:
            p = solve(graph, profiles, link, obj, c, group)
        except InfeasibleError as e:
            errors.append(e)
            continue
        a = plan_agreement(graph, p, accuracy)
        if a is not None and a >= budget:
            candidates.append(dataclasses.replace(p, agreement=a))
    single = isinstance(link, Link) or len(tuple(link)) == 1
    if lossy and len(profiles) == 2 and single:
        first = link if isinstance(link, Link) else tuple(link)[0]
        for enc in lossy:
            measured = False
            for cut_id in accuracy.cut_ids if accuracy is not None else ():
                a = accuracy.agreement(cut_id, enc)  # type: ignore[union-attr]
                measured |= a is not None
                cut = _measured_cut(graph, cut_id) if a is not None and a >= budget else None
                p = None if cut is None else _fixed_plan(graph, profiles, first, obj, c, cut, enc, a)  # type: ignore[arg-type]
                if p is not None:
                    candidates.append(p)
            if not measured:
                unmeasured.append(enc.key)
    if not candidates:
        if errors and not lossy:
            raise errors[0]
        why = (f"encodings {unmeasured} have no measured agreement ({CALIBRATE_HINT})" if unmeasured
               else "no measured cut and encoding reaches it within the constraints")
        raise InfeasibleError(
            f"no plan for {graph.model} agrees with the fp32 model at {budget:g} or more: {why}; or allow fp32 "
            "(lossless) or lower --min-agreement",
            constraint="min_agreement", required=budget, unit="agreement", model=graph.model)
    return min(candidates, key=lambda p: (_value(obj, p), -(p.agreement or 0.0)))
