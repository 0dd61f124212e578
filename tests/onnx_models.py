"""Small ONNX models built with onnx.helper for tests (generated, never downloaded)."""

from __future__ import annotations

import random

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
C, H, W = 4, 5, 5


def _model(nodes, inputs, outputs, inits, opset: int = OPSET) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "test", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _vi(name: str, shape=(1, C, H, W)) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def conv_bn_relu_chain(n_blocks: int = 3, *, seed: int = 0) -> onnx.ModelProto:
    """x -> [Conv -> BN -> Relu] * n -> GlobalAveragePool -> Flatten -> Gemm -> y."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    prev = "x"
    for i in range(n_blocks):
        w = numpy_helper.from_array(rng.standard_normal((C, C, 3, 3)).astype(np.float32) * 0.3, f"w{i}")
        bn = [numpy_helper.from_array(v.astype(np.float32), f"bn{i}_{k}") for k, v in enumerate(
            [1 + 0.1 * rng.standard_normal(C), 0.1 * rng.standard_normal(C), 0.1 * rng.standard_normal(C), 1 + rng.random(C)])]
        inits += [w, *bn]
        nodes += [
            helper.make_node("Conv", [prev, f"w{i}"], [f"c{i}"], name=f"conv{i}", pads=[1, 1, 1, 1]),
            helper.make_node("BatchNormalization", [f"c{i}"] + [b.name for b in bn], [f"b{i}"], name=f"bn{i}"),
            helper.make_node("Relu", [f"b{i}"], [f"r{i}"], name=f"relu{i}"),
        ]
        prev = f"r{i}"
    inits.append(numpy_helper.from_array(rng.standard_normal((3, C)).astype(np.float32), "fc_w"))
    nodes += [
        helper.make_node("GlobalAveragePool", [prev], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "fc_w"], ["y"], name="fc", transB=1),
    ]
    return _model(nodes, [_vi("x")], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])], inits)


def residual_block(*, seed: int = 0) -> onnx.ModelProto:
    """x -> conv_a -> relu -> conv_b ; Add(conv_b, x) -> relu -> y; x fans out twice."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(rng.standard_normal((C, C, 1, 1)).astype(np.float32), n) for n in ("wa", "wb")]
    nodes = [
        helper.make_node("Conv", ["x", "wa"], ["a"], name="conv_a"),
        helper.make_node("Relu", ["a"], ["ar"], name="relu_a"),
        helper.make_node("Conv", ["ar", "wb"], ["b"], name="conv_b"),
        helper.make_node("Add", ["b", "x"], ["s"], name="add"),
        helper.make_node("Relu", ["s"], ["y"], name="relu_out"),
    ]
    return _model(nodes, [_vi("x")], [_vi("y")], inits)


def random_dag(seed: int, n_nodes: int = 10, *, n_outputs: int | None = None) -> onnx.ModelProto:
    """A random DAG of same-shape ops (Conv 1x1, Relu, Add, Mul, Sigmoid, MaxPool, Concat+Conv).

    Tensors fan out, elementwise ops join branches, the model input is sometimes read
    by late nodes, and several tensors may be model outputs.
    """
    r = random.Random(seed)
    rng = np.random.default_rng(seed)
    avail = ["x"]
    nodes, inits = [], []
    for i in range(n_nodes):
        op = r.choice(["Conv", "Conv", "Relu", "Add", "Mul", "Sigmoid", "MaxPool", "Concat"])
        out = f"t{i}"
        a = r.choice(avail[-4:] if r.random() < 0.8 else avail)
        if op == "Conv":
            w = f"w{i}"
            inits.append(numpy_helper.from_array((rng.standard_normal((C, C, 1, 1)) * 0.5).astype(np.float32), w))
            nodes.append(helper.make_node("Conv", [a, w], [out], name=f"n{i}"))
        elif op in ("Add", "Mul"):
            b = r.choice(avail)
            nodes.append(helper.make_node(op, [a, b], [out], name=f"n{i}"))
        elif op == "MaxPool":
            nodes.append(helper.make_node("MaxPool", [a], [out], name=f"n{i}", kernel_shape=[3, 3], pads=[1, 1, 1, 1]))
        elif op == "Concat":
            b = r.choice(avail)
            w = f"w{i}"
            inits.append(numpy_helper.from_array((rng.standard_normal((C, 2 * C, 1, 1)) * 0.5).astype(np.float32), w))
            nodes.append(helper.make_node("Concat", [a, b], [f"cat{i}"], name=f"n{i}", axis=1))
            nodes.append(helper.make_node("Conv", [f"cat{i}", w], [out], name=f"n{i}_conv"))
        else:
            nodes.append(helper.make_node(op, [a], [out], name=f"n{i}"))
        avail.append(out)
    produced = avail[1:]
    read = {x for n in nodes for x in n.input}
    sinks = [t for t in produced if t not in read]
    k = n_outputs if n_outputs is not None else r.randint(0, 2)
    extra = r.sample([t for t in produced if t not in sinks], min(k, len(produced) - len(sinks)))
    outs = sinks + extra
    return _model(nodes, [_vi("x")], [_vi(t) for t in outs], inits)


def image_classifier(height: int | str = 32, width: int | str = 32) -> onnx.ModelProto:
    """x [1, 3, height, width] (a symbolic dim where a name is given) -> Conv(3->8) -> Relu ->
    GlobalAveragePool -> Flatten -> Gemm -> y [1, 5]: a camera frame's model for the lossy codecs."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array((rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((5, 8)).astype(np.float32), "fc_w")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("GlobalAveragePool", ["r"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "fc_w"], ["y"], name="fc", transB=1)]
    graph = helper.make_graph(nodes, "img", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                           [1, 3, height, width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def write(model: onnx.ModelProto, path) -> str:
    onnx.save_model(model, str(path))
    return str(path)
