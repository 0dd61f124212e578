"""Choosing the placement and encoding: `solve` and the Neurosurgeon scan.

[Note: exactness]
* latency and energy without an SLO or memory limit: exact on any DAG and any number
  of tiers. The cost is modular in the placement except for each tier's constant
  (charged only if it runs a layer) and each hop's RTT (only if a layer lies beyond
  it). `solve` runs one min cut ([Note: min-cut construction]) per set of tiers
  allowed to be non-empty, charging those constants; each such cost is >= the true
  cost with equality when the allowed tiers are all used, so the best true cost over
  the patterns is the optimum.
* every objective and constraint, when the placements number at most ``exact_limit``
  (enumerated, vectorised): exact.
* otherwise (big graphs with throughput, an SLO or a memory limit): the best feasible
  plan among sound candidates: the unconstrained optimum (returned as is when it is
  feasible), Lagrangian min cuts (objective + lambda * latency for an SLO; + mu *
  parameter bytes for memory), the topological-prefix scan and, for throughput,
  min cuts on multiplicatively re-weighted stages, then a local search (move one
  layer across the cut while that helps; two tiers, up to 2,000 layers, no memory
  limit, since each step would re-plan the memory of every neighbour). Every
  returned plan is checked
  against the constraints. Infeasibility is exact for the SLO (the min-latency cut is
  exact) and for memory when head memory grows with the head.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence

import numpy as np

from partitioner.cuts import id_ranges
from partitioner.graph import LayerGraph
from planner.costmodel import (
    _plan_parts, _stages, _Stages, _summaries, _Tables, _tables, cuts_of, require_known_sizes,
)
from planner.errors import InfeasibleError, PlannerError
from planner.memory import head_memory_bytes, unknown_head_tensors
from planner.mincut import _ones, _solve_labels, _Weights
from planner.profile import Profile
from planner.types import Constraints, Encoding, Link, Objective, Plan

__all__ = ["solve", "solve_chain_scan", "DEFAULT_EXACT_LIMIT"]

logger = logging.getLogger(__name__)

DEFAULT_EXACT_LIMIT = 20000
"""Placements `solve` enumerates outright when the objective is not min-cut exact."""
_ENUM_WORK = 30_000_000
"""...and the array cells the enumeration may touch on the way (deep graphs)."""

_MIB = float(1 << 20)


def _links(link: Link | Sequence[Link]) -> tuple[Link, ...]:
    return (link,) if isinstance(link, Link) else tuple(link)


def _pins(graph: LayerGraph, c: Constraints) -> np.ndarray:
    n = len(graph)
    bad = sorted(v for v in c.pinned_device_layers if not 0 <= v < n)
    if bad:
        raise PlannerError(
            f"pinned layer {bad[0]} does not exist: {graph.model} has layers 0..{n - 1}; "
            f"fix pinned_device_layers",
            model=graph.model, field="pinned_device_layers", layer=bad[0],
        )
    if c.first_k_local > n:
        raise PlannerError(
            f"first_k_local is {c.first_k_local} but {graph.model} has only {n} layers; "
            f"use at most {n}",
            model=graph.model, field="first_k_local",
        )
    seeds = set(c.pinned_device_layers) | set(range(c.first_k_local))
    if c.raw_input_stays_on_device:
        for name in graph.inputs:
            seeds.update(graph.tensor[name].consumers)
    pinned = np.zeros(n, dtype=bool)
    stack = list(seeds)
    while stack:
        v = stack.pop()
        if not pinned[v]:
            pinned[v] = True
            stack.extend(graph.preds[v])
    return pinned


def _value(obj: Objective, s: dict[str, np.ndarray]) -> np.ndarray:
    return {Objective.LATENCY: s["total"], Objective.ENERGY: s["energy"], Objective.THROUGHPUT: s["period"]}[obj]


def _obj_weights(tb: _Tables, obj: Objective) -> _Weights:
    k = tb.k
    if obj is Objective.ENERGY:
        idle = tb.idle_w
        seg = np.full(k, idle)
        codec = np.full(k, idle)
        up = np.full(k - 1, idle)
        seg[0] = codec[0] = tb.compute_w
        up[0] = tb.radio_tx_w
        return _Weights(seg, codec, up, np.full(k - 1, idle))
    w = _ones(k)
    if obj is Objective.THROUGHPUT:
        w.seg[-1] = tb.bfactor
    return w


def _add(a: _Weights, b: _Weights, lam: float) -> _Weights:
    return _Weights(a.seg + lam * b.seg, a.codec + lam * b.codec, a.up + lam * b.up, a.down + lam * b.down)


def _patterns(k: int) -> list[tuple[int, ...]]:
    return [c for r in range(k, 0, -1) for c in itertools.combinations(range(k), r)]


def _pattern_labels(tb: _Tables, w: _Weights, pins: np.ndarray, extra0: np.ndarray | None = None
                    ) -> list[np.ndarray]:
    out = []
    for allowed in _patterns(tb.k):
        labels = _solve_labels(tb, w, allowed, pins, extra0)
        if labels is not None:
            out.append(labels)
    return out


def _enumerate(graph: LayerGraph, tb: _Tables, pins: np.ndarray, limit: int) -> np.ndarray | None:
    """Every valid placement (labels never decrease along an edge), or None if more
    than ``limit``."""
    preds = [np.array(sorted(p), dtype=np.int64) for p in graph.preds]
    rows = np.zeros((1, tb.n), dtype=np.int64)
    work = 0
    for v in range(tb.n):
        work += len(rows) * tb.n
        if work > _ENUM_WORK:
            return None
        p = preds[v]
        lo = rows[:, p].max(axis=1) if len(p) else np.zeros(len(rows), dtype=np.int64)
        parts = []
        for level in ((0,) if pins[v] else range(tb.k)):
            sel = rows[lo <= level]
            sel[:, v] = level
            parts.append(sel)
        rows = np.concatenate(parts)
        if len(rows) > limit:
            return None
    return rows


def _prefix_stages(tb: _Tables) -> _Stages:
    """Stage components of the n+1 topological prefixes (two tiers), in O(n + tensors)."""
    n = tb.n
    i = np.arange(n + 1)
    c0 = np.concatenate([[0.0], np.cumsum(tb.unary[0])])
    c1 = np.concatenate([[0.0], np.cumsum(tb.unary[1])])
    seg = np.vstack([c0, c1[-1] - c1])
    nonempty = np.vstack([i > 0, i < n])
    if len(tb.t_prod):
        maxc = np.maximum.reduceat(tb.t_cons, tb.t_off)
    else:
        maxc = np.zeros(0, dtype=np.int64)

    def span(lo: np.ndarray, hi: np.ndarray, val: np.ndarray) -> np.ndarray:
        d = np.zeros(n + 2)
        np.add.at(d, lo, val)
        np.add.at(d, hi + 1, -val)
        return np.cumsum(d)[: n + 1]

    lo, hi = tb.t_prod + 1, maxc
    up = span(lo, hi, tb.up[0])[None, :]
    codec = np.vstack([span(lo, hi, tb.enc[0]), span(lo, hi, tb.dec[0])])
    has = tb.o_prod >= 0
    down = span(np.zeros(int(has.sum()), dtype=np.int64), tb.o_prod[has], tb.down[0][has])[None, :]
    rtt = np.where(i < n, tb.rtt[0], 0.0)
    return _Stages(seg=seg, nonempty=nonempty, codec=codec, up=up, down=down, rtt=rtt,
                   boundary=np.zeros((n + 1, 0), dtype=bool))


def _prefix_labels(n: int, i: int) -> np.ndarray:
    return (np.arange(n) >= i).astype(np.int64)


class _Search:
    """Candidates for one (encoding, batch), evaluated and filtered together."""

    def __init__(self, graph: LayerGraph, tb: _Tables, obj: Objective, pins: np.ndarray,
                 slo_ms: float | None, mem_limit: int | None) -> None:
        self.graph, self.tb, self.obj, self.pins = graph, tb, obj, pins
        self.slo_ms, self.mem_limit = slo_ms, mem_limit
        self._mem: dict[bytes, int | None] = {}

    def memory(self, labels: np.ndarray) -> int | None:
        """The head's memory; None where it holds a tensor of unknown size (it never fits a limit)."""
        dev = labels == 0
        key = np.packbits(dev).tobytes()
        if key not in self._mem:
            self._mem[key] = head_memory_bytes(self.graph, np.flatnonzero(dev).tolist())
        return self._mem[key]

    def fits(self, labels: np.ndarray) -> bool:
        """Within the device memory limit (cheap weight check first)."""
        if self.mem_limit is None:
            return True
        if float(self.tb.param_bytes[labels == 0].sum()) > self.mem_limit:
            return False
        need = self.memory(labels)
        return need is not None and need <= self.mem_limit

    def score(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(objective value, latency, meets the SLO) per row; memory is checked lazily."""
        s = _summaries(self.tb, _stages(self.tb, rows))
        value, lat = _value(self.obj, s), s["total"]
        ok = np.ones(len(rows), dtype=bool)
        if self.slo_ms is not None:
            ok &= lat <= self.slo_ms * (1 + 1e-12)
        return value, lat, ok

    def best(self, rows: np.ndarray) -> tuple[float, np.ndarray] | None:
        """The best feasible row. Memory plans are costly, so rows are tried best
        first and the first that fits wins."""
        value, _, ok = self.score(rows)
        for r in np.flatnonzero(ok)[np.argsort(value[ok], kind="stable")]:
            if self.fits(rows[r]):
                return float(value[r]), rows[r]
        return None


def _heuristic_rows(search: _Search, exact_rows: list[np.ndarray]) -> list[np.ndarray]:
    tb, obj, pins = search.tb, search.obj, search.pins
    rows = list(exact_rows)
    base = _obj_weights(tb, obj)
    lat_w = _ones(tb.k)
    scale_ms = max(float(tb.unary.sum()), 1e-9)
    if search.slo_ms is not None and obj is not Objective.LATENCY:
        for lam in np.geomspace(1e-3, 1e4, 15):
            norm = float(base.seg.max() + base.up.max() + 1e-12)
            rows += _pattern_labels(tb, _add(base, lat_w, lam * norm), pins)
    if search.mem_limit is not None:
        total_params = max(float(tb.param_bytes.sum()), 1.0)
        for mu in np.geomspace(1e-3, 1e4, 15):
            extra = tb.param_bytes * (mu * scale_ms / total_params)
            rows += _pattern_labels(tb, base, pins, extra)
        closure = np.where(pins, 0, tb.k - 1).astype(np.int64)
        rows.append(closure)
    if obj is Objective.THROUGHPUT:
        w = _obj_weights(tb, obj)
        rows += _pattern_labels(tb, w, pins)
        every = tuple(range(tb.k))
        seen: set[bytes] = set()
        for _ in range(12):
            # one cut per round, all tiers allowed: the patterns matter for exact sums,
            # not for this search
            labels = _solve_labels(tb, w, every, pins)
            if labels is None or labels.tobytes() in seen:
                break
            seen.add(labels.tobytes())
            rows.append(labels)
            st = _summaries(tb, _stages(tb, labels[None, :]))
            b = int(st["bottleneck"][0])
            k = tb.k
            # stage order: tiers, ups, downs (see costmodel._summaries)
            if b < k:
                w = dataclasses.replace(w, seg=w.seg.copy(), codec=w.codec.copy())
                w.seg[b] *= 2.0
                w.codec[b] *= 2.0
            elif b < 2 * k - 1:
                w = dataclasses.replace(w, up=w.up.copy())
                w.up[b - k] *= 2.0
            else:
                w = dataclasses.replace(w, down=w.down.copy())
                w.down[b - 2 * k + 1] *= 2.0
    if tb.k == 2:
        s = _summaries(tb, _prefix_stages(tb))
        value, lat = _value(obj, s), s["total"]
        ok = np.ones(tb.n + 1, dtype=bool)
        if search.slo_ms is not None:
            ok &= lat <= search.slo_ms
        first = int(np.flatnonzero(pins).max()) + 1 if pins.any() else 0
        ok[:first] = False
        order = np.argsort(np.where(ok, value, np.inf))[:32]
        rows += [_prefix_labels(tb.n, int(i)) for i in order if ok[i]]
    return rows


_LOCAL_SEARCH_MAX_LAYERS = 2000
_LOCAL_SEARCH_STEPS = 50


def _local_search(graph: LayerGraph, search: _Search, start: np.ndarray) -> np.ndarray:
    """Hill-climb from ``start`` (two tiers): move one layer whose producers are all on
    the device onto it, or one whose consumers are all in the cloud off it, while the
    objective (among feasible placements) improves."""
    tb = search.tb
    preds = graph.preds
    succs = graph.succs
    cur = start.copy()
    cur_v = search.score(cur[None, :])
    if not cur_v[2][0]:
        return start
    best_v = float(cur_v[0][0])
    for _ in range(_LOCAL_SEARCH_STEPS):
        dev = cur == 0
        moves = []
        for v in range(tb.n):
            if dev[v]:
                if not search.pins[v] and all(not dev[c] for c in succs[v]):
                    moves.append(v)
            elif all(dev[p] for p in preds[v]):
                moves.append(v)
        if not moves:
            break
        rows = np.repeat(cur[None, :], len(moves), axis=0)
        idx = np.arange(len(moves))
        rows[idx, moves] = 1 - rows[idx, moves]
        value, _, ok = search.score(rows)
        value = np.where(ok, value, np.inf)
        j = int(np.argmin(value))
        if not value[j] < best_v * (1 - 1e-12):
            break
        best_v = float(value[j])
        cur = rows[j]
    return cur


def _infeasible(graph: LayerGraph, search: _Search, rows: np.ndarray | None) -> InfeasibleError:
    """Say which constraint cannot be met, and by how much."""
    tb, pins = search.tb, search.pins
    if rows is None:
        closure = np.where(pins, 0, tb.k - 1).astype(np.int64)
        rows = np.array(_pattern_labels(tb, _ones(tb.k), pins) + [closure])
    s = _summaries(tb, _stages(tb, rows))
    fastest = float(s["total"].min())
    pinned = np.flatnonzero(pins)
    where = f"keeps layers {_ranges(pinned)} local" if len(pinned) else "runs nothing on the device"
    if search.slo_ms is not None and fastest > search.slo_ms * (1 + 1e-12):
        return InfeasibleError(
            f"latency SLO: the fastest plan takes {fastest:.3f} ms, the SLO is {search.slo_ms:.3f} ms "
            f"({fastest - search.slo_ms:.3f} ms over); raise the latency SLO (--slo), use a faster link or "
            f"unpin layers",
            constraint="latency_slo", required=fastest, limit=search.slo_ms, unit="ms", model=graph.model,
        )
    mems = [m for m in (search.memory(r) for r in rows) if m is not None]
    limit = search.mem_limit
    if limit is not None and not mems:
        unknown = unknown_head_tensors(graph, np.flatnonzero(rows[0] == 0).tolist())
        return InfeasibleError(
            f"device memory: every head that {where} holds tensors of unknown size "
            f"({', '.join(repr(n) for n in unknown[:5])}), so none can be shown to fit the device's "
            f"{limit / _MIB:.1f} MiB; fix the input shapes with --input-shape NAME=D0xD1x... (input_shapes=) "
            "or pass sample inputs with --inputs FILE.npz (inputs=)",
            constraint="device_memory", limit=limit, unit="bytes", model=graph.model,
        )
    least = min(mems, default=0)
    if limit is not None and least > limit:
        return InfeasibleError(
            f"device memory: the smallest head that {where} needs {least / _MIB:.1f} MiB, the device "
            f"has {limit / _MIB:.1f} MiB; raise --device-memory or unpin layers",
            constraint="device_memory", required=least, limit=limit, unit="bytes", model=graph.model,
        )
    return InfeasibleError(
        f"no plan meets the latency SLO ({search.slo_ms} ms) and the device memory "
        f"({(limit or 0) / _MIB:.1f} MiB) together: each alone can be met; relax one of them",
        constraint="combined", model=graph.model,
    )


def _ranges(ids: np.ndarray) -> str:
    return ",".join(id_ranges(int(x) for x in ids))


def _check_inputs(graph: LayerGraph, profiles: Sequence[Profile], links: tuple[Link, ...]) -> None:
    if len(graph) == 0:
        raise PlannerError(f"model {graph.model} has no layers; nothing to place", model=graph.model)


def solve(
    graph: LayerGraph,
    profiles: Sequence[Profile],
    link: Link | Sequence[Link],
    objective: Objective | str = Objective.LATENCY,
    constraints: Constraints | None = None,
    encodings: Sequence[Encoding] = (Encoding(),),
    *,
    exact_limit: int = DEFAULT_EXACT_LIMIT,
) -> Plan:
    """The best plan for ``objective`` under ``constraints``; see [Note: exactness].

    ``profiles`` lists the tiers device first (two: device, cloud; three: device,
    edge server, cloud); ``link`` is one Link per hop. Each encoding is solved on its
    own and the best kept. Throughput also tries each batch size in the last tier's
    ``batch_ms``. Raises InfeasibleError naming the constraint that cannot be met.
    Pure: no I/O, no clocks.
    """
    obj = Objective.parse(objective)
    c = constraints or Constraints()
    links = _links(link)
    _check_inputs(graph, profiles, links)
    if not encodings:
        raise PlannerError("encodings is empty; give at least one, e.g. (Encoding(),)", field="encodings")
    lossy = [e.key for e in encodings if e.lossy_codec]
    if lossy:
        # A codec's size and error are measured at one cut: pricing it at every placement,
        # and placing it without a bound on its accuracy cost, would both be guesses.
        raise PlannerError(
            f"lossy codecs {lossy} are placed only within an accuracy budget, at the cuts the accuracy table "
            "measured: call planner.budget.solve_within_budget (min_agreement=, accuracy=) or drop them",
            model=graph.model, field="encodings")
    pins = _pins(graph, c)
    mem_limit = c.device_memory_bytes if c.device_memory_bytes is not None else profiles[0].memory_bytes
    slo = c.latency_slo_ms
    batches = [1]
    if obj is Objective.THROUGHPUT and profiles[-1].batch_ms:
        batches += sorted(b for b in profiles[-1].batch_ms if b > 1)
    best: tuple[float, np.ndarray, _Tables, Encoding] | None = None
    enum_rows: np.ndarray | None = None
    enum_done = False
    searches: list[_Search] = []
    for enc in encodings:
        for b in batches:
            tb = _tables(graph, profiles, links, enc, b)
            search = _Search(graph, tb, obj, pins, slo, mem_limit)
            searches.append(search)
            found: tuple[float, np.ndarray] | None = None
            exact_rows: list[np.ndarray] = []
            if obj is not Objective.THROUGHPUT:
                exact_rows = _pattern_labels(tb, _obj_weights(tb, obj), pins)
                value, _, ok = search.score(np.array(exact_rows))
                r = int(np.argmin(value))
                # the unconstrained optimum, if feasible; otherwise search on
                found = (float(value[r]), exact_rows[r]) if ok[r] and search.fits(exact_rows[r]) else None
            if found is None:
                if not enum_done:
                    enum_rows = _enumerate(graph, tb, pins, exact_limit) if exact_limit > 0 else None
                    enum_done = True
                if enum_rows is not None:
                    found = search.best(enum_rows)
                else:
                    rows = _heuristic_rows(search, exact_rows)
                    found = search.best(np.array(rows)) if rows else None
                    if (found is not None and tb.k == 2 and tb.n <= _LOCAL_SEARCH_MAX_LAYERS
                            and mem_limit is None):
                        better = _local_search(graph, search, found[1])
                        found = search.best(np.array([found[1], better]))
            if found is not None and (best is None or found[0] < best[0]):
                best = (found[0], found[1], tb, enc)
    if best is None:
        # the SLO is missed by the least with the fastest encoding and batch
        errs = [_infeasible(graph, sr, enum_rows) for sr in searches]
        slo_errs = [e for e in errs if e.constraint == "latency_slo"]
        err = min(slo_errs, key=lambda e: e.required or 0.0) if len(slo_errs) == len(errs) else next(
            e for e in errs if e.constraint != "latency_slo")
        logger.info("no feasible plan for %s (%s, %s): %s", graph.model, obj.value, c, err.message)
        raise err
    value, labels, tb, enc = best
    breakdown, crossing = _plan_parts(tb, labels)
    require_known_sizes(graph, cuts_of(labels, tb.k))  # [Note: unknown sizes] in costmodel.py
    plan = Plan(
        model=graph.model,
        cuts=cuts_of(labels, tb.k),
        encoding=enc,
        objective=obj,
        link=links[0],
        breakdown=breakdown,
        boundary=crossing,
        next_links=links[1:],
    )
    logger.debug("planned %s for %s: %d device layers, %s, %s=%.6g", graph.model, obj.value,
                 len(plan.edge_layers), enc.key, obj.value, value)
    return plan


def solve_chain_scan(
    graph: LayerGraph,
    profiles: Sequence[Profile],
    link: Link,
    objective: Objective | str = Objective.LATENCY,
    encodings: Sequence[Encoding] = (Encoding(),),
) -> Plan:
    """Neurosurgeon: the best cut among the n+1 prefixes of the topological order.

    Exact on chains (every cut is a prefix); on a DAG it is the "Neurosurgeon on a
    DAG" baseline. Two tiers only; no constraints.
    """
    obj = Objective.parse(objective)
    if len(profiles) != 2:
        raise PlannerError(
            f"the chain scan places on two tiers, got {len(profiles)} profiles; use solve() for more",
            model=graph.model, field="profiles",
        )
    _check_inputs(graph, profiles, (link,))
    best = None
    batches = [1]
    if obj is Objective.THROUGHPUT and profiles[-1].batch_ms:
        batches += sorted(b for b in profiles[-1].batch_ms if b > 1)
    for enc in encodings:
        for b in batches:
            tb = _tables(graph, profiles, (link,), enc, b)
            value = _value(obj, _summaries(tb, _prefix_stages(tb)))
            i = int(np.argmin(value))
            if best is None or value[i] < best[0]:
                best = (float(value[i]), i, tb, enc)
    assert best is not None
    _, i, tb, enc = best
    labels = _prefix_labels(tb.n, i)
    breakdown, crossing = _plan_parts(tb, labels)
    require_known_sizes(graph, cuts_of(labels, 2))
    return Plan(graph.model, cuts_of(labels, 2), enc, obj, link, breakdown, crossing)
