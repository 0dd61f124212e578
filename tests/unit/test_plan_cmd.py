"""`splitinfer plan` and `splitinfer sweep`: JSON keys, the table, the plot, the errors."""

from __future__ import annotations

import json

import pytest

from partitioner import build_graph
from planner.errors import PlannerError
from planner.synthetic import make_flops_profile
from planner.whatif import SweepAnswer
from splitinfer.plan_cmd import format_sweep, parse_size_bytes, plan_main, sweep_main
from tests.onnx_models import random_dag, write


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write(random_dag(5, 12), tmp_path_factory.mktemp("m") / "dag5.onnx")


@pytest.fixture(scope="module")
def profiles(model: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("profiles")
    g = build_graph(model, name="dag5")
    out = []
    for name, gflops in (("edge", 0.5), ("cloud", 100.0)):
        p = d / f"{name}.json"
        p.write_text(make_flops_profile(g, device=name, gflops=gflops, fixed_ms=0.2, compute_w=3.0,
                                        radio_tx_w=1.5, idle_w=0.3).to_json())
        out.append(str(p))
    return out[0], out[1]


def _json(capsys: pytest.CaptureFixture[str], fn, argv: list[str]) -> dict:
    assert fn(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_json_has_the_documented_keys(model: str, profiles: tuple[str, str],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, plan_main, [model, "--edge", profiles[0], "--cloud", profiles[1], "--uplink", "18.88mbit",
                                    "--rtt", "20ms", "--json"])
    for key in ("edge_layers", "boundary", "encoding", "objective", "predicted", "baselines", "gain"):
        assert key in out
    assert set(out["predicted"]) >= {"edge_ms", "transfer_ms", "cloud_ms", "total_ms"}
    assert out["model"] == "dag5" and out["link"]["rtt_ms"] == 20.0 and out["link"]["down_bps"] == 18.88e6
    assert out["edge_device"] == "edge"


def test_plan_options_reach_the_solver(model: str, profiles: tuple[str, str],
                                       capsys: pytest.CaptureFixture[str]) -> None:
    args = [model, "--edge", profiles[0], "--cloud", profiles[1], "--uplink", "100kbit", "--json"]
    out = _json(capsys, plan_main, args + ["--first-k-local", "3", "--encoding", "auto", "--downlink", "1mbit"])
    assert {0, 1, 2} <= set(out["edge_layers"])
    assert out["link"]["down_bps"] == 1e6
    energy = _json(capsys, plan_main, args + ["--objective", "energy", "--slo", "10s"])
    assert energy["objective"] == "energy" and energy["metric"] == "energy_mj"
    kept = _json(capsys, plan_main, args + ["--keep-input-local"])
    assert "x" not in kept["boundary"]


def test_plan_table(model: str, profiles: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_main([model, "--edge", profiles[0], "--cloud", "50gflops", "--uplink", "5mbit", "--rtt", "10ms"]) == 0
    text = capsys.readouterr().out
    for word in ("cut", "boundary", "edge", "uplink", "cloud", "total", "bottleneck", "edge-only", "cloud-only"):
        assert word in text
    assert "roofline-50gflops" in text


def test_plan_on_a_zoo_model_with_rooflines(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, plan_main, ["squeezenet", "--edge", "5gflops", "--cloud", "200gflops", "--uplink",
                                    "18.88mbit", "--rtt", "20ms", "--json"])
    assert out["layers"] == 39 and out["predicted"]["total_ms"] > 0


def test_sweep_json(model: str, profiles: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    # the --plot path is tested in tests/integration/test_planner_http.py (matplotlib is slow to import)
    out = _json(capsys, sweep_main, [model, "--edge", profiles[0], "--cloud", profiles[1], "--uplink",
                                     "10kbit..1gbit", "--points", "25", "--rtt", "5ms", "--json"])
    assert len(out["uplink_bps"]) == 25 and set(out["series"]) == {"edge_only", "cloud_only", "chain", "dag"}
    assert out["method"] == "frontier"
    text = format_sweep(SweepAnswer.from_dict(out))
    assert "breakpoints" in text or "no breakpoints" in text


def test_sweep_table(model: str, profiles: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    assert sweep_main([model, "--edge", profiles[0], "--cloud", profiles[1], "--points", "5",
                       "--downlink", "10mbit", "--objective", "throughput"]) == 0
    text = capsys.readouterr().out
    assert "per-point" in text and "DAG opt" in text and "period_ms" in text


@pytest.mark.parametrize("argv, field", [
    (["--edge", "nosuch-device", "--cloud", "5gflops", "--uplink", "1mbit"], "--edge"),
    (["--edge", "missing.json", "--cloud", "5gflops", "--uplink", "1mbit"], "--edge"),
    (["--edge", "5gflops", "--cloud", "5gflops", "--uplink", "0bit"], "uplink"),
    (["--edge", "5gflops", "--cloud", "5gflops", "--uplink", "1mbit", "--slo", "0ms"], "--slo"),
    (["--edge", "0gflops", "--cloud", "5gflops", "--uplink", "1mbit"], "--edge"),
])
def test_plan_errors_name_the_option(model: str, argv: list[str], field: str) -> None:
    with pytest.raises(PlannerError) as e:
        plan_main([model, *argv])
    assert e.value.field == field
    assert e.value.message


@pytest.mark.parametrize("argv, line", [
    (["--uplink", "1mbps"], "argument --uplink: cannot parse rate '1mbps': unknown unit 'mbps'"),
    (["--uplink", "1mbit", "--rtt", "20 parsecs"], "argument --rtt: cannot parse duration '20 parsecs'"),
    (["--uplink", "1mbit", "--device-memory", "64MiBs"], "argument --device-memory: cannot parse size '64MiBs'"),
])
def test_unit_errors_are_usage_errors_naming_the_option(model: str, capsys: pytest.CaptureFixture[str],
                                                        argv: list[str], line: str) -> None:
    with pytest.raises(SystemExit) as e:
        plan_main([model, "--edge", "5gflops", "--cloud", "5gflops", *argv])
    assert e.value.code == 2 and line in capsys.readouterr().err


def test_a_bad_profile_file_names_the_file(model: str, tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlannerError, match="bad.json"):
        plan_main([model, "--edge", str(bad), "--cloud", "5gflops", "--uplink", "1mbit"])


def test_infeasible_plan_raises(model: str) -> None:
    with pytest.raises(PlannerError, match="device memory") as e:
        plan_main([model, "--edge", "5gflops", "--cloud", "5gflops", "--uplink", "1kbit",
                   "--first-k-local", "6", "--device-memory", "1B"])
    assert e.value.field == "device_memory"


def test_unknown_models() -> None:
    with pytest.raises(PlannerError, match="not known"):
        plan_main(["resnet51", "--edge", "5gflops", "--cloud", "5gflops", "--uplink", "1mbit"])
    with pytest.raises(PlannerError, match="not a file"):
        plan_main(["nowhere/model.onnx", "--edge", "5gflops", "--cloud", "5gflops", "--uplink", "1mbit"])


def test_sweep_range_errors(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        sweep_main([model, "--edge", "5gflops", "--cloud", "5gflops", "--uplink", "1mbit"])
    assert "argument --uplink: '1mbit' is not a range; write LO..HI" in capsys.readouterr().err
    with pytest.raises(PlannerError) as e:
        sweep_main([model, "--edge", "5gflops", "--cloud", "5gflops", "--uplink", "1mbit..1gbit", "--points", "1"])
    assert e.value.field == "points"


def test_usage_errors_exit_2(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        plan_main([model, "--edge", "5gflops"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        sweep_main([model, "--edge", "a", "--cloud", "b", "--down-ratio", "2", "--downlink", "1mbit"])


@pytest.mark.parametrize("text, value", [("64MiB", 64 << 20), ("1.5kB", 1500), ("10", 10), ("2 GiB", 2 << 30)])
def test_parse_size_bytes(text: str, value: float) -> None:
    assert parse_size_bytes(text) == value


@pytest.mark.parametrize("text", ["64 MiBs", "lots", ""])
def test_parse_size_bytes_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="64MiB"):
        parse_size_bytes(text)


def test_reference_device_names(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("planner.devices")
    out = _json(capsys, plan_main, [model, "--edge", "rpi4", "--cloud", "t4", "--uplink", "10mbit", "--json"])
    assert (out["edge_device"], out["cloud_device"]) == ("rpi4", "t4")
    with pytest.raises(PlannerError, match="rpi4"):  # the error lists the known names
        plan_main([model, "--edge", "rpi3", "--cloud", "t4", "--uplink", "10mbit"])
