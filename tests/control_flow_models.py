"""Small models with If, Loop and Scan, built with onnx.helper, with known weights and FLOPs.

Each builder returns the model; the constants beside it are the exact parameter bytes and
FLOPs per sample that the tests expect of the control-flow layer. All weights are
float32 and deterministic (seeded), so head-then-tail can be compared to the whole model.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

F = TensorProto.FLOAT
OPSET = 17


def _w(name: str, shape: tuple[int, ...], seed: int) -> onnx.TensorProto:
    rng = np.random.default_rng(seed)
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)


def _const_node(out: str, arr: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [out], value=numpy_helper.from_array(arr, out + "_value"))


def _model(nodes, inputs, outputs, inits, name: str) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


# ---------------------------------------------------------------- If (voice-activity style)
D = 8
IF_THEN_BYTES = D * D * 4 + D * 4
"""The then-branch's weights: outer initializer Wa (D x D) and its own bias Ba (D)."""
IF_ELSE_BYTES = D * D * 4
"""The else-branch's weight: a Constant node Wb (D x D) inside the branch."""
IF_THEN_FLOPS = 2 * D * D + D
"""MatMul (1 x D) @ (D x D), then Add of the bias."""
IF_ELSE_FLOPS = 2 * D * D + D
"""MatMul, then Relu."""


def if_model(*, computed_cond: bool = True) -> onnx.ModelProto:
    """``If(sr == 16000)`` choosing between two MatMul branches that read the outer
    activation ``h`` (produced by a top-level MatMul) and weights from both scopes.

    With ``computed_cond`` False the condition is a bool model input ``flag``.
    """
    then_g = helper.make_graph(
        [
            helper.make_node("MatMul", ["h", "Wa"], ["ta"]),
            helper.make_node("Add", ["ta", "Ba"], ["then_out"]),
        ],
        "then",
        [],
        [helper.make_tensor_value_info("then_out", F, None)],
        initializer=[_w("Ba", (D,), 3)],
    )
    wb = (np.random.default_rng(4).standard_normal((D, D)) * 0.3).astype(np.float32)
    else_g = helper.make_graph(
        [
            _const_node("Wb", wb),
            helper.make_node("MatMul", ["h", "Wb"], ["eb"]),
            helper.make_node("Relu", ["eb"], ["else_out"]),
        ],
        "else",
        [],
        [helper.make_tensor_value_info("else_out", F, None)],
    )
    x = helper.make_tensor_value_info("x", F, ["N", D])
    nodes = [helper.make_node("MatMul", ["x", "W0"], ["h"], name="enc")]
    inits = [_w("W0", (D, D), 1), _w("Wa", (D, D), 2)]
    if computed_cond:
        inputs = [x, helper.make_tensor_value_info("sr", TensorProto.INT64, [])]
        inits.append(numpy_helper.from_array(np.array(16000, np.int64), "sr16k"))
        nodes.append(helper.make_node("Equal", ["sr", "sr16k"], ["cond"], name="is16k"))
        cond = "cond"
    else:
        inputs = [x, helper.make_tensor_value_info("flag", TensorProto.BOOL, [])]
        cond = "flag"
    nodes += [
        helper.make_node("If", [cond], ["y"], name="branch", then_branch=then_g, else_branch=else_g),
        helper.make_node("Sigmoid", ["y"], ["prob"], name="head"),
    ]
    return _model(nodes, inputs, [helper.make_tensor_value_info("prob", F, ["N", D])], inits, "vad_if")


# ---------------------------------------------------------------- If with computed padding
PAD_CHANNELS, PAD_OUT, PAD_K = 4, 8, 3


def padded_if_model() -> onnx.ModelProto:
    """x [N, 4, L]; if sum(x) > 0: pad the last axis by L // 2 on each side (the pads
    computed from x's shape), then Conv; else Conv. ONNX shape inference loses the padded
    shape inside the branch (as in Silero VAD's front end); ORT's symbolic inference
    carries it. Per sample at L = 16: then 2 * 8 * 4 * 3 * 30 + 1 (the Div), else
    2 * 8 * 4 * 3 * 14."""
    then_g = helper.make_graph(
        [
            helper.make_node("Shape", ["x"], ["s"]),
            helper.make_node("Gather", ["s", "two"], ["len"], axis=0),
            helper.make_node("Div", ["len", "two"], ["half"]),
            helper.make_node("Unsqueeze", ["half", "axis0"], ["half1"]),
            helper.make_node("Concat", ["zeros2", "half1", "zeros2", "half1"], ["pads"], axis=0),
            helper.make_node("Pad", ["x", "pads"], ["xp"]),
            helper.make_node("Conv", ["xp", "Wc"], ["y_then"]),
        ],
        "then", [], [helper.make_tensor_value_info("y_then", F, ["N", PAD_OUT, "Lt"])],
        initializer=[numpy_helper.from_array(np.array(2, np.int64), "two"),
                     numpy_helper.from_array(np.array([0], np.int64), "axis0"),
                     numpy_helper.from_array(np.zeros(2, np.int64), "zeros2")],
    )
    else_g = helper.make_graph([helper.make_node("Conv", ["x", "Wc"], ["y_else"])], "else", [],
                               [helper.make_tensor_value_info("y_else", F, ["N", PAD_OUT, "Le"])])
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0, name="sum"),
        helper.make_node("Greater", ["total", "zero"], ["cond"], name="positive"),
        helper.make_node("If", ["cond"], ["y"], name="branch", then_branch=then_g, else_branch=else_g),
    ]
    inits = [_w("Wc", (PAD_OUT, PAD_CHANNELS, PAD_K), 7), numpy_helper.from_array(np.array(0, np.float32), "zero")]
    return _model(nodes, [helper.make_tensor_value_info("x", F, ["N", PAD_CHANNELS, "L"])],
                  [helper.make_tensor_value_info("y", F, ["N", PAD_OUT, "Ly"])], inits, "padded_if")


# ---------------------------------------------------------------- Loop
LOOP_TRIPS = 3
LOOP_BODY_FLOPS = 2 * D * D + 4 * D
"""MatMul (1 x D) @ (D x D), then Tanh (4 per element); the cond Identity is free."""
LOOP_BYTES = D * D * 4
"""The body reads the outer initializer Wl (D x D)."""


def loop_model(*, static_trips: bool = True, body_shapes: bool = True, trips: int = LOOP_TRIPS) -> onnx.ModelProto:
    """``v = tanh(v @ Wl)`` repeated M times, with ``v`` carried; M is an initializer
    (static, ``trips``) or a model input ``trips`` (dynamic). ONNX shape inference does not carry
    shapes into a Loop body (a carried value may change shape between iterations), so
    the body's shapes are what it declares: [N, D] with ``body_shapes``, none without."""
    v_shape = ["N", D] if body_shapes else None
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("MatMul", ["v_in", "Wl"], ["vm"]),
            helper.make_node("Tanh", ["vm"], ["v_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_in", F, v_shape),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_out", F, v_shape),
        ],
    )
    inputs = [helper.make_tensor_value_info("x", F, ["N", D])]
    inits = [
        _w("W0", (D, D), 1),
        _w("Wl", (D, D), 5),
        numpy_helper.from_array(np.array(True), "keep_going"),
    ]
    if static_trips:
        inits.append(numpy_helper.from_array(np.array(trips, np.int64), "trips"))
    else:
        inputs.append(helper.make_tensor_value_info("trips", TensorProto.INT64, []))
    nodes = [
        helper.make_node("MatMul", ["x", "W0"], ["h"], name="enc"),
        helper.make_node("Loop", ["trips", "keep_going", "h"], ["v"], name="loop", body=body),
        helper.make_node("Relu", ["v"], ["out"], name="act"),
    ]
    return _model(nodes, inputs, [helper.make_tensor_value_info("out", F, ["N", D])], inits, "loop")


# ---------------------------------------------------------------- Scan
T = 5
H = 4
SCAN_BODY_FLOPS = 2 * (2 * H * H) + H + 4 * H
"""Two MatMuls (1 x H) @ (H x H), the Add, then Tanh; the Identity is free."""
SCAN_BYTES = 2 * H * H * 4
"""The body reads the outer initializers Wx and Wh."""


def scan_model() -> onnx.ModelProto:
    """An RNN cell scanned over the sequence axis (1) of ``x`` [N, T, H], carrying the
    state; outputs the last state and every step's state [N, T, H]."""
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["xt", "Wx"], ["a"]),
            helper.make_node("MatMul", ["s_in", "Wh"], ["b"]),
            helper.make_node("Add", ["a", "b"], ["c"]),
            helper.make_node("Tanh", ["c"], ["s_out"]),
            helper.make_node("Identity", ["s_out"], ["y_t"]),
        ],
        "cell",
        [helper.make_tensor_value_info("s_in", F, ["N", H]), helper.make_tensor_value_info("xt", F, ["N", H])],
        [helper.make_tensor_value_info("s_out", F, ["N", H]), helper.make_tensor_value_info("y_t", F, ["N", H])],
    )
    nodes = [
        helper.make_node("Relu", ["x"], ["xr"], name="pre"),
        helper.make_node(
            "Scan", ["s0", "xr"], ["s_last", "ys"], name="rnn", body=body, num_scan_inputs=1,
            scan_input_axes=[1], scan_output_axes=[1],
        ),
        helper.make_node("Sigmoid", ["ys"], ["out"], name="post"),
    ]
    inputs = [helper.make_tensor_value_info("x", F, ["N", T, H]), helper.make_tensor_value_info("s0", F, ["N", H])]
    outputs = [helper.make_tensor_value_info("out", F, ["N", T, H]), helper.make_tensor_value_info("s_last", F, ["N", H])]
    return _model(nodes, inputs, outputs, [_w("Wx", (H, H), 6), _w("Wh", (H, H), 7)], "scan")


# ---------------------------------------------------------------- recurrent state
def state_model(*, with_if: bool) -> onnx.ModelProto:
    """Inputs ``x`` and ``state``, outputs ``y`` and ``state_out``: s = tanh(x@W1 +
    state@W2), y = s@W3. With ``with_if``, ``state_out`` is ``If(sum(x) > 0)`` choosing
    the new state or the incoming one (a reset on silence)."""
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["hx"], name="in_proj"),
        helper.make_node("MatMul", ["state", "W2"], ["hs"], name="state_proj"),
        helper.make_node("Add", ["hx", "hs"], ["pre"], name="mix"),
        helper.make_node("Tanh", ["pre"], ["s"], name="cell"),
        helper.make_node("MatMul", ["s", "W3"], ["y"], name="out_proj"),
    ]
    if with_if:
        keep = helper.make_graph(
            [helper.make_node("Identity", ["s"], ["keep_out"])], "keep", [],
            [helper.make_tensor_value_info("keep_out", F, None)],
        )
        reset = helper.make_graph(
            [helper.make_node("Identity", ["state"], ["reset_out"])], "reset", [],
            [helper.make_tensor_value_info("reset_out", F, None)],
        )
        nodes += [
            helper.make_node("ReduceSum", ["x"], ["energy"], name="energy", keepdims=0),
            helper.make_node("Greater", ["energy", "zero"], ["voiced"], name="voiced"),
            helper.make_node("If", ["voiced"], ["state_out"], name="gate", then_branch=keep, else_branch=reset),
        ]
    else:
        nodes.append(helper.make_node("Identity", ["s"], ["state_out"], name="carry"))
    inits = [_w("W1", (D, D), 8), _w("W2", (D, D), 9), _w("W3", (D, D), 10)]
    if with_if:
        inits.append(numpy_helper.from_array(np.array(0.0, np.float32), "zero"))
    inputs = [helper.make_tensor_value_info("x", F, [1, D]), helper.make_tensor_value_info("state", F, [1, D])]
    outputs = [helper.make_tensor_value_info("y", F, [1, D]), helper.make_tensor_value_info("state_out", F, [1, D])]
    return _model(nodes, inputs, outputs, inits, "state_if" if with_if else "state")


# ---------------------------------------------------------------- nested
NESTED_TRIPS = 2
NESTED_INNER_BYTES = D * 4
"""The inner then-branch's own initializer Bn (D)."""
NESTED_BODY_FLOPS = 1 + max(D + D, D) + 4 * D
"""Less (1), the larger branch (two Adds against one Mul), then Tanh; Identity is free."""


def nested_model() -> onnx.ModelProto:
    """A Loop whose body holds an If that reads the top-level tensor ``h``: on the first
    iteration v = v + h + Bn, afterwards v = v * h; then v = tanh(v)."""
    then_g = helper.make_graph(
        [
            helper.make_node("Add", ["v_in", "h"], ["t1"]),
            helper.make_node("Add", ["t1", "Bn"], ["then_out"]),
        ],
        "first",
        [],
        [helper.make_tensor_value_info("then_out", F, None)],
        initializer=[_w("Bn", (D,), 11)],
    )
    else_g = helper.make_graph(
        [helper.make_node("Mul", ["v_in", "h"], ["else_out"])],
        "later",
        [],
        [helper.make_tensor_value_info("else_out", F, None)],
    )
    body = helper.make_graph(
        [
            helper.make_node("Less", ["i", "one"], ["first"]),
            helper.make_node("If", ["first"], ["mixed"], then_branch=then_g, else_branch=else_g),
            helper.make_node("Tanh", ["mixed"], ["v_out"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_in", F, ["N", D]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("v_out", F, ["N", D]),
        ],
    )
    nodes = [
        helper.make_node("MatMul", ["x", "W0"], ["h"], name="enc"),
        helper.make_node("Neg", ["x"], ["v0"], name="start"),
        helper.make_node("Loop", ["trips", "keep_going", "v0"], ["v"], name="loop", body=body),
        helper.make_node("Sigmoid", ["v"], ["out"], name="act"),
    ]
    inits = [
        _w("W0", (D, D), 1),
        numpy_helper.from_array(np.array(NESTED_TRIPS, np.int64), "trips"),
        numpy_helper.from_array(np.array(True), "keep_going"),
        numpy_helper.from_array(np.array(1, np.int64), "one"),
    ]
    return _model(
        nodes, [helper.make_tensor_value_info("x", F, ["N", D])],
        [helper.make_tensor_value_info("out", F, ["N", D])], inits, "nested",
    )
