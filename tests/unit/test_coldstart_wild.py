"""Artefacts of models that real weights exposed: weights inside If branches, and a
model whose fixed batch of 1 cannot be made symbolic."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import uses_external_data

from tests.control_flow_models import if_model
from workers import coldstart
from workers.engine import Engine, EngineConfig


def _subgraph_initializers(model: onnx.ModelProto):
    for node in model.graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from a.g.initializer


def test_if_branch_weights_survive_the_artefact_round_trip(tmp_path, monkeypatch):
    # if_model's weights are small: a low threshold makes ORT save every one of them
    # (outer and inside both branches) to its external file, as it does for real sizes.
    monkeypatch.setattr(coldstart, "_EXTERNAL_MIN_BYTES", 16)
    model = if_model()
    cfg = EngineConfig(cache_dir=str(tmp_path), provider="cpu")
    eng = Engine(model, cfg)
    art_dir = eng.artefact.directory
    saved = onnx.load(os.path.join(art_dir, "model.onnx"), load_external_data=False)
    branch_inits = list(_subgraph_initializers(saved))
    assert branch_inits and not any(uses_external_data(t) for t in branch_inits)
    assert any(uses_external_data(t) for t in saved.graph.initializer)
    assert sorted(os.listdir(art_dir)) == ["meta.json", "model.onnx", "weights.bin"]

    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((1, 8)).astype(np.float32)
    for sr in (16000, 8000):  # both branches
        feed = {"x": x, "sr": np.array(sr, np.int64)}
        np.testing.assert_allclose(eng.run(feed)["prob"], ref.run(["prob"], feed)[0], rtol=1e-5, atol=1e-6)
    # a second engine reloads the cached artefact
    again = Engine(model, cfg)
    assert again.artefact.directory == art_dir
    feed = {"x": x, "sr": np.array(8000, np.int64)}
    np.testing.assert_allclose(again.run(feed)["prob"], ref.run(["prob"], feed)[0], rtol=1e-5, atol=1e-6)


def _batch_one_by_construction() -> onnx.ModelProto:
    """Batch 1 that the rewrite cannot free: a Reshape's leading 1 is not the batch
    (its input's dim 0 is the transposed 4), so 0 ("copy dim 0") makes it 4, and the
    Add against a [2, 4, 6] initializer no longer broadcasts."""
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2]),
        helper.make_node("Reshape", ["t", "shape"], ["r"], name="fold"),
        helper.make_node("Add", ["r", "bias"], ["y"], name="bias_add"),
    ]
    inits = [
        numpy_helper.from_array(np.array([1, 4, 6], np.int64), "shape"),
        numpy_helper.from_array(np.arange(48, dtype=np.float32).reshape(2, 4, 6), "bias"),
    ]
    graph = helper.make_graph(
        nodes, "batch_one", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 6])], initializer=inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_model_that_breaks_when_batch_is_symbolic_is_served_as_given(tmp_path, caplog):
    model = _batch_one_by_construction()
    dyn, rewrites = coldstart.make_batch_dynamic(model)
    assert rewrites  # the rewrite applies, and ORT refuses what it made
    try:
        ort.InferenceSession(dyn.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - ORT's error types are not public
        assert "Incompatible dimensions" in str(e)
    else:
        raise AssertionError("the symbolic-batch model was expected not to load")

    with caplog.at_level("INFO", logger="workers.coldstart"):
        eng = Engine(model, EngineConfig(cache_dir=str(tmp_path), provider="cpu"))
    art = eng.artefact
    assert not art.batch_safe and not eng.batch_safe and art.batch_rewrites == ()
    assert "symbolic batch" in art.batch_reason and "Incompatible dimensions" in art.batch_reason
    assert any("batching is unsafe" in r.getMessage() and "symbolic batch" in r.getMessage() for r in caplog.records)
    x = np.random.default_rng(1).standard_normal((1, 4, 6)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(eng.run({"x": x})["y"], ref, rtol=1e-6)


def _tail_with_shape_vector() -> onnx.ModelProto:
    """A tail whose boundary holds the batch size as an int32 vector ``n`` (what a head
    computes with Shape and Slice): ``y = Reshape(h, concat(n, [2, 2]))``."""
    nodes = [
        helper.make_node("Cast", ["n"], ["n64"], to=TensorProto.INT64),
        helper.make_node("Concat", ["n64", "rest"], ["shape"], axis=0),
        helper.make_node("Reshape", ["h", "shape"], ["r"]),
        helper.make_node("Relu", ["r"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "shape_vector_tail",
        [helper.make_tensor_value_info("n", TensorProto.INT32, [1]),
         helper.make_tensor_value_info("h", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, 2])],
        initializer=[numpy_helper.from_array(np.array([2, 2], np.int64), "rest")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_tail_with_a_shape_vector_warms_up_on_the_heads_outputs_as_they_are(tmp_path):
    tail = _tail_with_shape_vector()
    rng = np.random.default_rng(2)
    h = rng.standard_normal((3, 4)).astype(np.float32)
    samples = {"n": np.array([3], np.int32), "h": h}  # the head's outputs on a batch of 3
    eng = Engine(tail, EngineConfig(cache_dir=str(tmp_path), provider="cpu"), sample_inputs=samples)
    assert eng.warmed_up == "samples"
    assert not eng.batch_safe and "n" in eng.batch_reason and "set shapes" in eng.batch_reason
    x = rng.standard_normal((3, 4)).astype(np.float32)  # a request from the head at the samples' batch
    out = eng.run({"n": np.array([3], np.int32), "h": x})["y"]
    np.testing.assert_array_equal(out, np.maximum(x.reshape(3, 2, 2), 0))
