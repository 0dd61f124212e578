"""Where the next request runs: a pure function, in the shape of Ray Serve's autoscaling policy.

    action, state = policy(estimate, frontier, health, state, now_s, config=config)

No I/O and no clocks: the link estimate, the plan frontier, the health of both paths
and the time come in; an `Action` and the next `PolicyState` go out. The caller logs
every switch once, with `action.reason`, which names the estimates that caused it.

[Note: policy]
Options are every frontier plan whose head engine is warm (each evaluated at the
estimated link by rescaling its own breakdown, so the current plan's cost is known
even where it is no longer the optimum), and local execution of the whole model.
The uplink is shared by consecutive requests: at `arrival_rps` a plan whose upload
takes u ms loads it to rho = rps * u / 1000 and waits u * rho / (2 (1 - rho)) more
(M/D/1); a plan that would load it past 0.9 is not an option, unless the requests in
flight bound the queue (see [Note: closed loop]).
1. Deadline: with an SLO, the option least likely to miss it is the target (see [Note:
   risk]); when the best remote plan misses more often than local, the request runs
   locally.
2. Otherwise (or between options within `risk_tie` of each other) the cheapest option
   by the objective (ms or device joules) is the target.
3. Hysteresis, switch cost and dwell: the target replaces the current option only if it
   is at least `hysteresis` cheaper (or `risk_tie` safer), saves more than a switch costs
   over one dwell (see [Note: risk]), and `dwell_s` passed since the last switch (a
   safer target need not wait), unless the current option became unavailable (breaker
   open, engine gone), misses the SLO at least half the time more than the target, or
   costs over 1/`urgent_ratio` times the target. So jitter never flaps the cut and a
   real step switches at once.
4. Back-off on reversals: going back to the option just left, when that one was held
   less than `flap_window_s`, counts a reversal, and each reversal doubles the dwell
   that the next return must wait (up to 2^`max_backoff`), the urgent ratio included.
   A loop such as "the uplink saturates, so run locally; the load falls, so offload
   again" (the app's window ties its rate to the latency) then settles instead of
   flipping every dwell. Only an unavailable option or a missed SLO switches without
   it. An option held for `flap_window_s` beyond its back-off clears the count.
5. Trials: while the current option is local and a remote target is predicted at least
   `trial_ratio` times faster but hysteresis, dwell or back-off hold it back, one
   request every `trial_every_s` goes remote as a trial without moving the state. Its
   measured time refreshes the remote correction (a ratio learnt on a link that has
   since recovered would otherwise keep the agent local for good), and `after_trial`
   clears the back-off when the trial beat local by the hysteresis margin: a measured
   answer, not a prediction, says the remote path is better now.
A decision with `Health.request` False is a re-evaluation without a request (on a
timer, or when the estimate moved): it may switch, so a step reaches the plan as soon
as it is detected, but it takes no trial and no breaker probe.
Predictions are corrected by measurement: `Health.local_ms` is the profile's time times
the agent's measured/predicted ratio of local answers; a remote option's time is its
measured send (see [Note: measured send]) and the rest multiplied by `Health.remote_factor`,
the same ratio of remote answers after their send.
The cloud's load is in every remote option (see [Note: cloud load]).
A half-open breaker lets one probe through: that request goes remote without moving
the state, so recovery is tried without committing to it; but only when the remote plan
is predicted to beat local at the estimated link (otherwise the request would pay a
timeout and a local tail for nothing, and the agent's idle link probe tests the link).

[Note: risk]
A link that varies is a distribution, not a rate. The estimate carries the rate plans use
(`LinkEstimate.up_hold_bps`, which does not follow drops shorter than the monitor's
`hold_s`) and the recent transfers' prediction errors (`spread`); see [Note: held rate and
spread] in edge_agent/monitor.py. The held rate keeps the plan in use through a drop;
every other remote option is priced at the level (times the same errors). A drop is no
reason to leave a plan, nor to take one up: priced at the held rate, in bench.adaptation's
5.85 Mbit/s phase (level 5.8, held at 11.9) cloud-only drew the agent from local (199 ms
against 261), raced every request sent into the drop, and went back 4 s later. And a
request that the plan in use, priced at the level, would answer no sooner than local runs
here (`Action.held`): the plan stays in use, with no switch. Sent, its hedge would race it
at once, and a lost race answers at the send time plus the local run: the device's part of
the send (ResNet50's int8 input, 5-40 ms on an emulated rpi4) on top of local, for nothing
(on the shared LTE trace replayed at 1.5 times its rate, ours' p95 went from 501.6 ms
(cloud-only's 502.2) to 494.1 (edge-only's 494.2)). The link is measured meanwhile by the
idle link's probes. Each remote option is priced at every rate of
`LinkEstimate.rates_bps()` (so scaled): its first hop's bytes take time inversely to the
rate, the rest is fixed (the uplink's queue is priced once, at the option's rate: a queue
forms over many transfers). That gives the option's mean time (`ms`, what the objective
compares), its chance of missing the SLO (`miss`: the share of rates at which it would)
and a pessimistic time (`hi_ms`: all but `hedge_tail` of its times are shorter, the point
at which the hedge starts the local run; see [Note: hedge] in edge_agent/hedge.py). Under
the latency objective, with an SLO the local run can meet, the chance is that of the
request with its hedge: no time is later than the local run started where the hedge would
start it (at once when `hi_ms` is past the local time or the last safe moment, else at
that moment). Priced without it, a plan whose link dips a fifth of the time "missed" a
fifth of the SLOs that its hedge meets, and on the LTE trace (ResNet50 at an rpi4's speed)
the agent stayed local, p50 491 ms, where the cloud-only plan with its hedge answered in
308 ms. The cost (`cost`, what the objective compares) is a mean time, and which times
depends on the cloud's load. Unless the cloud reported the cut's pool busy
(`Health.unconfirmed`), its work is spare (a reported wait is in the times): the plan is
priced as the requests its hedge makes of it (none later than the local run started where
the hedge starts it), and with an SLO it must beat local by the `hysteresis` margin to be
the target (a hedge that starts at once runs the device anyway; the cloud's work is worth
a clear gain only), and by the same margin to stay in use: against a plan so priced, local
counts at that margin of its cost. A hedged plan is never dearer than local, so with the
usual hysteresis against it a device on the plan never left: through the dips of an LTE
trace (ResNet50 at an rpi4's speed) the agent kept cloud-only, raced 35 of 96 requests,
and answers queued behind each other's local runs to 1.3 s, where cloud-only's p99 was 0.7
s. Leaving such a plan still pays a switch: made free, the agent left at every LTE dip and
came back after it, 6.7 switches a minute against the 6 allowed. Priced at its own times
(a fifth of its transfers in dips past the local time), cloud-only with its hedge (p50 377
ms, p95 515; local 506 and 521) lost to local for most requests. While the pool is
reported busy, the plan costs its own mean: a hedge that starts at once is a local run
that also loads the pool; priced as the hedged request, a busy pool's remote plans cost no
more than local, and a fleet's fast devices (phones, 72 ms locally) kept offloading to the
pool that the slow ones need. Local execution is a point: it misses always or never. The
target is the option with the least chance of a miss, and among those within `risk_tie` of
it, the cheapest by the objective. With a point estimate (no spread) every chance is 0 or
1 and this is rule 1 above.
Switching is priced in the same terms: a candidate replaces the current option only if
what it saves over the requests of one dwell (`arrival_rps * dwell_s`, at least one;
per request its mean ms, plus `slo_ms` per miss avoided) exceeds `switch_cost_ms`
times one plus the switches of the last `switch_window_s`. A candidate that is only
better for the next second or two, or by a few ms, does not pay for the switch, and
every recent switch makes the next one dearer. The switches counted are those of the
last minute, the unit a switch rate is judged in: with a 10 s memory, switches 10-15 s
apart each paid the base cost, and on a cellular trace where remote beat local by 20 %
(ResNet50, an rpi4's speed, 4-9 Mbit/s) the agent went remote and back four times in
60 s, the first remote answers after each switch 250-340 ms slower than predicted. Under
the energy objective the saving is the relative energy gain at the current option's time.

[Note: closed loop]
An app with a window of requests in flight (a camera that drops a frame rather than
queue) sends as fast as the answers come: its rate is set by the plan. While the device
runs local requests back to back (`arrival_rps * local_ms` at least 0.6 of the time),
the rate the agent sees is held down by the local latency, and a remote option priced
at that rate looks free of uplink queueing; offloaded, the same app sends faster, the
uplink saturates, and the agent goes local again. In the demo's steady 5.85 Mbit/s phase
that loop switched every second or two. Two things break it. The rate the policy plans
for (`arrival_rps`) rises within 2 s but falls over 10 s, so the load the remote plan
drew is remembered while local answers hold the app back. And while the device is that
busy, the remote options are priced
at the rate the app would reach at their speed (`arrival_rps * local_ms / ms`, with
`ms` the fastest option's time on an idle uplink). An app that sends at a fixed rate
whatever the latency is then priced too high while the device is that busy: it may stay
local a little longer than it needs to, and a trial or a probe measures the link
meanwhile. Conversely, an app with a window cannot queue more than its window on the
uplink: with `Health.inflight` known, a request waits for at most `inflight - 1` uploads
ahead of it, so a plan whose uplink the app keeps full (utilisation past 0.9, where the
M/D/1 wait has no bound) is still an option, priced at that bound: a full uplink
answering the window in 0.8 s beats a device that answers it in 2 s.

[Note: measured send]
A remote option's time is the device's part, until the request is sent (the head and the
boundary's encode), then the rest: the link, the cloud and the answer's decode. The device's
part is measured per plan (`Health.send_ms`, the median of its recent requests); a plan not
yet used takes the profile's head and encode, scaled as local answers are. The rest is the
cost model's, scaled by `Health.remote_factor`, which the runner learns from the time after
the send only (`Action.model_ms`). Profiles time layers, and a device's codec is priced from
a desktop core's figures: on an emulated rpi4 the int8 encode of ResNet50's input took 37
ms where the profile says 0.5. Scaled into the remote factor, such an error also scaled
every plan's transfer and cloud time, the plans that send no input included.

[Note: cloud load]
A loaded cloud is seen two ways, per cut (the gateway batches each model@cut in its own
pool). `Health.queue_ms` is the predicted queue wait of a request sent now at that cut
(the larger of the gateway's `timings_ms['predicted_wait']`, drained since it was
reported, and its `timings_ms['expected_wait']`, the mean wait at its utilisation, faded
over `cloud_load_tau_s`; see edge_agent/cloud_load.py): it is
the cost model's `queue` term for that plan, replacing the plan's own batch-fill wait
where larger (and, being the cloud's own figure, not scaled by the remote factor), so a
loaded pool moves the device to a cut whose pool is not loaded (a deeper edge cut) or to
local, through the same hysteresis, dwell and back-off as a link step. A plan whose
requests go urgent (no local tail started at their send lands by the SLO:
edge_agent.hedge.goes_urgent, with the plan's send time and the rest of the local model)
is priced at `Health.urgent_queue_ms` instead, the wait of a request the cloud serves
first ([Note: priority under overload] in edge_agent/hedge.py): priced at the others'
wait, an rpi5 on 4G that no local run gets under a 150 ms SLO left a pool at 120 % load
that would have served it first, and answered 52.6 % of its requests in time against
load-blind DADS cuts' 67.7 % (bench.fleet --mix cloud-heavy); priced at its own, 69.1 %. `Health.refused_until_s` holds the cuts the gateway refused with
RESOURCE_EXHAUSTED: until its retry-after ends, such a cut is no option at all (the
gateway asked for quiet, and a request sent anyway is refused again and pays a round
trip for nothing); a current plan refused this way is unavailable, so the switch is
immediate. When the wait drains or the retry-after ends, the remote option returns and
the usual rules bring the device back.
A faded wait is a guess, and a device that left a busy pool hears nothing more of it: were
the guess a switch target, the device would go back each time the memory faded below the
margin, and leave at the first answer (with two busy cuts it went from one to the other
every few frames). So `Health.unconfirmed` holds the cuts whose last report said the pool
was busy (`CloudLoad.busy_cuts`: utilisation at least 0.8); while local, the device sends
one of them a trial (as rule 5, but at most one per `cloud_load_tau_s`, once its faded time
is `trial_ratio` times faster than local), and only the trial's fresh answer can make the
cut a target again. The current cut is priced as any other, but leaving it while its pool
is reported busy pays no switch cost (rule 3's gain over one dwell): a device that sends
one frame every few seconds gains a few ms a request by moving local, under the switch
cost, yet its place in the pool is what a device that cannot meet the SLO locally needs.
On the 10,000-device fleet at 120% load, charging that cost kept 59% of requests on the
cloud (80.8% within the SLO) where the fleet plan puts 50% (87.1%). A report forgotten
(faded under 1%) is no longer a sign of anything.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from edge_agent.hedge import goes_urgent, hedge_delay_s, hedged_times
from edge_agent.monitor import LinkEstimate, quantile
from edge_agent.policy_config import OBJECTIVES, PolicyConfig
from planner import Breakdown, Encoding, Frontier, Objective

__all__ = ["OBJECTIVES", "Action", "Health", "PolicyConfig", "PolicyState", "policy", "after_trial", "hedge_delay_s",
           "arrival_rps", "LOAD_WINDOWS_S", "LOCAL", "OFFLOAD"]

LOCAL, OFFLOAD = "local", "offload"
_MAX_UTILISATION = 0.9
LOAD_WINDOWS_S = (2.0, 10.0)
"""The request rate is the higher of the rates over these windows; see [Note: closed loop]."""
_BUSY = 0.6
"""Share of the time the device runs local requests from which their rate is taken as held down by
their latency; see [Note: closed loop]."""


@dataclass(frozen=True)
class Health:
    """What the policy knows about both paths."""

    remote_allowed: bool = True
    """The breaker lets this request use the network."""
    probe: bool = False
    """This request is the breaker's half-open probe."""
    breaker: str = "closed"
    """Breaker state, for the reason text."""
    local_ms: float = math.inf
    """Measured median of the whole model on the device; inf: no local model."""
    warm_cuts: frozenset[str] | None = None
    """Cut ids with a loaded head engine; None: every frontier cut."""
    arrival_rps: float = 0.0
    """Recent request rate; the uplink is a queue that this load may saturate."""
    remote_factor: float = 1.0
    """Measured / predicted time of recent remote answers; scales every remote option's time."""
    local_factor: float = 1.0
    """Measured / predicted time of recent local answers (already in `local_ms`; for the reason text)."""
    request: bool = True
    """This decision places a request (False: a re-evaluation; no trial, no probe)."""
    queue_ms: Mapping[str, float] = field(default_factory=dict)
    """The cloud's predicted queue wait (ms) for a request sent now, per cut id; a missing cut: 0
    (no sign of load). See [Note: cloud load]."""
    urgent_queue_ms: Mapping[str, float] | None = None
    """The same for a request that goes urgent (edge_agent.hedge.goes_urgent), which the cloud serves
    first; None: `queue_ms`."""
    refused_until_s: Mapping[str, float] = field(default_factory=dict)
    """Cut ids the cloud refused for load, with when their retry-after ends (monotonic s); no
    option until then. See [Note: cloud load]."""
    unconfirmed: frozenset[str] = frozenset()
    """Cut ids whose pool the cloud last reported busy (`CloudLoad.busy_cuts`): unless current, such a
    cut is a trial's target, never a switch's, until an answer reports it again. See [Note: cloud load]."""
    inflight: int = 0
    """Requests in flight with this one (0: unknown). A request waits for at most this many less one
    uploads ahead of it; see [Note: closed loop]."""
    send_ms: Mapping[str, float] = field(default_factory=dict)
    """Measured ms from a request's start until it was sent, per plan key: the device's head and
    encode, the first part of the plan's time ([Note: measured send]) and before which its hedge
    cannot start the local tail ([Note: hedge] in edge_agent/hedge.py); a missing plan: the profile's head and encode
    times, scaled as local answers are."""


@dataclass(frozen=True)
class Action:
    kind: str
    """'offload' or 'local'."""
    cut_id: str = ""
    """Wire cut id of the offload plan."""
    encoding: Encoding = field(default_factory=Encoding)
    """How the boundary travels."""
    plan_key: str = "local"
    """Stable id of the option ('local' or Plan.key)."""
    predicted_ms: float = math.inf
    """Predicted end-to-end ms of this option at the estimated link."""
    local_ms: float = math.inf
    """Predicted ms of local execution, for comparison."""
    reason: str = ""
    """Why, with the estimates that decided it."""
    switched: bool = False
    """This action changed the current option (log it)."""
    probe: bool = False
    """A breaker probe (the state did not move)."""
    trial: bool = False
    """A remote trial while local is current (the option did not move); see [Note: policy] 5."""
    queue_ms: float = 0.0
    """The cloud's reported queue wait in `predicted_ms` beyond the plan's own queue term (not
    scaled by `Health.remote_factor`); see [Note: cloud load]."""
    hi_ms: float = math.inf
    """Pessimistic end-to-end ms: all but `hedge_tail` of the option's predicted times are shorter
    (the hedge starts the local run when the remote answer is later); see [Note: hedge] in edge_agent/hedge.py."""
    miss: float = 0.0
    """Predicted chance that this option misses the SLO; see [Note: risk]."""
    model_ms: float = math.inf
    """The remote option's mean ms from the request's send to its answer, at the link's measured
    level (not the held rate) and before `Health.remote_factor`: what that factor is learnt
    against (runner.py [Note: measured correction]); inf for local."""
    held: bool = False
    """Local for this request only: the plan in use stays (see [Note: risk], a held drop)."""

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["encoding"] = self.encoding.to_dict()
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Action:
        d = json.loads(text)
        d["encoding"] = Encoding.from_dict(d["encoding"])
        return cls(**d)


@dataclass(frozen=True)
class PolicyState:
    current: str = ""
    """plan_key of the option in use; '' before the first decision."""
    switched_s: float | None = None
    """When the current option was chosen."""
    switches: int = 0
    """Switches so far."""
    previous: str = ""
    """plan_key of the option in use before the current one."""
    reversals: int = 0
    """Recent returns to the option just left; see [Note: policy] 4."""
    trial_s: float | None = None
    """When the last remote trial was let through."""
    recent_s: tuple[float, ...] = ()
    """When the switches of the last `switch_window_s` happened; each makes the next one dearer."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PolicyState:
        d = json.loads(text)
        d["recent_s"] = tuple(d.get("recent_s", ()))
        return cls(**d)


@dataclass(frozen=True)
class _Option:
    key: str
    kind: str
    ms: float
    """Mean end-to-end ms over the rate distribution."""
    cost: float
    cut_id: str = ""
    encoding: Encoding = field(default_factory=Encoding)
    queue_ms: float = 0.0
    hi_ms: float = math.inf
    miss: float = 0.0
    model_ms: float = math.inf
    level_ms: float = math.inf
    """Mean end-to-end ms at the link's level (`ms` is at the held rate for the plan in use)."""


def _refused(health: Health, cut_id: str, now_s: float) -> bool:
    return now_s < health.refused_until_s.get(cut_id, -math.inf)


def _remote_options(est: LinkEstimate, front: Frontier, health: Health, cfg: PolicyConfig,
                    energy: bool, now_s: float, current: str) -> list[_Option]:
    lr = front.link_range
    up = est.up_hold_bps or est.up_bps or cfg.initial_up_bps or math.sqrt(lr.up_lo_bps * lr.up_hi_bps)
    rates = est.rates_bps() or (up,)
    level = (est.up_bps or up) / up  # below 1 while a drop is held ([Note: held rate and spread])
    out = []
    for entry in front.entries:
        plan = entry.plan
        if not plan.boundary:  # edge-only: that is the local option
            continue
        cut_id = plan.cut.key
        if health.warm_cuts is not None and cut_id not in health.warm_cuts or _refused(health, cut_id, now_s):
            continue
        # [Note: risk] the held rate keeps the plan in use; any other is priced at the level.
        k = 1.0 if plan.key == current else level
        at = up * k
        # A one-entry frontier rescales this plan's own breakdown to the estimated link.
        p = dataclasses.replace(front, entries=(entry,)).plan_at(at)
        b = p.breakdown
        # The uplink serves every request's boundary in turn: an M/D/1 queue at this load, at the
        # plan's rate (a queue forms over many transfers, so over the rate they share).
        util = health.arrival_rps * b.uplink_ms / 1e3
        ahead_ms = (health.inflight - 1) * b.uplink_ms if health.inflight > 0 else math.inf  # [Note: closed loop]
        if util >= _MAX_UTILISATION and not math.isfinite(ahead_ms):
            continue
        wait_ms = min(ahead_ms, b.uplink_ms * util / (2.0 * (1.0 - util)) if util < _MAX_UTILISATION else math.inf)
        base_ms, hop_ms = _time_terms(b, at, est.rtt_ms)
        # [Note: measured send] the device's part, measured; the rest, scaled by the remote factor.
        head_ms = b.edge_ms * health.local_factor
        pre_ms = b.edge_ms + (b.tier_codec_ms[0] if b.tier_codec_ms else b.encode_ms)
        send_ms = health.send_ms.get(plan.key, pre_ms * health.local_factor)
        # The cloud's own figure, so not scaled by the agent's measured/predicted ratio.
        urgent = health.urgent_queue_ms is not None and goes_urgent(cfg.slo_ms, send_ms, health.local_ms - head_ms)
        reported = health.urgent_queue_ms if urgent else health.queue_ms
        queue_ms = max(0.0, reported.get(cut_id, 0.0) - b.queue_ms)  # type: ignore[union-attr] # [Note: cloud load]
        wait_ms += queue_ms
        after_ms = max(0.0, base_ms - pre_ms)
        f = health.remote_factor
        times = [send_ms + (after_ms + hop_ms / (r * k)) * f + wait_ms for r in rates]
        ms = sum(times) / len(times)
        at_level_ms = sum(after_ms + hop_ms / (r * level) for r in rates) / len(rates)  # after the send
        model_ms = at_level_ms + wait_ms
        hi_ms = quantile(times, 1.0 - cfg.hedge_tail)
        own = times
        if not energy:
            times = hedged_times(times, hi_ms, health.local_ms, cfg, send_ms, head_ms)
        slo = cfg.slo_ms
        miss = 0.0 if slo is None else sum(t > slo for t in times) / len(times)
        # [Note: risk] under the latency objective, the hedged requests' mean unless the cloud reported
        # this cut's pool busy; then the plan's own mean (a hedge at once would also load that pool).
        priced = times if cut_id not in health.unconfirmed else own
        cost = b.energy_j + front.idle_w * queue_ms / 1e3 if energy else sum(priced) / len(priced)
        level_ms = send_ms + at_level_ms * f + wait_ms
        out.append(_Option(plan.key, OFFLOAD, ms, cost, cut_id, plan.encoding, queue_ms, hi_ms, miss, model_ms,
                           level_ms))
    return out


def _time_terms(b: Breakdown, at_bps: float, rtt_ms: float | None) -> tuple[float, float]:
    """(base ms, hop ms x bit/s): a plan whose breakdown `b` is priced at `at_bps` takes base +
    hop / rate ms, before any queue and the remote factor, on a first hop of `rate` bit/s: that
    hop's bytes take time inversely to the rate, the rest is fixed; see [Note: risk]."""
    hop_up = b.hop_up_ms[0] if b.hop_up_ms else b.uplink_ms
    hop_down = b.hop_down_ms[0] if b.hop_down_ms else b.downlink_ms
    base = b.total_ms - hop_up - hop_down + (0.0 if rtt_ms is None else rtt_ms - b.rtt_ms)
    return base, (hop_up + hop_down) * at_bps


def _local_option(health: Health, frontier: Frontier | None, energy: bool, slo: float | None) -> _Option:
    cost = (frontier.compute_w * health.local_ms / 1e3) if energy and frontier else health.local_ms
    miss = 0.0 if slo is None or health.local_ms <= slo else 1.0
    return _Option(LOCAL, LOCAL, health.local_ms, cost, hi_ms=health.local_ms, miss=miss)


def _least_risk(options: list[_Option], tie: float) -> _Option | None:
    """The cheapest of the options whose chance of a miss is within `tie` of the least; see [Note: risk]."""
    if not options:
        return None
    least = min(o.miss for o in options)
    return min((o for o in options if o.miss <= least + tie), key=lambda o: o.cost)


def _show_miss(o: _Option) -> str:
    return f" {o.miss:.0%} of the time" if 0 < o.miss < 1 else ""


def _gain_ms(current: _Option, target: _Option, slo: float | None, energy: bool) -> float:
    """What one request gains by the target, in ms: mean time (or the relative energy gain at the
    current time), plus one SLO per miss avoided; see [Note: risk]."""
    if energy:
        gain = (current.cost - target.cost) / current.cost * current.ms if current.cost > 0 else 0.0
    else:
        gain = current.cost - target.cost
    return gain + (0.0 if slo is None else (current.miss - target.miss) * slo)


def _show_factors(health: Health) -> str:
    return f"; measured/predicted: local x{health.local_factor:.2f}, remote x{health.remote_factor:.2f}"


def _show(est: LinkEstimate, health: Health, now_s: float) -> str:
    up = "unknown" if est.up_bps is None else f"{est.up_bps / 1e6:.2f} Mbit/s"
    if est.up_hold_bps is not None and est.up_bps is not None and est.up_hold_bps > est.up_bps * 1.001:
        up += f" (held at {est.up_hold_bps / 1e6:.2f})"
    if est.up_low_bps is not None and len(est.spread) > 1:
        up += f", low {est.up_low_bps / 1e6:.2f}"
    rtt = "unknown" if est.rtt_ms is None else f"{est.rtt_ms:.0f} ms"
    waits = [f"{k} {ms:.0f} ms" for k, ms in sorted(health.queue_ms.items()) if ms >= 0.5]
    refused = [f"{k} {(t - now_s) * 1e3:.0f} ms" for k, t in sorted(health.refused_until_s.items()) if t > now_s]
    load = (f", cloud queue {', '.join(waits)}" if waits else "") + (
        f", refused for load: retry after {', '.join(refused)}" if refused else "")
    return f"up {up}, rtt {rtt}, {est.samples} samples{load}"


def _backoff(reversals: int, cfg: PolicyConfig) -> float:
    return 2.0 ** min(reversals, cfg.max_backoff)


def _reversals(state: PolicyState, now_s: float, cfg: PolicyConfig) -> int:
    """Reversals that still count: holding an option for `flap_window_s` beyond its back-off clears them."""
    held_s = math.inf if state.switched_s is None else now_s - state.switched_s
    return state.reversals if held_s < cfg.flap_window_s + cfg.dwell_s * _backoff(state.reversals, cfg) else 0


def _switch(state: PolicyState, to: str, now_s: float, cfg: PolicyConfig) -> PolicyState:
    """The state after switching to `to`, counting a return to the option just left as a reversal."""
    held_s = math.inf if state.switched_s is None else now_s - state.switched_s
    flip = bool(state.current) and to == state.previous and held_s < cfg.flap_window_s
    reversals = _reversals(state, now_s, cfg) + (1 if flip else 0)
    recent = _recent(state, now_s, cfg) + ((now_s,) if state.current else ())
    return PolicyState(to, now_s, state.switches + (1 if state.current else 0), state.current, reversals,
                       state.trial_s, recent)


def _recent(state: PolicyState, now_s: float, cfg: PolicyConfig) -> tuple[float, ...]:
    """The switches of the last `switch_window_s`."""
    return tuple(t for t in state.recent_s if now_s - t < cfg.switch_window_s)


def policy(estimate: LinkEstimate, frontier: Frontier | None, health: Health, state: PolicyState,
           now_s: float, *, config: PolicyConfig = PolicyConfig()) -> tuple[Action, PolicyState]:
    """The option for the next request; see [Note: policy]."""
    energy = config.objective == Objective.ENERGY.value and frontier is not None
    slo = config.slo_ms
    local = _local_option(health, frontier, energy, slo)
    remote = []
    if frontier is not None and health.remote_allowed:
        if state.current == LOCAL and health.arrival_rps * local.ms / 1e3 >= _BUSY:
            # [Note: closed loop] the device runs back to back: price the cloud at the load it would draw
            # (no less than the load of the moment, so no plan the moment's load rules out).
            unloaded = _remote_options(estimate, frontier, dataclasses.replace(health, arrival_rps=0.0), config,
                                       energy, now_s, state.current)
            fastest = min((o.ms for o in unloaded), default=math.inf)
            drawn = dataclasses.replace(health, arrival_rps=health.arrival_rps * max(1.0, local.ms / fastest))
            remote = (_remote_options(estimate, frontier, drawn, config, energy, now_s, state.current)
                      if unloaded else [])
        else:
            remote = _remote_options(estimate, frontier, health, config, energy, now_s, state.current)
    # [Note: cloud load] a busy cut left behind returns through a trial's fresh answer, not its faded wait.
    guesses = [o for o in remote if o.cut_id in health.unconfirmed and o.key != state.current]
    remote = [o for o in remote if o not in guesses]
    best_remote = _least_risk(remote, config.risk_tie)
    margin = 1.0 - config.hysteresis if slo is not None and not energy else 1.0
    options = {o.key: o for o in remote}
    if math.isfinite(local.ms):
        options[LOCAL] = local

    def act(o: _Option, reason: str, switched: bool, probe: bool = False, trial: bool = False) -> Action:
        held = (o.key == state.current and o.kind == OFFLOAD and health.request and estimate.holding and not energy
                and not (switched or probe or trial) and o.level_ms >= local.ms)
        if held:  # [Note: risk] a held drop: the plan stays in use, and this request runs here
            reason = (f"{o.key} kept; this request here: {o.level_ms:.0f} ms at the link's level vs local "
                      f"{local.ms:.0f} ms ({_show(estimate, health, now_s)})")
            o = local
        return Action(o.kind, o.cut_id, o.encoding, o.key, o.ms, health.local_ms, reason, switched, probe, trial,
                      o.queue_ms, o.hi_ms, o.miss, o.model_ms, held)

    if health.probe and health.request and best_remote is not None and (
            not math.isfinite(local.ms) or best_remote.cost <= local.cost):
        return act(best_remote, f"breaker probe ({_show(estimate, health, now_s)})", False, True), state

    # 1-2: the target.
    if best_remote is None:
        target = local
        if not health.remote_allowed:
            why = "breaker " + health.breaker
        elif frontier is not None and any(t > now_s for t in health.refused_until_s.values()) and _remote_options(
                estimate, frontier, dataclasses.replace(health, refused_until_s={}, arrival_rps=0.0), config,
                energy, now_s, state.current):
            why = "the cloud refused every warm plan for load"
        elif guesses:
            why = "the cloud reported every warm plan's pool busy"
        elif frontier is not None and health.arrival_rps > 0 and _remote_options(
                estimate, frontier, dataclasses.replace(health, arrival_rps=0.0), config, energy, now_s,
                state.current):
            why = f"the uplink cannot carry {health.arrival_rps:.1f} req/s of any warm plan"
        else:
            why = "no warm remote plan"
    elif not math.isfinite(local.ms):
        target, why = best_remote, "no local model"
    elif slo is not None and best_remote.miss > local.miss + config.risk_tie:
        target, why = local, (f"remote {best_remote.ms:.0f} ms misses the {slo:.0f} ms SLO{_show_miss(best_remote)}, "
                              f"local {local.ms:.0f} ms meets it")
    elif slo is not None and local.miss > best_remote.miss + config.risk_tie:
        target, why = best_remote, (f"only the remote plan ({best_remote.ms:.0f} ms) meets the {slo:.0f} ms SLO"
                                    + (f" ({1 - best_remote.miss:.0%} of the time)" if best_remote.miss else ""))
    else:
        # [Note: risk] the hedged request beats local by the hysteresis margin, or the cloud's work is for little.
        target = best_remote if best_remote.cost <= local.cost * margin else local
        unit = "J" if energy else "ms"
        why = f"remote {best_remote.cost:.3g} {unit} vs local {local.cost:.3g} {unit}"

    current = options.get(state.current)
    if current is None or current.key == target.key:
        switched = current is None
        new = state if not switched else _switch(state, target.key, now_s, config)
        reason = f"{target.key}: {why} ({_show(estimate, health, now_s)})"
        if switched and state.current:
            reason = f"{state.current} unavailable -> {reason}"
        trial = _busy_trial(guesses, target, new, health, now_s, config)
        if trial is not None and not switched:
            why = f"trial {trial.key} ({trial.ms:.0f} ms): its pool was busy; is it still? "
            why += f"({_show(estimate, health, now_s)})"
            return act(trial, why, False, trial=True), dataclasses.replace(state, trial_s=now_s)
        return act(target, reason, switched), new

    # 3-4: hysteresis, dwell and back-off.
    held_s = math.inf if state.switched_s is None else now_s - state.switched_s
    reversals = _reversals(state, now_s, config)
    returning = target.key == state.previous and reversals > 0
    dwell_s = config.dwell_s * (_backoff(reversals, config) if returning else 1.0)
    dwelt = held_s >= dwell_s
    urgent = target.cost <= current.cost * config.urgent_ratio and (dwelt or not returning)
    forced = (slo is not None and current.miss - target.miss >= 0.5) or urgent
    safer = slo is not None and current.miss - target.miss > config.risk_tie
    if target.kind == LOCAL and current.kind == OFFLOAD and margin < 1.0:
        # [Note: risk] a hedged plan is never dearer than local: against one, local counts at the margin
        # by which the plan must beat it, so that the plan is kept, as it was chosen, for a clear gain.
        target = dataclasses.replace(target, cost=target.cost * margin)
        better = target.cost < current.cost or safer
    else:
        better = target.cost < current.cost * (1.0 - config.hysteresis) or safer
    # [Note: risk] switching is worth it when the gain over one dwell's requests beats its cost; a
    # safer option need not wait for the dwell (misses are what the dwell would cost).
    requests = max(1.0, health.arrival_rps * dwell_s)
    switch_cost_ms = config.switch_cost_ms * (1 + len(_recent(state, now_s, config)))
    # [Note: cloud load] leaving a pool reported busy frees it for the devices that need it: no switch cost.
    leaving_busy = current.kind == OFFLOAD and current.cut_id in health.unconfirmed
    worth = leaving_busy or _gain_ms(current, target, slo, energy) * requests > switch_cost_ms
    if forced or (better and (dwelt or safer) and worth):
        reason = (f"{current.key} ({current.ms:.0f} ms{_show_miss(current)}) -> {target.key} ({target.ms:.0f} ms"
                  f"{_show_miss(target)}): {why}{'; forced' if forced else ''}{_show_factors(health)} "
                  f"({_show(estimate, health, now_s)})")
        return act(target, reason, True), _switch(state, target.key, now_s, config)
    hold = ("within hysteresis" if not better else f"dwell {dwell_s:g} s not over" if not (dwelt or safer)
            else f"saves less than a switch costs ({switch_cost_ms:.0f} ms over {requests:.0f} requests)")
    if (health.request and current.kind == LOCAL and target.kind == OFFLOAD
            and target.cost * config.trial_ratio <= current.cost
            and (state.trial_s is None or now_s - state.trial_s >= config.trial_every_s)):
        reason = (f"trial {target.key} ({target.ms:.0f} ms) while keeping local ({current.ms:.0f} ms, {hold})"
                  f"{_show_factors(health)} ({_show(estimate, health, now_s)})")
        return act(target, reason, False, trial=True), dataclasses.replace(state, trial_s=now_s)
    trial = _busy_trial(guesses, current, state, health, now_s, config)
    if trial is not None:
        why = f"trial {trial.key} ({trial.ms:.0f} ms): its pool was busy; is it still? "
        why += f"({_show(estimate, health, now_s)})"
        return act(trial, why, False, trial=True), dataclasses.replace(state, trial_s=now_s)
    return act(current, f"keep {current.key}: {hold} ({_show(estimate, health, now_s)})", False), state


def _busy_trial(guesses: list[_Option], current: _Option, state: PolicyState, health: Health, now_s: float,
                cfg: PolicyConfig) -> _Option | None:
    """While local, the cheapest cut left busy whose faded wait makes it `trial_ratio` times faster
    than local, once per `cloud_load_tau_s` (a load lasts): its answer reports the pool's load
    afresh; see [Note: cloud load]."""
    if not (guesses and health.request and current.kind == LOCAL and state.current == LOCAL) or (
            state.trial_s is not None and now_s - state.trial_s < max(cfg.trial_every_s, cfg.cloud_load_tau_s)):
        return None
    best = min(guesses, key=lambda o: o.cost)
    return best if best.cost * cfg.trial_ratio <= current.cost else None


def arrival_rps(arrivals_s: Sequence[float], now_s: float) -> float:
    """The request rate to plan for: the higher of the counts over each of `LOAD_WINDOWS_S` before
    `now_s`, over the whole window (a burst of five in 2 s is 2.5/s, not 500). A rise shows within
    2 s; a fall takes 10 s, because the fall is often the plan's own doing; see [Note: closed loop]."""
    return max(sum(1 for t in arrivals_s if 0 <= now_s - t <= w) / w for w in LOAD_WINDOWS_S)


def after_trial(state: PolicyState, measured_ms: float, local_ms: float, *,
                config: PolicyConfig = PolicyConfig()) -> PolicyState:
    """The state after a trial answered in `measured_ms`: one that beat local (`local_ms`, measured-
    corrected) by the hysteresis margin clears the back-off; see [Note: policy] 5."""
    if state.reversals and measured_ms < local_ms * (1.0 - config.hysteresis):
        return dataclasses.replace(state, reversals=0)
    return state
