"""The fleet planner: per-class cuts, tails and the workers a fleet needs, with the cloud's load in the plan.

    from planner.fleet import plan_fleet
    from planner.fleet_spec import FleetSpec
    result = plan_fleet(FleetSpec.from_dict(yaml.safe_load(text)))
    result.workers_needed, result.classes[0].p95_ms

`plan_fleet` resolves the spec's model and device names through a `planner.whatif.Workspace`
(which reads the model files) and calls the pure core, `plan_resolved`.

[Note: fleet links]
Each class's uplink and RTT spreads are planned at their points (`Spread.points`: the
listed values, or 9 quantiles of a lognormal), every (uplink, RTT) pair a group of
devices with its probability. A group's options are the agent's: every remote plan of
the class's frontier (`planner.frontier` over the class's uplink range; the plans an
agent preloads) and the whole model locally. A remote option's time at the group's link
is the edge policy's ([Note: policy] in edge_agent/policy.py): the plan rescaled to the
uplink, the RTT swapped, and the device's own uplink as an M/D/1 queue at the class's
frame rate (an option loading it past 0.9 is out).

[Note: fleet fixed point]
A device adds the cloud's wait to every remote option and picks as the policy does:
an option that meets the SLO beats one that misses it, then the fastest. The cloud's
wait in turn depends on who offloads ([Note: batch queue] in planner/queueing.py). The
plan is the fixed point W = F(W), where W is the cloud's delay beyond a plan's idle,
batch-1 figure (the wait for a worker, the batch's fill, and the longer run of a larger
batch, averaged over requests), and F(W) is that delay when every group chooses at W.
F does not increase with W (a larger wait only moves groups off the cloud), so
g(W) = F(W) - W falls from g(0) >= 0 and crosses 0 once; bisection on [0, W_hi] halves
the bracket every step and converges (`FixedPoint.trace` shows it). At a crossing
inside a jump of F (a group switching moves more load than the gap), the bracket's two
choice sets are mixed: a share theta of the switching groups moves, theta found by a
second bisection so that F equals W. This is the Wardrop equilibrium of the fleet: no
device gains by another choice at the wait that the choices make.
A remote request's answer comes by the agent's remote budget at the latest ([Note: remote
budget] in edge_agent/runner.py): if the cloud has not answered once the request is sent
(the head and its encode done: the upload is part of the remote call, and the device's
core is free for the tail meanwhile) plus max(SLO - head - tail, 0.3 SLO), the local
tail runs, so the latency is the smaller of the cloud's and that. The agent's hedge
([Note: hedge] in edge_agent/hedge.py) starts the tail earlier where it still lands by
the SLO: at the last moment with the default `planner.costmodel.HEDGE_MARGIN` of its time
to spare, or with what is left of it, if that moment comes after the send (the policy
may start it sooner; planned at that moment the answer is no earlier than the agent's).
Where the local tail fits the SLO, a long cloud wait costs goodput only through the
capacity it takes.
Admission control is the gateway's: a request whose predicted wait exceeds the deadline
is refused and answered locally. When the load would overload the workers or wait past
the longest SLO, the admitted share is cut until it does not (a bisection), and the
refused share is answered by the device's local tail after the refusal's round trip.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from partitioner import Cut, LayerGraph
from planner.queueing import QueueState, admission, batch_queue, run_ms_table
from planner.costmodel import evaluate, goes_urgent, latest_local_start_ms, remote_budget_ms
from planner.errors import PlannerError
from planner.fleet_result import ClassPlan, CloudPlan, FixedPoint, FleetPlan, ModelPlan, OptionShare, PoolPlan
from planner.fleet_spec import MAX_WORKERS, DeviceClass, FleetSpec, FleetSpecConflict
from planner.frontier import Frontier, frontier
from planner.profile import Profile
from planner.types import LinkRange
from planner.whatif import NotFoundError, Workspace

__all__ = ["ClassModel", "ClassPlan", "CloudPlan", "FixedPoint", "FleetPlan", "ModelPlan", "OptionShare",
           "PoolPlan", "ClassChoices", "plan_fleet", "plan_resolved", "planned_choices", "resolve", "remote_ms",
           "run_ms_table"]

_MAX_UPLINK_UTILISATION = 0.9  # as the edge policy's
_BISECTIONS = 60
_TOL_MS = 1e-3
_MIX_BISECTIONS = 24


# -- resolved inputs ------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class ClassModel:
    """One class's resolved inputs: the frontier its agents preload and its local time."""

    cls: DeviceClass
    graph: LayerGraph
    device: Profile
    cloud: Profile
    frontier: Frontier
    """The class's plans across its uplink range, as agents get them."""
    local_ms: float
    """The whole model on the device."""


def resolve(spec: FleetSpec, workspace: Workspace | None = None) -> tuple[ClassModel, ...]:
    """Each class's graph, profiles, frontier and local time; unknown names raise `FleetSpecConflict`."""
    ws = workspace if workspace is not None else Workspace()
    resolved = []
    for i, c in enumerate(spec.classes):
        try:
            graph = ws.graph(c.model)
        except NotFoundError as e:
            raise FleetSpecConflict(f"classes[{i}].model: {e.message}", field=f"classes[{i}].model") from None
        profiles = []
        for name, path in ((c.device, f"classes[{i}].device"), (spec.cloud.device, "cloud.device")):
            try:
                profiles.append(ws.profile(graph, name, path))
            except PlannerError as e:
                raise FleetSpecConflict(f"{path}: {e.message}", field=path) from None
        resolved.append((c, graph, profiles[0], profiles[1]))
    # One frontier per (model, device, cloud, down ratio) over every such class's uplinks, as an
    # agent's frontier covers its whole range; each option is then rescaled to the group's link.
    spans: dict[tuple[Any, ...], tuple[float, float, list[float]]] = {}
    for c, graph, dev, cloud in resolved:
        ups = c.up_mbps.points()[0] * 1e6
        key = (c.model, id(dev), id(cloud), c.down_ratio)
        lo, hi, rtts = spans.get(key, (math.inf, 0.0, []))
        spans[key] = (min(lo, float(ups.min())), max(hi, float(ups.max())), rtts + [c.rtt_ms.median])
    fronts: dict[tuple[Any, ...], Frontier] = {}
    out = []
    for c, graph, dev, cloud in resolved:
        key = (c.model, id(dev), id(cloud), c.down_ratio)
        if key not in fronts:
            lo, hi, rtts = spans[key]
            rng = LinkRange(lo, hi, c.down_ratio, float(np.median(rtts)))
            fronts[key] = frontier(graph, [dev, cloud], rng, "latency", None, spec.encoding_values)
        rng = fronts[key].link_range
        local = evaluate(graph, Cut(frozenset(range(len(graph)))), [dev, cloud], rng.at(rng.up_lo_bps)).total_ms
        out.append(ClassModel(c, graph, dev, cloud, fronts[key], local))
    return tuple(out)


def remote_ms(front: Frontier, entry_index: int, up_bps: float, rtt_ms: float, rps: float) -> tuple[float, Any]:
    """A remote option's predicted ms at this link and request rate, as the edge policy computes it
    ([Note: fleet links]); inf when the rate would load the uplink past 0.9. Also the breakdown."""
    p = dataclasses.replace(front, entries=(front.entries[entry_index],)).plan_at(up_bps)
    b = p.breakdown
    ms = b.total_ms - b.rtt_ms + rtt_ms
    util = rps * b.uplink_ms / 1e3
    if util >= _MAX_UPLINK_UTILISATION:
        return math.inf, b
    return ms + b.uplink_ms * util / (2.0 * (1.0 - util)), b


# -- the core -------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class _Groups:
    """Every (class, uplink point, RTT point) group and its options, as arrays (G groups, O options)."""

    cls: np.ndarray  # (G,) class index
    rate: np.ndarray  # (G,) requests/s
    slo: np.ndarray  # (G,)
    local: np.ndarray  # (G,)
    ms: np.ndarray  # (G, O) remote option ms at the group's link (inf: not an option)
    pre: np.ndarray  # (G, O) ms until the cloud's refusal is back at the device
    tail: np.ndarray  # (G, O) the local tail after that option's head
    cap: np.ndarray  # (G, O) when the budget's local tail answers if the cloud has not (from the start)
    urgent: np.ndarray  # (G, O) its requests go with priority 1 (no local answer in time)
    pool: np.ndarray  # (O,) pool index
    t1: np.ndarray  # (O,) the option's cloud ms at batch 1
    names: tuple[tuple[str, int, str], ...]  # per option: key, edge layers, encoding
    pools: tuple[str, ...]
    table: np.ndarray  # (P, max_batch) run ms


def _groups(spec: FleetSpec, models: Sequence[ClassModel]) -> _Groups:
    option_of: dict[tuple[str, str], int] = {}
    names: list[tuple[str, int, str]] = []
    pool_of: dict[str, int] = {}
    opt_pool: list[int] = []
    t1: list[float] = []
    segs: list[np.ndarray] = []
    rows: list[tuple[int, float, float, float, dict[int, tuple[float, float, float]]]] = []
    for i, m in enumerate(models):
        c = m.cls
        ups, wu = c.up_mbps.points()
        rtts, wr = c.rtt_ms.points()
        slo = spec.slo(c.model).slo_ms
        remote = [(k, e) for k, e in enumerate(m.frontier.entries) if e.plan.boundary]
        for u, pu in zip(ups, wu):
            for r, pr in zip(rtts, wr):
                opts: dict[int, tuple[float, float, float]] = {}
                for k, e in remote:
                    ms, b = remote_ms(m.frontier, k, float(u) * 1e6, float(r), c.fps)
                    if not math.isfinite(ms):
                        continue
                    key = (c.model, e.plan.key)
                    o = option_of.get(key)
                    if o is None:
                        o = option_of[key] = len(names)
                        names.append((e.plan.key, len(e.plan.cut.device), e.plan.encoding.key))
                        pool = f"{c.model}@{e.plan.cut.key or 'whole'}"
                        opt_pool.append(pool_of.setdefault(pool, len(pool_of)))
                        t1.append(b.cloud_ms)
                        if len(segs) < len(pool_of):
                            seg = max(0.0, b.tier_ms[-1] - m.cloud.segment_const_ms)
                            segs.append(run_ms_table(np.array([seg]), m.cloud.segment_const_ms, m.cloud.batch_ms,
                                                     spec.cloud.max_batch)[0])
                    pre = ms - b.cloud_ms - b.downlink_ms
                    tail_ms = max(0.0, m.local_ms - b.edge_ms)
                    send_ms = b.edge_ms + b.encode_ms  # the upload is the remote call's: the timers run from here
                    # the agent's remote budget: the local tail starts then if nothing came back
                    cap = send_ms + remote_budget_ms(slo, b.edge_ms, tail_ms) + tail_ms
                    hedge_ms = latest_local_start_ms(slo, tail_ms, now_ms=send_ms)  # [Note: fleet fixed point]
                    if hedge_ms > send_ms:
                        cap = min(cap, hedge_ms + tail_ms)
                    opts[o] = (ms, pre, tail_ms, cap, goes_urgent(slo, send_ms, tail_ms))
                rows.append((i, c.count * c.fps * pu * pr, slo, m.local_ms, opts))
    g, o = len(rows), len(names)
    ms = np.full((g, o), math.inf)
    pre = np.zeros((g, o))
    tail = np.zeros((g, o))
    cap = np.full((g, o), math.inf)
    urgent = np.zeros((g, o), dtype=bool)
    for j, (_, _, _, _, opts) in enumerate(rows):
        for k, (a, b2, t, f, u) in opts.items():
            ms[j, k], pre[j, k], tail[j, k], cap[j, k], urgent[j, k] = a, b2, t, f, u
    table = np.array(segs) if segs else np.zeros((0, spec.cloud.max_batch))
    return _Groups(np.array([r[0] for r in rows]), np.array([r[1] for r in rows]), np.array([r[2] for r in rows]),
                   np.array([r[3] for r in rows]), ms, pre, tail, cap, urgent, np.array(opt_pool, dtype=int),
                   np.array(t1), tuple(names), tuple(pool_of), table)


def _choose(gr: _Groups, delay_ms: float) -> np.ndarray:
    """One-hot choices (G, O + 1; the last column is local) when the cloud adds ``delay_ms``;
    the edge policy's rules 1-2."""
    g, o = gr.ms.shape
    x = np.zeros((g, o + 1))
    if o:
        cost = gr.ms + delay_ms
        best = cost.argmin(axis=1)
        best_ms = cost[np.arange(g), best]
    else:
        best = np.zeros(g, dtype=int)
        best_ms = np.full(g, math.inf)
    rm, lm = best_ms <= gr.slo, gr.local <= gr.slo
    local = np.where(~np.isfinite(best_ms), True,
                     np.where(~np.isfinite(gr.local), False,
                              np.where(~rm & lm, True, np.where(rm & ~lm, False, gr.local < best_ms))))
    x[np.arange(g), np.where(local, o, best)] = 1.0
    return x


@dataclass(frozen=True, eq=False)
class _Load:
    rates: np.ndarray  # per pool, offered
    queue: QueueState  # at the admitted rates
    admitted: float  # share of the offered requests
    delay_ms: float  # F
    mean_wait_ms: float  # for a worker, over the admitted requests
    refused: np.ndarray  # (G, O) share of each option's requests refused
    wait_ms: np.ndarray  # (G, O) mean wait for a worker of the admitted
    p_wait: np.ndarray  # (G, O) chance that an admitted request waits for a worker


def _load(gr: _Groups, x: np.ndarray, workers: int, timeout_ms: float) -> _Load:
    """The cloud at choices ``x``: each request admitted or refused against its own deadline
    ([Note: admission by deadline] in planner/queueing.py)."""
    per_group = gr.rate[:, None] * x[:, :-1]
    per_option = per_group.sum(axis=0)
    rates = np.bincount(gr.pool, weights=per_option, minlength=len(gr.pools)) if len(gr.pools) else np.zeros(0)
    total = float(rates.sum())
    zeros = np.zeros_like(per_group)
    q = batch_queue(rates, gr.table, workers, timeout_ms)
    if total <= 0:
        return _Load(rates, q, 1.0, 0.0, 0.0, zeros, zeros, zeros)
    # A request's slack for the wait: the SLO less the device's side of the trip and its batch's fill and run.
    side = np.where(np.isfinite(gr.ms), gr.slo[:, None] - (gr.ms - gr.t1[None, :]), 0.0)
    slack = side - (q.fill_ms + q.run_ms)[gr.pool][None, :]
    live = per_group > 0
    refused, wait, p_wait = zeros.copy(), zeros.copy(), zeros.copy()
    if live.any():
        full = np.broadcast_to(gr.table[gr.pool, -1], per_group.shape)
        r, wt, pw = admission(per_group[live], slack[live], full[live], workers, gr.table.shape[1])
        refused[live], wait[live], p_wait[live] = r, wt, pw
    kept = per_group * (1.0 - refused)
    admitted_rates = np.bincount(gr.pool, weights=kept.sum(axis=0), minlength=len(gr.pools))
    q = batch_queue(admitted_rates, gr.table, workers, timeout_ms)
    admitted = float(kept.sum()) / total
    share = admitted_rates / max(float(admitted_rates.sum()), 1e-12)
    t1_pool = np.zeros(len(gr.pools))
    t1_pool[gr.pool] = gr.t1
    mean_wait = float((kept * wait).sum()) / max(float(kept.sum()), 1e-12)
    delay = mean_wait + float((share * (q.fill_ms + q.run_ms - t1_pool)).sum())
    return _Load(rates, q, admitted, delay, mean_wait, refused, wait, p_wait)


def _equilibrium(gr: _Groups, workers: int, timeout_ms: float) -> tuple[np.ndarray, _Load, FixedPoint]:
    """[Note: fleet fixed point]."""
    def f(w: float) -> tuple[np.ndarray, _Load]:
        x = _choose(gr, w)
        return x, _load(gr, x, workers, timeout_ms)

    x0, l0 = f(0.0)
    trace = [(0.0, l0.delay_ms)]
    if l0.delay_ms <= _TOL_MS:
        return x0, l0, FixedPoint(0.0, l0.delay_ms, 1, 0.0, tuple(trace))
    gaps = gr.local[:, None] - gr.ms
    finite_gaps = gaps[np.isfinite(gaps)]
    widest_gap = float(finite_gaps.max()) if finite_gaps.size else 0.0  # past it every group that can leave has
    hi = max(float(gr.slo.max()) + float(gr.table[:, -1].max()), widest_gap) + 1.0
    x_hi, l_hi = f(hi)
    trace.append((hi, l_hi.delay_ms))
    lo, x_lo = 0.0, x0
    its = 2
    for _ in range(_BISECTIONS):
        if hi - lo <= _TOL_MS:
            break
        mid = (lo + hi) / 2
        xm, lm = f(mid)
        its += 1
        trace.append((mid, lm.delay_ms))
        if lm.delay_ms > mid:
            lo, x_lo = mid, xm
        else:
            hi, x_hi, l_hi = mid, xm, lm
    w = (lo + hi) / 2
    if np.array_equal(x_lo, x_hi):
        return x_hi, l_hi, FixedPoint(w, abs(l_hi.delay_ms - w), its, 0.0, tuple(trace))
    a, b = 0.0, 1.0  # theta: share of the switching groups that take the high-wait choice
    for _ in range(_MIX_BISECTIONS):
        mid = (a + b) / 2
        lm = _load(gr, x_lo * (1 - mid) + x_hi * mid, workers, timeout_ms)
        its += 1
        if lm.delay_ms > w:
            a = mid
        else:
            b = mid
    theta = (a + b) / 2
    x = x_lo * (1 - theta) + x_hi * theta
    lx = _load(gr, x, workers, timeout_ms)
    return x, lx, FixedPoint(w, abs(lx.delay_ms - w), its, theta, tuple(trace))


def _latency_parts(gr: _Groups, x: np.ndarray, ld: _Load) -> tuple[np.ndarray, ...]:
    """Per (group, branch): weight (req/s), fixed ms, P(wait for a worker), mean of that wait when it
    happens, and the latest answer (the remote budget's local tail; inf: none). Branches: each
    option admitted, each option refused, local."""
    g, o = gr.ms.shape
    q = ld.queue
    pool_extra = (q.fill_ms + q.run_ms)[gr.pool] - gr.t1 if o else np.zeros(0)
    w_adm = gr.rate[:, None] * x[:, :-1] * (1.0 - ld.refused)
    w_ref = gr.rate[:, None] * x[:, :-1] * ld.refused
    ms = np.where(np.isfinite(gr.ms), gr.ms, 0.0)
    weights = np.concatenate([w_adm, w_ref, (gr.rate * x[:, -1])[:, None]], axis=1)
    refused = np.minimum(gr.pre, gr.cap - gr.tail) + gr.tail
    fixed = np.concatenate([np.minimum(ms + pool_extra[None, :], gr.cap), refused,
                            np.where(np.isfinite(gr.local), gr.local, 0.0)[:, None]], axis=1)
    pw = np.concatenate([ld.p_wait, np.zeros((g, o + 1))], axis=1)
    m = np.concatenate([np.divide(ld.wait_ms, ld.p_wait, out=np.zeros_like(ld.wait_ms), where=ld.p_wait > 0),
                        np.zeros((g, o + 1))], axis=1)
    cap = np.concatenate([gr.cap, np.full((g, o + 1), math.inf)], axis=1)
    return weights, fixed, pw, m, cap


def _cdf(t: float, w: np.ndarray, x: np.ndarray, pw: np.ndarray, m: np.ndarray, cap: np.ndarray) -> float:
    tot = w.sum()
    if tot <= 0:
        return 1.0
    d = t - x
    tail = np.where(m > 0, np.exp(-np.maximum(d, 0.0) / np.where(m > 0, m, 1.0)), 0.0)
    p = np.where(t >= cap, 1.0, (d >= 0) * (1.0 - pw * tail))
    return float((w * p).sum() / tot)


def _quantile(q: float, w: np.ndarray, x: np.ndarray, pw: np.ndarray, m: np.ndarray, cap: np.ndarray) -> float:
    keep = w > 0
    if not keep.any():
        return math.nan
    w, x, pw, m, cap = w[keep], x[keep], pw[keep], m[keep], cap[keep]
    lo, hi = float(x.min()), float(x.max() + 50.0 * max(1.0, float(m.max())))
    for _ in range(60):
        mid = (lo + hi) / 2
        if _cdf(mid, w, x, pw, m, cap) >= q:
            hi = mid
        else:
            lo = mid
    return hi


def _solve(spec: FleetSpec, gr: _Groups, workers: int) -> tuple[np.ndarray, _Load, FixedPoint, list[ModelPlan]]:
    x, ld, fp = _equilibrium(gr, workers, spec.cloud.batch_timeout_ms)
    w, fixed, pw, m, cap = _latency_parts(gr, x, ld)
    models = []
    for slo in spec.models:
        rows = np.array([spec.classes[int(c)].model == slo.name for c in gr.cls])
        within = _cdf(slo.slo_ms, w[rows], fixed[rows], pw[rows], m[rows], cap[rows]) if rows.any() else 1.0
        models.append(ModelPlan(slo.name, slo.slo_ms, slo.target, within, within >= slo.target - 1e-12))
    return x, ld, fp, models


def _workers_needed(spec: FleetSpec, gr: _Groups, start: int) -> tuple[int | None, str]:
    """The fewest workers with which every model meets its target: from ``start``, doubling up or
    halving down to a bracket, then bisection."""
    seen: dict[int, bool] = {}

    def ok(c: int) -> bool:
        if c not in seen:
            seen[c] = all(m.meets for m in _solve(spec, gr, c)[3])
        return seen[c]

    if ok(start):
        lo, hi = start, start
        while lo > 1:
            lo = max(1, lo // 2)
            if not ok(lo):
                break
            hi = lo
        else:
            return 1, "1 worker meets every model's target"
    else:
        lo = hi = start
        while not ok(hi):
            if hi >= MAX_WORKERS:
                return None, (f"no worker count up to {MAX_WORKERS} meets every model's target: the devices' "
                              "links or local times miss the SLO even with an idle cloud; relax the SLO or the "
                              "target")
            lo, hi = hi, min(2 * hi, MAX_WORKERS)
    while hi - lo > 1:  # lo fails, hi meets
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi, f"{hi} worker(s) meet every model's target; {hi - 1} do not"


@dataclass(frozen=True, eq=False)
class ClassChoices:
    """A class's planned choices per link point, for devices that follow the fleet plan."""

    up_mbps: np.ndarray
    """(U,) the uplink points."""
    rtt_ms: np.ndarray
    """(R,) the RTT points."""
    options: tuple[str, ...]
    """Option keys: plan keys, then 'local'."""
    shares: np.ndarray
    """(U, R, len(options)): each option's share of the group's requests at the equilibrium."""


def planned_choices(spec: FleetSpec, models: Sequence[ClassModel], *, workers: int | None = None
                    ) -> tuple[ClassChoices, ...]:
    """The equilibrium's choices ([Note: fleet fixed point]) per class and link point."""
    gr = _groups(spec, models)
    x = _solve(spec, gr, spec.cloud.workers if workers is None else workers)[0]
    keys = tuple(n[0] for n in gr.names) + ("local",)
    out = []
    for i, c in enumerate(spec.classes):
        ups, rtts = c.up_mbps.points()[0], c.rtt_ms.points()[0]
        rows = x[gr.cls == i]  # groups in (up, rtt) order, as _groups makes them
        out.append(ClassChoices(ups, rtts, keys, rows.reshape(len(ups), len(rtts), len(keys))))
    return tuple(out)


def plan_resolved(spec: FleetSpec, models: Sequence[ClassModel], *, workers: int | None = None,
                  size_workers: bool = True) -> FleetPlan:
    """The fleet plan on resolved classes (pure); ``workers`` overrides the spec's count."""
    c_workers = spec.cloud.workers if workers is None else workers
    gr = _groups(spec, models)
    x, ld, fp, model_plans = _solve(spec, gr, c_workers)
    w, fixed, pw, m, cap = _latency_parts(gr, x, ld)
    o = gr.ms.shape[1]
    classes = []
    for i, c in enumerate(spec.classes):
        rows = gr.cls == i
        rate = float(gr.rate[rows].sum())
        shares = (gr.rate[rows, None] * x[rows]).sum(axis=0) / rate
        names = list(gr.names) + [("local", len(models[i].graph), "")]
        opts = sorted((OptionShare(names[k][0], names[k][1], names[k][2], float(shares[k]))
                       for k in range(o + 1) if shares[k] > 1e-9), key=lambda s: -s.share)
        slo = spec.slo(c.model).slo_ms
        within = _cdf(slo, w[rows], fixed[rows], pw[rows], m[rows], cap[rows])
        refused = float(w[rows][:, o:2 * o].sum() / rate) if o else 0.0
        urgent = float((gr.rate[rows, None] * x[rows, :o] * gr.urgent[rows]).sum() / rate) if o else 0.0
        classes.append(ClassPlan(c.name, c.model, c.count, rate, tuple(opts),
                                 _quantile(0.5, w[rows], fixed[rows], pw[rows], m[rows], cap[rows]),
                                 _quantile(0.95, w[rows], fixed[rows], pw[rows], m[rows], cap[rows]),
                                 within, within * rate, refused, urgent))
    q = ld.queue
    worker_wait = ld.mean_wait_ms
    pools = tuple(PoolPlan(name, float(ld.rates[p]), float(q.batch[p]), float(q.run_ms[p]),
                           float(q.fill_ms[p] + worker_wait)) for p, name in enumerate(gr.pools) if ld.rates[p] > 0)
    cloud = CloudPlan(c_workers, q.utilisation, q.capacity_rps, float(ld.rates.sum()), ld.admitted, worker_wait, pools)
    needed, note = _workers_needed(spec, gr, c_workers) if size_workers else (None, "not computed")
    total = float(gr.rate.sum())
    goodput = sum(c.goodput_rps for c in classes)
    return FleetPlan(spec.devices, total, goodput, goodput / total if total else 1.0,
                     _quantile(0.5, w.ravel(), fixed.ravel(), pw.ravel(), m.ravel(), cap.ravel()),
                     _quantile(0.95, w.ravel(), fixed.ravel(), pw.ravel(), m.ravel(), cap.ravel()),
                     tuple(classes), tuple(model_plans), cloud, fp, needed, note)


def plan_fleet(spec: FleetSpec, workspace: Workspace | None = None, *, workers: int | None = None,
               size_workers: bool = True) -> FleetPlan:
    """Resolve the spec's names (a `planner.whatif.Workspace`; a fresh one by default) and plan."""
    return plan_resolved(spec, resolve(spec, workspace), workers=workers, size_workers=size_workers)
