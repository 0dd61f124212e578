"""The load signal per priority ([Note: priority under overload] in edge_agent/hedge.py), with
time passed in: the batcher's and a Ray pool's wait of a priority-1 request (behind its own
class only), the expected wait by Cobham's formula at the urgent share of the arrivals,
`CloudLoad` keeping both, and the policy pricing a remote option whose requests would go
urgent at the urgent wait, and any other at the priority-0 wait."""

import asyncio
import itertools

import numpy as np
import pytest

from cluster._pools import AnswerLoad
from edge_agent.cloud_load import CloudLoad
from edge_agent.hedge import goes_urgent, hedge_delay_s, urgent_priority
from edge_agent.policy import LOCAL, OFFLOAD, Action, Health, PolicyConfig, PolicyState, policy
from planner.queueing import batch_queue, run_ms_table
from tests.unit.test_batcher_deadlines import _Clock, _run, _timed_batcher
from tests.unit.test_edge_cloud_load import A, A_CUT, B_CUT, EST, FRONT
from tests.unit.test_queueing_answer_load import _answer
from workers.batcher import ArrivalRate, BatcherLoad

TABLE = run_ms_table(np.array([3.0]), 2.0, {1: 1.0, 8: 4.0}, 8)[0]


def _expected_ms(rate_rps: float, share: float = 1.0) -> float:
    s = BatcherLoad.expected_wait_at(rate_rps, lambda b: float(TABLE[b - 1]) / 1e3, max_batch_size=8, instances=4,
                                     timeout_s=0.002, ahead_share=share)
    assert s is not None
    return s * 1e3


def test_the_urgent_expected_wait_scales_the_wait_for_an_instance_by_cobhams_formula():
    capacity = 4 * 8 * 1e3 / TABLE[-1]
    for load in (0.3, 0.8, 0.95):
        q = batch_queue(np.array([load * capacity]), TABLE[None, :], 4, 2.0)
        rest_ms = float(q.fill_ms[0]) + float(q.run_ms[0]) - TABLE[0]
        rho = q.utilisation
        assert _expected_ms(load * capacity) == pytest.approx(q.wait_ms + rest_ms, rel=1e-9)
        for share in (0.0, 0.1, 0.5):
            want = q.wait_ms * (1 - rho) / (1 - rho * share) + rest_ms
            assert _expected_ms(load * capacity, share) == pytest.approx(want, rel=1e-9), (load, share)
    # Near capacity with a tenth of the arrivals urgent, the urgent figure is mostly its batch's fill
    # and run: under a third of the others'.
    assert _expected_ms(0.99 * capacity) > 3 * _expected_ms(0.99 * capacity, 0.1)
    shares = [_expected_ms(0.9 * capacity, s) for s in np.linspace(0, 1, 11)]
    assert shares == sorted(shares)


def test_arrivals_count_the_urgent_ones_apart():
    rate = ArrivalRate()
    for k in range(10):
        rate.count(5.0 + k / 10, urgent=k < 3)
    rate.count(6.0, 0)
    assert rate.rps == pytest.approx(10.0) and rate.urgent_rps == pytest.approx(3.0)
    rate.count(8.5, 0)  # two idle seconds: both read 0
    assert rate.rps == rate.urgent_rps == 0.0


def test_the_batchers_urgent_wait_is_behind_the_urgent_requests_only():
    async def main():
        clock = _Clock()
        b, gate = _timed_batcher(clock, 0.1, max_batch_size=2, num_priority_levels=2)
        assert await b.submit(1) == 10  # times a batch of one
        gate.clear()
        running = [asyncio.ensure_future(b.submit(i)) for i in (2, 3)]
        await asyncio.sleep(0)
        queued = [asyncio.ensure_future(b.submit(i)) for i in (4, 5, 6, 7)]  # priority 0: two batches
        await asyncio.sleep(0)
        before = b.load()
        urgent = asyncio.ensure_future(b.submit(8, priority=1))
        await asyncio.sleep(0)
        after = b.load()
        gate.set()
        await asyncio.gather(*running, *queued, urgent)
        return before, after

    before, after = _run(main())
    batch_s = 0.2  # a batch of two, estimated at twice the timed batch of one
    # Priority 0: the running batch of two ends in 0.2, then the two batches queued ahead.
    assert before.predicted_wait_s == pytest.approx(batch_s + 2 * batch_s)
    # Priority 1: the running batch only; one urgent request queued is no whole batch ahead.
    assert before.urgent_predicted_wait_s == pytest.approx(batch_s)
    assert after.urgent_predicted_wait_s == pytest.approx(batch_s)
    assert after.predicted_wait_s == pytest.approx(3 * batch_s)  # five queued: still two whole batches ahead
    assert after.urgent_arrival_rps == 0.0  # the rate is read once a whole second has passed


def test_a_ray_pools_urgent_figure_is_at_the_urgent_share_and_over_the_urgent_answers():
    load = AnswerLoad(max_batch_size=2, replicas=1, instances=1, timeout_s=0.0)
    load.arrived(0.0)
    load.answered(_answer(0.0, 0.050, 1), first_in_batch=True)
    load.arrived(0.0)
    load.answered(_answer(0.0, 0.090, 2), first_in_batch=True)
    for k in range(20):  # 20 req/s, a fifth of them urgent; the others queued 300 ms, the urgent 10 ms
        urgent = k % 5 == 0
        load.arrived(1.0 + k / 20, urgent)
        load.answered(_answer(0.010 if urgent else 0.300, 0.090, 2), first_in_batch=False, urgent=urgent)
    util, wait_s, urgent_s = load.expected_load(2.0)
    formula = [BatcherLoad.expected_wait_at(20.0, load.run_times.estimate_s, max_batch_size=2, instances=1,
                                            timeout_s=0.0, ahead_share=share) for share in (1.0, 0.2)]
    assert util == pytest.approx(20 / (2 / 0.090), rel=0.02)
    assert formula[1] < formula[0]
    # Each figure: at least its own answers' EWMA (alpha 0.2; 40 ms more for the batch of two's run).
    beyond_0 = 0.340 - (0.340 - 0.008) * 0.8 ** 16
    beyond_1 = 0.050  # the first urgent answer starts its own EWMA
    assert wait_s == pytest.approx(max(formula[0], beyond_0))
    assert urgent_s == pytest.approx(max(formula[1], beyond_1))
    assert urgent_s < wait_s


def test_cloud_load_keeps_the_urgent_figures_and_falls_back_where_a_cut_has_none():
    load = CloudLoad(tau_s=10.0)
    load.observe_timings("c", {"predicted_wait": 200.0, "expected_wait": 150.0, "utilisation": 1.1,
                               "urgent_predicted_wait": 20.0, "urgent_expected_wait": 30.0}, 0.0)
    load.observe_timings("old", {"predicted_wait": 80.0}, 0.0)
    assert load.queue_ms(0.0) == {"c": pytest.approx(200.0), "old": pytest.approx(80.0)}
    assert load.queue_ms(0.0, urgent=True) == {"c": pytest.approx(30.0), "old": pytest.approx(80.0)}
    # The urgent waits drain and fade as the others: 15 ms on, the drained 5 ms is under the faded 30.
    assert load.queue_ms(0.015, urgent=True)["c"] == pytest.approx(30.0 * np.exp(-0.0015))
    assert load.utilisation(0.0) == {"c": pytest.approx(1.1)} and load.busy_cuts(0.0) == {"c"}
    # Gone from memory, the cut still has urgent figures: 0, not the priority-0 wait.
    assert "c" not in load.queue_ms(60.0, urgent=True)


def test_goes_urgent_is_the_hedges_own_test():
    cfg = PolicyConfig(slo_ms=150.0)
    action = Action(OFFLOAD, "c", predicted_ms=100.0, hi_ms=100.0)
    for send_ms, tail_ms in itertools.product((0.0, 20.0, 60.0, 140.0), (10.0, 50.0, 90.0, 130.0, 400.0)):
        delay = hedge_delay_s(action, elapsed_ms=send_ms, deadline_ms=150.0, local_ms=tail_ms, config=cfg)
        assert goes_urgent(150.0, send_ms, tail_ms) == bool(urgent_priority(150.0, delay)), (send_ms, tail_ms)
    assert goes_urgent(150.0, 0.0, float("inf")) and not goes_urgent(None, 0.0, float("inf"))


def _act(slo_ms: float | None, urgent_queue_ms: dict | None) -> Action:
    health = Health(local_ms=400.0, queue_ms={A_CUT: 500.0, B_CUT: 500.0}, urgent_queue_ms=urgent_queue_ms)
    action, _ = policy(EST, FRONT, health, PolicyState(), 0.0, config=PolicyConfig(slo_ms=slo_ms))
    return action


def test_an_option_whose_requests_go_urgent_is_priced_at_the_urgent_wait():
    """Local takes 400 ms. Under a 150 ms SLO no local tail lands in time, so the requests go
    urgent; under 1 s they do not, and the cloud's priority-0 wait is theirs."""
    urgent = {A_CUT: 5.0, B_CUT: 5.0}
    a = _act(150.0, urgent)
    assert a.kind == OFFLOAD and a.plan_key == A.key and a.queue_ms == pytest.approx(5.0)
    assert a.predicted_ms < 150.0
    # Without urgent figures (an older gateway): the priority-0 wait, and a miss either way.
    assert _act(150.0, None).predicted_ms > 500.0 or _act(150.0, None).kind == LOCAL
    # Requests that a local run still answers in time go at priority 0 and are priced there.
    assert _act(1000.0, urgent).kind == LOCAL
    assert _act(None, urgent).kind == LOCAL
