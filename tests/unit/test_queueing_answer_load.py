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


def _timed(load: AnswerLoad, *runs: tuple[int, float]) -> None:
    for size, run_s in runs:
        load.arrived(0.0)
        load.answered(_answer(0.0, run_s, size), first_in_batch=True)


def test_the_predicted_wait_is_the_batches_ahead_on_one_replica_and_half_the_running_one():
    """[Note: a Ray pool's predicted wait]: batches of 1 take 10 ms and of 4 24 ms, one instance."""
    load = AnswerLoad(max_batch_size=4, replicas=1, instances=1, timeout_s=0.0)
    assert load.predicted_waits(0.0) is None  # no batch timed yet
    _timed(load, (1, 0.010), (4, 0.024))
    assert load.predicted_waits(1.0) == (0.0, 0.0)  # nothing inside: an instance is free
    load.arrived(1.0)
    assert load.predicted_waits(1.0) == pytest.approx((0.005, 0.005))  # half a lone batch's run left
    for _ in range(11):
        load.arrived(1.0)
    # 12 inside: a full batch running (12 ms left on average), 8 queued in two batches of 24 ms.
    assert load.predicted_waits(1.0) == pytest.approx((0.012 + 2 * 0.024, 0.012))
    load.arrived(1.0, urgent=True)
    load.arrived(1.0, urgent=True)
    # 14: still two whole batches ahead of a priority-0 request; the two urgent ones go first, and an
    # urgent request joins them behind the running batch only.
    assert load.predicted_waits(1.0) == pytest.approx((0.012 + 2 * 0.024, 0.012))
    for _ in range(6):
        load.arrived(1.0, urgent=True)
    assert load.predicted_waits(1.0)[1] == pytest.approx(0.012 + 0.024)  # 8 urgent: a batch of them ahead
    load.failed(urgent=True)
    assert load.urgent_in_flight == 7 and load.in_flight == 19


def test_the_predicted_wait_spreads_the_requests_over_replicas_and_instances():
    load = AnswerLoad(max_batch_size=4, replicas=2, instances=2, timeout_s=0.0)
    _timed(load, (1, 0.010), (4, 0.024))
    for _ in range(6):
        load.arrived(1.0)
    # 3 on the replica a new request goes to: one batch on one instance, the other free.
    assert load.predicted_waits(1.0) == (0.0, 0.0)
    for _ in range(14):
        load.arrived(1.0)
    # 10 on it: both instances run a full batch, 2 wait; a new request joins them, behind the
    # first instance to free.
    assert load.predicted_waits(1.0)[0] == pytest.approx(0.012)
    for _ in range(16):
        load.arrived(1.0)
    # 18 on it: 10 queued, two batches ahead, one on each instance as it frees, then one more run.
    assert load.predicted_waits(1.0)[0] == pytest.approx(0.012 + 0.024)


def test_the_expected_wait_is_never_below_the_predicted_one():
    """The arrival rate is the last whole second's: a burst's first answers read the rate before it."""
    load = AnswerLoad(max_batch_size=4, replicas=1, instances=1, timeout_s=0.0)
    _timed(load, (1, 0.010), (4, 0.024))
    for _ in range(12):
        load.arrived(5.0)
    predicted = load.predicted_waits(5.0)
    util, wait_s, urgent_s = load.expected_load(5.0, predicted)
    assert wait_s == pytest.approx(0.060) and urgent_s == pytest.approx(0.012)
    assert load.expected_load(5.0)[1] < 0.060


def test_where_requests_take_longer_than_their_batches_the_fitted_drain_sets_the_wait():
    """Each request inside adds 8 ms to an answer's time in the pool (the gateway's and the
    transport's work per request as well as the batches'), where the batch queue alone would
    say 6 ms: the fit of time against the requests found inside stands for the wait."""
    load = AnswerLoad(max_batch_size=4, replicas=1, instances=1, timeout_s=0.0)
    _timed(load, (1, 0.010), (4, 0.024))
    for _ in range(30):  # answers that all found 3 inside: no spread, no fit
        ahead = load.arrived(1.0)
        load.answered(_answer(0.012 + 0.008 * 3 - 0.010, 0.010, 1), first_in_batch=False, ahead=ahead + 3)
    for _ in range(12):
        load.arrived(2.0)
    assert load.predicted_waits(2.0) == pytest.approx((0.060, 0.012))  # the batch queue alone
    for _ in range(12):
        load.failed()
    for k in range(60):
        x = k % 11
        load.arrived(3.0)
        load.answered(_answer(0.012 + 0.008 * x - 0.010, 0.010, 1), first_in_batch=False, ahead=x)
        # Urgent answers found other queues ahead of them: they are not fitted.
        load.arrived(3.0, urgent=True)
        load.answered(_answer(0.5, 0.010, 1), first_in_batch=False, urgent=True, ahead=x)
    for _ in range(12):
        load.arrived(4.0)
    p0, urgent = load.predicted_waits(4.0)
    assert p0 == pytest.approx(0.012 + 0.008 * 12 - 0.010, rel=0.05)
    assert urgent == pytest.approx(0.012)  # none urgent inside: the running batch's half
