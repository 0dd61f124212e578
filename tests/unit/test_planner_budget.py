"""The accuracy budget: no plan agrees less than asked, over random graphs, profiles, links
and accuracy tables; unmeasured encodings are refused with the calibrate command named."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner import candidate_cuts
from partitioner.cuts import Cut
from partitioner.synthetic import make_chain_graph
from planner import Encoding, InfeasibleError, Link, Plan, PlannerError, evaluate, solve
from planner.accuracy import AccuracyEntry, AccuracyTable, encoding_key
from planner.budget import check_budget, plan_agreement, solve_within_budget
from planner.synthetic import make_random_profile
from tests.strategies import problems

LOSSY = (Encoding("fp16"), Encoding("int8"), Encoding("int8", per_channel=True))


@st.composite
def tables(draw: st.DrawFn, graph) -> AccuracyTable:
    cuts = [c for c in candidate_cuts(graph) if len(c.device) < len(graph)][:12]
    entries = []
    for c in cuts:
        for enc in ("fp16", "int8", "int8+pc", "jpeg@90", "tiled-webp@75", "bits@4"):
            if draw(st.booleans()):
                a = draw(st.one_of(st.none(), st.floats(0.5, 1.0)))
                size = draw(st.floats(1.0, 1e4)) if "@" in enc else 0.0  # lossy codecs: measured bytes and ms
                ms = draw(st.floats(0.0, 5.0)) if "@" in enc else 0.0
                entries.append(AccuracyEntry(c.key, enc, a, wire_bytes=size, codec_ms=ms,
                                             reason="" if a is not None else "not applicable"))
    return AccuracyTable(graph.model, "f", 4, tuple(entries))


@settings(max_examples=40, deadline=None)
@given(data=st.data(), problem=problems(max_layers=8), budget=st.floats(0.6, 1.0),
       with_fp32=st.booleans())
def test_no_plan_is_below_the_budget(data, problem, budget: float, with_fp32: bool) -> None:
    graph, profiles, link = problem
    table = data.draw(tables(graph))
    encodings = ((Encoding(),) if with_fp32 else ()) + LOSSY
    try:
        plan = solve_within_budget(graph, profiles, link, encodings=encodings, accuracy=table,
                                   min_agreement=budget)
    except InfeasibleError as e:
        assert not with_fp32  # fp32 is always within any budget (lossless)
        assert e.constraint == "min_agreement"
        return
    assert plan.agreement is not None and plan.agreement >= budget
    lossless = plan.encoding.lossless or len(plan.cut.device) == len(graph)
    measured = 1.0 if lossless else table.agreement(plan.cut.key, encoding_key(plan.encoding))
    assert measured == plan.agreement == plan_agreement(graph, plan, table)
    # the reported cost is the cost model's for this cut and encoding
    assert plan.breakdown.total_ms == pytest.approx(evaluate(graph, plan.cut, profiles, link, plan.encoding).total_ms)
    if with_fp32:  # never worse than the lossless optimum
        assert plan.breakdown.total_ms <= solve(graph, profiles, link).breakdown.total_ms * (1 + 1e-9)


def _problem():
    graph = make_chain_graph(6, seed=3, max_tensor_bytes=1 << 20)
    dev = make_random_profile(graph, 1, device="device", gflops=5.0)
    cloud = make_random_profile(graph, 2, device="cloud", gflops=2000.0)
    return graph, (dev, cloud), Link(2e6, 2e6, 10.0)


def test_a_measured_lossy_encoding_wins_where_it_meets_the_budget_and_not_below() -> None:
    graph, profiles, link = _problem()
    empty = Cut(frozenset())
    table = AccuracyTable(graph.model, "f", 4, (AccuracyEntry(empty.key, "int8", 0.995),))
    plan = solve_within_budget(graph, profiles, link, encodings=(Encoding(), Encoding("int8")), accuracy=table,
                               min_agreement=0.99)
    lossless = solve(graph, profiles, link)
    assert plan.breakdown.total_ms <= lossless.breakdown.total_ms
    assert plan.agreement in (0.995, 1.0)
    strict = solve_within_budget(graph, profiles, link, encodings=(Encoding(), Encoding("int8")),
                                 accuracy=table, min_agreement=0.999)
    assert strict.encoding.precision == "fp32" and strict.agreement == 1.0
    assert strict.to_dict()["agreement"] == 1.0 and Plan.from_dict(strict.to_dict()) == strict


def test_unmeasured_encodings_are_refused_naming_the_calibrate_command() -> None:
    graph, profiles, link = _problem()
    with pytest.raises(InfeasibleError, match=r"no measured agreement .*splitinfer calibrate") as e:
        solve_within_budget(graph, profiles, link, encodings=(Encoding("int8"),), accuracy=None,
                            min_agreement=0.99)
    assert e.value.constraint == "min_agreement" and e.value.required == 0.99


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, float("nan"), True, "0.99"])
def test_a_budget_outside_0_to_1_is_a_clear_error(bad: object) -> None:
    with pytest.raises(PlannerError, match=r"min_agreement is .*fraction in \(0, 1\]"):
        check_budget(bad)  # type: ignore[arg-type]


def test_a_plan_without_a_budget_says_no_agreement() -> None:
    graph, profiles, link = _problem()
    plan = solve(graph, profiles, link)
    assert plan.agreement is None and "agreement" not in plan.to_dict()


# -- through the what-if API and the plan command ---------------------------------------


def _tiny_with_table(tmp_path):
    from tests.unit._accuracy_models import conv_model

    path = conv_model(str(tmp_path / "tiny.onnx"))
    table = AccuracyTable("tiny", "f", 4, (AccuracyEntry("L", "int8", 0.995, "y", "rel_l2", 4, 800.0, 0.05),
                                           AccuracyEntry("L", "fp16", 0.9999, "y", "rel_l2", 4, 1600.0, 0.05)))
    (tmp_path / "tiny.accuracy.json").write_text(table.to_json())
    return path


PLAN = ["--input-shape", "x=1x3x16x16", "--edge", "0.01gflops", "--cloud", "1000gflops", "--uplink", "1mbit",
        "--downlink", "1gbit", "--encoding", "auto", "--json"]


@pytest.mark.parametrize("budget,precision,agreement", [("0.99", "int8", 0.995), ("0.999", "fp16", 0.9999),
                                                        ("0.99999", "fp32", 1.0)])
def test_plan_command_keeps_to_the_budget_and_prints_the_agreement(tmp_path, capsys, budget, precision,
                                                                     agreement) -> None:
    import json

    from splitinfer.plan_cmd import plan_main

    path = _tiny_with_table(tmp_path)
    assert plan_main([path, *PLAN, "--min-agreement", budget]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["encoding"]["precision"] == precision and d["agreement"] == agreement >= float(budget)


def test_plan_command_without_a_table_refuses_lossy_only_plans_naming_calibrate(tmp_path) -> None:
    from tests.unit._accuracy_models import conv_model
    from splitinfer.plan_cmd import plan_main

    path = conv_model(str(tmp_path / "bare.onnx"))
    argv = [path, *PLAN[:-3], "--encoding", "int8", "--min-agreement", "0.99"]
    with pytest.raises(InfeasibleError, match="splitinfer calibrate"):
        plan_main(argv)


def test_requests_carry_min_agreement_and_refuse_a_bad_one() -> None:
    from planner.whatif import InvalidRequestError, PlanRequest

    body = {"model": "squeezenet", "edge": "rpi4", "cloud": "t4", "uplink": 1e6, "min_agreement": 0.99}
    req = PlanRequest.from_dict(body)
    assert req.scenario.min_agreement == 0.99
    assert PlanRequest.from_dict(req.to_dict()) == req
    for bad in (0, 1.5, "high"):
        with pytest.raises(InvalidRequestError, match="min_agreement"):
            PlanRequest.from_dict(dict(body, min_agreement=bad))


def test_the_frontier_keeps_to_the_budget_at_every_rate(tmp_path) -> None:
    from planner import LinkRange, frontier

    graph, profiles, _ = _problem()
    empty = Cut(frozenset())
    table = AccuracyTable(graph.model, "f", 4, (AccuracyEntry(empty.key, "int8", 0.995),
                                                 AccuracyEntry(empty.key, "fp16", 0.9999)))
    rng = LinkRange(1e5, 1e9, 1.0, 10.0)
    for budget in (0.99, 0.999, 0.99999):
        f = frontier(graph, profiles, rng, encodings=LOSSY + (Encoding(),), accuracy=table, min_agreement=budget)
        assert all(e.plan.agreement is not None and e.plan.agreement >= budget for e in f.entries)
        for up in (2e5, 3e6, 5e8):  # the envelope is the per-point optimum within the budget
            best = solve_within_budget(graph, profiles, rng.at(up), encodings=LOSSY + (Encoding(),),
                                       accuracy=table, min_agreement=budget)
            assert f.plan_at(up).breakdown.total_ms == pytest.approx(best.breakdown.total_ms, rel=1e-6)


# -- lossy codecs priced from the table ---------------------------------------------------


def test_a_codec_is_priced_with_its_measured_bytes_and_time() -> None:
    from planner.budget import price_codec

    graph, profiles, link = _problem()
    entry = AccuracyEntry("L", "jpeg@90", 0.99, "y", "top1", 4, 5000.0, 1.5)
    b = price_codec(graph, profiles, link, entry)
    fp32 = evaluate(graph, Cut(frozenset()), profiles, link)
    assert b.uplink_ms == pytest.approx(5000 * 8 / link.up_goodput_bps * 1e3)
    assert b.encode_ms == 1.5
    assert b.total_ms == pytest.approx(fp32.total_ms - fp32.uplink_ms - fp32.encode_ms + b.uplink_ms + 1.5)
    assert b.cloud_ms == fp32.cloud_ms and b.downlink_ms == fp32.downlink_ms


def test_best_codec_takes_the_fastest_quality_within_the_budget() -> None:
    from planner.budget import best_codec

    graph, profiles, link = _problem()
    table = AccuracyTable(graph.model, "f", 4, (
        AccuracyEntry("L", "jpeg@95", 0.995, "y", "top1", 4, 40000.0, 2.0),
        AccuracyEntry("L", "jpeg@50", 0.97, "y", "top1", 4, 8000.0, 2.0),
        AccuracyEntry("L", "webp@90", 0.992, "y", "top1", 4, 20000.0, 6.0),
        AccuracyEntry("L", "int8", 0.999, "y", "top1", 4, 100000.0, 0.5),
    ))
    assert best_codec(graph, profiles, link, table, 0.99).encoding == "webp@90"
    assert best_codec(graph, profiles, link, table, 0.95).encoding == "jpeg@50"
    assert best_codec(graph, profiles, link, table, 0.999) is None  # int8 is no image codec
    assert best_codec(graph, profiles, link, None, 0.9) is None


def test_under_a_budget_the_plan_answer_holds_the_frame_as_an_image_as_a_baseline(tmp_path, capsys) -> None:
    import json

    from planner.whatif import PlanAnswer
    from splitinfer.plan_cmd import plan_main

    path = _tiny_with_table(tmp_path)
    table = AccuracyTable.from_json((tmp_path / "tiny.accuracy.json").read_text())
    table = table.with_entries([AccuracyEntry("L", "jpeg@90", 0.993, "y", "rel_l2", 4, 400.0, 0.3),
                                AccuracyEntry("L", "jpeg@10", 0.95, "y", "rel_l2", 4, 100.0, 0.3)])
    (tmp_path / "tiny.accuracy.json").write_text(table.to_json())
    assert plan_main([path, *PLAN, "--min-agreement", "0.99"]) == 0
    d = json.loads(capsys.readouterr().out)
    image = d["baselines"]["cloud_only_image"]
    assert image["encoding"] == "jpeg@90" and image["agreement"] == 0.993  # jpeg@10 is below the budget
    assert d["gain"]["cloud_only_image"] == pytest.approx(image["total_ms"] / d["predicted"]["total_ms"])
    assert PlanAnswer.from_dict(d).to_dict() == d
    assert plan_main([path, *PLAN[:-1], "--min-agreement", "0.99"]) == 0
    assert "cloud-only jpeg@90" in capsys.readouterr().out
    assert plan_main([path, *PLAN]) == 0  # no budget: no agreement, no image baseline
    d = json.loads(capsys.readouterr().out)
    assert "agreement" not in d and "cloud_only_image" not in d["baselines"]
