"""`splitinfer bench e2e`: a tiny grid end to end, and the headline arithmetic.

The smoke run is real: a throttled edge child process, the gateway on loopback gRPC
and the link emulator, with SqueezeNet on two links, one request per cut and a short
Poisson load on the faster link.
"""

from __future__ import annotations

import json
import math

import pytest

from bench._e2e_report import STRATEGIES, compute_summary, markdown_table
from splitinfer.bench_cmd import bench_main


def _cand(cut: str, enc: str, p50: float, pred: float) -> dict:
    return {"cut_id": cut, "encoding": enc, "p50_ms": p50, "predicted_ms": pred}


def _link(up: float, picks: dict[str, tuple[str, str, float]], oracle: float, cands: list[dict],
          agreement: dict[str, float] | None = None, layers: int = 1) -> dict:
    agreement = agreement or {}
    return {"up_bps": up,
            "oracle": {"p50_ms": oracle, "cut_id": "x", "encoding": "fp32", "device_layers": layers, "agreement": 1.0},
            "strategies": {s: {"cut_id": c, "encoding": e, "agreement": agreement.get(s, 1.0),
                               "measured": {"p50_ms": v, "check_agreement": agreement.get(s, 1.0)}}
                           for s, (c, e, v) in picks.items()},
            "candidates": cands}


_PICKS = {"edge-only": ("E", "fp32", 200.0), "cloud-only": ("L", "fp32", 100.0),
          "neurosurgeon": ("A", "fp32", 60.0), "dads": ("A", "fp32", 60.0), "dads_encoded": ("A", "int8", 55.0),
          "cloud_only_jpeg": ("L", "jpeg@75", 80.0), "ours": ("B", "int8", 50.0)}


def test_summary_regret_speedup_and_error_arithmetic() -> None:
    cands = [_cand("E", "fp32", 200.0, 220.0), _cand("L", "fp32", 100.0, 90.0), _cand("A", "fp32", 60.0, 60.0),
             _cand("B", "int8", 50.0, 55.0), _cand("C", "fp32", 40.0, 30.0)]
    s = compute_summary([{"model": "m", "links": [_link(1e6, _PICKS, 40.0, cands)]}])
    assert s["regret"]["ours"]["geomean"] == pytest.approx(50 / 40)
    assert s["regret"]["edge-only"]["worst"] == pytest.approx(5.0)
    assert s["regret"]["cloud_only_jpeg"]["geomean"] == pytest.approx(80 / 40)
    assert s["speedup_vs_best_single_side"]["geomean"] == pytest.approx(100 / 50)
    # |errors| in %: 10, 10, 0, 10, 25 -> median 10; the chosen plans exclude C.
    assert s["cost_model_median_abs_pct_error"] == pytest.approx(10.0)
    assert s["cost_model_median_abs_pct_error_chosen_plans"] == pytest.approx(10.0)
    assert s["meets"] == {"ours_within_budget": True, "regret_geomean": False, "regret_worst": False,
                          "cost_model_median_abs_pct_error": True}
    assert set(s["regret"]) == set(STRATEGIES)
    assert s["ratios"]["ours_over_dads_encoded"]["geomean"] == pytest.approx(50 / 55)
    assert s["ratios"]["ours_over_cloud_only_jpeg"]["geomean"] == pytest.approx(50 / 80)


def test_summary_accuracy_budget_and_where_splitting_pays() -> None:
    agree = {"ours": 0.995, "dads_encoded": 0.993, "cloud_only_jpeg": 0.991}
    slow = _link(1e6, _PICKS, 40.0, [], agree, layers=3)  # the oracle: 3 of 10 layers, faster than both sides
    fast = _link(1e8, {**_PICKS, "ours": ("L", "jpeg@75", 80.0)}, 80.0, [], {**agree, "ours": 0.985}, layers=0)
    models = [{"model": "m", "setup": {"layers": 10}, "links": [slow, fast]}]
    s = compute_summary(models, 0.99)
    assert s["accuracy_budget"]["min_agreement"] == 0.99
    acc = s["accuracy"]
    assert set(acc) == set(STRATEGIES)
    assert acc["ours"]["min_agreement"] == pytest.approx(0.985)
    assert acc["ours"]["median_agreement"] == pytest.approx(0.99)
    assert acc["dads"] == {"min_agreement": 1.0, "median_agreement": 1.0, "n": 2, "checked_answers": 2,
                           "checked_min_agreement": 1.0, "checked_median_agreement": 1.0}
    # ours below the budget in one cell: counted and the target is missed
    assert s["accuracy_budget"]["ours_below_budget"] == 1 and s["meets"]["ours_within_budget"] is False
    sp = s["splitting"]
    assert sp["cells_where_split_pays"] == 1 and sp["pays_in"][0]["up_mbps"] == 1.0
    assert sp["pays_in"][0]["gain_over_best_side"] == pytest.approx(80 / 40)
    assert sp["does_not_pay_on"] == [] and "1 of 2 cells" in sp["note"]


def test_summary_skips_a_strategy_without_a_plan() -> None:
    lk = _link(1e6, _PICKS, 40.0, [])
    lk["strategies"]["cloud_only_jpeg"] = {"cut_id": None, "encoding": None, "measured": None, "agreement": None,
                                           "not_applicable": "no JPEG quality meets the budget"}
    s = compute_summary([{"model": "m", "setup": {"layers": 10}, "links": [lk]}])
    assert s["regret"]["cloud_only_jpeg"]["n"] == 0 and "cloud_only_jpeg" not in s["cells"][0]["regret"]
    assert s["ratios"]["ours_over_cloud_only_jpeg"]["n"] == 0
    assert s["accuracy"]["cloud_only_jpeg"]["n"] == 0


def test_summary_counts_an_unrun_pick_by_its_lower_bound() -> None:
    picks = {k: ("E", "fp32", 50.0) for k in STRATEGIES}
    lk = _link(1e5, picks, 50.0, [_cand("E", "fp32", 50.0, 50.0)])
    lk["strategies"]["cloud-only"] = {"cut_id": "L", "encoding": "fp32", "measured": None, "lower_bound_ms": 2000.0,
                                      "agreement": 1.0}
    s = compute_summary([{"model": "m", "links": [lk]}])
    assert s["regret"]["cloud-only"] == {"geomean": pytest.approx(40.0), "worst": pytest.approx(40.0), "n": 1,
                                         "n_lower_bounds": 1}
    assert s["cells"][0]["regret_at_least"] == {"cloud-only": pytest.approx(40.0)}
    assert "cloud-only" not in s["cells"][0]["regret"]
    # the better single side is edge-only alone when cloud-only was not run
    assert s["speedup_vs_best_single_side"]["geomean"] == pytest.approx(1.0)


def test_markdown_table_draws_every_figure_from_the_json() -> None:
    cands = [_cand("B", "int8", 50.0, 55.0), _cand("C", "fp32", 40.0, 30.0)]
    models = [{"model": "m", "links": [_link(1e6, _PICKS, 40.0, cands)]}]
    doc = {"config": {"uplinks_mbps": [1.0], "rtts_ms": [20.0]}, "summary": compute_summary(models)}
    table = markdown_table(doc)
    # ours 50/40 = 1.25, NS and DADS 1.5, DADS encoded 1.375, JPEG 2, edge-only 5, cloud-only 2.5; speed-up 2
    assert "| m | 1.250 (1.25) | 1.50 | 1.50 | 1.38 | 2.00 | 5.00 | 2.50 | 2.00x (2.00x) |" in table
    assert "worst ≤ 1.15 (missed)" in table and "1 cells (1 models" in table and "agreement ≥ 0.99" in table
    assert "Ours / DADS encoded: geomean 0.909" in table and "cloud-only JPEG: geomean 0.625" in table


def test_a_missing_wheel_is_skipped_with_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import bench._wild_models as wild
    from bench._e2e_real import installed_real

    monkeypatch.setattr(wild, "locate", lambda m: None)
    ok, missing = installed_real(["ppocr_cls"])
    assert ok == [] and len(missing) == 1
    assert "ppocr_cls" in missing[0] and "pip install -e .[wild]" in missing[0]


def test_make_static_fixes_the_inputs_and_refuses_another_rank() -> None:
    import onnx
    from onnx import TensorProto, helper

    from bench._e2e_real import make_static

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, "h", "w"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 3, "h", "w"])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]))
    fixed = make_static(model, {"x": (1, 3, 48, 192)})
    assert [d.dim_value for d in fixed.graph.input[0].type.tensor_type.shape.dim] == [1, 3, 48, 192]
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "n"  # the original is untouched
    onnx.checker.check_model(fixed)
    with pytest.raises(ValueError, match="rank 4"):
        make_static(model, {"x": (1, 3)})


def test_bench_main_names_and_unknown(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["--help"]) == 0
    assert "e2e" in capsys.readouterr().out
    assert bench_main(["nope"]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err


def test_bad_options_name_the_value(tmp_path) -> None:
    with pytest.raises(SystemExit, match="unknown model"):
        bench_main(["e2e", "--quick", "--models", "lenet", "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="uplinks-mbps"):
        bench_main(["e2e", "--quick", "--uplinks-mbps", "fast", "--out", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="--min-agreement is 1.5"):
        bench_main(["e2e", "--quick", "--min-agreement", "1.5", "--out", str(tmp_path / "x.json")])


@pytest.mark.slow
@pytest.mark.grpc
def test_e2e_smoke_squeezenet_two_links(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bench._e2e_real import installed_real

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the accuracy tables' cache
    real, _ = installed_real(["ppocr_cls"])  # a real-weight classifier too, where its wheel is installed
    out = tmp_path / "e2e.json"
    rc = bench_main(["e2e", "--quick", "--models", ",".join(["squeezenet", *real]), "--uplinks-mbps", "1.1,100",
                     "--reps", "1", "--max-chain", "3", "--profile-runs", "2", "--load-mbps", "100", "--load-n", "4",
                     "--min-agreement", "0.98", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    m = doc["models"][0]
    assert [x["model"] for x in doc["models"]] == ["squeezenet", *real]
    assert [x["key"] for x in doc["config"]["real_weight_models"]] == real
    assert doc["config"]["min_agreement"] == 0.98 and "2-core" in doc["config"]["host_note"]
    assert m["model"] == "squeezenet" and len(m["links"]) == 2
    assert m["setup"]["accuracy_table"]["entries"] > 0 and not m["setup"]["real_weights"]
    # the input's codecs are timed on the edge before the planner prices them
    on_edge = m["setup"]["codec_ms_on_edge"]
    assert "jpeg@75" in on_edge and all(v["edge_ms"] > 0 and v["table_ms"] > 0 for v in on_edge.values())
    input_bytes = 3 * 224 * 224 * 4
    for model in doc["models"]:
        for lk in model["links"]:
            oracle = lk["oracle"]["p50_ms"]
            assert lk["oracle"]["within_budget"] and lk["oracle"]["agreement"] >= 0.98
            assert set(lk["strategies"]) == set(STRATEGIES)
            for s in STRATEGIES:
                st = lk["strategies"][s]
                if st["cut_id"] is None:  # no plan: only the JPEG baseline may lack one
                    assert s == "cloud_only_jpeg" and st["not_applicable"]
                    continue
                meas = st["measured"]
                if meas is None:  # not run: its measured lower bound lost by 10x
                    assert s != "ours" and st["lower_bound_ms"] > 10 * oracle, s
                else:
                    assert meas["p50_ms"] >= oracle  # the oracle is the fastest measured candidate
                    assert meas["agreement"] == st["agreement"]
                    # each pick's first answer is checked against the whole model
                    assert 0.0 <= meas["check_agreement"] <= 1.0
            ours = lk["strategies"]["ours"]
            assert ours["agreement"] >= 0.98 and ours["measured"] is not None
            if ours["encoding"] == "fp32" or ours["device_layers"] == model["setup"]["layers"]:
                assert ours["agreement"] == 1.0
    # At 1.1 Mbit/s the 602 kB input alone takes 4.4 s on the wire, over 10x the edge's
    # whole-model run, so cloud-only is reported by that bound; at 100 Mbit/s it runs.
    slow_link, fast_link = m["links"]
    assert slow_link["strategies"]["cloud-only"]["measured"] is None
    assert slow_link["strategies"]["cloud-only"]["lower_bound_ms"] == pytest.approx(input_bytes * 8 / 1.1e6 * 1e3)
    assert fast_link["strategies"]["cloud-only"]["measured"]["wire_bytes"] == input_bytes
    jpeg = fast_link["strategies"]["cloud_only_jpeg"]
    assert jpeg["encoding"].startswith("jpeg@") and jpeg["device_layers"] == 0
    assert 0 < jpeg["measured"]["wire_bytes"] < input_bytes / 10  # the frame as a JPEG, through the wire codec
    for lk in m["links"]:
        edge = lk["strategies"]["edge-only"]["measured"]
        assert edge["wire_bytes"] == 0 and edge["remote_ms"] == 0.0
        for c in lk["candidates"]:
            assert c["predicted_ms"] > 0 and c["p50_ms"] > 0
            assert c["p95_ms"] >= c["p50_ms"]
            if c["device_layers"] not in (0, 39):
                assert c["remote_ms"] > 0 and c["server_ms"]["compute"] > 0
    load = m["links"][1]["load"]
    assert "load" not in m["links"][0]
    for s_name, row in load["strategies"].items():
        assert row["answered"] == 4 and row["achieved_hz"] > 0 and not row["errors"], s_name
    assert {"ours", "edge-only", "dads"} <= set(load["strategies"])
    s = doc["summary"]
    assert [t["up_mbps"] for t in s["throughput"]] == [100] * len(doc["models"])
    assert set(s["regret"]) == set(STRATEGIES) and set(s["accuracy"]) == set(STRATEGIES)
    assert s["accuracy_budget"]["min_agreement"] == 0.98 and s["meets"]["ours_within_budget"]
    assert s["accuracy"]["ours"]["min_agreement"] >= 0.98
    assert set(s["ratios"]) == {"ours_over_dads_encoded", "ours_over_cloud_only_jpeg"}
    assert s["regret"]["ours"]["geomean"] >= 1.0 and math.isfinite(s["cost_model_median_abs_pct_error"])
    for stem in ("e2e_regret", "e2e_speedup", "e2e_error", "e2e_accuracy"):
        assert (tmp_path / f"{stem}.png").stat().st_size > 1000

