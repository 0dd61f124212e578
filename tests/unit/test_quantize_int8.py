"""quantize() on hand-built models, run in ONNX Runtime: per-channel weights by default,
agreement in the metric that fits each output, models quantised already, and inputs
that only an If branch reads."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from workers.agreement import top1_agreement
from workers.quantize import QuantizeConfigError, QuantizeReport, quantize, to_fp16



def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _model(nodes, inputs, outputs, inits, opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "m", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    onnx.checker.check_model(model)
    return model


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feed)


def _conv_gemm_matmul() -> onnx.ModelProto:
    """X[N,3,8,8] -> Conv(8) -> Relu -> Flatten -> Gemm(6, transB) -> MatMul(7) -> Y."""
    rng = _rng()
    inits = [
        numpy_helper.from_array((rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32), "Wc"),
        numpy_helper.from_array((rng.standard_normal((6, 128)) * 0.1).astype(np.float32), "Wg"),
        numpy_helper.from_array((rng.standard_normal(6) * 0.1).astype(np.float32), "Bg"),
        numpy_helper.from_array(rng.standard_normal((6, 7)).astype(np.float32), "Wm"),
    ]
    nodes = [
        helper.make_node("Conv", ["X", "Wc"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Flatten", ["r"], ["f"]),
        helper.make_node("Gemm", ["f", "Wg", "Bg"], ["g"], transB=1),
        helper.make_node("MatMul", ["g", "Wm"], ["Y"]),
    ]
    return _model(nodes, [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 3, 8, 8])],
                  [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, 7])], inits)


def _weight_scales(model: onnx.ModelProto) -> dict[str, list[int]]:
    """op type -> dims of the scale of the DequantizeLinear feeding its weight."""
    inits = {t.name: t for t in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    found = {}
    for node in model.graph.node:
        if node.op_type in ("Conv", "Gemm", "MatMul"):
            dq = producer[node.input[1]]
            assert dq.op_type == "DequantizeLinear"
            assert inits[dq.input[0]].data_type == TensorProto.INT8
            found[node.op_type] = list(inits[dq.input[1]].dims)
    return found


def test_weights_get_one_scale_per_output_channel_by_default():
    model = _conv_gemm_matmul()
    x = _rng(5).random((16, 3, 8, 8), dtype=np.float32)
    result = quantize(model, x)
    assert result.report.per_channel
    # Conv [8,3,3,3] and Gemm [6,128] (transB) scale along axis 0, MatMul [6,7] along axis 1.
    assert _weight_scales(result.model) == {"Conv": [8], "Gemm": [6], "MatMul": [7]}
    per_tensor = quantize(model, x, per_channel=False)
    assert not per_tensor.report.per_channel
    assert _weight_scales(per_tensor.model) == {"Conv": [], "Gemm": [], "MatMul": []}


def _blob_images(n: int, seed: int) -> np.ndarray:
    """[n,1,32,32] images with four bright rectangles each, and a little noise."""
    rng = np.random.default_rng(seed)
    x = np.zeros((n, 1, 32, 32), np.float32)
    for i in range(n):
        for _ in range(4):
            cy, cx = rng.integers(3, 29, 2)
            h, w = rng.integers(2, 5, 2)
            x[i, 0, cy - h:cy + h, cx - w:cx + w] = rng.uniform(0.6, 1.0)
    return x + rng.normal(0, 0.05, x.shape).astype(np.float32)


def _detector() -> onnx.ModelProto:
    """A text-detector-like net: two Convs and a Sigmoid give a probability map
    [N,1,32,32] that is high over the bright rectangles; plus a box-like regression
    [N,4] (ReduceMean of the features, times a large scale)."""
    rng = np.random.default_rng(1)
    inits = [
        numpy_helper.from_array((np.abs(rng.standard_normal((4, 1, 3, 3))) * 0.2 + 0.05).astype(np.float32), "W1"),
        numpy_helper.from_array(np.full(4, -0.2, np.float32), "B1"),
        numpy_helper.from_array((np.abs(rng.standard_normal((1, 4, 3, 3))) * 0.3 + 0.05).astype(np.float32), "W2"),
        numpy_helper.from_array(np.array([-2.0], np.float32), "B2"),
        numpy_helper.from_array(np.array([4.0], np.float32), "K"),
        numpy_helper.from_array(np.array([[100.0, 200.0, 300.0, 400.0]], np.float32), "S"),
    ]
    nodes = [
        helper.make_node("Conv", ["X", "W1", "B1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "W2", "B2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Mul", ["c2", "K"], ["c3"]),
        helper.make_node("Sigmoid", ["c3"], ["map"]),
        helper.make_node("ReduceMean", ["r1"], ["pooled"], axes=[2, 3], keepdims=0),
        helper.make_node("Mul", ["pooled", "S"], ["boxes"]),
    ]
    return _model(nodes, [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 1, 32, 32])],
                  [helper.make_tensor_value_info("map", TensorProto.FLOAT, [None, 1, 32, 32]),
                   helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [None, 4])],
                  inits, opset=17)


def test_a_detection_map_is_judged_by_iou_and_every_output_is_reported():
    model, x_eval = _detector(), _blob_images(16, seed=2)
    fp32_map = _run(model, {"X": x_eval})[0]
    assert 0.05 < float(np.mean(fp32_map > 0.5)) < 0.5  # a map with regions on and off
    result = quantize(model, _blob_images(32, seed=3), eval_data=x_eval)
    stats = result.report.evaluation
    assert [o.output_name for o in stats.outputs] == ["map", "boxes"]
    dense, boxes = stats.output("map"), stats.output("boxes")
    assert dense.metric == "iou" and dense.threshold == 0.5 and dense.value > 0.9
    assert boxes.metric == "rel_l2" and 0.0 < boxes.value < 0.1
    assert boxes.agreement == pytest.approx(1.0 - boxes.value)
    worst = min((dense, boxes), key=lambda o: o.agreement)
    assert stats.worst_output == worst.output_name and stats.agreement == worst.agreement
    # One arg-max over the whole map, the measure this replaces, calls the same fine
    # map a failure: the saturated regions tie, and INT8 picks another pixel of them.
    int8_map = _run(result.model, {"X": x_eval})[0]
    assert top1_agreement(fp32_map, int8_map) < 0.5


def test_a_metric_can_be_named_per_output():
    model, x = _detector(), _blob_images(8, seed=4)
    stats = quantize(model, x, metrics={"map": "rel_l2"}).report.calibration
    assert stats.output("map").metric == "rel_l2" and stats.output("boxes").metric == "rel_l2"
    with pytest.raises(QuantizeConfigError, match="'psnr' is not one of") as info:
        quantize(model, x, metrics={"map": "psnr"})
    assert info.value.field_name == "metrics"
    with pytest.raises(QuantizeConfigError, match="output 'scores', which"):
        quantize(model, x, metrics={"scores": "iou"})


def test_a_model_quantised_already_passes_through_with_a_note():
    model = _conv_gemm_matmul()
    once = quantize(model, _rng(5).random((8, 3, 8, 8), dtype=np.float32)).model
    again = quantize(once, _rng(5).random((8, 3, 8, 8), dtype=np.float32))
    report = again.report
    assert report.kind == "already_quantized" and report.method is None
    assert again.model.SerializeToString() == once.SerializeToString()
    assert "quantised already" in report.note and "DequantizeLinear x" in report.note
    assert report.calibration is None and report.size_after_bytes == once.ByteSize()
    assert QuantizeReport.from_json(report.to_json()) == report
    fp16 = to_fp16(once)
    assert fp16.report.kind == "already_quantized" and "float16 scales" in fp16.report.note
    assert fp16.model.SerializeToString() == once.SerializeToString()


def test_a_dynamically_quantised_model_passes_through_and_still_runs():
    """MatMulInteger on uint8 inputs, as onnxruntime's dynamic quantiser writes it."""
    w = numpy_helper.from_array(_rng().integers(-20, 20, (4, 3)).astype(np.int8), "Wq")
    nodes = [helper.make_node("MatMulInteger", ["Xq", "Wq"], ["Y"])]
    model = _model(nodes, [helper.make_tensor_value_info("Xq", TensorProto.UINT8, [None, 4])],
                   [helper.make_tensor_value_info("Y", TensorProto.INT32, [None, 3])], [w])
    result = quantize(model, np.zeros((2, 4), np.uint8))
    assert result.report.kind == "already_quantized" and "MatMulInteger x1" in result.report.note
    assert _run(result.model, {"Xq": np.ones((1, 4), np.uint8)})[0].shape == (1, 3)


def _if_model() -> onnx.ModelProto:
    """Y = X @ W + Z if cond else X @ W - Z: Z is read only inside the branches."""
    w = numpy_helper.from_array(_rng().standard_normal((16, 5)).astype(np.float32), "W")
    then_branch = helper.make_graph(
        [helper.make_node("Add", ["h", "Z"], ["t"])], "then", [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    else_branch = helper.make_graph(
        [helper.make_node("Sub", ["h", "Z"], ["e"])], "else", [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("MatMul", ["X", "W"], ["h"]),
             helper.make_node("If", ["cond"], ["Y"], then_branch=then_branch,
                              else_branch=else_branch)]
    inputs = [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 16]),
              helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
              helper.make_tensor_value_info("Z", TensorProto.FLOAT, [None, 5])]
    return _model(nodes, inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, 5])],
                  [w])


def test_an_input_read_only_inside_an_if_branch_survives():
    model = _if_model()
    rng = _rng(5)
    feeds = [{"X": rng.random((8, 16), dtype=np.float32), "cond": np.array(flag),
              "Z": rng.random((8, 5), dtype=np.float32)} for flag in (True, False)]
    result = quantize(model, feeds)
    assert [i.name for i in result.model.graph.input] == ["X", "cond", "Z"]
    feed = {"X": rng.random((4, 16), dtype=np.float32), "cond": np.array(False),
            "Z": np.full((4, 5), 100.0, np.float32)}
    ref, got = _run(model, feed)[0], _run(result.model, feed)[0]
    assert np.allclose(got, ref, atol=0.5)  # the branch really subtracts Z (100)
    assert result.report.calibration.num_samples == 16


def test_a_model_whose_compute_is_all_inside_an_if_says_nothing_was_quantised():
    """Static quantisation does not enter If bodies: the result computes in fp32, and
    the report says so instead of letting agreement 1.0 stand for INT8."""
    w = numpy_helper.from_array(_rng().standard_normal((16, 5)).astype(np.float32), "W")
    then_branch = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["t"])], "then", [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    else_branch = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["m"]), helper.make_node("Neg", ["m"], ["e"])],
        "else", [], [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    model = _model([helper.make_node("If", ["cond"], ["Y"], then_branch=then_branch,
                                     else_branch=else_branch)],
                   [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 16]),
                    helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                   [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, 5])], [w])
    feeds = [{"X": _rng(5).random((4, 16), dtype=np.float32), "cond": np.array(True)}]
    report = quantize(model, feeds).report
    assert report.kind == "int8_qdq" and report.calibration.agreement == 1.0
    assert report.note.startswith("no op of m was quantised") and "inside If bodies" in report.note
    # Where something was quantised there is no note.
    assert quantize(_if_model(), [{**feeds[0], "Z": np.zeros((4, 5), np.float32)}]).report.note is None


def test_a_report_stored_with_top1_agreement_still_reads():
    report = quantize(_conv_gemm_matmul(), _rng(5).random((4, 3, 8, 8), dtype=np.float32)).report
    stored = json.loads(report.to_json())
    stored.pop("note")
    stored["calibration"] = {"num_samples": 4, "output_name": "Y", "top1_agreement": 0.75,
                             "max_abs_error": 0.5, "mean_abs_error": 0.25}
    read = QuantizeReport.from_json(json.dumps(stored))
    assert read.note is None
    assert read.calibration.worst_output == "Y" and read.calibration.agreement == 0.75
    assert read.calibration.output("Y").metric == "top1"
