"""A remote plan is priced as the requests its hedge makes of it (none later than the local run
the hedge starts) unless the cloud reported its cut's pool busy, and with an SLO must beat local
by the hysteresis margin; a busy cut is priced at its own times. Time is passed in."""

import dataclasses
import math

import pytest

from edge_agent.monitor import LinkEstimate
from edge_agent.policy import LOCAL, Health, PolicyConfig, PolicyState, policy
from planner import FrontierEntry

from tests.unit.test_edge_policy_risk import A, FRONT

ONLY_A = dataclasses.replace(FRONT, entries=(FrontierEntry(0.5e6, 1e9, A),))
HEALTH = Health(local_ms=400.0)
SLO = PolicyConfig(slo_ms=1000.0)


def _estimate(errors: tuple[float, ...]) -> LinkEstimate:
    return LinkEstimate(up_bps=10e6, down_bps=40e6, rtt_ms=20.0, samples=len(errors), last_sample_s=0.0,
                        last_change_s=None, up_hold_bps=10e6, spread=errors)


# Three transfers in five at 10 Mbit/s, two at 1: cloud-only takes ~150 ms or ~1.2 s, a mean of
# ~580 ms against the 400 ms local run. Its pessimistic time is past the last safe moment, so its
# hedge starts the local run at once: no request later than ~400 ms, a mean of ~250 ms.
DIPPY = _estimate((0.0,) * 6 + (math.log(0.1),) * 4)


def test_a_plan_slow_on_average_but_fast_with_its_hedge_is_chosen_while_the_cloud_is_idle():
    act, _ = policy(DIPPY, ONLY_A, HEALTH, PolicyState(), 0.0, config=SLO)
    assert act.plan_key == A.key and act.miss == 0.0
    assert act.predicted_ms > HEALTH.local_ms  # its own mean, which the runner's correction compares


def test_a_cut_the_cloud_reports_busy_is_priced_at_its_own_times():
    # A hedge that starts at once is a local run that also loads the pool: not on a busy one.
    busy = dataclasses.replace(HEALTH, unconfirmed=frozenset({A.cut.key}), queue_ms={A.cut.key: 5.0})
    act, _ = policy(DIPPY, ONLY_A, busy, PolicyState(A.key, 0.0), 1.0, config=SLO)
    assert act.kind == LOCAL
    # A small wait at a pool that is not busy is priced in the times, with the hedge.
    waiting = dataclasses.replace(HEALTH, queue_ms={A.cut.key: 5.0})
    assert policy(DIPPY, ONLY_A, waiting, PolicyState(), 0.0, config=SLO)[0].plan_key == A.key


def test_a_hedged_plan_must_beat_local_by_the_hysteresis_margin():
    # Steady at 10 Mbit/s with A ~150 ms, local at 170 ms: the remote gain is under 15 %.
    steady = _estimate((0.0,) * 10)
    near = dataclasses.replace(HEALTH, local_ms=170.0)
    assert policy(steady, ONLY_A, near, PolicyState(), 0.0, config=SLO)[0].kind == LOCAL
    assert policy(steady, ONLY_A, near, PolicyState(), 0.0,
                  config=dataclasses.replace(SLO, hysteresis=0.05))[0].plan_key == A.key
    # Without an SLO there is no hedge to price, and the mean decides at once.
    assert policy(steady, ONLY_A, near, PolicyState(), 0.0, config=PolicyConfig())[0].plan_key == A.key
