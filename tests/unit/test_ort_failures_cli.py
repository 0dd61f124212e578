"""ONNX Runtime failures in the commands that run a model: one line naming the model and
the cause, exit 2, no traceback, no files left.

The models are real and ONNX Runtime really fails on them: one loads but fails at run
time (a Gather index out of range), one does not load (an op no runtime registers).
Both pass `splitinfer inspect`, so the failure is ONNX Runtime's, not the partitioner's.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from partitioner import PartitionError, build_graph, make_cut, split
from partitioner.export import reference_outputs, run_segments
from splitinfer.cli import main


def _gather_out_of_range() -> onnx.ModelProto:
    """x[1,4] -> Relu -> Gather(index 7 of 4 on axis 1) -> Relu -> y: fails at run time."""
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="relu0"),
        helper.make_node("Gather", ["a", "idx"], ["g"], axis=1, name="gather1"),
        helper.make_node("Relu", ["g"], ["y"], name="relu2"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])],
        initializer=[numpy_helper.from_array(np.array([7], dtype=np.int64), "idx")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _unregistered_op() -> onnx.ModelProto:
    """x -> Relu -> com.example.Foo -> y: ONNX Runtime refuses to load it."""
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu0"),
             helper.make_node("Foo", ["a"], ["y"], name="foo1", domain="com.example")]
    graph = helper.make_graph(
        nodes, "u", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)],
                             ir_version=8)


@pytest.fixture
def bad_run(tmp_path) -> str:
    path = tmp_path / "badgather.onnx"
    onnx.save(_gather_out_of_range(), str(path))
    return str(path)


@pytest.fixture
def bad_load(tmp_path) -> str:
    path = tmp_path / "customop.onnx"
    onnx.save(_unregistered_op(), str(path))
    return str(path)


def _one_line(capsys, command: str) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert captured.err.startswith(f"splitinfer {command}: error: ") and captured.err.count("\n") == 1, captured.err
    return captured.err


def test_split_verify_reports_an_ort_run_failure_in_one_line(tmp_path, capsys, bad_run) -> None:
    out_dir = tmp_path / "out"
    assert main(["inspect", bad_run]) == 0  # the graph itself is fine
    capsys.readouterr()
    assert main(["split", bad_run, "--after", "0", "--verify", "-o", str(out_dir)]) == 2
    err = _one_line(capsys, "split")
    assert "ONNX Runtime cannot run badgather" in err
    assert "Gather node. Name:'gather1'" in err and "idx=7" in err
    assert not out_dir.exists()  # a split that fails verification writes nothing


def test_split_verify_reports_an_ort_load_failure_in_one_line(tmp_path, capsys, bad_load) -> None:
    out_dir = tmp_path / "out"
    assert main(["split", bad_load, "--after", "0", "--verify", "-o", str(out_dir)]) == 2
    err = _one_line(capsys, "split")
    assert "ONNX Runtime cannot load customop" in err and "com.example:Foo" in err
    assert not out_dir.exists()


def test_profile_reports_an_ort_run_failure_in_one_line(tmp_path, capsys, bad_run) -> None:
    out = tmp_path / "p.json"
    # with segments: the whole model's reference run fails first
    assert main(["profile", bad_run, "-o", str(out), "--runs", "1", "--warmup", "0", "--no-progress"]) == 2
    err = _one_line(capsys, "profile")
    assert "badgather" in err and "gather1" in err
    # without segments: the profiled run itself fails
    assert main(["profile", bad_run, "-o", str(out), "--runs", "1", "--warmup", "0", "--segments", "0",
                 "--no-progress"]) == 2
    err = _one_line(capsys, "profile")
    assert "ONNX Runtime failed running badgather to profile it" in err and "gather1" in err
    assert not out.exists()


def test_profile_reports_an_ort_load_failure_in_one_line(tmp_path, capsys, bad_load) -> None:
    out = tmp_path / "p.json"
    assert main(["profile", bad_load, "-o", str(out), "--runs", "1", "--warmup", "0", "--segments", "0",
                 "--no-progress"]) == 2
    err = _one_line(capsys, "profile")
    assert "ONNX Runtime cannot load customop to profile" in err and "com.example:Foo" in err
    assert not out.exists()


def test_instances_reports_an_ort_failure_in_one_line(tmp_path, capsys, bad_run, bad_load) -> None:
    common = ["--rounds", "1", "--seconds", "0.05", "--quiet"]
    assert main(["instances", bad_run, "--after", "0", *common]) == 2
    err = _one_line(capsys, "instances")
    assert "badgather after layer 0" in err and "gather1" in err
    assert main(["instances", bad_load, *common]) == 2
    err = _one_line(capsys, "instances")
    assert "customop" in err and "com.example:Foo" in err


def test_partitioner_runs_wrap_ort_errors_naming_the_model() -> None:
    model = _gather_out_of_range()
    graph = build_graph(model, name="g")
    x = {"x": np.ones((1, 4), np.float32)}
    with pytest.raises(PartitionError, match="ONNX Runtime cannot run mymodel: .*gather1") as info:
        reference_outputs(model, ["y"], x, name="mymodel")
    assert info.value.model == "mymodel"
    head, tail = split(model, make_cut(graph, [0]), graph=graph)
    with pytest.raises(PartitionError, match="ONNX Runtime cannot run segment 1 of g: .*gather1"):
        run_segments([head, tail], x, name="g")
