"""workers.rewrite reads what If, Loop and Scan bodies read from the outer graph
(partitioner.subgraphs.node_reads): an integer input that sets a shape inside a branch
is found, and a shape constant that a branch also reads is never changed in place."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from tests.control_flow_models import OPSET, if_model, loop_model
from workers.engine import Engine, EngineConfig
from workers.rewrite import make_batch_dynamic, shape_feeding_inputs

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    model = helper.make_model(helper.make_graph(nodes, "m", inputs, outputs, initializer=list(inits)),
                              opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def _branch(name: str, nodes, out: str) -> onnx.GraphProto:
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(out, F, None)])


def reshape_in_branch_model() -> onnx.ModelProto:
    """x[1, 6]; If(flag): the then-branch reshapes x to the int64 input ``shape`` (read
    from the outer graph, never by the If itself), the else-branch to a constant [2, 3]."""
    then_g = _branch("then", [helper.make_node("Reshape", ["x", "shape"], ["a"]),
                              helper.make_node("Relu", ["a"], ["then_out"])], "then_out")
    else_g = _branch("else", [helper.make_node("Reshape", ["x", "two_by_three"], ["else_out"])], "else_out")
    return _model(
        [helper.make_node("If", ["flag"], ["y"], name="branch", then_branch=then_g, else_branch=else_g)],
        [helper.make_tensor_value_info("x", F, [1, 6]), helper.make_tensor_value_info("shape", I64, [2]),
         helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", F, ["a", "b"])],
        [numpy_helper.from_array(np.array([2, 3], np.int64), "two_by_three")])


def size_from_branch_model() -> onnx.ModelProto:
    """A branch turns the int64 input ``n`` into a shape (n, 6 / n) that a Reshape
    outside the If uses: the If's output carries ``n``'s values."""
    then_g = helper.make_graph(
        [helper.make_node("Div", ["six", "n"], ["rest"]), helper.make_node("Concat", ["n", "rest"], ["s"], axis=0)],
        "then", [], [helper.make_tensor_value_info("s", I64, [2])])
    else_g = helper.make_graph([helper.make_node("Identity", ["two_by_three"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", I64, [2])])
    return _model(
        [helper.make_node("If", ["flag"], ["shape"], then_branch=then_g, else_branch=else_g),
         helper.make_node("Reshape", ["x", "shape"], ["y"])],
        [helper.make_tensor_value_info("x", F, [1, 6]), helper.make_tensor_value_info("n", I64, [1]),
         helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", F, ["a", "b"])],
        [numpy_helper.from_array(np.array([6], np.int64), "six"),
         numpy_helper.from_array(np.array([2, 3], np.int64), "two_by_three")])


def test_an_integer_input_that_a_branch_reshapes_by_sets_a_shape():
    assert shape_feeding_inputs(reshape_in_branch_model()) == ("shape",)
    assert shape_feeding_inputs(size_from_branch_model()) == ("n",)


def scale_in_branch_model() -> onnx.ModelProto:
    """A branch multiplies x by the int64 input ``k``: a value, no shape."""
    then_g = _branch("then", [helper.make_node("Cast", ["k"], ["kf"], to=F),
                              helper.make_node("Mul", ["x", "kf"], ["then_out"])], "then_out")
    else_g = _branch("else", [helper.make_node("Identity", ["x"], ["else_out"])], "else_out")
    return _model(
        [helper.make_node("If", ["flag"], ["y"], then_branch=then_g, else_branch=else_g)],
        [helper.make_tensor_value_info("x", F, [1, 6]), helper.make_tensor_value_info("k", I64, [1]),
         helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", F, [1, 6])])


def test_integer_inputs_that_control_flow_reads_as_values_set_no_shape():
    assert shape_feeding_inputs(scale_in_branch_model()) == ()
    assert shape_feeding_inputs(if_model()) == ()  # the sample rate only picks the branch
    assert shape_feeding_inputs(loop_model(static_trips=False)) == ("trips",)  # a trip count is a count


def test_the_engine_invents_no_value_for_a_shape_read_in_a_branch(tmp_path):
    engine = Engine(reshape_in_branch_model(), EngineConfig(cache_dir=str(tmp_path), dynamic_batch=False))
    assert engine.warmed_up.startswith("skipped") and "shape set" in engine.warmed_up
    x = np.arange(6, dtype=np.float32).reshape(1, 6) - 2
    out = engine.run({"x": x, "shape": np.array([3, 2], np.int64), "flag": np.array(True)}, copy=True)
    np.testing.assert_array_equal(out["y"], np.maximum(x.reshape(3, 2), 0))


def data_reshape_and_branch_model() -> onnx.ModelProto:
    """x[1, 6] reshaped to ``s`` = [1, 6] on the data path, and ``s`` also read by the
    branches, which reshape a 1-D constant c[6] with it: there only [1, 6] is right, as
    [0, 6] would copy c's 6."""
    c = numpy_helper.from_array(np.arange(6, dtype=np.float32), "c_value")
    then_g = _branch("then", [helper.make_node("Constant", [], ["c"], value=c),
                              helper.make_node("Reshape", ["c", "s"], ["then_out"])], "then_out")
    else_g = _branch("else", [helper.make_node("Constant", [], ["c2"], value=c),
                              helper.make_node("Reshape", ["c2", "s"], ["e"]),
                              helper.make_node("Neg", ["e"], ["else_out"])], "else_out")
    return _model(
        [helper.make_node("Reshape", ["x", "s"], ["r"]),
         helper.make_node("If", ["flag"], ["b"], then_branch=then_g, else_branch=else_g),
         helper.make_node("Add", ["r", "b"], ["y"])],
        [helper.make_tensor_value_info("x", F, [1, 6]), helper.make_tensor_value_info("flag", TensorProto.BOOL, [1])],
        [helper.make_tensor_value_info("y", F, [1, 6])],
        [numpy_helper.from_array(np.array([1, 6], np.int64), "s")])


def test_a_shape_constant_that_a_branch_reads_is_not_changed_in_place():
    model = data_reshape_and_branch_model()
    dynamic, rewrites = make_batch_dynamic(model)
    assert len(rewrites) == 1
    inits = {t.name: numpy_helper.to_array(t) for t in dynamic.graph.initializer}
    assert inits["s"].tolist() == [1, 6] and inits["s__batch"].tolist() == [0, 6]
    for flag in (True, False):
        feed = {"x": np.arange(6, dtype=np.float32).reshape(1, 6), "flag": np.array([flag])}
        want = ort.InferenceSession(model.SerializeToString()).run(None, feed)[0]
        got = ort.InferenceSession(dynamic.SerializeToString()).run(None, feed)[0]
        np.testing.assert_array_equal(got, want)


def test_an_engine_keeps_the_weights_that_only_a_branch_reads(tmp_path):
    # Wa is read only inside the then-branch: the artefact must keep it.
    model = if_model()
    engine = Engine(model, EngineConfig(cache_dir=str(tmp_path)))
    x = np.random.default_rng(0).standard_normal((1, 8)).astype(np.float32)
    for sr in (16000, 8000):  # both branches
        feed = {"x": x, "sr": np.array(sr, np.int64)}
        want = ort.InferenceSession(model.SerializeToString()).run(None, feed)[0]
        np.testing.assert_allclose(engine.run(feed, copy=True)["prob"], want, rtol=1e-5, atol=1e-6)
