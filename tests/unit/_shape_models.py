"""Tiny models, made with onnx.helper, for the shape features: symbolic dims, a batch lost
through Resize, a rank lost by ONNX inference, an op of another domain, and integer
inputs that feed Reshape."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

_OPSET = [helper.make_opsetid("", 17)]


def _w(name: str, *shape: int, seed: int = 0) -> onnx.TensorProto:
    rng = np.random.default_rng(seed)
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)


def _model(nodes, inputs, outputs, inits, name, opsets=_OPSET) -> onnx.ModelProto:
    m = helper.make_model(helper.make_graph(nodes, name, inputs, outputs, initializer=inits),
                          opset_imports=list(opsets), producer_name="tests")
    m.ir_version = 8
    return m


def conv_resize() -> onnx.ModelProto:
    """x[N,3,H,W] -> Conv -> Resize x2 -> Relu -> Conv -> GlobalAveragePool -> Flatten -> Gemm."""
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Resize", ["c1", "", "scales"], ["r"], mode="nearest", name="resize"),
        helper.make_node("Relu", ["r"], ["a"], name="relu"),
        helper.make_node("Conv", ["a", "w2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
        helper.make_node("GlobalAveragePool", ["c2"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "w3"], ["y"], transB=1, name="fc"),
    ]
    inits = [_w("w1", 4, 3, 3, 3), numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
             _w("w2", 6, 4, 3, 3, seed=1), _w("w3", 5, 6, seed=2)]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])], inits, "conv_resize")


def sequence() -> onnx.ModelProto:
    """ids[batch, seq] int64 -> embedding Gather -> MatMul -> Softmax -> MatMul: symbolic length."""
    nodes = [
        helper.make_node("Gather", ["emb", "ids"], ["e"], name="embed"),
        helper.make_node("MatMul", ["e", "w1"], ["h"], name="proj"),
        helper.make_node("Softmax", ["h"], ["s"], axis=-1, name="softmax"),
        helper.make_node("MatMul", ["s", "w2"], ["y"], name="out"),
    ]
    inits = [_w("emb", 16, 8), _w("w1", 8, 8, seed=1), _w("w2", 8, 4, seed=2)]
    return _model(nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 4])], inits, "sequence")


def reshape_by_input(shape_type: int = TensorProto.INT64) -> onnx.ModelProto:
    """x[N,12] -> MatMul -> Reshape(to the values of input ``shape``, of symbolic length) -> Relu
    -> ReduceSum -> out: ONNX inference loses the rank after the Reshape."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm")]
    shape_in = "shape"
    if shape_type != TensorProto.INT64:
        nodes.append(helper.make_node("Cast", ["shape"], ["shape64"], to=TensorProto.INT64, name="cast"))
        shape_in = "shape64"
    nodes += [
        helper.make_node("Reshape", ["h", shape_in], ["r"], name="reshape"),
        helper.make_node("Relu", ["r"], ["a"], name="relu"),
        helper.make_node("Mul", ["a", "a"], ["m"], name="square"),
        helper.make_node("ReduceSum", ["m", "axes"], ["y"], keepdims=0, name="sum"),
    ]
    inits = [_w("w1", 12, 12), numpy_helper.from_array(np.array([-1], np.int64), "axes")]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 12]),
                          helper.make_tensor_value_info("shape", shape_type, ["k"])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits, "reshape_by_input")


def ms_gelu() -> onnx.ModelProto:
    """x[N,8] -> MatMul -> com.microsoft Gelu -> MatMul -> Relu -> MatMul: ONNX inference knows
    no com.microsoft op, ORT's symbolic inference does."""
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        helper.make_node("Gelu", ["h"], ["g"], domain="com.microsoft", name="gelu"),
        helper.make_node("MatMul", ["g", "w2"], ["h2"], name="mm2"),
        helper.make_node("Relu", ["h2"], ["a"], name="relu"),
        helper.make_node("MatMul", ["a", "w3"], ["y"], name="mm3"),
    ]
    inits = [_w("w1", 8, 16), _w("w2", 16, 16, seed=1), _w("w3", 16, 3, seed=2)]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], inits, "ms_gelu",
                  opsets=[*_OPSET, helper.make_opsetid("com.microsoft", 1)])


def save(model: onnx.ModelProto, path) -> str:
    onnx.save_model(model, str(path))
    return str(path)


def folded_batch() -> onnx.ModelProto:
    """x[N,4,8] -> Reshape(-1, 8) -> MatMul -> Relu -> Reshape(-1, 4, 8) -> MatMul: the batch folds
    into rows (N*4, 8) in the middle, as transformers reshape to (N*seq, hidden)."""
    nodes = [
        helper.make_node("Reshape", ["x", "rows"], ["r"], name="fold"),
        helper.make_node("MatMul", ["r", "w1"], ["h"], name="mm1"),
        helper.make_node("Relu", ["h"], ["a"], name="relu"),
        helper.make_node("Reshape", ["a", "back"], ["b"], name="unfold"),
        helper.make_node("MatMul", ["b", "w2"], ["y"], name="mm2"),
    ]
    inits = [numpy_helper.from_array(np.array([-1, 8], np.int64), "rows"), _w("w1", 8, 8),
             numpy_helper.from_array(np.array([-1, 4, 8], np.int64), "back"), _w("w2", 8, 2, seed=1)]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 8])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 2])], inits, "folded_batch")


def recurrent_state() -> onnx.ModelProto:
    """x[N,4] and a state h[2,N,4] in; the new state and y[N,3] out. The state's batch sits
    on axis 1, and a Reshape to (-1, 8) loses it for ONNX inference."""
    nodes = [
        helper.make_node("Unsqueeze", ["x", "zero"], ["xs"], name="lift"),
        helper.make_node("Add", ["h", "xs"], ["s"], name="mix"),
        helper.make_node("Tanh", ["s"], ["h_out"], name="state"),
        helper.make_node("Transpose", ["h_out"], ["t"], perm=[1, 0, 2], name="batch_first"),
        helper.make_node("Reshape", ["t", "rows"], ["flat"], name="flatten"),
        helper.make_node("MatMul", ["flat", "w"], ["y"], name="head"),
    ]
    inits = [numpy_helper.from_array(np.array([0], np.int64), "zero"),
             numpy_helper.from_array(np.array([-1, 8], np.int64), "rows"), _w("w", 8, 3)]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
                          helper.make_tensor_value_info("h", TensorProto.FLOAT, [2, "N", 4])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3]),
                   helper.make_tensor_value_info("h_out", TensorProto.FLOAT, [2, "N", 4])], inits, "recurrent_state")
