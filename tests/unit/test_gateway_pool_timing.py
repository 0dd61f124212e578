"""The per-request timing a SegmentWorker reports with its outputs (the value; the Ray
path is tests/integration/test_gateway_ray.py)."""

from __future__ import annotations

import dataclasses

from workers._pool import RequestTiming


def test_request_timing_round_trips_and_copies():
    t = RequestTiming(queue_s=0.002, compute_s=0.0135, batch_size=4, first_in_batch=True)
    assert RequestTiming.from_json(t.to_json()) == t
    assert dataclasses.replace(t, first_in_batch=False).batch_size == 4
    assert RequestTiming(0.0, 0.0, 1).first_in_batch is False
