"""Requests of several shapes in one batcher ([Note: any shape] in workers/engine.py): a
shape that fills batches without pause never starves a shape that waits for company."""

from __future__ import annotations

from workers.batcher import BatcherConfig, _next_batch, _Request


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
