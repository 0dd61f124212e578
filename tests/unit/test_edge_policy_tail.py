"""With an SLO, remote plans are chosen for the tail the recent delivery record predicts
(`PolicyConfig.cost_quantile`), not for their mean. Time is passed in."""

import dataclasses
import math

import pytest

from edge_agent.monitor import LinkEstimate
from edge_agent.policy import LOCAL, Health, PolicyConfig, PolicyState, policy
from planner import FrontierEntry

from tests.unit.test_edge_policy_risk import A, FRONT

ONLY_A = dataclasses.replace(FRONT, entries=(FrontierEntry(0.5e6, 1e9, A),))
HEALTH = Health(local_ms=400.0)


def _estimate(errors: tuple[float, ...]) -> LinkEstimate:
    return LinkEstimate(up_bps=10e6, down_bps=40e6, rtt_ms=20.0, samples=len(errors), last_sample_s=0.0,
                        last_change_s=None, up_hold_bps=10e6, spread=errors)


# Four transfers in five at 10 Mbit/s, the fifth at 1.5: cloud-only takes ~150 ms or ~830 ms,
# a mean of ~290 ms against the 400 ms local run, but a 90th percentile of ~830 ms.
DIPPY = _estimate((0.0,) * 8 + (math.log(0.15),) * 2)
STEADY = _estimate(tuple(math.log(f) for f in (0.8, 0.9, 1.0, 1.1, 1.2) * 2))


def test_a_plan_whose_tail_is_slower_than_local_is_not_chosen_for_its_mean():
    tail, _ = policy(DIPPY, ONLY_A, HEALTH, PolicyState(), 0.0, config=PolicyConfig(slo_ms=1000.0))
    mean, _ = policy(DIPPY, ONLY_A, HEALTH, PolicyState(), 0.0, config=PolicyConfig(slo_ms=1000.0, cost_quantile=0.0))
    assert tail.kind == LOCAL
    assert mean.plan_key == A.key and mean.predicted_ms < HEALTH.local_ms


def test_a_plan_whose_tail_beats_local_is_chosen():
    act, _ = policy(STEADY, ONLY_A, HEALTH, PolicyState(), 0.0, config=PolicyConfig(slo_ms=1000.0))
    assert act.plan_key == A.key


def test_the_quantile_sets_how_rare_a_slow_transfer_may_be():
    # One transfer in five slow: the 70th percentile is fast, the 90th is not.
    assert policy(DIPPY, ONLY_A, HEALTH, PolicyState(), 0.0,
                  config=PolicyConfig(slo_ms=1000.0, cost_quantile=0.7))[0].plan_key == A.key
    assert policy(DIPPY, ONLY_A, HEALTH, PolicyState(), 0.0,
                  config=PolicyConfig(slo_ms=1000.0, cost_quantile=0.9))[0].kind == LOCAL


def test_without_an_slo_the_mean_decides():
    act, _ = policy(DIPPY, ONLY_A, HEALTH, PolicyState(), 0.0, config=PolicyConfig())
    assert act.plan_key == A.key


@pytest.mark.parametrize("value", [-0.1, 1.0, math.nan])
def test_a_bad_quantile_is_refused_by_name(value):
    with pytest.raises(ValueError, match="cost_quantile"):
        PolicyConfig(cost_quantile=value)
