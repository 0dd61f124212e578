"""The batch queue ([Note: batch queue] in planner/queueing.py) against a discrete-event run of
the batcher's dispatch: a free worker waits up to the timeout for company, and a worker
that frees takes everything waiting, up to max_batch."""

from __future__ import annotations

import math

import numpy as np
import pytest

from planner.queueing import batch_queue, run_ms_table

# ResNet50 on a T4 (the reference device's batch curve): 5.5 ms alone, 29.3 ms for 8.
TABLE = run_ms_table(np.array([4.8]), 0.7, {1: 5.53, 2: 8.92, 4: 15.71, 8: 29.28}, 8)[0]
TIMEOUT_MS = 2.0


def _merge_batcher_wait_ms(rate: float, workers: int, seconds: float = 40.0, seed: int = 1) -> float:
    """Mean ms from arrival to the batch's start, after the first 5 s."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, int(rate * seconds)))
    tau, full = TIMEOUT_MS / 1e3, len(TABLE)
    free_at = [0.0] * workers
    queue: list[float] = []
    waits: list[float] = []
    i = 0
    while i < len(arrivals) or queue:
        if not queue:
            queue.append(arrivals[i])
            i += 1
            continue
        w = min(free_at)
        ready = max(w, queue[0] + tau) if len(queue) < full else max(w, min(queue[0] + tau, queue[full - 1]))
        if i < len(arrivals) and arrivals[i] < ready:
            queue.append(arrivals[i])
            i += 1
            continue
        take, queue = queue[:full], queue[full:]
        free_at[free_at.index(w)] = ready + TABLE[len(take) - 1] / 1e3
        if ready > 5.0:
            waits += [ready - a for a in take]
    return 1e3 * float(np.mean(waits))


@pytest.mark.parametrize("workers", [1, 4, 8])
@pytest.mark.parametrize("load", [0.6, 0.9])
def test_the_wait_matches_the_merging_batcher(workers: int, load: float) -> None:
    rate = load * workers * 1000.0 * len(TABLE) / TABLE[-1]  # of the full-batch capacity
    q = batch_queue(np.array([rate]), TABLE[None, :], workers, TIMEOUT_MS)
    model = q.wait_ms + float(q.fill_ms[0])
    measured = _merge_batcher_wait_ms(rate, workers)
    # Batches queued as units at their own utilisation (the Allen-Cunneen wait of the formed
    # batches) read 1.76x this batcher's wait at 1 worker and 60%, 1.41x at 90%.
    assert 0.75 < model / measured < 1.3, (model, measured)


def test_full_batches_bound_the_load() -> None:
    capacity = 4 * 1000.0 * len(TABLE) / TABLE[-1]
    assert math.isinf(batch_queue(np.array([1.01 * capacity]), TABLE[None, :], 4, TIMEOUT_MS).wait_ms)
    q = batch_queue(np.array([0.99 * capacity]), TABLE[None, :], 4, TIMEOUT_MS)
    assert math.isfinite(q.wait_ms) and q.utilisation < 1.0 and q.batch[0] > 6.0  # the merge fills batches


def test_admission_without_deadlines_is_the_full_batch_wait() -> None:
    from planner.queueing import admission

    for workers, load in ((1, 0.6), (6, 0.9)):
        rate = load * workers * 1000.0 * len(TABLE) / TABLE[-1]
        q = batch_queue(np.array([rate]), TABLE[None, :], workers, TIMEOUT_MS)
        refused, wait, p_wait = admission(np.array([rate]), np.array([1e6]), np.array([TABLE[-1]]), workers, len(TABLE))
        assert refused[0] == pytest.approx(0.0, abs=1e-9)
        assert wait[0] == pytest.approx(q.wait_ms) and p_wait[0] == pytest.approx(q.p_wait)


def test_admission_refuses_the_requests_with_the_least_slack() -> None:
    from planner.queueing import admission

    full = np.full(3, TABLE[-1])
    capacity = 4 * 1000.0 * len(TABLE) / TABLE[-1]
    rates = np.full(3, 0.6 * capacity)  # 180% of capacity in all
    refused, wait, _ = admission(rates, np.array([-1.0, 5.0, 50.0]), full, 4, len(TABLE))
    assert refused[0] == 1.0  # no slack: refused even with a worker free
    assert 0.0 <= refused[2] < refused[1] < 1.0
    assert float((rates * (1.0 - refused)).sum()) < capacity  # what is admitted the workers can serve
    assert wait[1] < 5.0 and wait[2] < 50.0 and wait[1] < wait[2]  # the admitted wait within their slack
    more, _, _ = admission(rates, np.array([-1.0, 5.0, 50.0]), full, 5, len(TABLE))
    assert more[1] < refused[1]  # another worker refuses fewer
