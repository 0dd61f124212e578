"""Floating-point operations per node, for one sample.

A multiply-add counts as 2. The counts follow the usual conventions (as in fvcore and
ptflops): convolutions and matrix products dominate; pooling counts one op per window
element; normalisation and elementwise ops a few per element. Ops that move data
without arithmetic count 0. An op this table does not know returns None, never raises.
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod

import onnx
from onnx import helper

__all__ = ["node_flops"]

ShapeFn = Callable[[str], "tuple[int | str, ...] | None"]

_ZERO = frozenset(
    {
        "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Concat", "Split",
        "Slice", "Gather", "Identity", "Dropout", "Cast", "Shape", "Expand", "Pad",
        "Tile", "ConstantOfShape", "Constant", "DepthToSpace", "SpaceToDepth",
        "GatherElements", "ScatterND", "Size",
    }
)
_PER_ELEMENT = {
    "Relu": 1, "LeakyRelu": 2, "PRelu": 2, "Clip": 2, "Sigmoid": 4, "Tanh": 4,
    "HardSigmoid": 3, "HardSwish": 4, "Elu": 3, "Selu": 4, "Celu": 4, "Softplus": 3,
    "Softsign": 3, "Erf": 4, "Gelu": 8, "FastGelu": 8, "Mish": 6, "ThresholdedRelu": 1,
    "Add": 1, "Sub": 1, "Mul": 1, "Div": 1, "Max": 1, "Min": 1, "Pow": 1, "Sqrt": 1,
    "Neg": 1, "Abs": 1, "Exp": 1, "Log": 1, "Reciprocal": 1, "Where": 1, "Equal": 1,
    "BatchNormalization": 2, "InstanceNormalization": 5, "LayerNormalization": 5,
    "Softmax": 3, "LogSoftmax": 3, "ReduceMean": 1, "ReduceSum": 1, "ReduceMax": 1,
    "GlobalAveragePool": 1, "GlobalMaxPool": 1,
}


def _static(shape: tuple[int | str, ...] | None, batch: int | str) -> list[int] | None:
    """The shape with the batch dimension set to 1; None if any other dim is symbolic."""
    if shape is None:
        return None
    dims = list(shape)
    if dims and dims[0] == batch:
        dims[0] = 1
    if not all(isinstance(d, int) for d in dims):
        return None
    return [int(d) for d in dims]


def _attr(node: onnx.NodeProto, name: str, default: object) -> object:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def node_flops(node: onnx.NodeProto, shape: ShapeFn, batch: int | str) -> int | None:
    """FLOPs of one node for one sample; 0 for data movement; None if unknown."""
    op = node.op_type
    if op in _ZERO:
        return 0
    out = _static(shape(node.output[0]), batch) if node.output else None
    ins = [_static(shape(x), batch) if x else None for x in node.input]
    if op in ("Conv", "ConvTranspose", "ConvInteger", "QLinearConv"):
        w = ins[3] if op == "QLinearConv" else ins[1]
        if out is None or w is None or len(w) < 2:
            return None
        group = int(_attr(node, "group", 1))  # type: ignore[arg-type]
        if op == "ConvTranspose":
            x = ins[0]
            if x is None:
                return None
            # each input element scatters into C_out/group * kernel outputs
            return 2 * prod(x) * (w[1]) * prod(w[2:])
        cin_per_group = w[1]
        flops = 2 * prod(out) * cin_per_group * prod(w[2:])
        if op == "Conv" and len(node.input) > 2 and node.input[2]:
            flops += prod(out)
        del group  # group is folded into w[1] (= C_in / group)
        return flops
    if op == "Gemm":
        a = ins[0]
        if out is None or a is None:
            return None
        trans_a = int(_attr(node, "transA", 0))  # type: ignore[arg-type]
        k = a[0] if trans_a else a[-1]
        return 2 * prod(out) * k + (prod(out) if len(node.input) > 2 else 0)
    if op in ("MatMul", "MatMulInteger", "QLinearMatMul"):
        a = ins[0]
        if out is None or a is None or not a:
            return None
        return 2 * prod(out) * a[-1]
    if op in ("MaxPool", "AveragePool", "LpPool"):
        if out is None:
            return None
        kernel = _attr(node, "kernel_shape", [1])
        return prod(out) * prod(kernel)  # type: ignore[arg-type]
    if op == "LRN":
        if out is None:
            return None
        size = int(_attr(node, "size", 5))  # type: ignore[arg-type]
        return prod(out) * (size + 3)
    if op == "Sum":
        if out is None:
            return None
        return prod(out) * max(1, len(node.input) - 1)
    if op in ("Attention", "MultiHeadAttention"):
        q = ins[0]
        if q is None or len(q) < 3:
            return None
        seq, hidden = q[-2], q[-1]
        # QKV projections + scores + weighted sum + output projection
        return 2 * seq * hidden * hidden * 4 + 4 * seq * seq * hidden
    if op in _PER_ELEMENT:
        ref = out if out is not None else (ins[0] if ins else None)
        if ref is None:
            return None
        if op in ("GlobalAveragePool", "GlobalMaxPool", "ReduceMean", "ReduceSum", "ReduceMax"):
            ref = ins[0] if ins and ins[0] is not None else ref
        return prod(ref) * _PER_ELEMENT[op]
    return None
