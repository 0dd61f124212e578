"""A Ray pool's load keys as the gateway reads them from its own requests and their answers
(cluster._pools.AnswerLoad), with time passed in: the same utilisation and expected wait as
the in-process pool's batcher would give at the same arrivals and batch times, one replica's
batch queue at its share of the arrivals, and never below what the answers waited."""

import pytest

from cluster._pools import AnswerLoad, PoolResult
from workers.batcher import BatcherLoad, RunTimes


def _answer(queue_s: float, compute_s: float, batch_size: int) -> PoolResult:
    return PoolResult({}, queue_s, compute_s, batch_size)


def test_no_figure_before_a_batch_was_timed_and_requests_in_flight_are_counted():
    load = AnswerLoad(max_batch_size=4, replicas=2, instances=1, timeout_s=0.0)
    for k in range(3):
        load.arrived(10.0 + k * 0.01)
    assert load.in_flight == 3 and load.expected_load(10.05) is None and load.capacity_rps() is None
    load.answered(_answer(0.001, 0.010, 2), first_in_batch=False)  # not the batch's first: not timed
    load.failed()
    assert load.in_flight == 1 and load.capacity_rps() is None


def test_the_figures_are_the_batch_queue_of_one_replica_at_its_share():
    load = AnswerLoad(max_batch_size=4, replicas=2, instances=2, timeout_s=0.002)
    load.arrived(0.0)
    load.answered(_answer(0.0, 0.010, 1), first_in_batch=True)
    load.arrived(0.0)
    load.answered(_answer(0.0, 0.024, 4), first_in_batch=True)
    for k in range(150):  # 150 arrivals in the second from 1.0
        load.arrived(1.0 + k / 150)
        load.answered(_answer(0.0, 0.010, 1), first_in_batch=False)
    util, wait_s, _ = load.expected_load(2.0)
    capacity = 4 * 2 * 2 / 0.024
    assert load.capacity_rps() == pytest.approx(capacity)
    rate = 150 / 1.0
    assert util == pytest.approx(rate / capacity, rel=0.01)
    times = RunTimes()
    times.observe(1, 0.010)
    times.observe(4, 0.024)
    want = BatcherLoad.expected_wait_at(rate / 2, times.estimate_s, max_batch_size=4, instances=2, timeout_s=0.002)
    assert wait_s == pytest.approx(want, rel=0.01)
    # Three times the traffic to the same replicas: a longer wait.
    for k in range(450):
        load.arrived(2.0 + k / 450)
    assert load.expected_load(3.0)[1] > wait_s


def test_the_figure_is_at_least_what_the_answers_waited():
    """The gateway does not see the workers' queues; its answers show what they held."""
    load = AnswerLoad(max_batch_size=2, replicas=1, instances=1, timeout_s=0.0)
    load.arrived(0.0)
    load.answered(_answer(0.0, 0.050, 1), first_in_batch=True)
    load.arrived(0.0)
    load.answered(_answer(0.0, 0.090, 2), first_in_batch=True)
    for k in range(10):  # 10 req/s against a capacity of 2 / 0.09 = 22, but each answer queued 300 ms
        load.arrived(1.0 + k / 10)
        load.answered(_answer(0.300, 0.090, 2), first_in_batch=k % 2 == 0)
    util, wait_s, _ = load.expected_load(2.0)
    assert util == pytest.approx(10 / (2 / 0.090), rel=0.02)
    quiet = BatcherLoad.expected_wait_at(10.0, load.run_times.estimate_s, max_batch_size=2, instances=1, timeout_s=0.0)
    assert quiet < 0.1
    # 300 ms queued and 40 ms for the longer run of a batch of two, as an EWMA (alpha 0.2)
    # that stood at 8 ms after the two timing answers.
    assert wait_s == pytest.approx(0.340 - (0.340 - 0.008) * 0.8 ** 10)
