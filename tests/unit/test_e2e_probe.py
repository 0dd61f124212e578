"""The e2e benchmark's RTT probe ([Note: probed RTT] in bench._e2e_run): timed where no
head runs before the call, in the fewest bytes measured there."""

from __future__ import annotations

import pytest

from bench._e2e_run import _FAST_LINK, _call_extra_ms, _probe_choice
from planner.accuracy import AccuracyEntry, AccuracyTable


def _cand(cid: str, *, head: bool, local: bool = False) -> dict:
    return {"id": cid, "cut_key": cid, "local": local, "head_path": f"{cid}.onnx" if head else None, "boundary": []}


# SqueezeNet's shape: the smallest boundary (4,000 bytes) sits after a head of 38 layers,
# the model input (602,112 bytes in fp32) has no head before it.
_CANDS = [_cand("L0-38", head=False, local=True), _cand("L", head=False), _cand("L0-37", head=True),
          _cand("L0-10", head=True)]
_ALL = {c["id"] for c in _CANDS}


def _table(*entries: AccuracyEntry) -> AccuracyTable:
    return AccuracyTable("m", "f", 8, entries)


def test_the_probe_runs_no_head_even_where_a_headed_cut_sends_fewer_bytes() -> None:
    table = _table(AccuracyEntry("L0-37", "int8", 1.0, wire_bytes=1000.0),
                   AccuracyEntry("L", "jpeg@90", 0.999, wire_bytes=9000.0),
                   AccuracyEntry("L", "jpeg@10", 0.97, wire_bytes=1741.0),
                   AccuracyEntry("L", "webp@90", None, wire_bytes=500.0, reason="not applicable"),
                   AccuracyEntry("L", "int8", 1.0, wire_bytes=150528.0))
    assert _probe_choice(_CANDS, _ALL, "L", table) == ("L", "jpeg@10")


def test_the_probe_sends_int8_where_the_table_measured_no_bytes_at_the_input() -> None:
    assert _probe_choice(_CANDS, _ALL, "L", None) == ("L", "int8")
    assert _probe_choice(_CANDS, _ALL, "L", _table(AccuracyEntry("L0-10", "fp16", 1.0, wire_bytes=9.0))) == ("L", "int8")


def test_no_probe_where_the_input_cut_is_not_served() -> None:
    assert _probe_choice(_CANDS, _ALL - {"L"}, "L", None) is None
    assert _probe_choice([c for c in _CANDS if c["id"] != "L"], _ALL, "L", None) is None


def test_the_call_extra_subtracts_server_work_rtt_and_bytes_both_ways() -> None:
    row = {"remote_ms": 90.0, "wire_bytes": 125_000, "server": {"decode": 1.0, "compute": 4.0, "queue": 0.5,
                                                                "utilisation": 0.9}}
    link = {"up_bps": 10e6, "down_bps": 40e6, "rtt_ms": 20.0}
    # 125 kB up at 10 Mbit/s: 100 ms; 4 kB down at 40 Mbit/s: 0.8 ms
    assert _call_extra_ms(row, link, 4000.0) == pytest.approx(90.0 - 5.5 - 20.0 - 100.0 - 0.8)
    fast = {"up_bps": _FAST_LINK["up_bps"], "down_bps": _FAST_LINK["down_bps"], "rtt_ms": _FAST_LINK["rtt_ms"]}
    assert _call_extra_ms(row, fast, 0.0) == pytest.approx(90.0 - 5.5 - 1.0 - 1.0)


def test_the_device_profile_takes_the_median_of_its_edge_only_requests() -> None:
    from bench._e2e_run import _scaled_to
    from planner.profile import LayerTime, Profile

    # the profile says 40 ms (3 layers + 4 ms fixed); edge-only requests took 36-100 ms
    dev = Profile("edge", {0: LayerTime(10.0), 1: LayerTime(20.0), 2: LayerTime(6.0)}, fixed_ms=4.0)
    scaled, ms = _scaled_to(dev, [36.0, 100.0, 96.0, 70.0, 40.0, 99.0, 100.0])
    assert ms == 96.0
    assert sum(t.ms for t in scaled.layers.values()) + scaled.fixed_ms == pytest.approx(96.0)
    assert scaled.layers[1].ms == pytest.approx(20.0 * 96.0 / 40.0)  # every layer by one factor
    assert _scaled_to(dev, []) == (dev, None)


class _TimedEdge:
    """An edge whose input codec encodes in `encode_ms` ([Note: codec time on the device])."""

    def __init__(self, encode_ms: dict[str, float]) -> None:
        self.encode_ms = encode_ms

    def job(self, cand_id: str, precision: str, reps: int) -> dict:
        return {"rows": [{"encode_ms": self.encode_ms[precision]}] * reps}


def test_codecs_are_priced_at_the_devices_speed() -> None:
    from bench._e2e_run import _codec_on_edge
    from partitioner import build_graph
    from partitioner.zoo import load_zoo

    graph = build_graph(load_zoo("squeezenet", random_weights=True, seed=0), name="squeezenet")
    table = _table(AccuracyEntry("L", "jpeg@90", 1.0, codec_ms=2.0), AccuracyEntry("L", "webp@90", 1.0, codec_ms=5.0),
                   AccuracyEntry("L0-0", "tiled-jpeg@50", 1.0, codec_ms=6.0), AccuracyEntry("L", "int8", 1.0),
                   AccuracyEntry("L0-1", "tiled-webp@50", None, reason="not measured"))
    priced, seen = _codec_on_edge(_TimedEdge({"jpeg@90": 30.0, "webp@90": 1.0}), graph, _CANDS, table, 16.0)
    assert priced.entry("L", "jpeg@90").codec_ms == 30.0  # an input codec at its time on the edge
    assert priced.entry("L", "webp@90").codec_ms == 5.0  # never below the table's
    assert priced.entry("L0-0", "tiled-jpeg@50").codec_ms == 6.0 * 16.0  # a feature map's at the slowdown
    assert priced.entry("L", "int8").codec_ms == 0.0 and priced.entry("L0-1", "tiled-webp@50").agreement is None
    assert seen == {"jpeg@90": {"table_ms": 2.0, "edge_ms": 30.0}, "webp@90": {"table_ms": 5.0, "edge_ms": 1.0}}


class _WarmEdge(_TimedEdge):
    """An edge whose codec runs 10 ms when it ran the request before, 14 ms after another."""

    def __init__(self) -> None:
        super().__init__({})
        self.calls: list[str] = []

    def job(self, cand_id: str, precision: str, reps: int) -> dict:
        rows = [{"encode_ms": 10.0 if self.calls and self.calls[-1] == precision else 14.0}]
        self.calls.append(precision)
        for _ in range(reps - 1):
            rows.append({"encode_ms": 10.0})
            self.calls.append(precision)
        return {"rows": rows}


def test_input_codecs_are_timed_round_robin_as_the_grid_sends_them() -> None:
    from bench._e2e_run import _codec_on_edge
    from partitioner import build_graph
    from partitioner.zoo import load_zoo

    graph = build_graph(load_zoo("squeezenet", random_weights=True, seed=0), name="squeezenet")
    table = _table(AccuracyEntry("L", "jpeg@90", 1.0, codec_ms=2.0), AccuracyEntry("L", "tiled-jpeg@50", 1.0, codec_ms=2.0))
    edge = _WarmEdge()
    priced, _ = _codec_on_edge(edge, graph, _CANDS, table, 16.0, reps=3)
    assert edge.calls == ["jpeg@90", "tiled-jpeg@50"] * 3
    # timed back to back, each would read the warm 10 ms; the grid's round-robin sees 14
    assert priced.entry("L", "jpeg@90").codec_ms == priced.entry("L", "tiled-jpeg@50").codec_ms == 14.0
