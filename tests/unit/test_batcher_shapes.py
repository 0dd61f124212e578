"""Requests of several shapes in one batcher ([Note: any shape] in workers/engine.py): a
shape that fills batches without pause never starves a shape that waits for company, and
each shape's deadlines are judged by what its own batches take."""

from __future__ import annotations

import asyncio

import pytest

from workers.batcher import Batcher, BatcherConfig, OverloadedError, _next_batch, _Request


def test_a_busy_shape_never_starves_a_lone_one():
    cfg = BatcherConfig(max_batch_size=4, max_queue_delay_ms=10.0)
    queues: dict[object, list[_Request]] = {}
    seq = 0

    def add(shape, at_s):
        nonlocal seq
        queues.setdefault(shape, []).append(_Request(seq=seq, payload=seq, shape_key=shape, priority=0,
                                                     arrival_s=at_s, deadline_s=None))
        seq += 1

    add("small", 0.0)
    served_at = None
    for tick in range(40):  # every millisecond a full batch of the busy shape arrives
        now_s = tick * 1e-3
        for _ in range(4):
            add("large", now_s)
        decision = _next_batch(queues, now_s, cfg)
        assert decision.batch and len({r.shape_key for r in decision.batch}) == 1
        for r in decision.batch:
            queues[r.shape_key].remove(r)
        if decision.batch[0].shape_key == "small":
            served_at = now_s
            break
    # The lone request goes as soon as its delay is over, ahead of the newer full batches.
    assert served_at is not None and 0.010 <= served_at <= 0.011


def test_each_shape_is_predicted_from_its_own_batches():
    now = [100.0]
    cost_s = {"large": 0.1, "small": 0.001}

    async def run(payloads):
        now[0] += cost_s[payloads[0]]
        return payloads

    async def main():
        batcher = Batcher(run, BatcherConfig(max_batch_size=4, max_queue_delay_ms=0.0), clock=lambda: now[0])
        try:
            await batcher.submit("large", shape_key="large")
            await batcher.submit("small", shape_key="small")
            # 50 ms is too short for a large batch (100 ms) but plenty for a small one (1 ms),
            # though over every shape a batch of one averages 80 ms.
            assert batcher.run_times.estimate_s(1) > 0.05
            with pytest.raises(OverloadedError):
                await batcher.submit("large", shape_key="large", deadline_s=now[0] + 0.05)
            return await batcher.submit("small", shape_key="small", deadline_s=now[0] + 0.05)
        finally:
            await batcher.close()

    assert asyncio.run(asyncio.wait_for(main(), 5.0)) == "small"
