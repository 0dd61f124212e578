"""Tiny models with known structure for the accuracy table's tests (onnx.helper, seeded)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _save(nodes, inputs, outputs, inits, path: str) -> str:
    g = helper.make_graph(nodes, "acc", inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, path)
    return path


def conv_model(path: str, size: int = 16) -> str:
    """Image in ([N, 3, S, S]), three convolutions, a 6-channel map out (rel_l2 metric).
    Chain points after each convolution: the boundaries are [N, 8, S, S] feature maps."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32)
    w2 = (rng.standard_normal((8, 8, 3, 3)) * 0.2).astype(np.float32)
    w3 = (rng.standard_normal((6, 8, 1, 1)) * 0.3).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("Conv", ["r2", "w3"], ["y"])]
    return _save(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, size, size])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 6, size, size])],
                 [numpy_helper.from_array(w, n) for w, n in ((w1, "w1"), (w2, "w2"), (w3, "w3"))], path)


def mlp_model(path: str) -> str:
    """A vector in ([N, 16]), two Gemm layers and a softmax over 10 classes (top1 metric)."""
    rng = np.random.default_rng(1)
    w1 = rng.standard_normal((16, 32)).astype(np.float32)
    w2 = rng.standard_normal((32, 10)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["v", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["logits"]), helper.make_node("Softmax", ["logits"], ["p"], axis=1)]
    return _save(nodes, [helper.make_tensor_value_info("v", TensorProto.FLOAT, ["N", 16])],
                 [helper.make_tensor_value_info("p", TensorProto.FLOAT, ["N", 10])],
                 [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")], path)


def images(n: int = 4, size: int = 16) -> np.ndarray:
    """Smooth colour images with an edge, ImageNet-normalised, [n, 3, size, size]."""
    yy, xx = np.mgrid[0:size, 0:size] / size
    out = [np.stack([np.sin(6 * xx + i + k) * 0.4 + 0.5 + 0.1 * (yy > 0.5) for k in range(3)]) for i in range(n)]
    mean = np.array([0.485, 0.456, 0.406])[:, None, None]
    std = np.array([0.229, 0.224, 0.225])[:, None, None]
    return ((np.stack(out) - mean) / std).astype(np.float32)
