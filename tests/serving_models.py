"""Small generated models for serving tests: symbolic H/W, an integer input that sets a
shape, a mask whose dummy values break the batch check, and a model ONNX Runtime refuses
in part."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
C = 4


def _model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "serving", inputs, outputs, initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return model


def any_hw_model(*, seed: int = 0) -> onnx.ModelProto:
    """x[N, 4, H, W] -> Conv3x3 (pad 1) -> Relu -> Conv1x1 -> Relu -> y[N, 4, H, W]; H and W symbolic."""
    rng = np.random.default_rng(seed)
    w0 = numpy_helper.from_array((rng.standard_normal((C, C, 3, 3)) * 0.3).astype(np.float32), "w0")
    w1 = numpy_helper.from_array((rng.standard_normal((C, C, 1, 1)) * 0.3).astype(np.float32), "w1")
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c0"], name="conv0", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        helper.make_node("Conv", ["r0", "w1"], ["c1"], name="conv1"),
        helper.make_node("Relu", ["c1"], ["y"], name="relu1"),
    ]
    dims = ["N", C, "H", "W"]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)], [w0, w1])


def reshape_by_input_model() -> onnx.ModelProto:
    """x[1, 6] reshaped to the int64 input `shape` (2 values), then Relu: the shape input's
    values set the output's shape, so no value may be invented for it."""
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["t"], name="reshape"),
        helper.make_node("Relu", ["t"], ["y"], name="relu"),
    ]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6]),
                          helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])])


def mask_model() -> onnx.ModelProto:
    """y = x + 0 / (mask - 1) over a batch N: NaN where the int64 mask is 1 (what a 0/1 dummy mask of one
    column always is), x where it is a real value above 1."""
    zero = numpy_helper.from_array(np.zeros((1,), np.float32), "zero")
    one = numpy_helper.from_array(np.ones((1,), np.float32), "one")
    nodes = [
        helper.make_node("Cast", ["mask"], ["m"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("Sub", ["m", "one"], ["d"], name="sub"),
        helper.make_node("Div", ["zero", "d"], ["q"], name="div"),
        helper.make_node("Add", ["x", "q"], ["y"], name="add"),
    ]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3]),
                          helper.make_tensor_value_info("mask", TensorProto.INT64, ["N", 1])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], [zero, one])


def refused_model(*, seed: int = 0) -> onnx.ModelProto:
    """x[1, 4] float64 -> Tan -> Cast to float32 -> MatMul -> MatMul -> y. A valid model, but
    ONNX Runtime has no float64 Tan kernel on the CPU, so it refuses every segment that
    holds that first layer: the whole model (the cloud-only cut) fails to load, and the
    tails after it load."""
    rng = np.random.default_rng(seed)
    ws = [numpy_helper.from_array(rng.standard_normal((C, C)).astype(np.float32), f"w{i}") for i in range(2)]
    nodes = [
        helper.make_node("Tan", ["x"], ["t"], name="tan"),
        helper.make_node("Cast", ["t"], ["r"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("MatMul", ["r", "w0"], ["m0"], name="mm0"),
        helper.make_node("MatMul", ["m0", "w1"], ["y"], name="mm1"),
    ]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [1, C])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, C])], ws)
