"""--input-shape and --inputs on profile, plan, sweep and instances, and the planner's
refusal to plan across a boundary of unknown size."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnx
import pytest

from partitioner import PartitionError, build_graph
from partitioner.cuts import Cut
from partitioner.export import make_inputs, reference_outputs
from partitioner.synthetic import make_chain_graph
from planner.costmodel import evaluate
from planner.errors import PlannerError
from planner.solvers import solve
from planner.synthetic import make_flops_profile
from planner.types import Link
from splitinfer import cli
from splitinfer.instances_cmd import instances_main
from splitinfer.plan_cmd import plan_main, sweep_main
from splitinfer.profile_cmd import profile_main
from tests.unit import _shape_models as M

_FAST = ["--runs", "1", "--warmup", "0", "--no-progress", "--threads", "1"]


@pytest.fixture
def files(tmp_path):
    conv = M.save(M.conv_resize(), tmp_path / "cr.onnx")
    rbi = M.save(M.reshape_by_input(onnx.TensorProto.INT32), tmp_path / "rbi.onnx")
    npz = tmp_path / "rbi.npz"
    np.savez(npz, x=np.random.default_rng(0).standard_normal((1, 12)).astype(np.float32),
             shape=np.array([-1, 3, 4], np.int32))
    return conv, rbi, str(npz)


def test_profile_runs_at_the_given_shape_and_on_sample_inputs(files, tmp_path, capsys):
    conv, rbi, npz = files
    out = tmp_path / "p.json"
    assert profile_main([conv, "-o", str(out), "--segments", "0", "--input-shape", "x=1x3x16x16", *_FAST]) == 0
    assert set(json.loads(out.read_text())["layers"]) == {str(i) for i in range(5)}
    assert profile_main([rbi, "-o", str(out), "--segments", "1", "--inputs", npz, *_FAST]) == 0
    assert "corrections" in capsys.readouterr().out
    with pytest.raises(PartitionError, match=r"input 'shape' .*--inputs FILE.npz"):
        profile_main([rbi, "-o", str(out), *_FAST])


def test_cli_says_one_line_and_exits_2_without_the_flags(files, tmp_path, capsys):
    conv, _, _ = files
    assert cli.main(["profile", conv, "-o", str(tmp_path / "p.json"), *_FAST]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--input-shape x=1x3xHxW" in err and "Traceback" not in err
    assert cli.main(["inspect", conv, "--input-shape", "x=1x3x16"]) == 2
    assert "give 4 dims" in capsys.readouterr().err
    assert cli.main(["split", conv, "--after", "0", "-o", str(tmp_path / "s"), "--inputs", str(tmp_path / "no.npz")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_plan_refuses_a_boundary_of_unknown_size_naming_tensor_and_flag(files, capsys):
    conv, rbi, npz = files
    tiers = ["--edge", "5gflops", "--cloud", "50gflops", "--uplink", "10mbit"]
    with pytest.raises(PlannerError, match=r"unknown size: 'x'.*--input-shape NAME=D0xD1x.*--inputs FILE.npz"):
        plan_main([conv, *tiers])
    assert plan_main([conv, *tiers, "--input-shape", "1x3x64x64", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    # the input's 48 KiB are priced: 39.3 ms at 10 Mbit/s
    assert answer["baselines"]["cloud_only"]["transfer_ms"] == pytest.approx(3 * 64 * 64 * 4 * 8 / 10e6 * 1e3, rel=0.01)
    with pytest.raises(PlannerError, match="unknown size"):
        sweep_main([rbi, "--edge", "5gflops", "--cloud", "50gflops", "--points", "3"])
    assert sweep_main([rbi, "--edge", "5gflops", "--cloud", "50gflops", "--points", "3", "--inputs", npz]) == 0


def test_solver_plans_around_a_tensor_of_unknown_size():
    g = make_chain_graph(6, seed=1)
    profiles = [make_flops_profile(g, device="dev", gflops=5.0),
                make_flops_profile(g, device="cloud", gflops=5000.0, fixed_ms=1.0)]
    fast = Link(1e9, 1e9, 1.0)
    assert solve(g, profiles, fast).edge_layers == ()  # cloud-only: the input crosses
    first = g.inputs[0]
    unknown = g.replace(tensors=tuple(dataclasses.replace(t, bytes_per_sample=None) if t.name == first else t
                                      for t in g.tensors))
    plan = solve(unknown, profiles, fast)
    assert plan.edge_layers and first not in plan.boundary
    with pytest.raises(PlannerError, match=f"'{first}' would cross"):
        evaluate(unknown, Cut(frozenset()), profiles, fast)


def test_instances_runs_on_the_given_shape(files, capsys):
    conv, _, _ = files
    assert instances_main([conv, "--input-shape", "1x3x8x8", "--rounds", "1", "--seconds", "0.02", "--quiet",
                           "--threads", "2", "--batch", "2"]) == 0
    assert "choice: instances:" in capsys.readouterr().out


def test_reference_outputs_of_a_tensor_onnx_inference_does_not_type():
    m = M.ms_gelu()  # ONNX shape inference has no value_info for the com.microsoft Gelu's output
    g = build_graph(m, input_shapes={"x": (2, 8)})
    feed = make_inputs(m, g, batch=2)
    got = reference_outputs(m, ["g", "y"], feed)
    assert got["g"].shape == (2, 16) and got["y"].shape == (2, 3)


def test_plan_reads_a_registry_models_declared_input_shapes(files, tmp_path, capsys):
    conv, _, _ = files
    for name, yaml in (("sized", "name: sized\ninput_shapes: {x: [1, 3, 32, 32]}\n"), ("open", "name: open\n")):
        d = tmp_path / "reg" / name / "1"
        d.mkdir(parents=True)
        (d / "model.onnx").write_bytes(open(conv, "rb").read())
        (d / "model.yaml").write_text(yaml)
    tiers = ["--registry", str(tmp_path / "reg"), "--edge", "5gflops", "--cloud", "50gflops", "--uplink", "10mbit"]
    assert plan_main(["sized", *tiers, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "sized"
    with pytest.raises(PlannerError, match="unknown size: 'x'"):
        plan_main(["open", *tiers])


def test_planner_service_builds_registry_graphs_at_the_declared_shapes(files, tmp_path):
    from splitinfer.plan_cmd import make_service

    conv, _, _ = files
    d = tmp_path / "reg" / "sized" / "1"
    d.mkdir(parents=True)
    (d / "model.onnx").write_bytes(open(conv, "rb").read())
    (d / "model.yaml").write_text("name: sized\ninput_shapes: {x: [1, 3, 16, 16]}\n")
    graph = make_service(registry_dir=str(tmp_path / "reg")).workspace.graph("sized")
    assert graph.model == "sized" and graph.tensor["x"].bytes_per_sample == 3 * 16 * 16 * 4
