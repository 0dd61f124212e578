"""The batcher's pure scheduling decision, driven with explicit times (no sleeping)."""

from __future__ import annotations

import dataclasses

import pytest

from workers.batcher import (
    BatcherConfig,
    BatcherConfigError,
    BatcherStats,
    _next_batch,
    _Request,
)


class _Q:
    """Builds the ``queues`` mapping the way the Batcher keeps it."""

    def __init__(self) -> None:
        self.queues: dict[object, list[_Request]] = {}
        self._seq = 0

    def add(self, at_s: float, *, shape=None, priority=0, deadline_s=None, payload=None):
        r = _Request(
            seq=self._seq,
            payload=payload if payload is not None else self._seq,
            shape_key=shape,
            priority=priority,
            arrival_s=at_s,
            deadline_s=deadline_s,
        )
        self._seq += 1
        q = self.queues.setdefault(shape, [])
        q.append(r)
        q.sort(key=lambda x: x.sort_key)
        return r


def _payloads(batch):
    return [r.payload for r in batch]


def test_empty_queue_waits_for_an_arrival():
    d = _next_batch({}, 5.0, BatcherConfig())
    assert d.batch == () and d.expired == () and d.wait_s is None


def test_lone_request_waits_exactly_the_delay_then_forms():
    cfg = BatcherConfig(max_batch_size=8, max_queue_delay_ms=10.0)
    q = _Q()
    q.add(100.0)
    d = _next_batch(q.queues, 100.0, cfg)
    assert d.batch == ()
    assert d.wait_s == pytest.approx(0.010)
    d = _next_batch(q.queues, 100.004, cfg)
    assert d.batch == () and d.wait_s == pytest.approx(0.006)
    d = _next_batch(q.queues, 100.010, cfg)
    assert _payloads(d.batch) == [0]


def test_delay_counts_from_the_oldest_request():
    cfg = BatcherConfig(max_batch_size=8, max_queue_delay_ms=10.0)
    q = _Q()
    q.add(1.000)
    q.add(1.008)
    d = _next_batch(q.queues, 1.009, cfg)
    assert d.batch == () and d.wait_s == pytest.approx(0.001)
    assert _payloads(_next_batch(q.queues, 1.010, cfg).batch) == [0, 1]


def test_full_batch_forms_at_once_and_leaves_the_rest():
    cfg = BatcherConfig(max_batch_size=3, max_queue_delay_ms=1000.0)
    q = _Q()
    for _ in range(5):
        q.add(0.0)
    d = _next_batch(q.queues, 0.0, cfg)
    assert _payloads(d.batch) == [0, 1, 2]
    assert d.wait_s == 0.0


def test_preferred_size_forms_without_waiting_for_the_delay():
    cfg = BatcherConfig(max_batch_size=8, max_queue_delay_ms=1000.0, preferred_batch_sizes=(4, 2))
    assert cfg.preferred_batch_sizes == (2, 4)
    q = _Q()
    q.add(0.0)
    assert _next_batch(q.queues, 0.0, cfg).batch == ()
    q.add(0.0)
    q.add(0.0)
    # 3 waiting: the largest reachable preferred size is 2.
    assert _payloads(_next_batch(q.queues, 0.0, cfg).batch) == [0, 1]
    q.add(0.0)
    q.add(0.0)
    assert _payloads(_next_batch(q.queues, 0.0, cfg).batch) == [0, 1, 2, 3]


def test_delay_over_sends_everything_even_off_preferred_sizes():
    cfg = BatcherConfig(max_batch_size=8, max_queue_delay_ms=5.0, preferred_batch_sizes=(4,))
    q = _Q()
    for _ in range(3):
        q.add(0.0)
    assert _next_batch(q.queues, 0.001, cfg).batch == ()
    assert len(_next_batch(q.queues, 0.005, cfg).batch) == 3


def test_higher_priority_is_batched_first_then_arrival_order():
    cfg = BatcherConfig(max_batch_size=2, max_queue_delay_ms=0.0, num_priority_levels=3)
    q = _Q()
    q.add(0.0, priority=0, payload="low-old")
    q.add(0.1, priority=2, payload="high-1")
    q.add(0.2, priority=1, payload="mid")
    q.add(0.3, priority=2, payload="high-2")
    assert _payloads(_next_batch(q.queues, 0.3, cfg).batch) == ["high-1", "high-2"]


def test_shapes_are_never_mixed_and_priority_picks_the_shape():
    cfg = BatcherConfig(max_batch_size=4, max_queue_delay_ms=0.0, num_priority_levels=2)
    q = _Q()
    q.add(0.0, shape=(1, 3), payload="a0")
    q.add(0.1, shape=(1, 5), payload="b0", priority=1)
    q.add(0.2, shape=(1, 3), payload="a1")
    d = _next_batch(q.queues, 0.3, cfg)
    assert _payloads(d.batch) == ["b0"]
    assert {r.shape_key for r in d.batch} == {(1, 5)}


def test_oldest_shape_goes_first_at_equal_priority():
    cfg = BatcherConfig(max_batch_size=4, max_queue_delay_ms=0.0)
    q = _Q()
    q.add(0.1, shape="a", payload="a0")
    q.add(0.2, shape="b", payload="b0")
    assert _payloads(_next_batch(q.queues, 0.3, cfg).batch) == ["a0"]
    del q.queues["a"]
    assert _payloads(_next_batch(q.queues, 0.3, cfg).batch) == ["b0"]


def test_only_a_ready_shape_is_dispatched():
    cfg = BatcherConfig(max_batch_size=2, max_queue_delay_ms=50.0)
    q = _Q()
    q.add(0.0, shape="lonely", payload="x")
    q.add(0.01, shape="pair", payload="p0")
    q.add(0.02, shape="pair", payload="p1")
    d = _next_batch(q.queues, 0.02, cfg)
    assert _payloads(d.batch) == ["p0", "p1"]


def test_expired_requests_are_reported_and_never_batched():
    cfg = BatcherConfig(max_batch_size=2, max_queue_delay_ms=0.0)
    q = _Q()
    q.add(0.0, deadline_s=1.0, payload="late")
    q.add(0.0, deadline_s=9.0, payload="ok")
    q.add(0.0, payload="no-deadline")
    d = _next_batch(q.queues, 1.0, cfg)
    assert _payloads(d.expired) == ["late"]
    assert _payloads(d.batch) == ["ok", "no-deadline"]


def test_wait_is_cut_short_by_a_deadline_before_the_delay():
    cfg = BatcherConfig(max_batch_size=8, max_queue_delay_ms=100.0)
    q = _Q()
    q.add(0.0, deadline_s=0.030)
    d = _next_batch(q.queues, 0.010, cfg)
    assert d.batch == () and d.wait_s == pytest.approx(0.020)


def test_flush_ignores_the_delay():
    cfg = BatcherConfig(max_batch_size=8, max_queue_delay_ms=1e6)
    q = _Q()
    q.add(0.0)
    assert _next_batch(q.queues, 0.0, cfg).batch == ()
    assert len(_next_batch(q.queues, 0.0, cfg, flush=True).batch) == 1


def test_decision_does_not_change_the_queues():
    cfg = BatcherConfig(max_batch_size=1, max_queue_delay_ms=0.0)
    q = _Q()
    q.add(0.0, deadline_s=0.5)
    q.add(0.0)
    before = {k: list(v) for k, v in q.queues.items()}
    _next_batch(q.queues, 1.0, cfg)
    assert q.queues == before


@pytest.mark.parametrize(
    "kwargs, field_name",
    [
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_queue_delay_ms": -1.0}, "max_queue_delay_ms"),
        ({"max_queue_delay_ms": float("nan")}, "max_queue_delay_ms"),
        ({"max_batch_size": 4, "preferred_batch_sizes": (2, 8)}, "preferred_batch_sizes"),
        ({"max_queue_size": 0}, "max_queue_size"),
        ({"num_priority_levels": 0}, "num_priority_levels"),
        ({"max_concurrent_batches": 0}, "max_concurrent_batches"),
    ],
)
def test_config_rejects_bad_values_naming_them(kwargs, field_name):
    with pytest.raises(BatcherConfigError) as info:
        BatcherConfig(**kwargs)
    assert info.value.field_name == field_name
    assert field_name in str(info.value)
    assert isinstance(info.value, ValueError)


def test_config_json_round_trip():
    cfg = BatcherConfig(max_batch_size=16, max_queue_delay_ms=3.5, preferred_batch_sizes=(8, 4),
                        max_queue_size=64, num_priority_levels=3, max_concurrent_batches=2)
    assert BatcherConfig.from_json(cfg.to_json()) == cfg
    assert dataclasses.replace(cfg, max_batch_size=32).max_batch_size == 32


def test_stats_json_round_trip():
    stats = BatcherStats(batches_formed=3, batch_size_histogram={1: 1, 4: 2},
                         rejected={"deadline": 2}, failed_batches=1, completed=8,
                         queue_depth=0, in_flight_batches=0)
    assert BatcherStats.from_json(stats.to_json()) == stats
