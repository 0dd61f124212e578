"""Lossy codecs as plans: the Encoding carries the codec and its measured price, the
cost model charges it, and the planner places it only within an accuracy budget at
the cuts the table measured."""

from __future__ import annotations

import pytest

from partitioner.cuts import Cut
from partitioner.synthetic import make_chain_graph
from planner import Encoding, Link, LinkRange, Plan, PlannerError, evaluate, frontier, solve
from planner.accuracy import AccuracyEntry, AccuracyTable, encoding_key
from planner.budget import lossy_encoding, solve_within_budget
from planner.synthetic import make_random_profile

EMPTY = Cut(frozenset())


def _problem():
    graph = make_chain_graph(6, seed=3, max_tensor_bytes=1 << 20)
    dev = make_random_profile(graph, 1, device="device", gflops=5.0)
    cloud = make_random_profile(graph, 2, device="cloud", gflops=2000.0)
    return graph, (dev, cloud)


def _input_bytes(graph) -> float:
    return float(sum(graph.tensor[n].bytes_per_sample for n in graph.inputs))


def _table(graph, agreement=0.995, fraction=0.02, codec_ms=1.0) -> AccuracyTable:
    """jpeg@90 of the model input (the empty cut): ``fraction`` of its float32 bytes."""
    size = _input_bytes(graph) * fraction
    return AccuracyTable(graph.model, "f", 4, (
        AccuracyEntry(EMPTY.key, "jpeg@90", agreement, "y", "top1", 4, size, codec_ms),
        AccuracyEntry(EMPTY.key, "int8", 0.999, "y", "top1", 4, _input_bytes(graph) / 4, 0.1),
    ))


def test_a_lossy_encoding_round_trips_and_keys_as_the_table_does() -> None:
    enc = Encoding(codec="jpeg", level=90, ratio=0.05, codec_ms_per_mb=3.0)
    assert enc.key == encoding_key(enc) == "jpeg@90" and not enc.lossless and enc.lossy_codec
    assert Encoding.from_dict(enc.to_dict()) == enc and Encoding.from_json(enc.to_json()) == enc
    assert Encoding().to_dict() == {"precision": "fp32", "compression": "none", "per_channel": False}
    assert Encoding.from_dict({"precision": "int8"}) == Encoding("int8")


@pytest.mark.parametrize("kw,match", [
    ({"codec": "png", "level": 90}, "codec is 'png'"),
    ({"codec": "jpeg", "level": 0}, r"quality \(level\) is 0; use 1..100"),
    ({"codec": "bits", "level": 9}, r"bit depth \(level\) is 9; use 2..8"),
    ({"codec": "jpeg", "level": 90, "precision": "int8"}, "replaces the cast"),
    ({"codec": "jpeg", "level": 90, "compression": "zstd"}, "replaces the cast"),
    ({"level": 90}, "apply to a lossy codec only"),
    ({"codec": "jpeg", "level": 90, "ratio": 0.0}, "ratio is 0.0"),
    ({"codec": "jpeg", "level": 90, "ratio": 0.1, "codec_ms_per_mb": -1.0}, "codec_ms_per_mb is -1.0"),
])
def test_bad_lossy_encodings_are_clear_errors(kw, match) -> None:
    with pytest.raises(PlannerError, match=match):
        Encoding(**kw)


def test_without_a_budget_lossy_codecs_are_refused() -> None:
    graph, profiles = _problem()
    enc = Encoding(codec="jpeg", level=90, ratio=0.02, codec_ms_per_mb=1.0)
    with pytest.raises(PlannerError, match=r"placed only within an accuracy budget.*solve_within_budget"):
        solve(graph, profiles, Link(1e6, 1e6), encodings=(Encoding(), enc))
    with pytest.raises(PlannerError, match="carries no measured ratio"):
        evaluate(graph, EMPTY, profiles, Link(1e6, 1e6), Encoding(codec="jpeg", level=90))


def test_the_cost_model_charges_the_measured_bytes_and_codec_time() -> None:
    graph, profiles = _problem()
    link = Link(1e6, 1e6, 5.0)
    table = _table(graph)
    entry = table.entry(EMPTY, "jpeg@90")
    enc = lossy_encoding(graph, EMPTY, entry)
    b = evaluate(graph, EMPTY, profiles, link, enc)
    fp32 = evaluate(graph, EMPTY, profiles, link)
    assert b.uplink_ms == pytest.approx(entry.wire_bytes * 8 / link.up_goodput_bps * 1e3)
    assert b.encode_ms == pytest.approx(entry.codec_ms) and b.tier_codec_ms[0] == pytest.approx(entry.codec_ms)
    assert b.total_ms == pytest.approx(fp32.total_ms - fp32.uplink_ms + b.uplink_ms + entry.codec_ms)


def test_the_planner_sends_a_jpeg_on_a_slow_link_within_the_budget_and_never_below_it() -> None:
    graph, profiles = _problem()
    slow = Link(0.2e6, 1e6, 20.0)
    table = _table(graph)
    encs = (Encoding(), Encoding("fp16"), Encoding("int8"))
    plan = solve_within_budget(graph, profiles, slow, encodings=encs, accuracy=table, min_agreement=0.99)
    assert plan.encoding.key == "jpeg@90" and plan.cut == EMPTY and plan.agreement == 0.995
    assert plan.breakdown == evaluate(graph, plan.cut, profiles, slow, plan.encoding)
    assert Plan.from_dict(plan.to_dict()) == plan
    best_else = solve_within_budget(graph, profiles, slow, encodings=encs, accuracy=table, min_agreement=0.99,
                                    codecs=())
    assert best_else.encoding.key != "jpeg@90" and plan.breakdown.total_ms < best_else.breakdown.total_ms
    strict = solve_within_budget(graph, profiles, slow, encodings=encs, accuracy=table, min_agreement=0.998)
    assert strict.encoding.key != "jpeg@90" and strict.agreement >= 0.998
    # Explicitly allowed by key even when the codec family is not.
    named = solve_within_budget(graph, profiles, slow, encodings=(Encoding(), Encoding(codec="jpeg", level=90)),
                                accuracy=table, min_agreement=0.99, codecs=())
    assert named.encoding.key == "jpeg@90"


def test_a_codec_measured_nowhere_is_refused_naming_calibrate() -> None:
    graph, profiles = _problem()
    from planner import InfeasibleError

    with pytest.raises(InfeasibleError, match=r"\['webp@80'\] have no measured agreement.*calibrate"):
        solve_within_budget(graph, profiles, Link(1e6, 1e6), encodings=(Encoding(codec="webp", level=80),),
                            accuracy=_table(graph), min_agreement=0.99, codecs=())


def test_the_frontier_within_a_budget_holds_the_jpeg_at_slow_links_only_above_the_budget() -> None:
    graph, profiles = _problem()
    rng = LinkRange(0.05e6, 10e9, rtt_ms=10.0)
    table = _table(graph, codec_ms=2.0)
    front = frontier(graph, profiles, rng, encodings=(Encoding(),), accuracy=table, min_agreement=0.99)
    keys = [e.plan.encoding.key for e in front.entries]
    assert "jpeg@90" in keys
    assert all(e.plan.agreement is not None and e.plan.agreement >= 0.99 for e in front.entries)
    [held] = [e for e in front.entries if e.plan.encoding.key == "jpeg@90"]
    mid = (held.up_lo_bps * held.up_hi_bps) ** 0.5
    there = solve_within_budget(graph, profiles, rng.at(mid), encodings=(Encoding(),), accuracy=table,
                                min_agreement=0.99)
    assert there.key == held.plan.key  # the envelope is the per-rate optimum within the budget
    none = frontier(graph, profiles, rng, encodings=(Encoding(),), accuracy=table, min_agreement=0.999)
    assert "jpeg@90" not in [e.plan.encoding.key for e in none.entries]


def test_the_plan_answer_sends_the_jpeg_and_holds_fp32_baselines(tmp_path, capsys) -> None:
    import json

    from splitinfer.plan_cmd import plan_main
    from tests.unit.test_planner_budget import PLAN, _tiny_with_table

    path = _tiny_with_table(tmp_path)
    table = AccuracyTable.from_json((tmp_path / "tiny.accuracy.json").read_text())
    table = table.with_entries([AccuracyEntry("L", "jpeg@90", 0.993, "y", "rel_l2", 4, 400.0, 0.3)])
    (tmp_path / "tiny.accuracy.json").write_text(table.to_json())
    assert plan_main([path, *PLAN, "--min-agreement", "0.99"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["encoding"]["codec"] == "jpeg" and d["agreement"] == 0.993
    fp32 = [a if a != "auto" else "fp32" for a in PLAN]
    assert plan_main([path, *fp32]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert d["baselines"]["cloud_only"] == plain["baselines"]["cloud_only"]
    assert d["baselines"]["edge_only"] == plain["baselines"]["edge_only"]
    assert plan_main([path, *PLAN[:-1], "--min-agreement", "0.99"]) == 0
    assert "encoding jpeg@90" in capsys.readouterr().out
