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


def _link(up: float, picks: dict[str, tuple[str, str, float]], oracle: float, cands: list[dict]) -> dict:
    return {"up_bps": up, "oracle": {"p50_ms": oracle, "cut_id": "x", "encoding": "fp32", "device_layers": 1},
            "strategies": {s: {"cut_id": c, "encoding": e, "measured": {"p50_ms": v}} for s, (c, e, v) in picks.items()},
            "candidates": cands}


def test_summary_regret_speedup_and_error_arithmetic() -> None:
    picks = {"edge-only": ("E", "fp32", 200.0), "cloud-only": ("L", "fp32", 100.0),
             "neurosurgeon": ("A", "fp32", 60.0), "dads": ("A", "fp32", 60.0), "ours": ("B", "int8", 50.0)}
    cands = [_cand("E", "fp32", 200.0, 220.0), _cand("L", "fp32", 100.0, 90.0), _cand("A", "fp32", 60.0, 60.0),
             _cand("B", "int8", 50.0, 55.0), _cand("C", "fp32", 40.0, 30.0)]
    s = compute_summary([{"model": "m", "links": [_link(1e6, picks, 40.0, cands)]}])
    assert s["regret"]["ours"]["geomean"] == pytest.approx(50 / 40)
    assert s["regret"]["edge-only"]["worst"] == pytest.approx(5.0)
    assert s["speedup_vs_best_single_side"]["geomean"] == pytest.approx(100 / 50)
    # |errors| in %: 10, 10, 0, 10, 25 -> median 10; the chosen plans exclude C.
    assert s["cost_model_median_abs_pct_error"] == pytest.approx(10.0)
    assert s["cost_model_median_abs_pct_error_chosen_plans"] == pytest.approx(10.0)
    assert s["meets"] == {"regret_geomean": False, "regret_worst": False, "cost_model_median_abs_pct_error": True}


def test_summary_counts_an_unrun_pick_by_its_lower_bound() -> None:
    picks = {"edge-only": ("E", "fp32", 50.0), "cloud-only": ("L", "fp32", 0.0),
             "neurosurgeon": ("E", "fp32", 50.0), "dads": ("E", "fp32", 50.0), "ours": ("E", "fp32", 50.0)}
    lk = _link(1e5, picks, 50.0, [_cand("E", "fp32", 50.0, 50.0)])
    lk["strategies"]["cloud-only"] = {"cut_id": "L", "encoding": "fp32", "measured": None, "lower_bound_ms": 2000.0}
    s = compute_summary([{"model": "m", "links": [lk]}])
    assert s["regret"]["cloud-only"] == {"geomean": pytest.approx(40.0), "worst": pytest.approx(40.0), "n": 1,
                                         "n_lower_bounds": 1}
    assert s["cells"][0]["regret_at_least"] == {"cloud-only": pytest.approx(40.0)}
    assert "cloud-only" not in s["cells"][0]["regret"]
    # the better single side is edge-only alone when cloud-only was not run
    assert s["speedup_vs_best_single_side"]["geomean"] == pytest.approx(1.0)


def test_markdown_table_draws_every_figure_from_the_json() -> None:
    picks = {"edge-only": ("E", "fp32", 200.0), "cloud-only": ("L", "fp32", 100.0),
             "neurosurgeon": ("A", "fp32", 60.0), "dads": ("A", "fp32", 60.0), "ours": ("B", "int8", 50.0)}
    cands = [_cand("B", "int8", 50.0, 55.0), _cand("C", "fp32", 40.0, 30.0)]
    models = [{"model": "m", "links": [_link(1e6, picks, 40.0, cands)]}]
    doc = {"config": {"uplinks_mbps": [1.0], "rtts_ms": [20.0]}, "summary": compute_summary(models)}
    table = markdown_table(doc)
    # ours 50/40 = 1.25, NS and DADS 1.5, edge-only 5, cloud-only 2.5; speed-up 100/50 = 2
    assert "| m | 1.250 (1.25) | 1.50 | 1.50 | 5.00 | 2.50 | 2.00x (2.00x) |" in table
    assert "worst ≤ 1.15 (missed)" in table and "1 cells (1 models" in table


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


@pytest.mark.slow
@pytest.mark.grpc
def test_e2e_smoke_squeezenet_two_links(tmp_path) -> None:
    out = tmp_path / "e2e.json"
    rc = bench_main(["e2e", "--quick", "--models", "squeezenet", "--uplinks-mbps", "1.1,100", "--reps", "1",
                     "--max-chain", "3", "--profile-runs", "2", "--load-mbps", "100", "--load-n", "4",
                     "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    (m,) = doc["models"]
    assert m["model"] == "squeezenet" and len(m["links"]) == 2
    input_bytes = 3 * 224 * 224 * 4
    for lk in m["links"]:
        oracle = lk["oracle"]["p50_ms"]
        for s in STRATEGIES:
            meas = lk["strategies"][s]["measured"]
            if meas is None:  # not run: its measured lower bound lost by 10x
                assert s != "ours" and lk["strategies"][s]["lower_bound_ms"] > 10 * oracle, s
            else:
                assert meas["p50_ms"] >= oracle  # the oracle is the fastest measured candidate
    # At 1.1 Mbit/s the 602 kB input alone takes 4.4 s on the wire, over 10x the edge's
    # whole-model run, so cloud-only is reported by that bound; at 100 Mbit/s it runs.
    slow_link, fast_link = m["links"]
    assert slow_link["strategies"]["cloud-only"]["measured"] is None
    assert slow_link["strategies"]["cloud-only"]["lower_bound_ms"] == pytest.approx(input_bytes * 8 / 1.1e6 * 1e3)
    assert fast_link["strategies"]["cloud-only"]["measured"]["wire_bytes"] == input_bytes
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
    for s_name in STRATEGIES:
        row = load["strategies"][s_name]
        assert row["answered"] == 4 and row["achieved_hz"] > 0 and not row["errors"]
    s = doc["summary"]
    (tp,) = s["throughput"]
    assert tp["up_mbps"] == 100 and tp["ratio"] > 0
    assert s["regret"]["ours"]["geomean"] >= 1.0 and math.isfinite(s["cost_model_median_abs_pct_error"])
    for stem in ("e2e_regret", "e2e_speedup", "e2e_error"):
        assert (tmp_path / f"{stem}.png").stat().st_size > 1000
