"""bench.traces' pure parts: which trace pairs run, the per-strategy figures and the hindsight bound."""

import collections

import pytest

from bench.traces import find_pairs, hindsight, rate_per_second, summarise
from splitinfer.netem import load_mahimahi_trace


def test_pairs_are_the_up_files_with_a_down_beside_them(tmp_path):
    for name in ("b.up", "b.down", "a.up", "a.down", "lonely.up", "other.down", "notes.txt"):
        (tmp_path / name).write_text("1\n")
    assert [n for n, _, _ in find_pairs(tmp_path)] == ["a", "b"]
    with pytest.raises(SystemExit, match="no NAME.up/NAME.down pair"):
        find_pairs(_empty(tmp_path))
    with pytest.raises(SystemExit, match="is not a folder"):
        find_pairs(tmp_path / "missing")


def _empty(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    return d


def test_the_rate_per_second_counts_the_trace_opportunities(tmp_path):
    p = tmp_path / "t.up"
    p.write_text("\n".join(["0"] * 10 + ["500"] * 10 + ["1500"] * 5 + ["2000"]) + "\n")
    rates = rate_per_second(load_mahimahi_trace(p), 2)
    assert rates == [pytest.approx(20 * 1500 * 8 / 1e6), pytest.approx(5 * 1500 * 8 / 1e6)]


def test_figures_count_misses_lost_and_doubled_answers():
    recs = [{"index": i, "latency_ms": ms, "served_by": "remote"} for i, ms in enumerate([100, 200, 300, 900])]
    answers = collections.Counter({"r0": 1, "r1": 1, "r2": 2, "r3": 1})
    s = summarise(recs, 5, answers, 500.0, switches=3, seconds=30.0, bytes_up=1234)
    assert s["lost"] == 1 and s["doubled"] == 1 and s["switches_per_min"] == 6.0
    assert s["slo_miss_rate"] == pytest.approx(2 / 5)  # one late answer and one never answered
    assert s["p50_ms"] == 250.0 and s["bytes_up"] == 1234


def test_hindsight_takes_the_best_measured_latency_of_each_request():
    runs = {"edge_only": [{"index": 0, "latency_ms": 300.0}, {"index": 1, "latency_ms": 300.0}],
            "cloud_only": [{"index": 0, "latency_ms": 100.0}, {"index": 1, "latency_ms": 900.0}]}
    h = hindsight(runs, 2, slo_ms=250.0)
    assert h["p50_ms"] == 200.0 and h["slo_miss_rate"] == 0.5
    # With neighbours, one lucky sample of a strategy is not its level at that moment.
    noisy = {"a": [{"index": i, "latency_ms": ms} for i, ms in enumerate([300, 50, 300, 300])],
             "b": [{"index": i, "latency_ms": 150.0} for i in range(4)]}
    assert hindsight(noisy, 4, slo_ms=100.0)["slo_miss_rate"] == 0.75  # the lucky 50 ms counts
    assert hindsight(noisy, 4, slo_ms=100.0, half_width=1)["slo_miss_rate"] == 1.0  # b's 150 ms is the bound
