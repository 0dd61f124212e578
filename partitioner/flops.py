"""Floating-point operations per node, for one sample.

A multiply-add counts as 2. The counts follow the usual conventions (as in fvcore and
ptflops): convolutions and matrix products dominate; pooling counts one op per window
element; normalisation and elementwise ops a few per element. Ops that move data
without arithmetic count 0. An op this table does not know returns None, never raises.

[Note: control-flow FLOPs]
An ``If``, ``Loop`` or ``Scan`` node costs what its subgraphs run, counted node by node
with the shapes the subgraph itself carries (its value_info after shape inference, ONNX's
or ORT's symbolic where that knows more, its inputs and outputs), falling back to the
enclosing scopes for names it reads from them:

- ``If``: the larger branch, since either may run;
- ``Loop``: the body times the trip count ``M`` when ``M`` is a constant (an initializer
  or a ``Constant`` node). A static ``M`` is taken as the count even where ``cond`` could
  end the loop early, which makes the figure an upper bound. An ``M`` of 2**31 or more is
  the "until cond" idiom of exporters, not a count, so it is unknown;
- ``Scan``: the body times the length of the first scan input along its scan axis, when
  that length is static (the batch dimension counts 1, as everywhere here).

Any part that cannot be told (a branch with an unknown op, a dynamic trip count, a body
whose shapes inference could not carry in) makes the node unknown (None), never 0.

[Note: FLOPs of real models' ops]
- INT8 ops count as their float counterparts: ``QLinearConv`` and ``ConvInteger`` as
  Conv, ``QLinearMatMul``, ``MatMulInteger``, ``MatMulIntegerToFloat`` and
  ``DynamicQuantizeMatMul`` as MatMul, ``QGemm`` as Gemm, ``QAttention`` as Attention,
  ``DynamicQuantizeLSTM`` as LSTM, ``QLinearAdd`` and the other ``QLinear*`` elementwise
  ops as theirs: the multiply-adds are the work; the (de)quantisation folded into them
  is not counted. The standalone ``QuantizeLinear`` and ``DequantizeLinear`` count 2 per
  element (scale and zero point), ``DynamicQuantizeLinear`` 4 (min and max, then both).
- ``Resize``/``Upsample`` count per output element by mode, over the d axes whose size
  changes: ``nearest`` 0 (it picks an input element, like Gather); ``linear`` 3 (2^d - 1)
  (2^d - 1 lerps of a sub, a mul and an add: 9 for bilinear); ``cubic`` 7 (4^d - 1) / 3
  (separable 4-tap sums of 4 muls and 3 adds: 35 for bicubic).
- ``LSTM``, ``GRU`` and ``RNN``: per direction and time step, with G gates (4, 3, 1),
  hidden size H and input size I, 2 G H (I + H) for the two products, G H to add them,
  2 G H for the biases where given, and the cell's elementwise work with the default
  activations (Sigmoid and Tanh 4 each, as below): LSTM 24 H (+ 6 H with peepholes),
  GRU 17 H, RNN 4 H. Times the sequence length where it is static, else unknown.
- ``Attention`` (com.microsoft): the QKV projection 2 S D_in (D_q + D_k + D_v) (+ its
  bias), then as ``MultiHeadAttention``: scores 2 S S_kv D_k, their scaling (h S S_kv),
  Softmax (3 h S S_kv) and the weighted sum 2 S S_kv D_v, for h heads, S query and S_kv
  key positions (past ones included). The output projection is a MatMul of its own.
- ``Einsum``: 2 per term of the full index product for two or more operands (k per term
  for k operands), as MatMul's 2 M N K; one operand: 1 per element where it reduces.
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
    "Floor": 1, "Ceil": 1, "Round": 1, "Sign": 1, "Sin": 1, "Cos": 1, "Mod": 1, "IsNaN": 1, "IsInf": 1,
    "ReduceMin": 1, "ReduceProd": 1, "ReduceL1": 2, "ReduceL2": 2, "ReduceSumSquare": 2,
    "ReduceLogSumExp": 3, "ArgMax": 1, "ArgMin": 1, "CumSum": 1, "TopK": 1,
    "GroupNormalization": 5, "SkipLayerNormalization": 6, "SimplifiedLayerNormalization": 4,
    "SkipSimplifiedLayerNormalization": 5, "BiasGelu": 9, "QuickGelu": 5, "BiasAdd": 2,
    "QuantizeLinear": 2, "DequantizeLinear": 2, "DynamicQuantizeLinear": 4,
}
_REDUCING = frozenset({
    "GlobalAveragePool", "GlobalMaxPool", "ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd",
    "ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSumExp", "ArgMax", "ArgMin", "TopK",
    "DynamicQuantizeLinear",
})
"""Ops whose work is per *input* element (their output is smaller)."""
_AS = {
    "ConvInteger": "Conv", "QLinearConv": "Conv", "FusedConv": "Conv",
    "MatMulInteger": "MatMul", "QLinearMatMul": "MatMul", "MatMulIntegerToFloat": "MatMul",
    "DynamicQuantizeMatMul": "MatMul", "FusedMatMul": "MatMul", "QGemm": "Gemm", "FusedGemm": "Gemm",
    "QAttention": "Attention", "DynamicQuantizeLSTM": "LSTM", "Upsample": "Resize",
    "QLinearAdd": "Add", "QLinearMul": "Mul", "QLinearSigmoid": "Sigmoid", "QLinearLeakyRelu": "LeakyRelu",
    "QLinearSoftmax": "Softmax", "QLinearGlobalAveragePool": "GlobalAveragePool",
    "QLinearAveragePool": "AveragePool", "QLinearConcat": "Concat", "QLinearReduceMean": "ReduceMean",
}
"""Ops counted as another (see [Note: FLOPs of real models' ops]); inputs are re-indexed
by `_float_inputs` where the layouts differ."""
_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
_CELL = {"LSTM": 24, "GRU": 17, "RNN": 4}


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
    names = _float_inputs(node)
    op = _AS.get(op, op)
    if op in _ZERO:
        return 0
    out = _static(shape(node.output[0]), batch) if node.output else None
    ins = [_static(shape(x), batch) if x else None for x in names]
    if op in _GATES:
        return _recurrent_flops(node, op, names, shape)
    if op in ("Attention", "MultiHeadAttention"):
        return _attention_flops(node, op, names, ins, shape)
    if op == "Resize":
        return _resize_flops(node, ins, out)
    if op == "Einsum":
        return _einsum_flops(node, ins)
    if op in ("Conv", "ConvTranspose"):
        w = ins[1]
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
        if len(names) > 2 and names[2]:
            flops += prod(out)
        return flops
    if op == "Gemm":
        a = ins[0]
        if out is None or a is None:
            return None
        trans_a = int(_attr(node, "transA", 0))  # type: ignore[arg-type]
        k = a[0] if trans_a else a[-1]
        return 2 * prod(out) * k + (prod(out) if len(names) > 2 and names[2] else 0)
    if op == "MatMul":
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
    if op in ("Sum", "Mean"):
        if out is None:
            return None
        return prod(out) * max(1, len(node.input) - (op == "Sum"))
    if op in _PER_ELEMENT:
        # the reductions' work is per input element: their output never stands in for it
        ref = (ins[0] if ins else None) if op in _REDUCING else (out if out is not None else (ins[0] if ins else None))
        if ref is None:
            return None
        return prod(ref) * _PER_ELEMENT[op]
    return None


def _float_inputs(node: onnx.NodeProto) -> list[str]:
    """The node's inputs at the positions its float counterpart has them (scales and zero
    points dropped; "" where the counterpart's input is absent)."""
    x = list(node.input) + [""] * 12
    op = node.op_type
    if op == "QLinearConv":  # x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp, B
        return [x[0], x[3], x[8]]
    if op == "ConvInteger":  # x, w, x_zero_point, w_zero_point: no bias
        return [x[0], x[1]]
    if op == "QLinearMatMul":  # a, a_scale, a_zp, b, b_scale, b_zp, y_scale, y_zp
        return [x[0], x[3]]
    if op == "QGemm":  # A, a_scale, a_zp, B, b_scale, b_zp, C, y_scale, y_zp
        return [x[0], x[3], x[6]]
    if op in ("QLinearAdd", "QLinearMul"):  # A, A_scale, A_zp, B, B_scale, B_zp, C_scale, C_zp
        return [x[0], x[3]]
    if op == "QAttention":  # input, weight, bias, input_scale, weight_scale, mask_index, input_zp, weight_zp, past
        return [x[0], x[1], x[2], x[5], x[8]]
    if op == "DynamicQuantizeLSTM":  # X, W, R, B, sequence_lens, initial_h, initial_c, P, scales and zero points
        return [x[0], "", "", x[3], x[4], x[5], x[6], x[7]]
    if op == "FusedConv":  # X, W, B, Z (a residual added)
        return [x[0], x[1], x[2]]
    return list(node.input)


def _recurrent_flops(node: onnx.NodeProto, op: str, names: list[str], shape: ShapeFn) -> int | None:
    """LSTM/GRU/RNN: see [Note: FLOPs of real models' ops]."""
    x = shape(names[0]) if names and names[0] else None
    hidden = int(_attr(node, "hidden_size", 0))  # type: ignore[arg-type]
    if x is None or len(x) != 3 or hidden < 1:
        return None
    seq, inp = x[int(_attr(node, "layout", 0)) if node.op_type != "DynamicQuantizeLSTM" else 0], x[2]  # type: ignore[call-overload]
    if not isinstance(seq, int) or not isinstance(inp, int):
        return None
    g = _GATES[op]
    has = lambda i: len(names) > i and bool(names[i])  # noqa: E731 - a one-line predicate
    step = 2 * g * hidden * (inp + hidden) + g * hidden + (2 * g * hidden if has(3) else 0)
    step += _CELL[op] * hidden + (6 * hidden if op == "LSTM" and has(7) else 0)
    directions = 2 if _attr(node, "direction", b"forward") in (b"bidirectional", "bidirectional") else 1
    return directions * seq * step


def _attention_flops(node: onnx.NodeProto, op: str, names: list[str], ins: list, shape: ShapeFn) -> int | None:
    """com.microsoft Attention and MultiHeadAttention: see [Note: FLOPs of real models' ops]."""
    heads = int(_attr(node, "num_heads", 0))  # type: ignore[arg-type]
    q = ins[0] if ins else None
    if heads < 1 or q is None:
        return None
    flops = 0
    if op == "Attention":  # input [B, S, D_in], weights [D_in, D_q + D_k + D_v], bias, mask, past
        w = ins[1] if len(ins) > 1 else None
        if len(q) != 3 or w is None or len(w) != 2:
            return None
        s, cols = q[1], w[1]
        sizes = list(_attr(node, "qkv_hidden_sizes", []))  # type: ignore[call-overload]
        dq, dk, dv = sizes if len(sizes) == 3 else (cols // 3,) * 3
        flops += 2 * s * q[2] * cols + (s * cols if len(names) > 2 and names[2] else 0)
        s_kv = s
        if len(names) > 4 and names[4]:  # past [2, B, heads, P, head_size]
            past = shape(names[4])
            if past is None or len(past) != 5 or not isinstance(past[3], int):
                return None
            s_kv += past[3]
    else:  # query [B, S, D] or packed [B, S, heads, 3, H]; key [B, S_kv, D], [B, heads, S_kv, H] or packed KV
        key = ins[1] if len(ins) > 1 and names[1] else None
        value = ins[2] if len(ins) > 2 and names[2] else None
        if len(q) == 5 and key is None:
            s, s_kv, dq = q[1], q[1], q[2] * q[4]
            dk = dv = dq
        elif len(q) == 3 and key is not None and len(key) == 5:
            s, s_kv, dq, dk, dv = q[1], key[1], q[2], key[2] * key[4], key[2] * key[4]
        elif len(q) == 3 and key is not None and value is not None and len(key) == len(value) == 3:
            s, s_kv, dq, dk, dv = q[1], key[1], q[2], key[2], value[2]
        elif len(q) == 3 and key is not None and value is not None and len(key) == len(value) == 4:
            s, s_kv, dq, dk, dv = q[1], key[2], q[2], key[1] * key[3], value[1] * value[3]
        else:
            return None
        if len(names) > 3 and names[3]:  # bias [D_q + D_k + D_v]
            flops += s * dq + s_kv * (dk + dv)
    return flops + 2 * s * s_kv * dk + 4 * heads * s * s_kv + 2 * s * s_kv * dv


def _resize_flops(node: onnx.NodeProto, ins: list, out: list[int] | None) -> int | None:
    """Resize/Upsample per output element by mode: see [Note: FLOPs of real models' ops]."""
    x = ins[0] if ins else None
    if out is None or x is None or len(x) != len(out):
        return None
    mode = _attr(node, "mode", b"nearest")
    mode = mode.decode() if isinstance(mode, bytes) else str(mode)
    d = sum(a != b for a, b in zip(x, out))
    if mode == "nearest":
        return 0
    if mode in ("linear", "bilinear", "trilinear"):
        return prod(out) * 3 * (2**d - 1)
    if mode in ("cubic", "bicubic"):
        return prod(out) * 7 * (4**d - 1) // 3
    return None


def _einsum_flops(node: onnx.NodeProto, ins: list) -> int | None:
    """Einsum: see [Note: FLOPs of real models' ops]."""
    eq = _attr(node, "equation", b"")
    eq = (eq.decode() if isinstance(eq, bytes) else str(eq)).replace(" ", "")
    lhs, _, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ins) or any(t is None for t in ins):
        return None
    size: dict[str, int] = {}
    for term, dims in zip(terms, ins):
        explicit = term.replace("...", "")
        if "..." in term:  # the broadcast dims, named by their position from the right
            extra = len(dims) - len(explicit)
            if extra < 0:
                return None
            head, tail = term.split("...")
            term = head + "".join(str(i) for i in range(extra - 1, -1, -1)) + tail
        if len(term) != len(dims):
            return None
        for letter, n in zip(term, dims):
            size[letter] = max(size.get(letter, 1), n)
    if not rhs and "->" not in eq:  # implicit output: the letters seen once, sorted
        rhs = "".join(sorted(c for c in size if lhs.count(c) == 1 and not c.isdigit()))
    everything = prod(size.values())
    if len(terms) > 1:
        return len(terms) * everything
    kept = {c for c in rhs.replace("...", "")} | {c for c in size if c.isdigit()}
    return everything if set(size) - kept else 0


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
