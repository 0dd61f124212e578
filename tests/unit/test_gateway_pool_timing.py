"""The per-request timing a SegmentWorker reports with its outputs (the value; the Ray
path is tests/integration/test_gateway_ray.py)."""

from __future__ import annotations

import pickle

import pytest

from workers._pool import RequestTiming, new_timing


def test_request_timing_round_trips_and_copies():
    t = RequestTiming(queue_s=0.002, compute_s=0.0135, batch_size=4, first_in_batch=True)
    assert RequestTiming.from_json(t.to_json()) == t
    assert t._replace(first_in_batch=False).batch_size == 4
    assert RequestTiming(0.0, 0.0, 1).first_in_batch is False
    fast = new_timing((0.002, 0.0135, 4, True))  # the hot paths' constructor
    assert type(fast) is RequestTiming and fast == t and fast.compute_s == 0.0135
    assert pickle.loads(pickle.dumps(fast)) == t
    with pytest.raises(AttributeError):
        t.queue_s = 1.0  # type: ignore[misc]
