"""A discrete-event simulator of a fleet: N devices running the edge agent's own policy against a
queueing model of the cloud. Seeded and deterministic; 10,000 devices for 20 simulated seconds
take seconds.

[Note: fleet simulator]
What runs is the agent's code, not a copy: each request asks `edge_agent.policy.policy` for
its option (with the device's `edge_agent.cloud_load.CloudLoad` as `Health.queue_ms` and
`Health.refused_until_s`), its life is an `edge_agent.flow.RequestFlow` (so an answer
delivered twice, or none, is counted rather than assumed away), and times come from the
planner's frontier and cost model, as on a device. What is modelled:

* devices: each draws its uplink and RTT once from its class's spreads; frames are Poisson
  at the class's fps. A request's head, encode and upload take the plan's times at the
  device's link, then half the RTT to the cloud; the answer takes the other half and the
  download. Device compute and uplink contention between a device's own requests are
  not modelled (the policy's uplink queue term stays in its choice).
* the remote budget ([Note: remote budget] in edge_agent/runner.py): the local tail
  starts at the send (the head and encode done; the upload is part of the remote call, and
  the device's core is free for the tail meanwhile, as in the runner) plus
  max(SLO - head - tail, 0.3 SLO) if nothing came back,
  or earlier where the runner's hedge (`edge_agent.policy.hedge_delay_s`, on the
  option's pessimistic time and the device's record of answers) starts it; the first
  result wins, the other is dropped. The baselines' pessimistic time is their plan's own
  at batch 1. A hedged local run is one more run on the device, not modelled beyond its time.
* the cloud: c workers shared by every model@cut pool, each running one batch at a time for
  T_pool(b) ms (`planner.queueing.run_ms_table`'s curve, as the planner uses;
  ``service='exponential'`` draws it exponential with that mean instead). The batcher waits
  ``batch_timeout_ms`` for company while a worker is free, takes up to ``max_batch`` when one
  frees, oldest pool first, and leaves out a request that cannot finish before its deadline
  (refused: deadline-aware batching); the deadline is the request's SLO, or with
  ``deadline='runner'`` the edge runner's, `planner.costmodel.remote_call_ms`. Admission: a
  request whose predicted wait (the batcher's
  own: `workers.batcher.queue_wait_s`, with the batches ahead at the size batches form at
  while others wait, `AheadSize`) and its own batch end past its deadline, or that finds 1024
  queued, is refused with RESOURCE_EXHAUSTED and retry-after = that wait. A request that no
  local run can land in time (the hedge would not start) is urgent, as the runner marks it: it
  queues ahead of the others and only the urgent ones count as ahead of it
  ([Note: priority under overload] in edge_agent/hedge.py; ``priority=False`` serves in
  arrival order). Every answer carries the predicted wait at the time it is sent, as the
  gateway's `timings_ms['predicted_wait']` does, and the gateway's load keys: the utilisation
  (the last second's arrivals, admitted or not, times their pool's full-batch time per
  request, over the workers) and the expected wait at it
  (`workers.batcher.BatcherLoad.expected_wait_at`, the gateway's own formula, on the answer's
  pool), which the device's `CloudLoad` keeps with its decay; and, with the priority, both
  waits of an urgent request (behind the urgent ones queued; the formula at the urgent share
  of the last second's arrivals), at which the policy prices a plan whose requests go urgent.
Strategies: 'ours' (the policy with the cloud's load), 'planned' (each device follows the
fleet plan's equilibrium choice for its class and link point, `planner.fleet.planned_choices`,
drawn by its shares), 'dads' (each device's load-blind
optimum, the frontier's plan at its uplink), 'cloud-only' (the whole model remote, the best
encoding), 'edge-only'. All share the cloud, its admission control and the local fallback
of a refused or late request; only 'ours' holds a refused cut off for its retry-after (that
is load-awareness, which the baselines lack).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_agent.cloud_load import CloudLoad
from edge_agent.flow import RequestFlow
from edge_agent.monitor import LinkEstimate
from edge_agent.hedge import URGENT, urgent_priority
from edge_agent.policy import Action, Health, PolicyConfig, PolicyState, after_trial, hedge_delay_s, policy
from partitioner import Cut
from planner import Frontier, FrontierEntry, LinkRange, Objective, Plan, evaluate
from planner.costmodel import remote_budget_ms, remote_call_ms
from planner.fleet import ClassChoices, ClassModel, planned_choices, remote_ms, run_ms_table
from planner.fleet_spec import FleetSpec
from workers.batcher import AheadSize, BatcherLoad, queue_wait_s

__all__ = ["SimConfig", "SimResult", "simulate", "STRATEGIES", "quantiles"]

STRATEGIES = ("ours", "planned", "dads", "cloud-only", "edge-only")
_MAX_QUEUE = 1024

# event kinds, in tie order
_FRAME, _ARRIVE, _DONE, _TIMER, _BATCH, _ANSWER, _REFUSED, _LOCAL = range(8)


@dataclass(frozen=True)
class SimConfig:
    """One simulation run."""

    strategy: str = "ours"
    """One of STRATEGIES."""
    seconds: float = 20.0
    """Simulated time during which frames arrive."""
    warmup_s: float = 5.0
    """Requests starting before this are run but not counted."""
    seed: int = 0
    """Seeds the links, the frames and any service noise."""
    service: str = "deterministic"
    """'deterministic' (the cost model's run time) or 'exponential' (with that mean)."""
    workers: int | None = None
    """Overrides the spec's worker count."""
    fps_scale: float = 1.0
    """Multiplies every class's frame rate (load sweeps)."""
    request_overhead_ms: float = 0.0
    """The cloud's per-request time outside the batch run (decoding, encoding, the transport), added
    to every remote answer; a measured gateway's figure, 0 for the cost model alone."""
    priority: bool = True
    """The cloud serves first the requests that no local run can answer in time, as the gateway
    does ([Note: priority under overload] in edge_agent/hedge.py); False: in arrival order."""
    deadline: str = "slo"
    """The deadline a request carries to the cloud: 'slo', its SLO from its start (as bench.fleet_load's
    requests and the planner's admission); 'runner', the edge runner's, `planner.costmodel.remote_call_ms`
    of the remote budget from the send."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r}; use one of {list(STRATEGIES)}")
        if self.service not in ("deterministic", "exponential"):
            raise ValueError(f"service={self.service!r}; use 'deterministic' or 'exponential'")
        if not (math.isfinite(self.request_overhead_ms) and self.request_overhead_ms >= 0):
            raise ValueError(f"request_overhead_ms={self.request_overhead_ms!r} must be a finite number >= 0")
        if self.deadline not in ("slo", "runner"):
            raise ValueError(f"deadline={self.deadline!r}; use 'slo' or 'runner'")
        if not 0 <= self.warmup_s < self.seconds:
            raise ValueError(f"warmup_s={self.warmup_s!r} must be >= 0 and below seconds={self.seconds!r}")


@dataclass(frozen=True)
class SimResult:
    """What the counted requests saw."""

    strategy: str
    devices: int
    workers: int
    requests: int
    """Counted requests (started after the warm-up)."""
    within_slo: float
    """Share answered within their model's SLO."""
    goodput_rps: float
    """Counted requests answered within the SLO per second."""
    p50_ms: float
    p95_ms: float
    offloaded: float
    """Share sent to the cloud (trials included)."""
    refused: float
    """Share refused by the cloud (admission or deadline-aware batching) and answered locally (some by
    a tail that the budget or the hedge started before the refusal came: those count in `fallbacks` too)."""
    fallbacks: float
    """Share answered by the local tail after the budget ran out or the hedge started it."""
    hedged: float
    """Share answered by a local tail that the hedge started beside the remote call."""
    lost: int
    """Counted requests with no answer."""
    doubled: int
    """Answers delivered twice (the flow refuses that; a count above 0 is a bug)."""
    cloud_utilisation: float
    """Busy share of the workers from the start until the last batch ends (or the frames end)."""
    worker_wait_ms: float
    """Mean wait of admitted requests from arrival to their batch's start."""
    class_within_slo: dict[str, float] = field(default_factory=dict)
    remote_p50_ms: float | None = None
    """Median of the answers the cloud gave (None: none); the local answers, a device's fixed
    time, are left out: a p95 that lands on them says nothing of the cloud's model."""
    remote_p95_ms: float | None = None
    hedge_started: float = 0.0
    """Share whose local tail the hedge started beside the remote call, whichever answered first: the
    device's extra work (`hedged` counts those the tail answered)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def quantiles(x: np.ndarray, qs: Sequence[float]) -> list[float]:
    return [float(np.quantile(x, q)) if len(x) else math.nan for q in qs]


@dataclass(eq=False)
class _Req:
    device: int
    start: float
    counted: bool
    flow: RequestFlow
    pool: int = -1
    cut_id: str = ""
    post_ms: float = 0.0
    tail_ms: float = 0.0
    deadline: float = 0.0
    arrive: float = 0.0
    trial: bool = False
    answer: float = math.nan
    how: str = ""
    hedged: bool = False
    tail_started: bool = False
    """The budget or the hedge started its local tail while the remote call went on."""
    refused: bool = False
    """The cloud refused it (its local tail may have started already, by the budget or the hedge)."""
    urgent: bool = False
    """No local run lands it in time: sent with priority ([Note: priority under overload] in edge_agent/hedge.py)."""


@dataclass(frozen=True, eq=False)
class _Route:
    """One remote option at one device's link."""

    pre_ms: float
    """From the request's start to its arrival at the cloud: head, encode, upload, half the RTT."""
    post_ms: float
    tail_ms: float
    pool: int
    head_ms: float
    send_ms: float
    """From the request's start to its send: head and encode (the upload is the remote call's)."""


class _Sim:
    def __init__(self, spec: FleetSpec, models: Sequence[ClassModel], cfg: SimConfig, table: dict[str, np.ndarray],
                 pool_names: list[str]) -> None:
        self.spec, self.models, self.cfg = spec, models, cfg
        self.rng = np.random.default_rng(cfg.seed)
        self.workers = cfg.workers or spec.cloud.workers
        self.max_batch, self.timeout = spec.cloud.max_batch, spec.cloud.batch_timeout_ms / 1e3
        self.pool_names = pool_names
        self.tables = [table[n] for n in pool_names]
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        # devices
        cls_of, ups, rtts = [], [], []
        for i, m in enumerate(models):
            c = m.cls
            cls_of += [i] * c.count
            ups.append(c.up_mbps.sample(self.rng, c.count) * 1e6)
            rtts.append(c.rtt_ms.sample(self.rng, c.count))
        self.cls = np.array(cls_of)
        self.up = np.concatenate(ups)
        self.rtt = np.concatenate(rtts)
        n = len(self.cls)
        self.states = [PolicyState() for _ in range(n)]
        self.loads = [CloudLoad(PolicyConfig().cloud_load_tau_s) for _ in range(n)]
        self.answered: list[deque[float]] = [deque(maxlen=32) for _ in range(n)]
        self.routes: list[dict[str, _Route]] = [{} for _ in range(n)]
        self.configs = [PolicyConfig(slo_ms=spec.slo(m.cls.model).slo_ms) for m in models]
        self.slo_s = [spec.slo(m.cls.model).slo_ms / 1e3 for m in models]
        self.fixed = self._fixed_choices() if cfg.strategy in ("planned", "dads", "cloud-only") else None
        # cloud
        self.queues: list[deque[_Req]] = [deque() for _ in pool_names]
        self.urgent_n = [0] * len(pool_names)
        """Urgent requests at the front of each queue."""
        self.busy_until = [0.0] * self.workers
        self.free = self.workers
        self.ahead = AheadSize()
        self.timer_at = math.inf
        self.busy_s = 0.0
        self.waits: list[float] = []
        self.done: list[_Req] = []
        self.doubled = 0
        self.counted_started = 0
        self.last_run_end = 0.0
        self.recent: deque[tuple[float, float, bool]] = deque()
        """(arrival s, its pool's full-batch seconds per request) over the last second."""
        self.recent_work_s = 0.0
        self.recent_urgent_s = 0.0
        self._expected: dict[tuple[int, int], float] = {}

    # -- plumbing ---------------------------------------------------------------------
    def push(self, t: float, kind: int, data: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, data))

    def route(self, d: int, key: str, entry: FrontierEntry, front: Frontier) -> _Route:
        r = self.routes[d].get(key)
        if r is None:
            m = self.models[self.cls[d]]
            one = dataclasses.replace(front, entries=(entry,))
            _, b = remote_ms(one, 0, float(self.up[d]), float(self.rtt[d]), 0.0)
            rtt = float(self.rtt[d])
            pool = self.pool_names.index(f"{m.cls.model}@{entry.plan.cut.key or 'whole'}")
            r = _Route(b.edge_ms + b.encode_ms + b.uplink_ms + rtt / 2,
                       rtt / 2 + b.downlink_ms + self.cfg.request_overhead_ms,
                       max(0.0, m.local_ms - b.edge_ms), pool, b.edge_ms, b.edge_ms + b.encode_ms)
            self.routes[d][key] = r
        return r

    def _fixed_choices(self) -> list[tuple[str, FrontierEntry, Frontier] | None]:
        out: list[tuple[str, FrontierEntry, Frontier] | None] = []
        whole = {i: _cloud_only(m, self.spec) for i, m in enumerate(self.models)}
        planned = self._planned() if self.cfg.strategy == "planned" else ()
        for d in range(len(self.cls)):
            m = self.models[self.cls[d]]
            if self.cfg.strategy == "planned":
                cc = planned[self.cls[d]]
                u = int(np.abs(np.log(cc.up_mbps * 1e6 / self.up[d])).argmin())
                r = int(np.abs(cc.rtt_ms - self.rtt[d]).argmin())
                p = cc.shares[u, r]
                key = cc.options[int(self.rng.choice(len(p), p=p / p.sum()))]
                entry = next((e for e in m.frontier.entries if e.plan.key == key), None)
                out.append(None if entry is None else (key, entry, m.frontier))
            elif self.cfg.strategy == "dads":
                p = m.frontier.plan_at(float(self.up[d]))
                entry = next(e for e in m.frontier.entries if e.plan.key == p.key)
                out.append((p.key, entry, m.frontier) if p.boundary else None)
            else:
                best = min(whole[self.cls[d]], key=lambda f: f.plan_at(float(self.up[d])).breakdown.total_ms)
                out.append((best.entries[0].plan.key, best.entries[0], best))
        return out

    def _planned(self) -> tuple[ClassChoices, ...]:
        """The fleet plan's per-group choices at this run's frame rates and workers."""
        k = self.cfg.fps_scale
        models = [dataclasses.replace(m, cls=dataclasses.replace(m.cls, fps=m.cls.fps * k)) for m in self.models]
        spec = dataclasses.replace(self.spec, classes=tuple(m.cls for m in models))
        return planned_choices(spec, models, workers=self.workers)

    # -- the device -------------------------------------------------------------------
    def frame(self, d: int, now: float) -> None:
        c = self.cls[d]
        m = self.models[c]
        nxt = now + self.rng.exponential(1.0 / (m.cls.fps * self.cfg.fps_scale))
        if nxt < self.cfg.seconds:
            self.push(nxt, _FRAME, d)
        req = _Req(d, now, now >= self.cfg.warmup_s, RequestFlow(str(self.seq)))
        self.counted_started += req.counted
        choice = self.choose(d, now)
        if choice is None:
            req.flow.fire("local")
            self.push(now + m.local_ms / 1e3, _LOCAL, req)
            return
        key, entry, front, trial, hi_ms = choice
        r = self.route(d, key, entry, front)
        req.flow.fire("offload")
        req.flow.fire("head_done")
        req.pool, req.cut_id, req.trial = r.pool, entry.plan.cut.key, trial
        req.post_ms, req.tail_ms = r.post_ms, r.tail_ms
        slo_s = self.slo_s[c]
        send_s = r.send_ms / 1e3  # the runner's timers start at the send: the upload is the remote call's
        budget = remote_budget_ms(slo_s * 1e3, r.head_ms, r.tail_ms) / 1e3  # as the runner, once the head is done
        req.deadline = now + (slo_s if self.cfg.deadline == "slo" else send_s + remote_call_ms(budget * 1e3) / 1e3)
        if hi_ms is None:  # a baseline: its plan's own time at batch 1
            hi_ms = r.pre_ms + float(self.tables[r.pool][0]) + r.post_ms
        hedge = hedge_delay_s(Action("offload", req.cut_id, predicted_ms=hi_ms, hi_ms=hi_ms),
                              elapsed_ms=r.send_ms, deadline_ms=slo_s * 1e3, local_ms=r.tail_ms,
                              record_ms=self.answered[d], config=self.configs[c])
        req.hedged = hedge < budget
        req.urgent = self.cfg.priority and urgent_priority(slo_s * 1e3, hedge) == URGENT
        self.push(now + r.pre_ms / 1e3, _ARRIVE, req)
        self.push(now + send_s + min(budget, hedge), _TIMER, req)

    def choose(self, d: int, now: float) -> tuple[str, FrontierEntry, Frontier, bool, float | None] | None:
        """The option of device `d` now: its plan, whether it is a trial, and its pessimistic
        time (None for a baseline's fixed plan), or None for local."""
        if self.cfg.strategy == "edge-only":
            return None
        if self.fixed is not None:
            f = self.fixed[d]
            return None if f is None else (*f, False, None)
        c = self.cls[d]
        m = self.models[c]
        cl = self.loads[d]
        up, rtt = float(self.up[d]), float(self.rtt[d])
        est = LinkEstimate(up, up * m.cls.down_ratio, rtt, 100, now, None)
        health = Health(local_ms=m.local_ms, arrival_rps=m.cls.fps * self.cfg.fps_scale,
                        queue_ms=cl.queue_ms(now), urgent_queue_ms=cl.queue_ms(now, urgent=True),
                        refused_until_s=cl.refused_until_s(now),
                        unconfirmed=cl.busy_cuts(now))
        action, self.states[d] = policy(est, m.frontier, health, self.states[d], now, config=self.configs[c])
        if action.kind != "offload":
            return None
        entry = next(e for e in m.frontier.entries if e.plan.key == action.plan_key)
        return action.plan_key, entry, m.frontier, action.trial, action.hi_ms

    def deliver(self, req: _Req, event: str, now: float) -> None:
        step = req.flow.fire(event)
        if step.delivers:
            if not math.isnan(req.answer):
                self.doubled += 1
            req.answer, req.how = now, event
            self.done.append(req)
            if req.trial and event == "remote_ok":
                m = self.models[self.cls[req.device]]
                self.states[req.device] = after_trial(self.states[req.device], (now - req.start) * 1e3, m.local_ms,
                                                      config=self.configs[self.cls[req.device]])

    # -- the cloud --------------------------------------------------------------------
    def run_ms(self, pool: int, b: int) -> float:
        ms = float(self.tables[pool][b - 1])
        return ms * self.rng.exponential() if self.cfg.service == "exponential" else ms

    def predicted_wait_s(self, pool: int, now: float, urgent: bool = False) -> float:
        """The batcher's own estimate (`Batcher.predicted_wait_s`) on the workers' state; for an
        urgent request, behind the urgent requests queued only."""
        size = self.ahead.size(self.max_batch)
        depth = sum(self.urgent_n) if urgent else sum(len(q) for q in self.queues)
        return queue_wait_s(now, depth, self.busy_until, float(self.tables[pool][size - 1]) / 1e3, size,
                            self.workers)

    def utilisation(self, now: float) -> float:
        """The last second's arrivals (admitted or not) in full-batch work, over the workers."""
        while self.recent and self.recent[0][0] <= now - 1.0:
            _, work_s, urgent = self.recent.popleft()
            self.recent_work_s -= work_s
            self.recent_urgent_s -= work_s * urgent
        return max(0.0, self.recent_work_s) / self.workers

    def expected_wait_ms(self, pool: int, util: float, now: float, urgent: bool = False) -> float:
        """The gateway's expected wait ([Note: expected wait] in workers/_batch_policy.py) at `pool`, of
        an urgent request: at the urgent share of the last second's arrivals."""
        full_s = float(self.tables[pool][-1]) / 1e3
        rate = util * self.workers * self.max_batch / full_s
        predicted_s = self.predicted_wait_s(pool, now, urgent)
        share = min(1.0, self.recent_urgent_s / self.recent_work_s) if urgent and self.recent_work_s > 0 else 1.0
        key = (pool, round(rate), round(predicted_s * 1e3), round(share, 2))
        got = self._expected.get(key)
        if got is None:
            table = self.tables[pool]
            wait_s = BatcherLoad.expected_wait_at(rate, lambda b: float(table[b - 1]) / 1e3,
                                                  max_batch_size=self.max_batch, instances=self.workers,
                                                  timeout_s=self.timeout, predicted_wait_s=predicted_s,
                                                  ahead_share=round(share, 2))
            got = self._expected[key] = (wait_s or 0.0) * 1e3
        return got

    def arrive(self, req: _Req, now: float) -> None:
        req.arrive = now
        work_s = float(self.tables[req.pool][-1]) / 1e3 / self.max_batch
        self.recent.append((now, work_s, req.urgent))
        self.recent_work_s += work_s
        self.recent_urgent_s += work_s * req.urgent
        q = self.queues[req.pool]
        wait = self.predicted_wait_s(req.pool, now, req.urgent)
        ahead = self.urgent_n[req.pool] if req.urgent else len(q)
        own = float(self.tables[req.pool][min(ahead, self.max_batch - 1)]) / 1e3
        if len(q) >= _MAX_QUEUE or now + wait + own > req.deadline:
            self.push(now + self.rtt[req.device] / 2e3, _REFUSED, (req, wait))
            return
        if req.urgent:  # the queue serves priority first, then arrival ([Note: priority under overload])
            q.insert(self.urgent_n[req.pool], req)
            self.urgent_n[req.pool] += 1
        else:
            q.append(req)
        self.dispatch(now)

    def dispatch(self, now: float) -> None:
        while self.free:
            ready, oldest = -1, math.inf
            next_due = math.inf
            for p, q in enumerate(self.queues):
                if not q:
                    continue
                n = self.urgent_n[p]  # the oldest request: the first urgent one or the first of the rest
                head = min(q[0].arrive, q[n].arrive) if n < len(q) else q[0].arrive
                if len(q) >= self.max_batch or now >= head + self.timeout - 1e-12:
                    if head < oldest:
                        ready, oldest = p, head
                else:
                    next_due = min(next_due, head + self.timeout)
            if ready < 0:
                if next_due < self.timer_at:
                    self.timer_at = next_due
                    self.push(next_due, _BATCH, None)
                return
            q = self.queues[ready]
            take = [q.popleft() for _ in range(min(self.max_batch, len(q)))]
            self.urgent_n[ready] -= sum(r.urgent for r in take)
            run_s = self.run_ms(ready, len(take)) / 1e3
            batch = []
            for r in take:  # deadline-aware batching: one that cannot finish in time is refused now
                if now + run_s > r.deadline:
                    self.push(now + self.rtt[r.device] / 2e3, _REFUSED, (r, self.predicted_wait_s(ready, now)))
                else:
                    batch.append(r)
                    if r.counted:
                        self.waits.append(now - r.arrive)
            if not batch:
                continue
            if any(self.queues):  # [Note: batches ahead] in workers/batcher.py
                self.ahead.formed(len(batch))
            w = self.busy_until.index(min(self.busy_until))
            self.busy_until[w] = now + run_s
            self.free -= 1
            self.busy_s += run_s
            self.last_run_end = max(self.last_run_end, now + run_s)
            self.push(now + run_s, _DONE, (ready, batch))

    def batch_done(self, pool: int, batch: list[_Req], now: float) -> None:
        self.free += 1
        wait_ms = self.predicted_wait_s(pool, now) * 1e3
        util = self.utilisation(now)
        timings = {"predicted_wait": wait_ms, "utilisation": util,
                   "expected_wait": self.expected_wait_ms(pool, util, now)}
        if self.cfg.priority:  # the gateway's urgent figures ([Note: priority under overload])
            timings["urgent_predicted_wait"] = self.predicted_wait_s(pool, now, True) * 1e3
            timings["urgent_expected_wait"] = self.expected_wait_ms(pool, util, now, True)
        for r in batch:
            self.push(now + r.post_ms / 1e3, _ANSWER, (r, timings))
        self.dispatch(now)

    # -- the loop ---------------------------------------------------------------------
    def run(self) -> SimResult:
        for d in range(len(self.cls)):
            m = self.models[self.cls[d]]
            first = self.rng.exponential(1.0 / (m.cls.fps * self.cfg.fps_scale))
            if first < self.cfg.seconds:
                self.push(first, _FRAME, d)
        while self.heap:
            now, kind, _, data = heapq.heappop(self.heap)
            if kind == _FRAME:
                self.frame(data, now)
            elif kind == _ARRIVE:
                self.arrive(data, now)
            elif kind == _DONE:
                self.batch_done(data[0], data[1], now)
            elif kind == _BATCH:
                self.timer_at = math.inf
                self.dispatch(now)
            elif kind == _ANSWER:
                req, timings = data
                self.loads[req.device].observe_timings(req.cut_id, timings, now)
                self.answered[req.device].append((now - req.start) * 1e3)
                self.deliver(req, "remote_ok", now)
            elif kind == _REFUSED:
                req, wait_s = data
                req.refused = True
                self.loads[req.device].refuse(req.cut_id, wait_s * 1e3, now)
                if req.flow.state == "remote":
                    req.flow.fire("remote_error")
                    req.how = "refused"
                    self.push(now + req.tail_ms / 1e3, _LOCAL, req)
            elif kind == _TIMER:
                if data.flow.state == "remote":
                    data.flow.fire("remote_timeout")
                    data.how, data.tail_started = "fallback", True
                    self.push(now + data.tail_ms / 1e3, _LOCAL, data)
            elif kind == _LOCAL:
                how = data.how
                self.deliver(data, "local_done", now)
                if data.how == "local_done" and how in ("refused", "fallback"):
                    data.how = how
        return self.result()

    def result(self) -> SimResult:
        counted = [r for r in self.done if r.counted]
        lat = np.array([(r.answer - r.start) * 1e3 for r in counted])
        slo = np.array([self.slo_s[self.cls[r.device]] * 1e3 for r in counted])
        ok = lat <= slo + 1e-9
        n = len(counted)
        span = self.cfg.seconds - self.cfg.warmup_s
        by_class: dict[str, list[bool]] = {}
        for r, good in zip(counted, ok):
            by_class.setdefault(self.models[self.cls[r.device]].cls.name, []).append(bool(good))
        started = sum(1 for r in self.done if r.counted)
        p50, p95 = quantiles(lat, (0.5, 0.95))
        remote = np.array([(r.answer - r.start) * 1e3 for r in counted if r.how == "remote_ok"])
        rp50, rp95 = quantiles(remote, (0.5, 0.95)) if len(remote) else (None, None)
        return SimResult(
            strategy=self.cfg.strategy, devices=len(self.cls), workers=self.workers, requests=n,
            within_slo=float(ok.mean()) if n else 1.0, goodput_rps=float(ok.sum()) / span, p50_ms=p50, p95_ms=p95,
            offloaded=sum(1 for r in counted if r.pool >= 0) / max(1, n),
            refused=sum(1 for r in counted if r.refused) / max(1, n),
            fallbacks=sum(1 for r in counted if r.how == "fallback") / max(1, n),
            hedged=sum(1 for r in counted if r.how == "fallback" and r.hedged) / max(1, n),
            lost=self.counted_started - started, doubled=self.doubled,
            cloud_utilisation=self.busy_s / (self.workers * max(self.last_run_end, self.cfg.seconds)),
            worker_wait_ms=float(np.mean(self.waits)) * 1e3 if self.waits else 0.0,
            class_within_slo={k: float(np.mean(v)) for k, v in sorted(by_class.items())},
            remote_p50_ms=rp50, remote_p95_ms=rp95,
            hedge_started=sum(1 for r in counted if r.tail_started and r.hedged) / max(1, n))


def _cloud_only(m: ClassModel, spec: FleetSpec) -> list[Frontier]:
    """One-entry frontiers holding the whole model remote, one per encoding (plan_at rescales them)."""
    rng = m.frontier.link_range
    link = rng.at(rng.up_lo_bps)
    out = []
    for enc in spec.encoding_values:
        b = evaluate(m.graph, Cut(frozenset()), [m.device, m.cloud], link, enc)
        plan = Plan(m.graph.model, (Cut(frozenset()),), enc, Objective.LATENCY, link, b, boundary=("input",))
        out.append(Frontier(m.graph.model, Objective.LATENCY, LinkRange(rng.up_lo_bps, rng.up_hi_bps, rng.down_ratio,
                                                                         rng.rtt_ms, rng.loss),
                            (FrontierEntry(rng.up_lo_bps, rng.up_hi_bps, plan),),
                            m.frontier.compute_w, m.frontier.radio_tx_w, m.frontier.idle_w))
    return out


def simulate(spec: FleetSpec, models: Sequence[ClassModel], config: SimConfig = SimConfig()) -> SimResult:
    """Run the fleet of [Note: fleet simulator] once."""
    tables: dict[str, np.ndarray] = {}
    for m in models:
        fronts = [m.frontier] + _cloud_only(m, spec)
        for f in fronts:
            for e in f.entries:
                if not e.plan.boundary:
                    continue
                name = f"{m.cls.model}@{e.plan.cut.key or 'whole'}"
                if name not in tables:
                    seg = max(0.0, e.plan.breakdown.tier_ms[-1] - m.cloud.segment_const_ms)
                    tables[name] = run_ms_table(np.array([seg]), m.cloud.segment_const_ms, m.cloud.batch_ms,
                                                spec.cloud.max_batch)[0]
    return _Sim(spec, models, config, tables, sorted(tables)).run()
