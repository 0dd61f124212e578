"""bench/transport.py's OIP section against a real `splitinfer gateway` process: every door answers
max(x, 0) (the bench checks each answer before timing) and every ratio it reports is finite."""

from __future__ import annotations

import math

import pytest

from bench._transport_oip import OIP_SIZES, bench_oip
from bench.transport import _interleaved

pytestmark = pytest.mark.grpc


def _has_tritonclient() -> bool:
    try:
        import tritonclient.grpc  # noqa: F401
        import tritonclient.http  # noqa: F401
    except (ImportError, RuntimeError):  # tritonclient.grpc on a grpcio older than 1.81.1 raises RuntimeError
        return False
    return True


def test_every_door_answers_and_is_timed():
    calls: list[int] = []

    def few(fns, n, warmup=20):  # noqa: ANN001, ANN202 - _interleaved's signature, with 3 calls a door
        calls.append(n)
        return _interleaved(fns, 3, warmup=1)

    rows = bench_oip(True, few)
    assert [r["size_bytes"] for r in rows] == list(OIP_SIZES.values())
    for r in rows:
        doors = set(r["median_ms"])
        triton = {"oip_grpc_triton", "rest_binary", "rest_json"} if _has_tritonclient() else set()
        assert doors == {"native", "oip_grpc"} | triton
        for door in doors - {"native"}:
            assert math.isfinite(r[f"{door}_vs_native"]) and r[f"{door}_vs_native"] > 0
    assert calls and all(n > 0 for n in calls)
