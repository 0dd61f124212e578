"""The cloud's load as the agent plans with it, with time passed in: the gateway's expected
wait at its utilisation (the fleet planner's batch queue, one pool), the answer keys that
carry it (additive: an older answer still reads), `CloudLoad`'s decay, and the policy moving
a rarely-sending device off a loaded pool and back without flapping."""

import math

import numpy as np
import pytest

from cluster.protocol.messages import InferResponse
from edge_agent.cloud_load import CloudLoad
from edge_agent.policy import LOCAL, Health, PolicyConfig, PolicyState, policy
from planner.queueing import batch_queue, run_ms_table
from tests.unit.test_edge_cloud_load import A, A_CUT, B, B_CUT, EST, FRONT
from workers.batcher import BatcherLoad

SEG_MS, CONST_MS, MAX_B, WORKERS, TIMEOUT_MS = 3.0, 2.0, 8, 4, 2.0
TABLE = run_ms_table(np.array([SEG_MS]), CONST_MS, {1: 1.0, 8: 4.0}, MAX_B)[0]


def _expected_ms(rate_rps: float, predicted_s: float = 0.0) -> float:
    s = BatcherLoad.expected_wait_at(rate_rps, lambda b: float(TABLE[b - 1]) / 1e3, max_batch_size=MAX_B,
                                     instances=WORKERS, timeout_s=TIMEOUT_MS / 1e3, predicted_wait_s=predicted_s)
    assert s is not None
    return s * 1e3


def test_the_expected_wait_is_the_planners_batch_queue_at_the_same_rate():
    capacity = WORKERS * MAX_B * 1e3 / TABLE[-1]
    for share in (0.05, 0.3, 0.6, 0.8, 0.9, 0.95):
        q = batch_queue(np.array([share * capacity]), TABLE[None, :], WORKERS, TIMEOUT_MS)
        planner_ms = q.wait_ms + float(q.fill_ms[0]) + float(q.run_ms[0]) - TABLE[0]
        assert _expected_ms(share * capacity) == pytest.approx(planner_ms, rel=0.02, abs=0.05), share
    # 5% busy: about the batch timeout; near capacity the wait for a worker dominates.
    assert _expected_ms(0.05 * capacity) < 3.0 and _expected_ms(0.99 * capacity) > 10 * _expected_ms(0.05 * capacity)
    # Past capacity: no steady state; the figure stops at the cap, or the queue the batcher sees.
    assert _expected_ms(2 * capacity) == pytest.approx(_expected_ms(0.99 * capacity))
    assert _expected_ms(2 * capacity, predicted_s=1.5) == pytest.approx(1500.0)
    # No arrivals: what the batcher sees now; no batch timed yet: no figure.
    assert _expected_ms(0.0, predicted_s=0.004) == pytest.approx(4.0)
    assert BatcherLoad.expected_wait_at(10.0, lambda b: None, max_batch_size=8, instances=1, timeout_s=0.0) is None


def test_utilisation_is_arrivals_over_capacity():
    load = BatcherLoad(queue_depth=0, running_batches=0, predicted_wait_s=0.0, batch_run_s=0.1, capacity_rps=80.0,
                       arrival_rps=60.0)
    assert load.utilisation == pytest.approx(0.75)
    assert BatcherLoad(0, 0, None, None, None, 5.0).utilisation is None


def test_the_load_keys_round_trip_and_an_answer_without_them_still_reads():
    new = InferResponse("r1", {}, {"queue": 1.0, "predicted_wait": 0.0, "utilisation": 0.93, "expected_wait": 41.5})
    back = InferResponse.from_msgpack(new.to_msgpack())
    assert dict(back.timings_ms) == dict(new.timings_ms)
    old = InferResponse.from_msgpack(InferResponse("r2", {}, {"queue": 1.0, "predicted_wait": 12.0}).to_msgpack())
    load = CloudLoad()
    load.observe_timings("c", back.timings_ms, 0.0)
    load.observe_timings("d", old.timings_ms, 0.0)
    assert load.queue_ms(0.0) == {"c": pytest.approx(41.5), "d": pytest.approx(12.0)}
    assert load.utilisation(0.0) == {"c": pytest.approx(0.93)}
    # A gateway that sends neither key: nothing is known, nothing is assumed.
    load.observe_timings("e", InferResponse("r3", {}, {"queue": 1.0}).timings_ms, 0.0)
    assert "e" not in load.queue_ms(0.0)


def test_a_reported_load_decays_over_its_time_constant_and_the_larger_wait_counts():
    load = CloudLoad(tau_s=10.0)
    load.observe_load("a", 100.0, 0.95, 0.0)
    assert load.queue_ms(0.0)["a"] == pytest.approx(100.0)
    assert load.queue_ms(10.0)["a"] == pytest.approx(100.0 / math.e)
    assert load.utilisation(10.0)["a"] == pytest.approx(0.95 / math.e)
    # An instantaneous wait drains at 1 ms per ms; the expected wait fades slowly: the larger counts.
    load.observe_wait("a", 500.0, 10.0)
    assert load.queue_ms(10.2)["a"] == pytest.approx(300.0)
    assert load.queue_ms(11.0)["a"] == pytest.approx(100.0 * math.exp(-1.1))
    # A fresh report replaces the old one; a load faded under 1% of its report is forgotten.
    load.observe_load("a", 5.0, 0.2, 20.0)
    assert load.queue_ms(20.0)["a"] == pytest.approx(5.0)
    assert load.queue_ms(20.0 + 10.0 * math.log(101)) == {}
    for bad in (-1.0, math.nan, math.inf, None):
        load.observe_load("b", bad, 0.5, 30.0)  # type: ignore[arg-type]
    assert "b" not in load.queue_ms(30.0)
    with pytest.raises(ValueError, match="cloud_load_tau_s=0"):
        CloudLoad(tau_s=0)
    with pytest.raises(ValueError, match="cloud_load_tau_s"):
        PolicyConfig(cloud_load_tau_s=-1.0)


def _fleet_day(reported, frame_s=3.0, seconds=600.0, timings_of=lambda cut, t: {}):
    """A device sending one frame every `frame_s`: each remote answer (request or trial) reports
    the pool's load at that time, `reported(cut, t) -> (utilisation, expected wait ms)`; local
    requests hear nothing. Returns the plan key per frame and the last state."""
    load, state, keys, trials = CloudLoad(tau_s=10.0), PolicyState(), [], []
    cfg = PolicyConfig(hysteresis=0.15, dwell_s=1.0)
    for i in range(int(seconds / frame_s)):
        now = i * frame_s
        health = Health(local_ms=400.0, arrival_rps=1.0 / frame_s, queue_ms=load.queue_ms(now),
                        unconfirmed=load.busy_cuts(now))
        a, state = policy(EST, FRONT, health, state, now, config=cfg)
        keys.append(state.current)
        if a.trial:
            trials.append((now, a.plan_key))
        if a.kind != LOCAL:
            util, wait_ms = reported(a.cut_id, now)
            load.observe_timings(a.cut_id, {"predicted_wait": 0.0, "utilisation": util, "expected_wait": wait_ms,
                                            **timings_of(a.cut_id, now)}, now)
    return keys, state, trials


def _runs(keys):
    return [k for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k]


def test_a_rare_sender_moves_deeper_then_local_under_load_and_back_without_flapping():
    # Cloud-only's pool A is 96% busy from 120 s, both pools from 240 s, none from 360 s. The
    # instantaneous wait stays 0 throughout (no round of full batches queued): only the expected
    # wait says so.
    def reported(cut, t):
        busy = (120 <= t < 360 and cut == A_CUT) or (240 <= t < 360 and cut == B_CUT)
        return (0.96, 600.0) if busy else (0.3, 2.0)

    keys, state, trials = _fleet_day(reported)
    at = {t: keys[int(t / 3.0)] for t in (117, 126, 237, 258, 357, 372, 597)}
    assert at[117] == A.key and at[126] == B.key  # A's load is seen at its next answer
    assert at[237] == B.key and at[258] == LOCAL and at[357] == LOCAL
    assert at[372] == A.key and at[597] == A.key  # back at the first trial after the load fell
    # Held options: A, B, then A once more (its report, 120 s old, was forgotten: one answer
    # says it is busy), local, A. No option is left and taken again while the load holds.
    assert _runs(keys) == [A.key, B.key, A.key, LOCAL, A.key] and state.switches == 4
    # While local, a busy pool gets one trial per time constant (10 s), not every frame.
    local_trials = [t for t, _ in trials if 258 <= t < 360]
    assert 5 <= len(local_trials) <= 10 and min(b - a for a, b in zip(local_trials, local_trials[1:])) >= 10.0


def test_without_the_expected_wait_a_rare_sender_reads_a_busy_cloud_as_idle():
    keys, _, _ = _fleet_day(lambda cut, t: (0.96, 600.0), timings_of=lambda cut, t: {"expected_wait": None})
    assert set(keys) == {A.key}


def test_leaving_a_pool_reported_busy_pays_no_switch_cost():
    # On A (46 ms idle); A's wait makes it 60 ms against a 50 ms local run: 10 ms a request,
    # under the 50 ms a switch costs for a device sending one request per dwell.
    cfg = PolicyConfig(hysteresis=0.15, dwell_s=1.0, switch_cost_ms=50.0)
    state = PolicyState(current=A.key, switched_s=0.0, previous="")
    for busy, want in ((frozenset(), A.key), (frozenset({A_CUT}), LOCAL)):
        health = Health(local_ms=50.0, arrival_rps=0.3, queue_ms={A_CUT: 14.0, B_CUT: 60.0}, unconfirmed=busy)
        a, _ = policy(EST, FRONT, health, state, 30.0, config=cfg)
        assert a.plan_key == want, a.reason
