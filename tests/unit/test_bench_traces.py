"""bench.traces' pure parts: which trace pairs run, the per-strategy figures and the hindsight bound."""

import collections

import pytest

from bench.traces import (
    STRATEGIES,
    find_pairs,
    hindsight,
    main,
    p95_gaps,
    pooled,
    pooled_hindsight,
    rate_per_second,
    summarise,
    turn_order,
)
from splitinfer.netem import load_mahimahi_trace


def test_pairs_are_the_up_files_with_a_down_beside_them(tmp_path):
    for name in ("b.up", "b.down", "a.up", "a.down", "lonely.up", "other.down", "notes.txt"):
        (tmp_path / name).write_text("1\n")
    assert [n for n, _, _ in find_pairs(tmp_path)] == ["a", "b"]
    with pytest.raises(SystemExit, match="no NAME.up/NAME.down pair"):
        find_pairs(_empty(tmp_path))
    with pytest.raises(SystemExit, match="is not a folder"):
        find_pairs(tmp_path / "missing")


def test_a_bad_trace_or_an_unknown_name_stops_the_run_before_any_turn(tmp_path, capsys):
    for name, text in (("good", "1\n2\n"), ("bad", "1\nabc\n")):
        (tmp_path / f"{name}.up").write_text(text)
        (tmp_path / f"{name}.down").write_text("1\n")
    with pytest.raises(SystemExit, match=r"bad\.up:2: .*\(got 'abc'\); write one whole number"):
        main(["--trace-dir", str(tmp_path), "--out", str(tmp_path / "out.json")])
    with pytest.raises(SystemExit) as info:
        main(["--trace-dir", str(tmp_path), "--only", "nope"])
    assert info.value.code == 2 and "--only nope: no such pair" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--trace-dir", str(tmp_path), "--rate-scale", "-2"])
    assert "--rate-scale is -2.0; it must be a number > 0" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


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


def test_every_strategy_runs_once_a_round_and_the_first_rotates():
    order = turn_order(3)
    assert len(order) == 3 * len(STRATEGIES)
    for r in range(3):
        assert sorted(s for rr, s in order if rr == r) == sorted(STRATEGIES)
    firsts = [s for i, (_, s) in enumerate(order) if i % len(STRATEGIES) == 0]
    assert len(set(firsts)) == 3


def _round(latencies, tag, switches=0):
    recs = [{"index": i, "latency_ms": ms, "served_by": "local"} for i, ms in enumerate(latencies)]
    return {"records": recs, "sent": len(latencies), "answers": collections.Counter(f"{tag}-{i}" for i in
                                                                                    range(len(latencies))),
            "switches": switches, "bytes_up": 10, "counters": {"hedges": 1, "remote_errors": {"timeout": 1}}}


def test_rounds_pool_their_requests_and_keep_their_spread():
    rounds = [_round([100.0] * 10, "r0", switches=1), _round([300.0] * 10, "r1", switches=3)]
    s = pooled(rounds, slo_ms=200.0, seconds=60.0)
    assert s["requests"] == 20 and s["lost"] == 0 and s["doubled"] == 0  # the same index in two rounds is no double
    assert s["slo_miss_rate"] == 0.5 and s["switches_per_min"] == 2.0  # 4 switches over two minutes
    assert s["spread"]["p95_ms"] == [100.0, 300.0] and s["spread"]["switches_per_min"] == [1.0, 3.0]
    assert s["counters"] == {"hedges": 2, "remote_errors": {"timeout": 2}} and s["bytes_up"] == 20


def test_the_hindsight_bound_is_taken_within_each_round_then_pooled():
    # Round 0: a is fast; round 1: b is. Each round's bound is its own best, not the other round's.
    r0 = {"a": _round([100.0] * 4, "a0")["records"], "b": _round([300.0] * 4, "b0")["records"]}
    r1 = {"a": _round([500.0] * 4, "a1")["records"], "b": _round([200.0] * 4, "b1")["records"]}
    h = pooled_hindsight([r0, r1], [4, 4], slo_ms=150.0, half_width=0)
    assert h["requests"] == 8 and h["slo_miss_rate"] == 0.5
    assert [r["p50_ms"] for r in h["rounds"]] == [100.0, 200.0]


def _timeline(fn, seconds=60, per_s=2, rounds=3):
    return [(i / per_s, fn(r, i / per_s), "local") for r in range(rounds) for i in range(seconds * per_s)]


def test_a_strategy_slower_everywhere_has_a_gap_whose_interval_excludes_zero():
    tl = {"ours": _timeline(lambda r, t: 300.0 + (t % 7)), "static": _timeline(lambda r, t: 400.0 + (t % 7))}
    g = p95_gaps(tl)["static"]
    assert g["gap_ms"] == pytest.approx(-100.0)
    assert g["interval_ms"][1] < 0 and g["interval_ms"][0] == pytest.approx(-100.0, abs=1.0)
    assert g["blocks"] == 12 and g["resamples"] > 0


def test_strategies_that_differ_by_noise_have_an_interval_around_zero():
    import numpy as np

    noise = np.random.default_rng(1)
    # Both see the same link moments (a slow block every 15 s); only their own jitter differs.
    link = lambda t: 900.0 if int(t // 5) % 3 == 0 else 300.0  # noqa: E731
    tl = {s: _timeline(lambda r, t: link(t) + noise.normal(0, 2)) for s in ("ours", "edge_only")}
    g = p95_gaps(tl)["edge_only"]
    lo, hi = g["interval_ms"]
    assert lo < 0 < hi and abs(g["gap_ms"]) < 10
    # The same link for ours moved 50 ms up is a gap the run tells apart.
    tl["ours"] = [(t, ms + 50.0, by) for t, ms, by in tl["ours"]]
    assert p95_gaps(tl)["edge_only"]["interval_ms"][0] > 0


def test_gaps_are_added_to_an_earlier_result_and_a_bad_file_is_named(tmp_path):
    import json

    tl = {"ours": _timeline(lambda r, t: 250.0), "edge_only": _timeline(lambda r, t: 494.0)}
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"traces": {"A": {"strategies": {}, "timeline": {"latency_ms": tl}}}}))
    assert main(["--gaps-of", str(path)]) == 0
    assert json.loads(path.read_text())["traces"]["A"]["p95_gaps"]["edge_only"]["gap_ms"] == pytest.approx(-244.0)
    bad = tmp_path / "bad.json"
    bad.write_text('{"traces": {"A": {}}}')
    with pytest.raises(SystemExit, match=r"--gaps-of .*bad\.json.*KeyError.*give a result this bench wrote"):
        main(["--gaps-of", str(bad)])
