"""The Batcher on a real asyncio loop: results, deadlines, priorities, queue limits,
shape separation, error isolation, cancellation and close."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from workers.batcher import (
    Batcher,
    BatcherClosedError,
    BatcherConfig,
    BatcherConfigError,
    BatchSizeMismatchError,
    DeadlineExceededError,
    NOT_NOW,
    BatcherRequestError,
    QueueFullError,
)


def _run(coro):
    async def guarded():
        return await asyncio.wait_for(coro, timeout=5.0)

    return asyncio.run(guarded())


class _Recorder:
    """An async run_batch that records each batch and can be held closed."""

    def __init__(self) -> None:
        self.batches: list[list] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.started = asyncio.Event()

    async def __call__(self, payloads):
        self.batches.append(list(payloads))
        self.started.set()
        await self.gate.wait()
        return [p * 10 if isinstance(p, int) else p for p in payloads]


async def _until(predicate):
    while not predicate():
        await asyncio.sleep(0.001)


def test_results_come_back_to_the_right_callers_in_one_batch():
    async def main():
        rec = _Recorder()
        b = Batcher(rec, BatcherConfig(max_batch_size=4, max_queue_delay_ms=1000.0))
        results = await asyncio.gather(*(b.submit(i) for i in range(4)))
        await b.close()
        return rec, results, b.stats()

    rec, results, stats = _run(main())
    assert results == [0, 10, 20, 30]
    assert rec.batches == [[0, 1, 2, 3]]
    assert stats.batches_formed == 1 and stats.batch_size_histogram == {4: 1}
    assert stats.completed == 4 and stats.queue_depth == 0


def test_sync_run_batch_runs_off_the_loop():
    loop_thread: list[int] = []

    def run_batch(payloads):
        loop_thread.append(threading.get_ident())
        return [p + 1 for p in payloads]

    async def main():
        b = Batcher(run_batch, BatcherConfig(max_batch_size=2, max_queue_delay_ms=0.0))
        out = await asyncio.gather(b.submit(1), b.submit(2))
        await b.close()
        return out

    assert _run(main()) == [2, 3]
    assert loop_thread and loop_thread[0] != threading.get_ident()


def test_a_finished_batch_starts_the_next_before_answering_its_callers():
    # [Note: back-to-back batches]: the engine must not idle while callers wake up.
    events: list[tuple] = []

    async def run_batch(payloads):
        events.append(("start", tuple(payloads)))
        await asyncio.sleep(0)
        return payloads

    async def main():
        b = Batcher(run_batch, BatcherConfig(max_batch_size=2, max_queue_delay_ms=0.0, max_concurrent_batches=1))

        async def call(x):
            await b.submit(x)
            events.append(("answered", x))

        await asyncio.gather(*(call(x) for x in (1, 2, 3, 4)))
        await b.close()

    _run(main())
    assert events == [("start", (1, 2)), ("start", (3, 4)), ("answered", 1), ("answered", 2),
                      ("answered", 3), ("answered", 4)]


def test_sync_run_batch_starts_the_next_batch_after_a_failed_one():
    def run_batch(payloads):
        if 1 in payloads:
            raise RuntimeError("bad batch")
        return [p + 1 for p in payloads]

    async def main():
        b = Batcher(run_batch, BatcherConfig(max_batch_size=1, max_queue_delay_ms=0.0, max_concurrent_batches=1))
        out = await asyncio.gather(b.submit(1), b.submit(2), b.submit(3), return_exceptions=True)
        await b.close()
        return out, b.stats()

    out, stats = _run(main())
    assert isinstance(out[0], RuntimeError) and out[1:] == [3, 4]
    assert stats.failed_batches == 1 and stats.completed == 2 and stats.in_flight_batches == 0


def test_a_short_lone_request_runs_on_the_loop_thread_and_company_goes_to_the_executor():
    # [Note: inline runs]
    threads: list[tuple[tuple, bool]] = []
    loop_thread = threading.get_ident()

    def run_batch(payloads):
        threads.append((tuple(payloads), threading.get_ident() == loop_thread))
        return [p + 1 for p in payloads]

    async def main():
        b = Batcher(run_batch, BatcherConfig(max_batch_size=4, max_queue_delay_ms=0.0, inline_max_ms=50.0))
        outs = [await b.submit(1), await b.submit(2)]  # the first run is timed on the executor
        outs += await asyncio.gather(b.submit(3), b.submit(4))  # together: one batch of two
        outs.append(await b.submit(5))
        await b.close()
        return outs, b.stats()

    outs, stats = _run(main())
    assert outs == [2, 3, 4, 5, 6]
    assert threads == [((1,), False), ((2,), True), ((3, 4), False), ((5,), True)]
    assert stats.inline_runs == 2


def test_lone_requests_with_long_runs_or_company_waiting_stay_on_the_executor():
    loop_thread = threading.get_ident()
    on_loop: list[bool] = []

    def run_batch(payloads):
        on_loop.append(threading.get_ident() == loop_thread)
        if payloads[0] == "slow":
            time.sleep(0.03)
        return payloads

    async def main():
        slow = Batcher(run_batch, BatcherConfig(max_batch_size=1, max_queue_delay_ms=0.0, inline_max_ms=10.0))
        for _ in range(3):
            await slow.submit("slow")  # 30 ms runs, above the 10 ms limit
        await slow.close()
        queued = Batcher(run_batch, BatcherConfig(max_batch_size=1, max_queue_delay_ms=0.0, inline_max_ms=50.0))
        await queued.submit("warm")
        await asyncio.gather(*(queued.submit(i) for i in range(3)))  # batches of one, with company waiting
        await queued.close()
        return slow.stats(), queued.stats()

    slow_stats, queued_stats = _run(main())
    assert on_loop[:3] == [False, False, False] and slow_stats.inline_runs == 0
    # "warm" is the first lone run (not yet timed); of the three, the last is alone by then.
    assert on_loop[3:] == [False, False, False, True] and queued_stats.inline_runs == 1
    with pytest.raises(BatcherConfigError, match="inline_max_ms"):
        BatcherConfig(inline_max_ms=-1.0)


def test_max_delay_forms_a_partial_batch_after_the_delay():
    delay_ms = 20.0

    async def main():
        rec = _Recorder()
        b = Batcher(rec, BatcherConfig(max_batch_size=8, max_queue_delay_ms=delay_ms))
        t0 = time.monotonic()
        first = await asyncio.gather(b.submit(1), b.submit(2), b.submit(3))
        waited_s = time.monotonic() - t0
        await b.close()
        return rec, first, waited_s

    rec, first, waited_s = _run(main())
    # Three requests, far below max_batch_size, still leave together once the delay runs out.
    assert first == [10, 20, 30]
    assert rec.batches == [[1, 2, 3]]
    assert waited_s >= delay_ms / 1000.0


def test_deadline_passed_at_submit_is_rejected_at_once():
    async def main():
        rec = _Recorder()
        b = Batcher(rec)
        with pytest.raises(DeadlineExceededError) as info:
            await b.submit(1, deadline_s=time.monotonic() - 0.001)
        await b.close()
        return rec, info.value, b.stats()

    rec, err, stats = _run(main())
    assert rec.batches == []
    assert "deadline_s=" in str(err) and err.deadline_s <= err.now_s
    assert stats.rejected == {"deadline": 1}


def test_deadline_passing_in_the_queue_rejects_before_running():
    async def main():
        rec = _Recorder()
        rec.gate.clear()
        b = Batcher(rec, BatcherConfig(max_batch_size=1, max_queue_delay_ms=0.0))
        blocker = asyncio.ensure_future(b.submit(1))
        await rec.started.wait()
        doomed = asyncio.ensure_future(b.submit(2, deadline_s=time.monotonic() + 0.01))
        with pytest.raises(DeadlineExceededError):
            await doomed
        rec.gate.set()
        assert await blocker == 10
        await b.close()
        return rec, b.stats()

    rec, stats = _run(main())
    assert rec.batches == [[1]]  # the expired request never reached run_batch
    assert stats.rejected == {"deadline": 1}


def test_higher_priority_runs_first_when_the_worker_frees_up():
    async def main():
        rec = _Recorder()
        rec.gate.clear()
        cfg = BatcherConfig(max_batch_size=1, max_queue_delay_ms=0.0, num_priority_levels=2)
        b = Batcher(rec, cfg)
        first = asyncio.ensure_future(b.submit("busy"))
        await rec.started.wait()
        low = [asyncio.ensure_future(b.submit(f"low{i}", priority=0)) for i in range(2)]
        high = asyncio.ensure_future(b.submit("high", priority=1))
        await _until(lambda: b.stats().queue_depth == 3)
        rec.gate.set()
        await asyncio.gather(first, high, *low)
        await b.close()
        return rec

    assert _run(main()).batches == [["busy"], ["high"], ["low0"], ["low1"]]


def test_bad_priority_and_unhashable_shape_are_rejected():
    async def main():
        b = Batcher(_Recorder(), BatcherConfig(num_priority_levels=2))
        with pytest.raises(BatcherRequestError) as p:
            await b.submit(1, priority=2)
        with pytest.raises(BatcherRequestError) as s:
            await b.submit(1, shape_key=[1, 2])
        await b.close()
        return p.value, s.value

    p, s = _run(main())
    assert p.field_name == "priority" and "[0, 2)" in str(p)
    assert s.field_name == "shape_key"


def test_queue_full_is_retryable_and_names_the_sizes():
    async def main():
        rec = _Recorder()
        rec.gate.clear()
        cfg = BatcherConfig(max_batch_size=1, max_queue_delay_ms=0.0, max_queue_size=2)
        b = Batcher(rec, cfg)
        running = asyncio.ensure_future(b.submit(0))
        await rec.started.wait()
        queued = [asyncio.ensure_future(b.submit(i)) for i in (1, 2)]
        await _until(lambda: b.stats().queue_depth == 2)
        with pytest.raises(QueueFullError) as info:
            await b.submit(3)
        rec.gate.set()
        done = await asyncio.gather(running, *queued)
        # Once the queue drains, a retry is accepted.
        again = await b.submit(3)
        await b.close()
        return info.value, done, again, b.stats()

    err, done, again, stats = _run(main())
    assert err.retryable is True
    assert err.queue_size == 2 and err.max_queue_size == 2
    assert "retry" in str(err) and "2" in str(err)
    assert done == [0, 10, 20] and again == 30
    assert stats.rejected == {"queue_full": 1}


def test_requests_of_different_shapes_never_share_a_batch():
    async def main():
        rec = _Recorder()
        b = Batcher(rec, BatcherConfig(max_batch_size=8, max_queue_delay_ms=5.0))
        shapes = [(1, 3), (1, 5), (1, 3), (2, 3), (1, 5), (1, 3)]
        out = await asyncio.gather(*(b.submit((i, s), shape_key=s) for i, s in enumerate(shapes)))
        await b.close()
        return rec, out

    rec, out = _run(main())
    assert [o[0] for o in out] == list(range(6))
    assert sorted(len(batch) for batch in rec.batches) == [1, 2, 3]
    for batch in rec.batches:
        assert len({shape for _, shape in batch}) == 1


def test_a_failing_batch_fails_only_its_requests_and_serving_continues():
    class Boom(RuntimeError):
        pass

    async def run_batch(payloads):
        if "bad" in payloads:
            raise Boom(f"cannot run {payloads}")
        return [p.upper() for p in payloads]

    async def main():
        b = Batcher(run_batch, BatcherConfig(max_batch_size=2, max_queue_delay_ms=0.0))
        first = await asyncio.gather(b.submit("bad", shape_key="x"), b.submit("ok", shape_key="x"),
                                     b.submit("fine", shape_key="y"), return_exceptions=True)
        later = await b.submit("later")
        await b.close()
        return first, later, b.stats()

    first, later, stats = _run(main())
    assert isinstance(first[0], Boom) and isinstance(first[1], Boom)
    assert first[2] == "FINE"
    assert later == "LATER"
    assert stats.failed_batches == 1 and stats.completed == 2


def test_wrong_number_of_results_fails_the_batch_clearly():
    async def main():
        b = Batcher(lambda payloads: payloads[:1], BatcherConfig(max_batch_size=2,
                                                                 max_queue_delay_ms=0.0))
        out = await asyncio.gather(b.submit(1), b.submit(2), return_exceptions=True)
        await b.close()
        return out

    out = _run(main())
    assert all(isinstance(e, BatchSizeMismatchError) for e in out)
    assert out[0].batch_size == 2 and out[0].num_results == 1
    assert "exactly one result per payload" in str(out[0])


def test_cancelling_a_waiting_submit_removes_it_from_the_queue():
    async def main():
        rec = _Recorder()
        rec.gate.clear()
        b = Batcher(rec, BatcherConfig(max_batch_size=4, max_queue_delay_ms=0.0))
        running = asyncio.ensure_future(b.submit(1))
        await rec.started.wait()
        victim = asyncio.ensure_future(b.submit(2))
        keeper = asyncio.ensure_future(b.submit(3))
        await _until(lambda: b.stats().queue_depth == 2)
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        depth_after_cancel = b.stats().queue_depth
        rec.gate.set()
        assert await running == 10 and await keeper == 30
        await b.close()
        return rec, depth_after_cancel, b.stats()

    rec, depth, stats = _run(main())
    assert depth == 1
    assert rec.batches == [[1], [3]]
    assert stats.rejected == {"cancelled": 1}


def test_close_drain_runs_everything_queued_without_waiting_the_delay():
    async def main():
        rec = _Recorder()
        b = Batcher(rec, BatcherConfig(max_batch_size=8, max_queue_delay_ms=60_000.0))
        pending = [asyncio.ensure_future(b.submit(i)) for i in range(3)]
        await _until(lambda: b.stats().queue_depth == 3)
        await b.close(drain=True)
        with pytest.raises(BatcherClosedError):
            await b.submit(9)
        return await asyncio.gather(*pending), b.stats()

    results, stats = _run(main())
    assert results == [0, 10, 20]
    assert stats.rejected == {"closed": 1} and stats.queue_depth == 0


def test_close_without_drain_fails_queued_but_finishes_running():
    async def main():
        rec = _Recorder()
        rec.gate.clear()
        b = Batcher(rec, BatcherConfig(max_batch_size=1, max_queue_delay_ms=0.0))
        running = asyncio.ensure_future(b.submit(1))
        await rec.started.wait()
        queued = asyncio.ensure_future(b.submit(2))
        await _until(lambda: b.stats().queue_depth == 1)
        closing = asyncio.ensure_future(b.close(drain=False))
        with pytest.raises(BatcherClosedError) as info:
            await queued
        rec.gate.set()
        await closing
        return rec, await running, info.value

    rec, running_result, err = _run(main())
    assert running_result == 10
    assert rec.batches == [[1]]
    assert "drain=False" in str(err)


def test_a_broken_clock_fails_queued_requests_instead_of_hanging():
    calls = [0]

    def clock():
        calls[0] += 1
        if calls[0] > 1:  # submit reads it once; the scheduling loop's first read fails
            raise RuntimeError("clock went away")
        return 0.0

    async def main():
        b = Batcher(_Recorder(), BatcherConfig(max_queue_delay_ms=0.0), clock=clock)
        with pytest.raises(BatcherClosedError) as info:
            await b.submit(1)
        return info.value, b.stats()

    err, stats = _run(main())
    assert "clock went away" in str(err) and stats.queue_depth == 0


def test_run_now_runs_a_lone_request_at_once_only_when_the_batcher_is_idle():
    # [Note: run now]
    calls: list[tuple] = []

    def run_batch(payloads):
        calls.append(tuple(payloads))
        return [p + 1 for p in payloads]

    async def main():
        b = Batcher(run_batch, BatcherConfig(max_batch_size=4, max_queue_delay_ms=0.0, inline_max_ms=50.0))
        before = b.run_now(1)  # no lone run timed yet: the batcher decides
        await b.submit(1)
        now = b.run_now(2)
        other = b.run_now(3, run=lambda payloads: [("other", payloads[0])])
        queued = b.enqueue(4)  # something waiting: not now
        busy = b.run_now(5)
        await queued.future
        stats = b.stats()
        await b.close()
        return before, now, other, busy, stats

    before, now, other, busy, stats = _run(main())
    assert before is NOT_NOW and busy is NOT_NOW
    assert now == 3 and other == ("other", 3)
    assert calls == [(1,), (2,), (4,)]
    assert stats.batch_size_histogram == {1: 4} and stats.completed == 4 and stats.inline_runs == 3


def test_run_now_raises_what_submit_would_and_counts_a_failed_run():
    def run_batch(payloads):
        if payloads[0] == "boom":
            raise ValueError("boom")
        return payloads

    async def main():
        b = Batcher(run_batch, BatcherConfig(max_batch_size=2, max_queue_delay_ms=0.0, inline_max_ms=50.0))
        await b.submit("warm")
        with pytest.raises(DeadlineExceededError, match="already passed"):
            b.run_now("late", deadline_s=time.monotonic() - 1.0)
        with pytest.raises(BatcherRequestError, match="priority"):
            b.run_now("x", priority=99)
        with pytest.raises(ValueError, match="boom"):
            b.run_now("boom")
        assert b.run_now("ok") == "ok"  # serving goes on
        await b.close()
        assert b.run_now("closed") is NOT_NOW
        with pytest.raises(BatcherClosedError):
            await b.submit("closed")
        return b.stats()

    stats = _run(main())
    assert stats.failed_batches == 1 and stats.rejected["deadline"] == 1
    assert stats.batch_size_histogram == {1: 3}  # warm, boom, ok


def test_enqueued_requests_batch_together_and_withdraw_takes_one_back():
    rec = _Recorder()

    async def main():
        rec.gate.clear()
        b = Batcher(rec, BatcherConfig(max_batch_size=4, max_queue_delay_ms=0.0))
        first = b.enqueue(0)
        await rec.started.wait()  # batch [0] runs, held
        queued = [b.enqueue(i) for i in (1, 2, 3)]
        assert b.withdraw(queued[1]) is True
        assert b.withdraw(queued[1]) is False  # already taken back
        rec.gate.set()
        results = [await first.future, await queued[0].future, await queued[2].future]
        stats = b.stats()
        await b.close()
        return results, queued[1].future.done(), stats

    results, withdrawn_done, stats = _run(main())
    assert results == [0, 10, 30]
    assert rec.batches == [[0], [1, 3]]
    assert withdrawn_done is False  # left as it was; the caller stopped waiting on it
    assert stats.rejected == {"cancelled": 1}


def test_run_now_leaves_a_request_to_wait_for_company_when_there_is_a_queue_delay():
    def run_batch(payloads):
        return payloads

    async def main():
        waits = Batcher(run_batch, BatcherConfig(max_batch_size=4, max_queue_delay_ms=5.0, inline_max_ms=50.0))
        full_at_one = Batcher(run_batch, BatcherConfig(max_batch_size=4, max_queue_delay_ms=5.0,
                                                       preferred_batch_sizes=(1,), inline_max_ms=50.0))
        for b in (waits, full_at_one):
            await b.submit("warm")
        out = (waits.run_now("x"), full_at_one.run_now("x"))
        await waits.close()
        await full_at_one.close()
        return out

    assert _run(main()) == (NOT_NOW, "x")
