"""When the device starts its own run beside a remote call: the hedge. Pure functions, as the
policy's; the runner schedules what `hedge_delay_s` says, and the policy prices each remote
option with `hedged_times`.

[Note: hedge]
A request sent to the cloud has a deadline: `slo_ms`, or `remote_timeout_ms` without
one. `hedge_delay_s` says when the device starts its own run of the rest of the model
beside the remote call (the cut's tail from the head's output). Normally that is the
latest moment at which the local run still lands in time with `hedge_margin` of its own
time to spare: a remote answer still missing then is late enough to race. But when the
remote time predicted for the request nears the deadline (its pessimistic time
`Action.hi_ms`, all but `hedge_tail` of its predicted times, is past that moment; and,
once the plan has three measured answers, the same quantile of them agrees), the local
run starts at once: waiting for the last safe moment would only make its answer later.
A race costs the device a run, and a remote time past the local run's own is no reason
for one: the policy offloads such a plan only where its mean beats local, and racing
every such request at once ran the device for nearly every request (it failed the
runner's remote-error, outage and overload tests, the hedge answering first).
Under an SLO, a local run that lands in time but not with the whole margin keeps what is left
of it (an rpi4, ResNet50 in 493 ms, under a 600 ms SLO never hedged: slow calls missed it).
Where the local run cannot land in time even started at once, there is no hedge: the
remote budget alone decides when to give up on the cloud. The hedge starts the tail no
sooner than the request was sent (`Health.send_ms`: the head and the encode run on the
device first), so a hedged request answers by the send time plus the tail's time: with
ResNet50 at an rpi4's speed, int8 of the input took the device 37 ms that the profile's
figures for a desktop core put at 0.5, and the hedged requests that lost the race answered
in 531 ms against the local model's 494. The remote call is not cancelled: the first
valid answer is the request's, the other is dropped and counted (`late_dropped`), or the
local tail is cancelled (`local_cancelled`; runner.py [Note: local runs cancelled]), so a
request is never answered twice and never left without an answer. The hedge is what lets
the plan ignore short dips: the few requests inside a dip are rescued one by one, and the
plan moves only for a drop that lasts. While a drop is held (the link's level below the rate
the plan is priced at), a request whose rest after the send, priced at the level, would
answer after its local run started now races at once: the plan's record predates the drop,
and without an SLO the last safe moment is the remote budget's. (A request of the plan in
use is not sent then under the latency objective: it runs here; see [Note: risk] in
edge_agent/policy.py. The race covers trials, probes and plans taken up in the drop.) Left to it, on the demo
trace's step from 18.88 to 1.1 Mbit/s (ResNet50, 222 ms locally, no SLO, a 1.5 s budget)
the 5 requests sent before the agent left the cloud ran their local runs after 1.2 s each,
one after the other, and answered in 1.4-2.1 s.

[Note: priority under overload]
A request that the hedge would not race (its local run could not land by the SLO even
started now, or there is no local fallback) has no answer in time but the cloud's, and
one the cloud refuses misses its SLO for certain; a request that the hedge covers still
answers in time. So under an SLO the first goes to the cloud with priority 1
(`urgent_priority`), the second with 0: the gateway's batcher serves the higher priority
first and counts only the requests of its priority or higher as ahead of a new one when
it decides whether to refuse it (workers/batcher.py), so under overload the refusals
fall on the requests that can still answer here. In the simulated fleet of
bench.fleet at 120 % load (10,000 devices, SLO 150 ms), where the Pis' requests are
urgent (no local run of theirs meets the SLO) and the phones' and Jetsons' are not,
devices on load-blind DADS cuts answered 86.2 % within the SLO with the priority and
81.6 % in arrival order; cloud-only 86.6 % and 67.6 %. (In the fleet load test, an rpi4
under a 600 ms SLO, the tail started at the send covers every request: none goes urgent.)
A client may claim it falsely; the agent claims it only where its own hedge says so, and
a token's `max_priority` caps what the gateway grants ([Note: priority claims] in
cluster/auth.py). The answers report the waits of both priorities (cluster/gateway.py),
and the policy prices a remote option whose requests would go urgent (`goes_urgent`, the
hedge's own test) at the urgent ones ([Note: cloud load] in edge_agent/policy.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from edge_agent.monitor import quantile
from edge_agent.policy_config import PolicyConfig
from planner.costmodel import goes_urgent, latest_local_start_ms

if TYPE_CHECKING:
    from edge_agent.policy import Action

__all__ = ["URGENT", "goes_urgent", "hedge_delay_s", "hedged_times", "urgent_priority"]

URGENT = 1
"""The priority of a request whose only answer in time is the cloud's ([Note: priority under overload])."""
_HEDGE_RECORD = 3
"""Measured answers of a plan from which they must agree with a prediction to hedge at once."""


def _hedge_start_ms(hi_ms: float, local_ms: float, cfg: PolicyConfig) -> float | None:
    """When the hedge of `hedge_delay_s` starts the local run of a remote option whose pessimistic
    time is `hi_ms` (0: at once), given an SLO the local model meets; None: no hedge."""
    if cfg.slo_ms is None or not math.isfinite(local_ms) or cfg.hedge_tail <= 0:
        return None
    latest_ms = latest_local_start_ms(cfg.slo_ms, local_ms, cfg.hedge_margin)
    if latest_ms <= 0:
        return None
    return 0.0 if hi_ms >= min(latest_ms, local_ms) else latest_ms


def hedged_times(times: list[float], hi_ms: float, local_ms: float, cfg: PolicyConfig, send_ms: float = 0.0,
                 head_ms: float = 0.0) -> list[float]:
    """A remote option's times with its hedge: none later than its local tail (the whole model's
    `local_ms` less the head's `head_ms`) started when the hedge starts it, and not before the
    request was sent (`send_ms`): a hedge at once answers at the send time plus the tail's."""
    start_ms = _hedge_start_ms(hi_ms, local_ms, cfg)
    if start_ms is None:
        return times
    latest = max(start_ms, send_ms) + max(0.0, local_ms - head_ms)
    return [min(t, latest) for t in times]


def hedge_delay_s(action: Action, *, elapsed_ms: float, deadline_ms: float, local_ms: float,
                  record_ms: Sequence[float] = (), held_ms: float | None = None,
                  config: PolicyConfig = PolicyConfig()) -> float:
    """Seconds from now until the local run starts beside the remote call of `action`, for a request
    `elapsed_ms` old whose answer is due `deadline_ms` after its start, when the rest of the model
    takes `local_ms` here; `record_ms` are recent measured times of remote answers of the same plan;
    `held_ms`, while a drop is held, the rest of the request (after its send) priced at the level.
    0: at once; inf: no hedge (the local run could not land in time: the remote budget decides)."""
    now_ms = elapsed_ms if config.slo_ms is not None else -math.inf  # a timeout is no promise to race for
    latest_ms = latest_local_start_ms(deadline_ms, local_ms, config.hedge_margin, now_ms)
    if latest_ms <= elapsed_ms:
        return math.inf
    if held_ms is not None and held_ms >= local_ms:
        return 0.0  # a held drop: at the link's level the answer comes after a local run started now
    near = config.hedge_tail > 0 and action.hi_ms >= latest_ms
    if near and len(record_ms) >= _HEDGE_RECORD:
        # The plan's own recent answers must agree: a prediction alone may be off (a profile's
        # fixed costs, gRPC on a small model), and a race costs the device a run.
        near = quantile(record_ms, 1.0 - config.hedge_tail) >= latest_ms
    return 0.0 if near else (latest_ms - elapsed_ms) / 1e3


def urgent_priority(slo_ms: float | None, hedge_s: float) -> int:
    """The cloud priority of a request whose hedge starts in `hedge_s` (inf: never): `URGENT` under
    an SLO when no local run can answer it in time, else 0; see [Note: priority under overload]."""
    return URGENT if slo_ms is not None and not math.isfinite(hedge_s) else 0
