"""LayerGraph construction: grouping, constants, tensor facts, FLOPs and bad input."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from partitioner import LayerGraph, PartitionError, build_graph, load_model
from partitioner.zoo import ZOO_MODELS, zoo_path
from tests.onnx_models import _model, _vi, conv_bn_relu_chain, residual_block, write


def test_conv_bn_relu_fuse_into_one_layer() -> None:
    g = build_graph(conv_bn_relu_chain(3))
    assert [layer.ops for layer in g.layers[:3]] == [("Conv", "BatchNormalization", "Relu")] * 3
    # GAP starts a layer; Flatten fuses into it; Gemm starts its own
    assert [layer.ops for layer in g.layers[3:]] == [("GlobalAveragePool", "Flatten"), ("Gemm",)]


def test_residual_add_joins_latest_producer_and_graph_stays_acyclic() -> None:
    g = build_graph(residual_block())
    assert [layer.ops for layer in g.layers] == [("Conv", "Relu"), ("Conv", "Add", "Relu")]
    assert g.layers[1].inputs == ("ar", "x") or set(g.layers[1].inputs) == {"ar", "x"}
    x = g.tensor["x"]
    assert x.producer is None and x.consumers == (0, 1)
    for layer in g.layers:
        assert all(p < layer.id for p in g.preds[layer.id])


def test_tensor_facts_and_symbolic_batch() -> None:
    g = build_graph(conv_bn_relu_chain(2))
    r0 = g.tensor["r0"]
    assert r0.dtype == "float32"
    assert r0.shape == ("N", 4, 5, 5)
    assert r0.bytes_per_sample == 4 * 5 * 5 * 4
    assert r0.producer == 0 and r0.consumers == (1,)
    y = g.tensor["y"]
    assert y.is_output and y.consumers == () and y.bytes_per_sample == 3 * 4
    # tensors inside a layer (conv -> bn) are not listed: they never cross a cut
    assert "c0" not in g.tensor and "b0" not in g.tensor


def test_flops_and_params_are_exact_for_conv_and_gemm() -> None:
    g = build_graph(conv_bn_relu_chain(1))
    conv = g.layers[0]
    macs = 4 * 5 * 5 * 4 * 3 * 3  # out elems x C_in x kernel
    elems = 4 * 5 * 5
    assert conv.flops == 2 * macs + 2 * elems + elems  # conv + BN + Relu
    assert conv.param_bytes == (4 * 4 * 3 * 3 + 4 * 4) * 4
    gemm = g.layers[-1]
    assert gemm.flops == 2 * 3 * 4
    assert gemm.param_bytes == 3 * 4 * 4


def test_constant_subgraph_is_folded_into_its_consumer() -> None:
    shape = numpy_helper.from_array(np.array([4, 4, 1, 1], dtype=np.int64), "wshape")
    nodes = [
        helper.make_node("ConstantOfShape", ["wshape"], ["w"], value=helper.make_tensor("v", TensorProto.FLOAT, [1], [0.5])),
        helper.make_node("Conv", ["x", "w"], ["y"], name="conv"),
    ]
    g = build_graph(_model(nodes, [_vi("x")], [_vi("y")], [shape], opset=11))
    assert len(g) == 1
    assert g.layers[0].nodes == ("conv",)
    assert g.layers[0].const_nodes == ("ConstantOfShape_0",)
    assert g.layers[0].param_bytes == 16 * 4  # the generated weight, not its shape vector


def test_unknown_op_gets_a_layer_with_unknown_flops() -> None:
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="relu"),
        helper.make_node("Hardmax", ["a"], ["y"], name="mystery", axis=1),
    ]
    g = build_graph(_model(nodes, [_vi("x")], [_vi("y")], []))
    assert [layer.ops for layer in g.layers] == [("Relu",), ("Hardmax",)]
    assert g.layers[1].flops is None


def test_custom_domain_op_is_not_an_error() -> None:
    nodes = [helper.make_node("Frobnicate", ["x"], ["y"], name="custom", domain="com.example")]
    model = helper.make_model(
        helper.make_graph(nodes, "t", [_vi("x")], [_vi("y")]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)],
    )
    g = build_graph(model)
    assert len(g) == 1 and g.layers[0].flops is None


def test_json_round_trip_is_exact() -> None:
    g = build_graph(residual_block())
    again = LayerGraph.from_json(g.to_json())
    assert again == g
    assert again.preds == g.preds


@pytest.mark.parametrize("name", ZOO_MODELS)
def test_zoo_models_build(name: str) -> None:
    g = build_graph(zoo_path(name), name=name)
    assert len(g) > 5
    assert all(layer.flops is not None for layer in g.layers)
    assert all(t.bytes_per_sample for t in g.tensors)
    assert g.tensor[g.inputs[0]].shape == ("N", 3, 224, 224)
    assert LayerGraph.from_json(g.to_json()) == g


def test_resnet50_flops_match_the_published_count() -> None:
    g = build_graph(zoo_path("resnet50"))
    # ResNet-50 is ~4.1 GMACs = ~8.2 GFLOPs
    assert 7.9e9 < g.total_flops < 8.5e9


# -- bad input ------------------------------------------------------------------


def test_not_onnx_file(tmp_path) -> None:
    p = tmp_path / "notes.onnx"
    p.write_text("this is not a model")
    with pytest.raises(PartitionError, match="not a readable ONNX model"):
        load_model(p)


def test_truncated_protobuf(tmp_path) -> None:
    data = conv_bn_relu_chain(2).SerializeToString()
    p = tmp_path / "cut.onnx"
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(PartitionError, match="truncated|not a readable|no graph"):
        build_graph(p)


def test_missing_file(tmp_path) -> None:
    with pytest.raises(PartitionError, match="does not exist"):
        load_model(tmp_path / "nope.onnx")


def test_shapes_cannot_be_inferred() -> None:
    nodes = [helper.make_node("Add", ["x", "z"], ["y"], name="bad_add")]
    inputs = [_vi("x", (1, 3)), _vi("z", (1, 4))]
    with pytest.raises(PartitionError, match="cannot be inferred"):
        build_graph(_model(nodes, inputs, [_vi("y", (1, 3))], []))


def test_undefined_tensor_is_named() -> None:
    nodes = [helper.make_node("Relu", ["ghost"], ["y"], name="r")]
    with pytest.raises(PartitionError, match="'ghost'"):
        build_graph(_model(nodes, [_vi("x")], [_vi("y")], []))


def test_cycle_is_detected() -> None:
    nodes = [
        helper.make_node("Add", ["x", "b"], ["a"], name="n1"),
        helper.make_node("Relu", ["a"], ["b"], name="n2"),
    ]
    graph = helper.make_graph(nodes, "cyc", [_vi("x")], [_vi("b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(PartitionError, match="cycle"):
        build_graph(model)


def test_model_with_only_initializers_as_inputs() -> None:
    w = numpy_helper.from_array(np.ones((1, 4, 5, 5), np.float32), "w")
    nodes = [helper.make_node("Relu", ["w"], ["y"], name="r")]
    with pytest.raises(PartitionError, match="no inputs"):
        build_graph(_model(nodes, [], [_vi("y")], [w]))


def test_file_path_gives_the_model_its_name(tmp_path) -> None:
    path = write(residual_block(), tmp_path / "tiny_res.onnx")
    assert build_graph(path).model == "tiny_res"
    assert isinstance(onnx.load(path), onnx.ModelProto)
