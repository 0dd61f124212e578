"""INT8 and fp16 on real weights and real data: an MLP trained on scikit-learn's
digits, and a constant-folded zoo model from the onnx package."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from workers.quantize import quantize, to_fp16
from workers.testmodels import DIGITS_INPUT_NAME, DIGITS_OUTPUT_NAME, make_digits_mlp

ZOO = os.path.join(os.path.dirname(onnx.__file__), "backend/test/data/light")


@pytest.fixture(scope="module")
def digits():
    model, x_test, y_test = make_digits_mlp(seed=0)
    # Calibrate on one half of the held-out split and judge on the other.
    half = len(x_test) // 2
    return model, x_test[:half], x_test[half:], y_test[half:]


def _accuracy(model: onnx.ModelProto, x: np.ndarray, y: np.ndarray) -> float:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    probs = session.run([DIGITS_OUTPUT_NAME], {DIGITS_INPUT_NAME: x})[0]
    return float(np.mean(probs.argmax(axis=1) == y))


def test_digits_mlp_is_a_plain_float_graph(digits):
    model, _, x_eval, y_eval = digits
    assert {n.op_type for n in model.graph.node} == {"MatMul", "Add", "Relu", "Softmax"}
    assert _accuracy(model, x_eval, y_eval) > 0.9


def test_int8_agrees_with_fp32_on_held_out_digits(digits):
    model, x_calib, x_eval, y_eval = digits
    result = quantize(model, x_calib, eval_data=x_eval)
    stats = result.report.evaluation
    assert stats.num_samples == len(x_eval)
    assert stats.agreement >= 0.99 and stats.output(DIGITS_OUTPUT_NAME).metric == "top1"
    assert result.report.size_after_bytes < 0.5 * result.report.size_fp32_bytes
    # Agreement carries over to accuracy against the true labels.
    fp32_acc = _accuracy(model, x_eval, y_eval)
    int8_acc = _accuracy(result.model, x_eval, y_eval)
    assert abs(fp32_acc - int8_acc) <= 0.01


@pytest.mark.parametrize("method", ["minmax", "entropy", "percentile"])
@pytest.mark.parametrize("per_channel", [False, True])
def test_every_calibration_method_runs(digits, method, per_channel):
    model, x_calib, x_eval, _ = digits
    result = quantize(model, x_calib, eval_data=x_eval, method=method, per_channel=per_channel)
    assert result.report.method == method and result.report.per_channel is per_channel
    assert result.report.evaluation.agreement >= 0.98


def _weight_dequantizers(model: onnx.ModelProto, op_type: str) -> list[onnx.NodeProto]:
    """The DequantizeLinear feeding each ``op_type`` node's weight (input 1), if any."""
    producer = {o: n for n in model.graph.node for o in n.output}
    found = []
    for node in model.graph.node:
        if node.op_type == op_type:
            dq = producer.get(node.input[1])
            if dq is not None and dq.op_type == "DequantizeLinear":
                found.append(dq)
    return found


def test_per_channel_gives_each_output_channel_its_scale(digits):
    model, x_calib, _, _ = digits
    for per_channel in (False, True):
        result = quantize(model, x_calib, per_channel=per_channel)
        inits = {t.name: t for t in result.model.graph.initializer}
        dqs = _weight_dequantizers(result.model, "MatMul")
        assert len(dqs) == 3
        for dq in dqs:
            weight, scale = inits[dq.input[0]], inits[dq.input[1]]
            assert weight.data_type == onnx.TensorProto.INT8
            expected = [weight.dims[1]] if per_channel else []
            assert list(scale.dims) == expected


def test_fp16_on_digits_reports_a_small_error(digits):
    model, _, x_eval, y_eval = digits
    result = to_fp16(model, x_eval)
    stats = result.report.evaluation
    assert stats.agreement >= 0.99 and stats.output(DIGITS_OUTPUT_NAME).metric == "top1"
    assert stats.output(DIGITS_OUTPUT_NAME).max_abs_error < 1e-2
    assert abs(_accuracy(result.model, x_eval, y_eval) - _accuracy(model, x_eval, y_eval)) <= 0.01


@pytest.mark.slow
def test_zoo_squeezenet_is_folded_then_quantised(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.random((3, 3, 224, 224), dtype=np.float32)
    result = quantize(os.path.join(ZOO, "light_squeezenet.onnx"), images)
    report = result.report
    assert report.folded_constants
    assert report.opset_before == 9 and report.opset_after >= 13
    # The file as shipped is tiny (weights are generated); folded fp32 is the baseline.
    assert report.size_original_bytes < 100_000 < report.size_after_bytes
    assert report.size_after_bytes < 0.4 * report.size_fp32_bytes
    assert len(_weight_dequantizers(result.model, "Conv")) == 26  # every Conv weight is INT8
    assert report.calibration.num_samples == 3  # fixed batch of 1: one run per image
    out = tmp_path / "squeezenet.int8.onnx"
    result.save(out)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert session.run(None, {"data_0": images[:1]})[0].shape[:2] == (1, 1000)
