"""quantize() and to_fp16() on small hand-built models, and their errors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from workers.errors import WorkerError
from workers.agreement import summarize
from workers.quantize import (
    CalibrationDataError,
    OutputAgreement,
    QuantizeConfigError,
    QuantizeModelError,
    QuantizeReport,
    prepare_model,
    quantize,
    to_fp16,
)

N_IN, N_HIDDEN, N_OUT = 16, 32, 5


def _mlp(seed: int = 0, *, weights_by_constant_of_shape: bool = False) -> onnx.ModelProto:
    """X[N,16] -> MatMul -> Add -> Relu -> MatMul -> Softmax -> Y[N,5]."""
    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((N_IN, N_HIDDEN)).astype(np.float32) * 0.5
    b1 = rng.standard_normal(N_HIDDEN).astype(np.float32) * 0.1
    w2 = rng.standard_normal((N_HIDDEN, N_OUT)).astype(np.float32) * 0.5
    nodes = [
        helper.make_node("MatMul", ["X", "W1"], ["h"]),
        helper.make_node("Add", ["h", "B1"], ["a"]),
        helper.make_node("Relu", ["a"], ["r"]),
        helper.make_node("MatMul", ["r", "W2"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["Y"], axis=-1),
    ]
    inits = [numpy_helper.from_array(b1, "B1"), numpy_helper.from_array(w2, "W2")]
    if weights_by_constant_of_shape:
        # The zoo models' trick: the weight is computed at load from its shape.
        inits.append(numpy_helper.from_array(np.array(w1.shape, np.int64), "W1_shape"))
        value = helper.make_tensor("v", TensorProto.FLOAT, [1], [0.05])
        nodes.insert(0, helper.make_node("ConstantOfShape", ["W1_shape"], ["W1"], value=value))
    else:
        inits.append(numpy_helper.from_array(w1, "W1"))
    graph = helper.make_graph(
        nodes, "tiny_mlp",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, N_IN])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, N_OUT])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _data(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).random((n, N_IN), dtype=np.float32)


def _quantized_weights(model: onnx.ModelProto) -> set[str]:
    """Names of weights feeding a DequantizeLinear as int8/uint8 initializers."""
    inits = {t.name: t for t in model.graph.initializer}
    return {
        n.input[0].removesuffix("_quantized") for n in model.graph.node
        if n.op_type == "DequantizeLinear" and n.input[0] in inits
        and inits[n.input[0]].data_type in (TensorProto.INT8, TensorProto.UINT8)
    }


def test_int8_qdq_reports_accuracy_and_size():
    result = quantize(_mlp(), _data(64), eval_data=_data(64, seed=2))
    report = result.report
    assert report.kind == "int8_qdq" and report.method == "minmax"
    assert not report.folded_constants
    assert {"QuantizeLinear", "DequantizeLinear"} <= {n.op_type for n in result.model.graph.node}
    assert {"W1", "W2"} <= _quantized_weights(result.model)  # stored as 8-bit
    assert report.calibration.num_samples == 64 and report.evaluation.num_samples == 64
    [y] = report.evaluation.outputs
    assert y.output_name == "Y" and y.metric == "top1" and y.value >= 0.9
    assert report.evaluation.worst_output == "Y" and report.evaluation.agreement == y.value
    assert 0.0 <= y.mean_abs_error <= y.max_abs_error < 0.2
    # Per-tensor scales cost one number per weight: even this tiny model shrinks.
    per_tensor = quantize(_mlp(), _data(64), per_channel=False).report
    assert not per_tensor.per_channel
    assert per_tensor.size_after_bytes < per_tensor.size_fp32_bytes


def test_constant_of_shape_weights_are_folded_before_quantising():
    model = _mlp(weights_by_constant_of_shape=True)
    result = quantize(model, _data(32))
    assert result.report.folded_constants
    assert "W1" in _quantized_weights(result.model)
    assert "ConstantOfShape" not in {n.op_type for n in result.model.graph.node}
    # Without folding the quantiser cannot see W1 as a weight.
    unfolded = quantize(model, _data(32), fold_constants=False)
    assert "W1" not in _quantized_weights(unfolded.model)


def test_prepare_model_raises_old_opsets_to_13():
    old = _mlp()
    old.opset_import[0].version = 11
    old.graph.node[-1].attribute[0].i = 1  # opset 11 Softmax: axis 1 over 2-D input
    prepared = prepare_model(old)
    assert prepared.opset_import[0].version >= 13


def test_fp16_runs_on_cpu_and_keeps_io_float32():
    x = _data(50)
    result = to_fp16(_mlp(), x)
    model = result.model
    assert model.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert model.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert any(t.data_type == TensorProto.FLOAT16 for t in model.graph.initializer)
    stats = result.report.evaluation
    assert result.report.kind == "fp16" and result.report.calibration is None
    assert stats.num_samples == 50 and stats.agreement == 1.0
    assert stats.output("Y").metric == "top1"
    assert 0.0 < stats.output("Y").max_abs_error < 1e-2
    assert result.report.size_ratio < 0.7


def test_fp16_without_io_casts_takes_float16_inputs():
    result = to_fp16(_mlp(), keep_io_types=False)
    assert result.model.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    assert result.report.evaluation is None


def test_calibration_data_forms():
    model = _mlp()
    x = _data(40)
    as_dicts = [{"X": x[i:i + 10]} for i in range(0, 40, 10)]
    one_dict = {"X": x}
    for data in (x, as_dicts, iter(as_dicts), one_dict):
        assert quantize(model, data).report.calibration.num_samples == 40
    # An array is split into runs of calibration_batch_size rows, the last one shorter.
    assert quantize(model, x, calibration_batch_size=16).report.calibration.num_samples == 40


def test_report_json_round_trip():
    report = quantize(_mlp(), _data(20), eval_data=_data(10)).report
    assert QuantizeReport.from_json(report.to_json()) == report
    stats = summarize([OutputAgreement(output_name="y", metric="rel_l2", value=0.5,
                                       agreement=0.5, threshold=None, num_samples=3,
                                       max_abs_error=0.5, mean_abs_error=0.25)], num_samples=3)
    fp16 = QuantizeReport(kind="fp16", method=None, per_channel=False, folded_constants=False,
                          opset_before=9, opset_after=13, size_original_bytes=10,
                          size_fp32_bytes=100, size_after_bytes=50, calibration=None,
                          evaluation=stats)
    assert QuantizeReport.from_json(fp16.to_json()) == fp16


@pytest.mark.parametrize("empty", [np.zeros((0, N_IN), np.float32), [], iter(())])
def test_empty_calibration_data_is_refused(empty):
    with pytest.raises(CalibrationDataError) as info:
        quantize(_mlp(), empty)
    assert "calibration_data is empty" in str(info.value)
    assert info.value.num_samples == 0
    assert isinstance(info.value, WorkerError)


def test_non_onnx_file_is_refused(tmp_path):
    bad = tmp_path / "model.onnx"
    bad.write_text("this is not a protobuf, just text\n" * 10)
    with pytest.raises(QuantizeModelError) as info:
        quantize(bad, _data(8))
    assert info.value.stage == "load" and str(bad) in str(info.value)
    assert "not a readable ONNX model" in str(info.value) or "no nodes" in str(info.value)


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(QuantizeModelError, match="does not exist"):
        to_fp16(tmp_path / "absent.onnx")


def test_wrong_input_names_and_rank_are_refused():
    with pytest.raises(CalibrationDataError, match=r"takes \['X'\]"):
        quantize(_mlp(), [{"input": _data(4)}])
    with pytest.raises(CalibrationDataError, match="rank 2") as info:
        quantize(_mlp(), [{"X": _data(4)[0]}])
    assert info.value.input_name == "X"


def test_array_for_a_multi_input_model_is_refused():
    model = _mlp()
    model.graph.input.append(helper.make_tensor_value_info("extra", TensorProto.FLOAT, [None, 1]))
    model.graph.node.append(helper.make_node("Relu", ["extra"], ["Z"]))
    model.graph.output.append(helper.make_tensor_value_info("Z", TensorProto.FLOAT, [None, 1]))
    with pytest.raises(CalibrationDataError, match="has 2 inputs"):
        quantize(model, _data(4))


def test_histogram_methods_need_equal_runs():
    runs = [{"X": _data(4)}, {"X": _data(3)}]
    with pytest.raises(CalibrationDataError, match="same shape"):
        quantize(_mlp(), runs, method="entropy")
    # An array is cut into equal runs for them, so it just works.
    result = quantize(_mlp(), _data(70), method="percentile", calibration_batch_size=32)
    assert result.report.calibration.num_samples == 64


@pytest.mark.parametrize(
    "kwargs, field_name",
    [
        ({"method": "kl"}, "method"),
        ({"activation_type": "int4"}, "activation_type"),
        ({"percentile": 0.0}, "percentile"),
        ({"calibration_batch_size": 0}, "calibration_batch_size"),
        ({"output_name": "nope"}, "output_name"),
    ],
)
def test_bad_options_name_the_field(kwargs, field_name):
    with pytest.raises(QuantizeConfigError) as info:
        quantize(_mlp(), _data(8), **kwargs)
    assert info.value.field_name == field_name
    assert field_name in str(info.value)


def test_model_of_the_wrong_type_is_refused():
    with pytest.raises(QuantizeConfigError, match="onnx.ModelProto"):
        quantize(b"bytes are not accepted", _data(8))
