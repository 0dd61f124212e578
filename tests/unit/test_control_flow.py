"""If / Loop / Scan: one layer each, outer-scope reads as dependencies, weights and FLOPs
counted, and every valid cut exports segments that equal the whole model on ORT."""

from __future__ import annotations

import logging
import random

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from partitioner import (
    LayerGraph,
    PartitionError,
    Splitter,
    boundary,
    build_graph,
    candidate_cuts,
    make_cut,
    random_cut,
    verify,
)
from partitioner.build import _toposort, node_reads, subgraph_outer_reads
from tests import control_flow_models as cf

D = cf.D


def _layer(g: LayerGraph, name: str) -> int:
    return next(layer.id for layer in g.layers if layer.name == name)


def _inputs(g: LayerGraph, batch: int = 2, **fixed: np.ndarray) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for name in g.inputs:
        t = g.tensor[name]
        dims = [batch if d == "N" else d for d in t.shape or ()]
        out[name] = fixed[name] if name in fixed else rng.standard_normal(dims).astype(np.float32)
    return out


def _verify_cuts(model: onnx.ModelProto, g: LayerGraph, feeds: list[dict[str, np.ndarray]], seeds: int = 6) -> int:
    """Head then tail equals the whole model on every candidate cut and on random valid
    cuts, for each feed; returns how many distinct cuts were checked."""
    splitter = Splitter(model, g)
    rng = random.Random(0)
    cuts = {c.device: c for c in candidate_cuts(g)}
    for _ in range(seeds):
        c = random_cut(g, rng)
        cuts[c.device] = c
    for cut in cuts.values():
        head, tail = splitter.split(cut)
        for feed in feeds:
            diffs = verify(model, [head, tail], feed, graph=g)
            assert all(d <= 1e-5 for d in diffs.values()), (sorted(cut.device), diffs)
    return len(cuts)


# ---------------------------------------------------------------------- If

def test_if_depends_on_the_producer_its_branches_read() -> None:
    g = build_graph(cf.if_model())
    enc, cond, branch = _layer(g, "enc"), _layer(g, "is16k"), _layer(g, "branch")
    assert g.preds[branch] == {enc, cond}
    assert branch in g.tensor["h"].consumers
    assert set(g.layers[branch].inputs) == {"h", "cond"}
    # The branch reads h only inside its subgraphs: a device set without h's producer is no cut.
    with pytest.raises(PartitionError, match=r"producer layer 0 \(enc\)"):
        make_cut(g, [cond, branch])
    assert boundary(g, make_cut(g, [enc])) == ("sr", "h")


def test_node_order_puts_the_outer_producer_first_whatever_the_file_order() -> None:
    model = cf.if_model()
    nodes = list(model.graph.node)
    del model.graph.node[:]
    model.graph.node.extend([nodes[2], nodes[3], nodes[0], nodes[1]])  # If, Sigmoid, MatMul h, Equal
    known = {"x", "sr", "W0", "Wa", "sr16k"}
    order = [model.graph.node[i].name for i in _toposort(model, known, "vad_if")]
    assert order.index("enc") < order.index("branch")
    assert order.index("is16k") < order.index("branch") < order.index("head")


def test_if_counts_weights_of_both_branches_and_the_larger_branch_flops() -> None:
    g = build_graph(cf.if_model())
    layer = g.layers[_layer(g, "branch")]
    assert layer.ops == ("If", "Sigmoid")
    assert layer.param_bytes == cf.IF_THEN_BYTES + cf.IF_ELSE_BYTES == 544
    assert layer.flops == max(cf.IF_THEN_FLOPS, cf.IF_ELSE_FLOPS) + 4 * D  # + Sigmoid
    # the JSON that inspect prints carries the same figures
    again = LayerGraph.from_json(g.to_json())
    assert again.layers[layer.id].param_bytes == 544
    assert again.layers[layer.id].flops == layer.flops


def test_if_with_a_larger_branch_takes_its_flops() -> None:
    model = cf.if_model()
    then_g = next(a.g for a in model.graph.node[2].attribute if a.name == "then_branch")
    then_g.node.append(helper.make_node("Tanh", ["then_out"], ["then_tanh"]))
    then_g.output[0].name = "then_tanh"
    g = build_graph(model)
    assert g.layers[_layer(g, "branch")].flops == cf.IF_THEN_FLOPS + 4 * D + 4 * D  # Tanh, Sigmoid


@pytest.mark.parametrize("computed", [True, False])
def test_if_segments_equal_the_model_on_both_branches(computed: bool) -> None:
    model = cf.if_model(computed_cond=computed)
    g = build_graph(model)
    if computed:
        feeds = [_inputs(g, sr=np.array(sr, np.int64)) for sr in (16000, 8000)]
    else:
        feeds = [_inputs(g, flag=np.array(f)) for f in (True, False)]
    assert _verify_cuts(model, g, feeds) >= (5 if computed else 3)


# ---------------------------------------------------------------------- Loop

def test_loop_flops_are_the_body_times_a_static_trip_count() -> None:
    g = build_graph(cf.loop_model())
    layer = g.layers[_layer(g, "loop")]
    assert layer.ops == ("Loop", "Relu")
    assert layer.flops == cf.LOOP_TRIPS * cf.LOOP_BODY_FLOPS + D == 488
    # Wl read by the body, plus the trip count (int64) and cond (bool) initializers
    assert layer.param_bytes == cf.LOOP_BYTES + 8 + 1
    assert g.preds[layer.id] == {_layer(g, "enc")}


@pytest.mark.parametrize("as_tensor", [True, False])
def test_loop_trip_count_from_a_constant_node(as_tensor: bool) -> None:
    model = cf.loop_model()
    kept = [t for t in model.graph.initializer if t.name != "trips"]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    value = {"value": numpy_helper.from_array(np.array(4, np.int64))} if as_tensor else {"value_int": 4}
    model.graph.node.insert(0, helper.make_node("Constant", [], ["trips"], name="four", **value))
    g = build_graph(model)
    assert g.layers[_layer(g, "loop")].flops == 4 * cf.LOOP_BODY_FLOPS + D
    _verify_cuts(model, g, [_inputs(g)], seeds=0)


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(lambda: cf.loop_model(static_trips=False), id="trip-count-is-an-input"),
        pytest.param(lambda: cf.loop_model(trips=2**62), id="until-cond-idiom"),
    ],
)
def test_loop_flops_are_unknown_when_they_cannot_be_told(model) -> None:
    g = build_graph(model())
    assert g.layers[_layer(g, "loop")].flops is None
    assert g.layers[_layer(g, "enc")].flops == 2 * D * D


def test_a_loop_body_that_declares_no_shapes_gets_them_from_symbolic_inference() -> None:
    # ONNX inference does not carry shapes into a Loop body; ORT's symbolic inference does.
    g = build_graph(cf.loop_model(body_shapes=False))
    assert g.layers[_layer(g, "loop")].flops == cf.LOOP_TRIPS * cf.LOOP_BODY_FLOPS + D


def test_if_flops_through_a_pad_of_computed_size_inside_a_branch() -> None:
    model = cf.padded_if_model()
    length = 16
    x = np.random.default_rng(0).standard_normal((1, cf.PAD_CHANNELS, length)).astype(np.float32)
    g = build_graph(model, inputs={"x": x})
    conv = 2 * cf.PAD_OUT * cf.PAD_CHANNELS * cf.PAD_K
    then_flops = conv * (length + 2 * (length // 2) - cf.PAD_K + 1) + 1
    else_flops = conv * (length - cf.PAD_K + 1)
    assert g.layers[_layer(g, "branch")].flops == max(then_flops, else_flops) == 5761
    # With the length symbolic, the padded length is an expression, and the count unknown (never 0).
    assert build_graph(model).layers[_layer(build_graph(model), "branch")].flops is None
    _verify_cuts(model, g, [{"x": x}, {"x": -x}], seeds=0)


def test_loop_segments_equal_the_model() -> None:
    model = cf.loop_model()
    g = build_graph(model)
    _verify_cuts(model, g, [_inputs(g)])
    dyn = cf.loop_model(static_trips=False)
    gd = build_graph(dyn)
    assert "trips" in gd.layers[_layer(gd, "loop")].inputs
    _verify_cuts(dyn, gd, [_inputs(gd, trips=np.array(t, np.int64)) for t in (0, 4)])


# ---------------------------------------------------------------------- Scan

def test_scan_flops_are_the_body_times_the_sequence_length() -> None:
    g = build_graph(cf.scan_model())
    layer = g.layers[_layer(g, "rnn")]
    assert layer.ops == ("Scan",)
    assert layer.flops == cf.T * cf.SCAN_BODY_FLOPS == 420
    assert layer.param_bytes == cf.SCAN_BYTES == 128
    assert set(layer.inputs) == {"s0", "xr"}


def test_scan_flops_are_unknown_over_a_symbolic_sequence() -> None:
    model = cf.scan_model()
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "T"
    g = build_graph(model)
    assert g.layers[_layer(g, "rnn")].flops is None
    assert g.layers[_layer(g, "rnn")].param_bytes == cf.SCAN_BYTES


def test_scan_segments_equal_the_model() -> None:
    model = cf.scan_model()
    g = build_graph(model)
    _verify_cuts(model, g, [_inputs(g)])


# ---------------------------------------------------------------------- recurrent state

@pytest.mark.parametrize("with_if", [False, True])
def test_recurrent_state_in_and_out_splits_exactly(with_if: bool) -> None:
    model = cf.state_model(with_if=with_if)
    g = build_graph(model)
    assert g.inputs == ("x", "state") and g.outputs == ("y", "state_out")
    feeds = [_inputs(g, batch=1)]
    if with_if:
        gate = _layer(g, "gate")
        # the If reads the model input `state` and `s` only inside its branches
        assert g.preds[gate] == {_layer(g, "state_proj"), _layer(g, "voiced")}
        assert gate in g.tensor["state"].consumers
        everything_but_gate = make_cut(g, set(range(len(g))) - {gate})
        assert set(boundary(g, everything_but_gate)) == {"state", "s", "voiced"}
        silent = {"x": -np.abs(feeds[0]["x"]), "state": feeds[0]["state"]}
        feeds.append(silent)
    assert _verify_cuts(model, g, feeds) >= 6


# ---------------------------------------------------------------------- nested

def test_nested_if_in_a_loop_body_depends_on_the_top_level_tensor_it_reads() -> None:
    model = cf.nested_model()
    loop_node = model.graph.node[2]
    assert subgraph_outer_reads(loop_node.attribute[0].g) == ["one", "h"]
    assert node_reads(loop_node) == ["trips", "keep_going", "v0", "one", "h"]
    g = build_graph(model)
    layer = g.layers[_layer(g, "loop")]
    assert g.preds[layer.id] == {_layer(g, "enc"), _layer(g, "start")}
    with pytest.raises(PartitionError, match=r"producer layer 0 \(enc\)"):
        make_cut(g, [_layer(g, "start"), layer.id])
    # Bn inside the inner branch, and the trip count, cond and `one` initializers
    assert layer.param_bytes == cf.NESTED_INNER_BYTES + 8 + 1 + 8
    assert layer.flops == cf.NESTED_TRIPS * cf.NESTED_BODY_FLOPS + 4 * D  # + Sigmoid
    _verify_cuts(model, g, [_inputs(g)])


# ---------------------------------------------------------------------- constants, errors

def _constant_if_model(*, random_inside: bool) -> onnx.ModelProto:
    def branch(name: str, value: float) -> onnx.GraphProto:
        if random_inside:
            node = helper.make_node("RandomNormal", [], [name], shape=[1, D], seed=1.0)
        else:
            node = helper.make_node(
                "Constant", [], [name], value=numpy_helper.from_array(np.full((1, D), value, np.float32))
            )
        return helper.make_graph([node], name, [], [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, D])])

    nodes = [
        helper.make_node("If", ["use_a"], ["bias"], name="pick", then_branch=branch("a", 1.0), else_branch=branch("b", 2.0)),
        helper.make_node("Add", ["x", "bias"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes, "const_if",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, D])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, D])],
        initializer=[numpy_helper.from_array(np.array(False), "use_a")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", cf.OPSET)], ir_version=8)


def test_an_if_on_constants_is_a_constant_of_the_layer_that_reads_it() -> None:
    g = build_graph(_constant_if_model(random_inside=False))
    assert len(g) == 1 and g.meta["constant_nodes"] == 1
    assert g.layers[0].const_nodes == ("pick",)
    model = _constant_if_model(random_inside=False)
    _verify_cuts(model, g, [_inputs(g, batch=1)], seeds=0)


def test_an_if_with_a_random_op_inside_is_never_folded() -> None:
    g = build_graph(_constant_if_model(random_inside=True))
    assert [layer.ops for layer in g.layers] == [("If", "Add")]  # the Add fuses into the If's layer
    assert g.meta["constant_nodes"] == 0


def test_a_branch_reading_an_undefined_name_is_a_malformed_model() -> None:
    model = cf.if_model()
    then_g = next(a.g for a in model.graph.node[2].attribute if a.name == "then_branch")
    then_g.node[0].input[1] = "nowhere"
    with pytest.raises(PartitionError, match=r"reads 'nowhere', which no node, input or initializer defines"):
        build_graph(model)


# ---------------------------------------------------------------------- profile

def test_profile_measures_every_layer_of_a_model_with_control_flow(caplog: pytest.LogCaptureFixture) -> None:
    from workers.profile.measure import measure

    model = cf.nested_model()
    g = build_graph(model)
    with caplog.at_level(logging.ERROR):
        m = measure(model, g, threads=1, warmup=1, runs=2, progress=False)
    assert set(m.profile.layers) == set(range(len(g)))
    assert m.profile.layers[_layer(g, "loop")].ms > 0


def test_subgraph_flops_count_a_symbolic_batch_as_one_wherever_it_sits() -> None:
    from partitioner.flops import graph_flops

    body = helper.make_graph(
        [helper.make_node("Tanh", ["s"], ["t"])], "cell",
        [helper.make_tensor_value_info("s", TensorProto.FLOAT, [2, "batch", 4])],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, "batch", 4])],
    )
    assert graph_flops(body, lambda t: None, "batch") == 4 * 2 * 4
    assert graph_flops(body, lambda t: None, "other") is None  # an unknown symbol stays unknown


def test_a_top_level_constant_read_only_inside_a_branch_travels_with_the_if() -> None:
    model = cf.if_model()
    wa = next(t for t in model.graph.initializer if t.name == "Wa")
    kept = [t for t in model.graph.initializer if t.name != "Wa"]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    model.graph.node.insert(0, helper.make_node("Constant", [], ["Wa"], name="wa_const", value=wa))
    g = build_graph(model)
    branch = g.layers[_layer(g, "branch")]
    assert branch.const_nodes == ("wa_const",)
    assert branch.param_bytes == cf.IF_THEN_BYTES + cf.IF_ELSE_BYTES
    feeds = [_inputs(g, sr=np.array(sr, np.int64)) for sr in (16000, 8000)]
    _verify_cuts(model, g, feeds, seeds=0)
