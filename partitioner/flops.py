"""Floating-point operations per node, for one sample.

A multiply-add counts as 2. The counts follow the usual conventions (as in fvcore and
ptflops): convolutions and matrix products dominate; pooling counts one op per window
element; normalisation and elementwise ops a few per element. Ops that move data
without arithmetic count 0. An op this table does not know returns None, never raises.

[Note: control-flow FLOPs]
An ``If``, ``Loop`` or ``Scan`` node costs what its subgraphs run, counted node by node
with the shapes the subgraph itself carries (its value_info after shape inference, its
inputs and outputs), falling back to the enclosing scopes for names it reads from them:

- ``If``: the larger branch, since either may run;
- ``Loop``: the body times the trip count ``M`` when ``M`` is a constant (an initializer
  or a ``Constant`` node). A static ``M`` is taken as the count even where ``cond`` could
  end the loop early, which makes the figure an upper bound. An ``M`` of 2**31 or more is
  the "until cond" idiom of exporters, not a count, so it is unknown;
- ``Scan``: the body times the length of the first scan input along its scan axis, when
  that length is static (the batch dimension counts 1, as everywhere here).

Any part that cannot be told (a branch with an unknown op, a dynamic trip count, a body
whose shapes inference could not carry in) makes the node unknown (None), never 0.
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["node_flops", "graph_flops"]

ShapeFn = Callable[[str], "tuple[int | str, ...] | None"]
ValueFn = Callable[[str], "np.ndarray | None"]
"""The value of a constant tensor by name; None where it is not a known constant."""

_UNTIL_COND_TRIPS = 2**31
"""Loop trip counts from here up are exporters' stand-in for "no limit", not counts."""

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
    "Less": 1, "LessOrEqual": 1, "Greater": 1, "GreaterOrEqual": 1, "Not": 1, "And": 1,
    "Or": 1, "Xor": 1,
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


def _no_value(name: str) -> None:
    return None


def node_flops(node: onnx.NodeProto, shape: ShapeFn, batch: int | str, value: ValueFn = _no_value) -> int | None:
    """FLOPs of one node for one sample; 0 for data movement; None if unknown.

    ``value`` gives constant tensors by name; only a Loop's trip count needs it. A node
    with subgraphs (If, Loop, Scan) should come from a shape-inferred model, whose
    subgraphs carry their own shapes (see [Note: control-flow FLOPs]).
    """
    op = node.op_type
    if op in ("If", "Loop", "Scan"):
        return _control_flops(node, shape, batch, value)
    if op in _ZERO:
        return 0
    out = _static(shape(node.output[0]), batch) if node.output else None
    ins = [_static(shape(x), batch) if x else None for x in node.input]
    if op in ("Conv", "ConvTranspose", "ConvInteger", "QLinearConv"):
        w = ins[3] if op == "QLinearConv" else ins[1]
        if out is None or w is None or len(w) < 2:
            return None
        # groups need no term of their own: w[1] is already C_in / group
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


def _subgraph(node: onnx.NodeProto, name: str) -> onnx.GraphProto | None:
    for a in node.attribute:
        if a.name == name and a.type == onnx.AttributeProto.GRAPH:
            return a.g
    return None


def _control_flops(node: onnx.NodeProto, shape: ShapeFn, batch: int | str, value: ValueFn) -> int | None:
    """See [Note: control-flow FLOPs]."""
    if node.op_type == "If":
        then_g, else_g = _subgraph(node, "then_branch"), _subgraph(node, "else_branch")
        if then_g is None or else_g is None:
            return None
        branches = [graph_flops(g, shape, batch, value) for g in (then_g, else_g)]
        return None if None in branches else max(branches)  # type: ignore[type-var]
    body = _subgraph(node, "body")
    if body is None:
        return None
    if node.op_type == "Loop":
        trips = _scalar(value(node.input[0])) if node.input and node.input[0] else None
        if trips is None or not 0 <= trips < _UNTIL_COND_TRIPS:
            return None
    else:  # Scan
        trips = _scan_length(node, body, shape, batch)
        if trips is None:
            return None
    per_trip = graph_flops(body, shape, batch, value)
    return None if per_trip is None else per_trip * trips


def _scalar(arr: np.ndarray | None) -> int | None:
    if arr is None or arr.size != 1 or not np.issubdtype(arr.dtype, np.integer):
        return None
    return int(arr.reshape(-1)[0])


def _scan_length(node: onnx.NodeProto, body: onnx.GraphProto, shape: ShapeFn, batch: int | str) -> int | None:
    """Iterations of a Scan (opset 9 and later): the first scan input's length on its axis.

    The opset-8 form (an extra leading ``sequence_lens`` input, batch-major) is unknown.
    """
    if len(node.input) != len(body.input):
        return None
    k = int(_attr(node, "num_scan_inputs", 0))  # type: ignore[arg-type]
    if k < 1:
        return None
    first = _static(shape(node.input[len(node.input) - k]), batch)
    axes = list(_attr(node, "scan_input_axes", [0]))  # type: ignore[call-overload]
    if first is None or not axes:
        return None
    axis = int(axes[0])
    if not -len(first) <= axis < len(first):
        return None
    return first[axis]


def graph_flops(graph: onnx.GraphProto, outer_shape: ShapeFn, batch: int | str, outer_value: ValueFn = _no_value) -> int | None:
    """FLOPs of one run of a subgraph for one sample; None if any of its nodes is unknown.

    Shapes come from the subgraph's own value_info, inputs, outputs and initializers, and
    from ``outer_shape`` for names it reads from the enclosing scopes.
    """
    local = {vi.name: vi for vi in [*graph.value_info, *graph.input, *graph.output]}
    inits = {t.name: t for t in graph.initializer}
    consts = {
        n.output[0]: a.t
        for n in graph.node
        if n.op_type == "Constant" and n.output
        for a in n.attribute
        if a.name == "value"
    }

    def shape(t: str) -> tuple[int | str, ...] | None:
        if t in inits:
            return tuple(int(d) for d in inits[t].dims)
        if t in local:
            dims = _declared_shape(local[t])
            # a symbolic batch counts 1 wherever it sits (an RNN state is [layers, N, hidden])
            return None if dims is None else tuple(1 if d == batch and isinstance(d, str) else d for d in dims)
        return outer_shape(t)

    defined = set(local) | {o for n in graph.node for o in n.output}

    def value(t: str) -> np.ndarray | None:
        tensor = inits[t] if t in inits else consts.get(t)
        if tensor is None:
            return None if t in defined else outer_value(t)
        try:
            return numpy_helper.to_array(tensor)
        except Exception:  # external or malformed data: not a known constant
            return None

    total = 0
    for n in graph.node:
        f = node_flops(n, shape, batch, value)
        if f is None:
            return None
        total += f
    return total


def _declared_shape(vi: onnx.ValueInfoProto) -> tuple[int | str, ...] | None:
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return None
    dims: list[int | str] = []
    for d in tt.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            return None
    return tuple(dims)
