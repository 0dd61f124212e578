"""Any ONNX Runtime failure that escapes a command is one line naming the command, the
model and the cause, exit 2, never a traceback. The failures are real: a model ONNX
Runtime refuses to load, and one that loads and fails at run time. The command is a
small module planted on sys.path and registered for the test, so that no command's own
error handling stands between the failure and the command line."""

from __future__ import annotations

import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from splitinfer import cli
from splitinfer.cli import main, ort_failure

_COMMAND = '''
import numpy as np
import onnxruntime as ort


def load(argv):
    ort.InferenceSession(argv[-1].split("=")[-1], providers=["CPUExecutionProvider"])


def run(argv):
    session = ort.InferenceSession(argv[-1], providers=["CPUExecutionProvider"])
    session.run(None, {"x": np.ones((1, 4), np.float32)})


def wrapped(argv):
    try:
        load(argv)
    except Exception as e:
        raise RuntimeError("the engine could not start") from e


def unrelated(argv):
    raise KeyError("not an ONNX Runtime failure")
'''


def _save(model: onnx.ModelProto, path) -> str:
    onnx.save(model, str(path))
    return str(path)


@pytest.fixture
def command(tmp_path, monkeypatch) -> None:
    (tmp_path / "ort_failing_cmd.py").write_text(textwrap.dedent(_COMMAND))
    monkeypatch.syspath_prepend(str(tmp_path))
    for func in ("load", "run", "wrapped", "unrelated"):
        monkeypatch.setitem(cli.COMMANDS, f"ort-{func}", ("ort_failing_cmd", func, "test"))


@pytest.fixture
def custom_op(tmp_path) -> str:
    """x -> com.example.Foo -> y: ONNX Runtime refuses to load it."""
    graph = helper.make_graph(
        [helper.make_node("Foo", ["x"], ["y"], domain="com.example")], "u",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    model = helper.make_model(graph, ir_version=8, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    return _save(model, tmp_path / "customop.onnx")


@pytest.fixture
def bad_gather(tmp_path) -> str:
    """x[1,4] -> Gather(index 7 of 4) -> y: loads, fails at run time."""
    graph = helper.make_graph(
        [helper.make_node("Gather", ["x", "idx"], ["y"], axis=1, name="gather1")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])],
        initializer=[numpy_helper.from_array(np.array([7], np.int64), "idx")])
    model = helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17)])
    return _save(model, tmp_path / "badgather.onnx")


def _one_line(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith(f"splitinfer {command}: error: ONNX Runtime ") and err.count("\n") == 1, err
    return err


def test_a_load_failure_is_one_line_naming_the_model_and_the_cause(command, custom_op, capsys):
    assert main(["ort-load", custom_op]) == 2
    err = _one_line(capsys, "ort-load")
    assert f"failed on {custom_op}: " in err
    assert "Foo" in err and "com.example" in err  # ONNX Runtime's own words on the op
    assert "[ONNXRuntimeError]" not in err  # its code prefix is tidied to the status name


def test_a_run_failure_is_one_line(command, bad_gather, capsys):
    assert main(["ort-run", "--model", bad_gather]) == 2
    err = _one_line(capsys, "ort-run")
    assert f"failed on {bad_gather}: " in err and "gather1" in err


def test_an_error_raised_from_an_ort_failure_reports_the_ort_cause(command, custom_op, capsys):
    assert main(["ort-wrapped", f"--model={custom_op}"]) == 2
    err = _one_line(capsys, "ort-wrapped")
    assert f"failed on {custom_op}: " in err and "Foo" in err


def test_other_errors_still_raise(command):
    with pytest.raises(KeyError, match="not an ONNX Runtime failure"):
        main(["ort-unrelated"])
    assert ort_failure(KeyError("x")) is None


def test_the_message_prefix_alone_marks_an_ort_failure():
    line = ort_failure(RuntimeError("[ONNXRuntimeError] : 10 : INVALID_GRAPH : bad\nnode"))
    assert line is not None and line.endswith("failed: INVALID_GRAPH: bad node")
