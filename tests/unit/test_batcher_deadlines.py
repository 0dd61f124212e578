"""Deadline-aware batching ([Note: deadline-aware batching] in workers/_batch_policy.py):
run-time estimates, the pure decision with them, refusal on arrival and at batch time,
discarded results; with a fake clock, and once on real ONNX Runtime."""

from __future__ import annotations

import asyncio
import heapq
import time

import numpy as np
import pytest

from tests.onnx_models import C, H, W, conv_bn_relu_chain, write
from workers.batcher import (
    Batcher,
    BatcherConfig,
    BatcherConfigError,
    BatcherLoad,
    OverloadedError,
    QueueFullError,
    RunTimes,
    _next_batch,
    queue_wait_s,
)
from tests.unit.test_batcher_policy import _Q, _payloads


def _run(coro):
    async def guarded():
        return await asyncio.wait_for(coro, timeout=5.0)

    return asyncio.run(guarded())


# -- RunTimes ------------------------------------------------------------------------------

def test_run_times_estimate_from_timed_sizes():
    rt = RunTimes(alpha=0.5)
    assert rt.estimate_s(4) is None
    rt.observe(2, 0.010)
    assert rt.estimate_s(2) == 0.010
    assert rt.estimate_s(1) == 0.010  # below the smallest timed size: its time
    assert rt.estimate_s(4) == pytest.approx(0.020)  # above the largest: scaled by size
    rt.observe(6, 0.040)
    assert rt.estimate_s(4) == pytest.approx(0.025)  # between: linear (the cached 0.020 is gone)
    rt.observe(2, 0.020)
    assert rt.estimate_s(2) == pytest.approx(0.015)  # EWMA with alpha 0.5
    assert rt.estimate_s(4) == pytest.approx(0.0275)
    assert rt.as_dict() == {2: pytest.approx(0.015), 6: pytest.approx(0.040)}


def test_run_times_upper_is_the_mean_plus_two_mean_absolute_deviations():
    rt = RunTimes(alpha=0.5)
    assert rt.upper_s(1) is None
    rt.observe(1, 0.100)
    assert rt.upper_s(1) == pytest.approx(0.100)  # one run: no spread seen yet
    rt.observe(1, 0.140)  # mean 0.120; deviation 0.5 x 0.040
    assert rt.estimate_s(1) == pytest.approx(0.120)
    assert rt.upper_s(1) == pytest.approx(0.120 + 2 * 0.020)
    rt.observe(1, 0.120)  # on the mean: the deviation halves
    assert rt.upper_s(1) == pytest.approx(0.120 + 2 * 0.010)
    rt.observe(4, 0.300)  # a size without spread keeps its own
    assert rt.upper_s(4) == pytest.approx(0.300)
    assert rt.upper_s(2) == pytest.approx(rt.estimate_s(2) + 2 * 0.010)  # untimed: the largest deviation


def test_a_request_whose_batch_may_run_long_is_refused_where_the_mean_would_admit_it():
    """Runs of 0.1 and 0.3 s in turn: a deadline between the mean and the mean plus the spread
    is refused at once rather than answered late; one past the spread is served."""
    async def main():
        clock = _Clock()
        times = iter([0.1, 0.3] * 10)

        async def run_batch(payloads):
            clock.now_s += next(times)
            return payloads

        b = Batcher(run_batch, BatcherConfig(max_batch_size=1, max_queue_delay_ms=0.0), clock=clock)
        for i in range(6):
            await b.submit(i)
        mean_s, upper_s = b.run_times.estimate_s(1), b.run_times.upper_s(1)
        with pytest.raises(OverloadedError) as info:
            b.enqueue(7, deadline_s=clock.now_s + (mean_s + upper_s) / 2)
        fits = await b.submit(8, deadline_s=clock.now_s + upper_s + 0.001)
        return mean_s, upper_s, info.value, fits

    mean_s, upper_s, err, fits = _run(main())
    assert 0.15 < mean_s < 0.25 and upper_s - mean_s > 0.1
    assert err.reason == "predicted_wait" and fits == 8


def test_run_times_refuse_a_bad_alpha():
    with pytest.raises(BatcherConfigError, match="alpha=0"):
        RunTimes(alpha=0.0)


# -- the pure decision -----------------------------------------------------------------------

def test_a_batch_leaves_out_requests_it_would_finish_too_late():
    q = _Q()
    q.add(0.0, deadline_s=10.05)  # cannot finish: the batch ends at 10.1
    q.add(0.0, deadline_s=11.0)
    q.add(0.0)  # no deadline
    q.add(0.0, deadline_s=10.2)
    cfg = BatcherConfig(max_batch_size=4, max_queue_delay_ms=0.0)
    d = _next_batch(q.queues, 10.0, cfg, run_s=lambda n: 0.1)
    assert _payloads(d.batch) == [1, 2, 3]
    assert _payloads(d.unreachable) == [0]
    assert d.batch_end_s == pytest.approx(10.1)


def test_a_busy_instance_pushes_the_batch_end_and_refuses_more():
    q = _Q()
    q.add(0.0, deadline_s=10.15)
    q.add(0.0, deadline_s=10.5)
    cfg = BatcherConfig(max_batch_size=2, max_queue_delay_ms=0.0)
    idle = _next_batch(q.queues, 10.0, cfg, run_s=lambda n: 0.1)
    assert _payloads(idle.batch) == [0, 1] and idle.unreachable == ()
    busy = _next_batch(q.queues, 10.0, cfg, run_s=lambda n: 0.1, start_s=10.1)
    assert _payloads(busy.batch) == [1] and _payloads(busy.unreachable) == [0]


def test_a_batch_shrinks_to_what_its_deadlines_allow():
    q = _Q()
    for _ in range(4):
        q.add(0.0, deadline_s=10.12)
    cfg = BatcherConfig(max_batch_size=4, max_queue_delay_ms=0.0)
    # A batch of n takes 50 ms per request: 4 or 3 would end after 10.12, 2 ends at 10.1.
    d = _next_batch(q.queues, 10.0, cfg, run_s=lambda n: 0.05 * n)
    assert _payloads(d.batch) == [0, 1] and d.unreachable == ()
    assert d.batch_end_s == pytest.approx(10.1)


def test_without_an_estimate_nothing_is_refused():
    q = _Q()
    q.add(0.0, deadline_s=10.001)
    d = _next_batch(q.queues, 10.0, BatcherConfig(max_batch_size=1), run_s=lambda n: None)
    assert _payloads(d.batch) == [0] and d.unreachable == () and d.batch_end_s is None


def test_predicted_wait_counts_full_batches_per_instance_and_the_running_ones():
    assert queue_wait_s(0.0, 3, (), 0.1, 4, 2) == 0.0
    # Both instances busy until 0.05 and 0.2: the first frees at 0.05.
    assert queue_wait_s(0.0, 3, (0.05, 0.2), 0.1, 4, 2) == pytest.approx(0.05)
    # 8 waiting = two batches of 4 ahead: both take the instance free at 0.05 (the second
    # from 0.15), so the request's own batch starts when the other frees at 0.2.
    assert queue_wait_s(0.0, 8, (0.05, 0.2), 0.1, 4, 2) == pytest.approx(0.2)
    assert queue_wait_s(0.0, 16, (), 0.1, 4, 2) == pytest.approx(0.2)
    assert queue_wait_s(0.0, 16, (), 0.05, 2, 2) == pytest.approx(0.2)


def _simulated_start_s(now_s: float, depth: int, ends_s: tuple[float, ...], batch_s: float, batch_size: int,
                       instances: int) -> float:
    """When the batch of a request arriving behind ``depth`` waiting ones starts, by playing the
    queue out: each batch, in order, takes the instance that frees first."""
    free = sorted([now_s] * (instances - len(ends_s)) + [max(now_s, e) for e in ends_s])
    for _ in range(depth // batch_size):
        heapq.heapreplace(free, free[0] + batch_s)
    return free[0]


def test_predicted_wait_is_when_its_batch_starts_on_the_instance_it_gets():
    # Two instances busy until 0.01 and 0.04, one full batch waiting: that batch takes the
    # instance free at 0.01, so the request's own batch starts at 0.04, not 0.01.
    assert queue_wait_s(0.0, 8, (0.01, 0.04), 0.05, 8, 2) == pytest.approx(0.04)
    # One of three instances idle, two full batches ahead: the idle one, then the one free at 0.02.
    assert queue_wait_s(0.0, 16, (0.02, 0.03), 0.05, 8, 3) == pytest.approx(0.03)
    rng = np.random.default_rng(7)
    for _ in range(500):
        instances = int(rng.integers(1, 5))
        ends = tuple(float(e) for e in rng.uniform(0.0, 0.1, int(rng.integers(0, instances + 1))))
        size, depth, batch_s = int(rng.integers(1, 9)), int(rng.integers(0, 60)), float(rng.uniform(0.01, 0.1))
        want = _simulated_start_s(0.0, depth, ends, batch_s, size, instances)
        assert queue_wait_s(0.0, depth, ends, batch_s, size, instances) == pytest.approx(want), \
            (depth, ends, batch_s, size, instances)


def test_the_expected_wait_is_never_below_the_wait_of_a_request_arriving_now():
    """The rate is the last whole second's: at the start of a burst it still reads the quiet
    second before, while the queue is already long. The mean at that rate is then no answer
    for a request arriving now."""
    rt = RunTimes()
    rt.observe(1, 0.02)
    rt.observe(8, 0.06)
    quiet = BatcherLoad.expected_wait_at(5.0, rt.estimate_s, max_batch_size=8, instances=1, timeout_s=0.002)
    queued = BatcherLoad.expected_wait_at(5.0, rt.estimate_s, max_batch_size=8, instances=1, timeout_s=0.002,
                                          predicted_wait_s=0.25)
    assert quiet < 0.01 and queued == pytest.approx(0.25)
    # Below a queue's wait the figure is the mean at the rate, as before.
    assert BatcherLoad.expected_wait_at(5.0, rt.estimate_s, max_batch_size=8, instances=1, timeout_s=0.002,
                                        predicted_wait_s=0.0) == pytest.approx(quiet)


# -- the Batcher with a fake clock ----------------------------------------------------------

class _Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def _timed_batcher(clock: _Clock, run_s: float, **cfg) -> tuple[Batcher, asyncio.Event]:
    """A batcher whose every batch takes ``run_s`` on ``clock``, held until ``gate`` is set."""
    gate = asyncio.Event()
    gate.set()

    async def run_batch(payloads):
        await gate.wait()
        clock.now_s += run_s
        return [p * 10 for p in payloads]

    return Batcher(run_batch, BatcherConfig(max_queue_delay_ms=0.0, **cfg), clock=clock), gate


def test_a_request_predicted_to_miss_its_deadline_is_refused_on_arrival():
    async def main():
        clock = _Clock()
        b, gate = _timed_batcher(clock, 0.1, max_batch_size=2)
        assert await b.submit(1) == 10  # times a batch of one: 0.1 s
        assert b.load().predicted_wait_s == 0.0
        gate.clear()
        running = [asyncio.ensure_future(b.submit(i)) for i in (2, 3)]  # a full batch, running
        await asyncio.sleep(0)
        queued = [asyncio.ensure_future(b.submit(i)) for i in (4, 5)]  # the next full batch
        await asyncio.sleep(0)
        # Behind one running and one full queued batch: waits 0.1 + 0.2, then takes 0.2 itself.
        wait_s = b.predicted_wait_s()
        with pytest.raises(OverloadedError) as info:
            await b.submit(6, deadline_s=clock.now_s + 0.3)
        fits = asyncio.ensure_future(b.submit(7, deadline_s=clock.now_s + 10.0))
        await asyncio.sleep(0)
        gate.set()
        results = await asyncio.gather(*running, *queued, fits)
        return wait_s, info.value, results, b.stats()

    wait_s, err, results, stats = _run(main())
    assert wait_s == pytest.approx(0.4)  # the running batch of 2 is predicted at 2 x 0.1 s
    assert err.reason == "predicted_wait" and err.retry_after_s > 0
    assert "retry after" in str(err) and "queued behind 2 requests" in str(err)
    assert results == [20, 30, 40, 50, 70]
    assert stats.rejected == {"predicted_wait": 1}


def test_a_request_of_higher_priority_waits_only_behind_its_own_and_is_admitted_where_others_are_refused():
    """[Note: priority under overload] in edge_agent/hedge.py: a request with no local answer in
    time (priority 1) goes ahead of the queued ones that have one, so its deadline is judged
    against them alone; the same deadline at priority 0 is refused."""
    async def main():
        clock = _Clock()
        b, gate = _timed_batcher(clock, 0.1, max_batch_size=2, num_priority_levels=2)
        assert await b.submit(1) == 10
        gate.clear()
        running = [asyncio.ensure_future(b.submit(i)) for i in (2, 3)]
        await asyncio.sleep(0)
        queued = [asyncio.ensure_future(b.submit(i)) for i in (4, 5)]  # priority 0, no deadline
        await asyncio.sleep(0)
        with pytest.raises(OverloadedError) as info:
            await b.submit(6, deadline_s=clock.now_s + 0.35)
        urgent = asyncio.ensure_future(b.submit(7, deadline_s=clock.now_s + 0.35, priority=1))
        await asyncio.sleep(0)
        gate.set()
        first = await urgent
        results = await asyncio.gather(*running, *queued)
        return info.value, first, results, b.stats()

    err, first, results, stats = _run(main())
    # Behind the running batch alone: starts in 0.2 s and runs 0.1; behind the queued two as well, 0.4 + 0.1.
    assert err.reason == "predicted_wait" and "queued behind 2 requests" in str(err)
    assert first == 70 and results == [20, 30, 40, 50]
    assert stats.rejected == {"predicted_wait": 1}


def test_a_request_that_its_batch_would_finish_late_is_refused_when_the_batch_forms():
    async def main():
        clock = _Clock()
        b, gate = _timed_batcher(clock, 0.1, max_batch_size=1)
        await b.submit(0)
        gate.clear()
        first = asyncio.ensure_future(b.submit(1))
        await asyncio.sleep(0)
        # Admitted (the running batch is predicted to end in 0.1 s, this one by 0.2 s),
        # but the running batch overruns: when it ends, 0.25 s have passed.
        late = asyncio.ensure_future(b.submit(2, deadline_s=clock.now_s + 0.3))
        await asyncio.sleep(0)
        clock.now_s += 0.15
        gate.set()
        assert await first == 10
        with pytest.raises(OverloadedError) as info:
            await late
        return info.value, b.stats()

    err, stats = _run(main())
    assert err.reason == "deadline_unreachable" and err.retry_after_s > 0
    assert stats.rejected == {"deadline_unreachable": 1}
    assert stats.batch_size_histogram == {1: 2}  # the refused request never ran


def test_a_full_queue_says_when_to_retry():
    async def main():
        clock = _Clock()
        b, gate = _timed_batcher(clock, 0.1, max_batch_size=1, max_queue_size=1)
        await b.submit(0)
        gate.clear()
        running = asyncio.ensure_future(b.submit(1))
        await asyncio.sleep(0)
        queued = asyncio.ensure_future(b.submit(2))
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError) as info:
            await b.submit(3)
        gate.set()
        await asyncio.gather(running, queued)
        return info.value

    err = _run(main())
    assert err.retry_after_s == pytest.approx(0.2) and "retry after 200 ms" in str(err)  # the running batch, then the queued one


def test_results_that_finish_after_their_deadline_are_counted_as_discarded():
    async def main():
        clock = _Clock()
        b, _ = _timed_batcher(clock, 0.5, max_batch_size=2)
        # No estimate yet: admitted, and the batch overruns both deadlines.
        out = await asyncio.gather(b.submit(1, deadline_s=clock.now_s + 0.1),
                                   b.submit(2, deadline_s=clock.now_s + 0.1))
        return out, b.stats()

    out, stats = _run(main())
    assert out == [10, 20] and stats.discarded == 2 and stats.completed == 2


# -- real ONNX Runtime -----------------------------------------------------------------------

def test_real_engine_runs_are_timed_and_a_hopeless_deadline_is_refused(tmp_path):
    from workers.engine import Engine, EngineConfig

    engine = Engine(write(conv_bn_relu_chain(2), tmp_path / "m.onnx"), EngineConfig(provider="cpu"))
    x = np.ones((1, C, H, W), np.float32)

    async def main():
        b = Batcher(engine.run_batch, BatcherConfig(max_batch_size=4, max_queue_delay_ms=0.0))
        for _ in range(3):
            await b.submit({"x": x}, deadline_s=time.monotonic() + 60.0)
        run_s = b.run_times.estimate_s(1)
        now_s = b._clock()
        with pytest.raises(OverloadedError) as info:
            await b.submit({"x": x}, deadline_s=now_s + 0.9 * run_s)  # a batch of one ends later
        ok = await b.submit({"x": x}, deadline_s=b._clock() + 60.0)
        await b.close()
        return run_s, info.value, ok, b.stats()

    try:
        run_s, err, ok, stats = _run(main())
    finally:
        engine.close()
    assert run_s is not None and run_s > 0
    assert err.reason == "predicted_wait"
    assert np.isfinite(next(iter(ok.values()))).all()
    assert stats.completed == 4 and stats.rejected == {"predicted_wait": 1} and stats.discarded == 0


def test_a_lone_run_now_predicted_to_end_late_is_refused_and_never_runs():
    calls: list = []
    clock = _Clock()

    def run_batch(payloads):
        calls.append(list(payloads))
        clock.now_s += 0.01
        return [p + 1 for p in payloads]

    async def main():
        b = Batcher(run_batch, BatcherConfig(max_batch_size=2, max_queue_delay_ms=0.0, inline_max_ms=50.0),
                    clock=clock)
        await b.submit(1)  # times a lone run; later lone runs may run now
        with pytest.raises(OverloadedError) as info:
            b.run_now(2, deadline_s=clock.now_s + 0.005)
        return info.value, b.run_now(3, deadline_s=clock.now_s + 1.0)

    err, ok = _run(main())
    assert err.reason == "predicted_wait" and ok == 4 and calls == [[1], [3]]


def test_load_reports_arrivals_per_second_and_headroom():
    async def main():
        clock = _Clock()
        b, _ = _timed_batcher(clock, 0.1, max_batch_size=2)
        start_s = clock.now_s
        for i in range(5):
            await b.submit(i)  # each batch of one takes 0.1 s on the clock
        with pytest.raises(OverloadedError):
            await b.submit(9, deadline_s=clock.now_s + 0.01)  # refused, but it arrived
        clock.now_s = start_s + 1.2
        busy = b.load()
        clock.now_s = start_s + 3.5
        b.load()
        return busy, b.load()

    busy, idle = _run(main())
    assert busy.arrival_rps == pytest.approx(6 / 1.2)
    assert busy.capacity_rps == pytest.approx(2 / 0.2)  # a batch of 2 is estimated at 2 x 0.1 s
    assert busy.headroom_rps == pytest.approx(10 - 5)
    assert idle.arrival_rps == 0.0


async def _timed_linear_batcher(clock):
    """A batcher of up to 8 whose runs take 50 ms a request on ``clock``, with a batch of one
    and one of two timed (both waited for nothing: no size formed under a queue yet)."""
    async def run_batch(payloads):
        clock.now_s += 0.05 * len(payloads)
        return payloads

    b = Batcher(run_batch, BatcherConfig(max_batch_size=8, max_queue_delay_ms=0.0), clock=clock)
    await b.submit(0)
    await asyncio.gather(b.submit(1), b.submit(2))
    return b


def test_the_batches_ahead_are_predicted_at_the_size_they_form_under_a_queue():
    """[Note: batches ahead]: where deadlines let batches of four form while others wait, the
    queue drains four at a time, and the predicted wait says so."""
    async def main():
        clock = _Clock()
        b = await _timed_linear_batcher(clock)
        timed = b.run_times.as_dict()
        before = b.ahead_batch_size()
        start_s = clock.now_s
        # Four requests due just after +0.2 s, four after +0.4 s: a batch of eight would end
        # at +0.4 s, too late for the first four, so they go first, four at a time.
        got = await asyncio.gather(*(b.submit(k, deadline_s=start_s + 0.2 * (k // 4 + 1) + 0.001)
                                     for k in range(8)))
        sizes = dict(b.stats().batch_size_histogram)
        after = b.ahead_batch_size()
        queued = [b.enqueue(k) for k in range(4)]  # four waiting, before the loop runs again
        wait_s = b.predicted_wait_s(clock.now_s)
        await asyncio.gather(*(r.future for r in queued))
        return timed, before, got, sizes, after, wait_s

    timed, before, got, sizes, after, wait_s = _run(main())
    assert timed == {1: pytest.approx(0.05), 2: pytest.approx(0.1)}
    assert before == 8  # no batch formed under a queue yet: full batches
    assert got == list(range(8)) and sizes[4] == 2  # two batches of four, every request answered
    assert after == 4  # the first formed with four waiting; the second took what was left
    assert wait_s == pytest.approx(0.2)  # a batch of four ahead, where full batches read none


def test_a_request_is_not_counted_twice_in_the_batches_ahead_and_its_own():
    """Where batches of two form under a queue, three waiting ahead are one batch of two and
    one left over, which the newcomer joins: it ends 0.2 s from now, not 0.3 s as if its own
    batch held the three again."""
    async def main():
        clock = _Clock()
        b = await _timed_linear_batcher(clock)
        start_s = clock.now_s  # two due just after +0.1 s, two after +0.2 s: batches of two
        await asyncio.gather(*(b.submit(k, deadline_s=start_s + 0.1 * (k // 2 + 1) + 0.001) for k in range(4)))
        ahead = b.ahead_batch_size()
        queued = [b.enqueue(k) for k in range(3)]  # three waiting, before the loop runs again
        late = b.enqueue(9, deadline_s=clock.now_s + 0.25)
        results = await asyncio.gather(*(r.future for r in queued), late.future)
        return ahead, results, b.stats()

    ahead, results, stats = _run(main())
    assert ahead == 2
    assert results == [0, 1, 2, 9]
    assert "predicted_wait" not in stats.rejected


def test_shape_run_times_keep_the_first_shape_apart_once_a_second_comes():
    from workers._batch_policy import ShapeRunTimes  # noqa: PLC0415

    t = ShapeRunTimes()
    t.observe("small", 1, 0.010)
    t.observe("small", 1, 0.010)
    assert t.of("small")(1) == t.of("large")(1) == pytest.approx(0.010)  # one shape: the overall times
    t.observe("large", 1, 0.090)
    assert t.of("small")(1) == pytest.approx(0.010)  # its own times, as before the second shape
    assert t.of("large")(1) == pytest.approx(0.090)
    assert t.of("unseen")(1) == pytest.approx(0.010 + 0.2 * 0.080)  # the overall EWMA
    assert t.upper_of("small")(1) == pytest.approx(0.010)
