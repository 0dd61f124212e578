"""Plans within an accuracy budget: no plan agrees with the fp32 model less than asked.

[Note: accuracy budget]
A plan's agreement is known in three cases:

* fp32 crosses every cut without loss (segments are verified equal to the model), and an
  edge-only plan sends nothing: agreement 1, at any cut;
* a lossy encoding (fp16, int8, int8 per channel, or a lossy codec: jpeg@90, tiled-webp@75,
  bits@4...) at a cut the accuracy table measured: the table's figure
  (`planner.accuracy.AccuracyTable`, from ``splitinfer calibrate``);
* anything else is unknown, and refused under a budget.

So `solve_within_budget` solves the lossless encodings over every placement (the exact
solver, as without a budget), and each lossy cast over the measured cuts whose
agreement meets the budget (each evaluated with the cost model and checked against
the constraints), plus that cast's unconstrained optimum when its agreement is known.
The lossy codecs of the table (``codecs=``, all by default) are placed the same way at
their measured cuts only, priced with their measured bytes and codec time there
(`lossy_encoding`): a codec's size and error depend on the content it compresses, so
they are known only where measured. The best of these wins. Without a budget the
solver places no lossy codec at all (`planner.solve` refuses them), because their
accuracy cost is then unbounded. Lossy encodings are placed on two tiers only: the
table measures one boundary, and the errors of two lossy hops compound.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from collections.abc import Sequence

from partitioner.cuts import Cut, boundary, make_cut
from partitioner.errors import PartitionError
from partitioner.graph import LayerGraph
from planner.accuracy import AccuracyEntry, AccuracyTable, parse_encoding_key
from planner.costmodel import evaluate
from planner.errors import InfeasibleError, PlannerError
from planner.memory import head_memory_bytes
from planner.profile import Profile
from planner.solvers import _pins, solve
from planner.types import LOSSY_CODECS, Breakdown, Constraints, Encoding, Link, Objective, Plan

__all__ = ["CodecOption", "best_codec", "check_budget", "lossy_encoding", "plan_agreement", "price_codec",
           "solve_within_budget"]

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
    if plan.encoding.lossless or _sends_nothing(graph, plan):
        return 1.0
    if accuracy is None or len(plan.cuts) != 1:
        return None
    return accuracy.agreement(plan.cut, plan.encoding)


def _value(obj: Objective, plan: Plan) -> float:
    return _cost(obj, plan.breakdown)


def _fixed_plan(graph: LayerGraph, profiles: Sequence[Profile], link: Link, obj: Objective, c: Constraints,
                cut: Cut, enc: Encoding, agreement: float) -> Plan | None:
    """The plan of this cut and encoding, or None when it breaks a constraint."""
    pinned = _pins(graph, c)
    if any(pinned[v] and v not in cut.device for v in range(len(graph))):
        return None
    mem_limit = c.device_memory_bytes if c.device_memory_bytes is not None else profiles[0].memory_bytes
    if mem_limit is not None:
        need = head_memory_bytes(graph, sorted(cut.device))
        if need is None or need > mem_limit:  # unknown never fits
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


def lossy_encoding(graph: LayerGraph, cut: Cut, entry: AccuracyEntry) -> Encoding | None:
    """The entry's lossy codec as an Encoding priced with its measurement at ``cut``: the
    float32 boundary bytes scaled by the measured ratio (the entry's bytes less the
    tensors that travel as they are) and the measured codec ms per MB. None when the
    entry is no lossy codec, measured no bytes, or the boundary holds no float32 bytes
    of known size."""
    codec, level = parse_encoding_key(entry.encoding)
    if level is None or entry.wire_bytes <= 0:
        return None
    floats = other = 0.0
    for name in boundary(graph, cut):
        t = graph.tensor[name]
        if t.bytes_per_sample is None:
            return None
        if t.dtype == "float32":
            floats += t.bytes_per_sample
        else:
            other += t.bytes_per_sample
    if floats <= 0:
        return None
    coded = max(entry.wire_bytes - other, 1.0)
    return Encoding(codec=codec, level=level, ratio=coded / floats, codec_ms_per_mb=entry.codec_ms / (floats / 1e6))


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
    codecs: Sequence[str] = LOSSY_CODECS,
) -> Plan:
    """The best plan whose predicted agreement is at least ``min_agreement``
    ([Note: accuracy budget]); its ``agreement`` field says the figure. ``codecs`` are
    the lossy codecs of the table it may place (() for none; a codec Encoding in
    ``encodings`` allows its own key too). Raises InfeasibleError (constraint
    'min_agreement') naming the calibrate command when no encoding meets the budget
    because none was measured."""
    budget = check_budget(min_agreement)
    obj = Objective.parse(objective)
    c = constraints or Constraints()
    if not encodings:
        raise PlannerError("encodings is empty; give at least one, e.g. (Encoding(),)", field="encodings")
    bad = [x for x in codecs if x not in LOSSY_CODECS]
    if bad:
        raise PlannerError(f"codecs {bad} are unknown; use some of {list(LOSSY_CODECS)}", field="codecs")
    lossless = [e for e in encodings if e.lossless]
    named = [e for e in encodings if e.lossy_codec]
    lossy = [e for e in encodings if not e.lossless and not e.lossy_codec]
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
    if isinstance(link, Sequence) and len(link) == 1:
        link = link[0]
    single = isinstance(link, Link)
    if lossy and len(profiles) == 2 and single:
        first: Link = link  # type: ignore[assignment]
        for enc in lossy:
            measured = False
            for cut_id in accuracy.cut_ids if accuracy is not None else ():
                a = accuracy.agreement(cut_id, enc)  # type: ignore[union-attr]
                measured |= a is not None
                cut = _measured_cut(graph, cut_id) if a is not None and a >= budget else None
                if cut is not None and a is not None:
                    p = _fixed_plan(graph, profiles, first, obj, c, cut, enc, a)
                    if p is not None:
                        candidates.append(p)
            if not measured:
                unmeasured.append(enc.key)
    if len(profiles) == 2 and single:
        allowed = {e.key for e in named}
        codec_plans = _codec_plans(graph, profiles, link, obj, c, accuracy, budget, set(codecs), allowed)  # type: ignore[arg-type]
        candidates += codec_plans
        measured_keys = set(accuracy.encodings) if accuracy is not None else set()
        unmeasured += [k for k in sorted(allowed) if k not in measured_keys]
    if not candidates:
        if errors and not lossy and not named:
            raise errors[0]
        why = (f"encodings {unmeasured} have no measured agreement ({CALIBRATE_HINT})" if unmeasured
               else "no measured cut and encoding reaches it within the constraints")
        raise InfeasibleError(
            f"no plan for {graph.model} agrees with the fp32 model at {budget:g} or more: {why}; or allow fp32 "
            "(lossless) or lower --min-agreement",
            constraint="min_agreement", required=budget, unit="agreement", model=graph.model)
    return min(candidates, key=lambda p: (_value(obj, p), -(p.agreement or 0.0)))


def _codec_plans(graph: LayerGraph, profiles: Sequence[Profile], link: Link, obj: Objective, c: Constraints,
                 accuracy: AccuracyTable | None, budget: float, codecs: set[str], allowed: set[str]) -> list[Plan]:
    """A plan per lossy-codec entry of the table within the budget, at its measured cut."""
    plans: list[Plan] = []
    for e in accuracy.entries if accuracy is not None else ():
        if e.agreement is None or e.agreement < budget:
            continue
        codec, level = parse_encoding_key(e.encoding)
        if level is None or (codec not in codecs and e.encoding not in allowed):
            continue
        cut = _measured_cut(graph, e.cut_id)
        enc = lossy_encoding(graph, cut, e) if cut is not None else None
        if cut is not None and enc is not None:
            p = _fixed_plan(graph, profiles, link, obj, c, cut, enc, e.agreement)
            if p is not None:
                plans.append(p)
    return plans


# -- lossy codecs priced from the table --------------------------------------------------


@dataclass(frozen=True)
class CodecOption:
    """A lossy codec of the accuracy table at its cut, priced on one link: what a user who
    sends the frame as a JPEG gets, to hold a plan against."""

    encoding: str
    """The codec's key: 'jpeg@90'."""
    cut_id: str
    """The cut it was measured at ('L': the model input crosses)."""
    agreement: float
    """Its measured agreement with the fp32 model."""
    wire_bytes: float
    """Measured mean bytes per sample."""
    breakdown: Breakdown
    """The cost model's figures with the measured bytes and codec time."""


def price_codec(graph: LayerGraph, profiles: Sequence[Profile], link: Link, entry: AccuracyEntry) -> Breakdown:
    """The breakdown of the entry's cut as the cost model prices its lossy codec
    (`lossy_encoding`): the uplink carries the entry's measured bytes and the sender's
    codec stage its measured encode + decode ms (on the host that calibrated; counted as
    device time)."""
    cut = _measured_cut(graph, entry.cut_id)
    if cut is None:
        raise PlannerError(f"cut {entry.cut_id!r} of the accuracy table is not a cut of {graph.model}; measure the "
                           f"table again ({CALIBRATE_HINT})", field="accuracy", model=graph.model)
    enc = lossy_encoding(graph, cut, entry)
    if enc is None:
        raise PlannerError(f"entry {entry.encoding} at cut {entry.cut_id} of {graph.model} is no lossy codec with a "
                           f"measured size over float32 tensors of known size; measure it again ({CALIBRATE_HINT})",
                           field="accuracy", model=graph.model)
    return evaluate(graph, cut, profiles, link, enc)


def best_codec(graph: LayerGraph, profiles: Sequence[Profile], link: Link, accuracy: AccuracyTable | None,
               min_agreement: float, *, objective: Objective | str = Objective.LATENCY,
               codecs: Sequence[str] = ("jpeg", "webp")) -> CodecOption | None:
    """The best of the table's ``codecs`` entries at or above ``min_agreement`` on this link
    (by the objective), or None when none is measured within it. With the image codecs
    (the default) this is the cloud-only baseline a camera app would deploy: the frame as
    a JPEG or WebP at the quality that meets the budget."""
    budget = check_budget(min_agreement)
    obj = Objective.parse(objective)
    best: CodecOption | None = None
    for e in accuracy.entries if accuracy is not None else ():
        if e.agreement is None or e.agreement < budget or parse_encoding_key(e.encoding)[0] not in codecs:
            continue
        b = price_codec(graph, profiles, link, e)
        option = CodecOption(e.encoding, e.cut_id, e.agreement, e.wire_bytes, b)
        if best is None or _cost(obj, b) < _cost(obj, best.breakdown):
            best = option
    return best


def _cost(obj: Objective, b: Breakdown) -> float:
    return {Objective.LATENCY: b.total_ms, Objective.ENERGY: b.energy_j, Objective.THROUGHPUT: b.period_ms}[obj]
