"""Token bucket arithmetic with an injected clock (no network, no sleeping)."""

import math

import pytest

from splitinfer.netem import NetemError, TokenBucket

RATE_BPS = 8e6  # 1e6 bytes/s: 1000 bytes take exactly 1 ms


def test_burstless_bucket_is_a_serialiser():
    bucket = TokenBucket(RATE_BPS, now_s=0.0)
    assert bucket.reserve(1000, now_s=0.0) == pytest.approx(0.001)
    # Back-to-back reservations queue behind each other.
    assert bucket.reserve(1000, now_s=0.0) == pytest.approx(0.002)
    assert bucket.backlog_bytes(now_s=0.0) == pytest.approx(2000)
    assert bucket.backlog_bytes(now_s=0.0015) == pytest.approx(500)
    # An idle link does not bank credit: later data serialises from its own arrival.
    assert bucket.backlog_bytes(now_s=1.0) == 0
    assert bucket.reserve(500, now_s=1.0) == pytest.approx(1.0005)


def test_bucket_throughput_equals_rate_over_many_segments():
    bucket = TokenBucket(RATE_BPS, now_s=0.0)
    end_s = 0.0
    for _ in range(1000):
        end_s = bucket.reserve(1500, now_s=0.0)
    assert 1000 * 1500 * 8 / end_s == pytest.approx(RATE_BPS)


def test_burst_lets_a_full_bucket_send_at_once_then_refills_at_rate():
    bucket = TokenBucket(RATE_BPS, now_s=0.0, burst_bytes=2000)
    assert bucket.reserve(1000, now_s=0.0) == 0.0
    assert bucket.reserve(1000, now_s=0.0) == 0.0
    assert bucket.reserve(1000, now_s=0.0) == pytest.approx(0.001)
    # Refill is capped at the burst size however long the link idles.
    assert bucket.reserve(3000, now_s=10.0) == pytest.approx(10.001)


def test_rate_change_applies_from_now_and_keeps_the_backlog():
    bucket = TokenBucket(RATE_BPS, now_s=0.0)
    bucket.reserve(2000, now_s=0.0)
    bucket.set_rate(2 * RATE_BPS, now_s=0.001)  # 1000 bytes left, now drained at 2e6 B/s
    assert bucket.rate_bps == 2 * RATE_BPS
    assert bucket.reserve(0, now_s=0.001) == pytest.approx(0.0015)


def test_zero_rate_never_finishes_and_resumes_after_a_new_rate():
    bucket = TokenBucket(RATE_BPS, now_s=0.0)
    bucket.set_rate(0.0, now_s=0.0)
    assert math.isinf(bucket.reserve(1000, now_s=0.0))
    assert bucket.backlog_bytes(now_s=100.0) == pytest.approx(1000)
    bucket.set_rate(RATE_BPS, now_s=100.0)
    assert bucket.reserve(0, now_s=100.0) == pytest.approx(100.001)


def test_bucket_rejects_negative_rate():
    with pytest.raises(NetemError, match="-1"):
        TokenBucket(-1.0, now_s=0.0)


def test_a_late_reservation_is_backdated_to_when_its_bytes_were_ready():
    bucket = TokenBucket(RATE_BPS, now_s=0.0)
    assert bucket.reserve(1000, now_s=0.0) == pytest.approx(0.001)
    # The caller woke 4 ms late; the link went idle at 1 ms and the bytes were waiting.
    assert bucket.reserve(1000, now_s=0.005, ready_s=0.0) == pytest.approx(0.002)
    # Backdating never goes before the previous reservation, so the rate still holds.
    assert bucket.reserve(1000, now_s=0.005, ready_s=-1.0) == pytest.approx(0.003)
    # Bytes that only became ready later start then.
    assert bucket.reserve(1000, now_s=0.02, ready_s=0.01) == pytest.approx(0.011)


def test_backlog_query_does_not_change_the_bucket():
    bucket = TokenBucket(RATE_BPS, now_s=0.0)
    bucket.reserve(1000, now_s=0.0)
    assert bucket.backlog_bytes(now_s=5.0) == 0
    assert bucket.reserve(1000, now_s=5.0, ready_s=0.0) == pytest.approx(0.002)
