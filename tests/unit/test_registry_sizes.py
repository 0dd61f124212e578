"""The frontier of a model with symbolic H and W is planned at model.yaml's declared
shapes ([Note: planned at the declared shapes] in cluster/_registry_sizes.py), while its
tails keep the symbolic dims."""

from __future__ import annotations

import dataclasses
import logging

import onnx
import pytest

from cluster._registry_sizes import same_layers, sized_graph
from cluster.registry import Registry, RegistryError
from partitioner import build_graph
from planner import make_flops_profile
from tests.onnx_models import conv_bn_relu_chain
from tests.serving_models import any_hw_model

SHAPE = (1, 4, 8, 8)


def _version(root, yml: str):
    d = root / "hw" / "1"
    (d / "profiles").mkdir(parents=True)
    onnx.save(any_hw_model(), str(d / "model.onnx"))
    (d / "model.yaml").write_text(yml)
    graph = build_graph(any_hw_model(), input_shapes={"x": SHAPE})
    # A slow device and a fast cloud: the input is worth sending once the uplink is fast enough.
    (d / "profiles" / "device.json").write_text(make_flops_profile(graph, device="slow", gflops=1e-3).to_json())
    (d / "profiles" / "cloud.json").write_text(make_flops_profile(graph, device="fast", gflops=100.0).to_json())
    return d


def test_declared_shapes_give_the_frontier_sizes_and_the_tails_stay_symbolic(tmp_path):
    _version(tmp_path, "input_shapes: {x: [1, 4, 8, 8]}\n")
    lv = Registry(str(tmp_path)).load("hw", "1")
    sized = lv.files.sized_graph()
    assert all(t.bytes_per_sample == 4 * 8 * 8 * 4 for t in sized.tensors)
    assert lv.files.splitter().graph.tensor["x"].bytes_per_sample is None
    assert lv.frontier.source == "planner"
    [cloud_only] = lv.frontier.cuts  # sending x wins on a fast uplink: its size is known
    assert cloud_only.boundary == ("x",) and not cloud_only.edge_layers
    sent = [e["plan"] for e in lv.frontier.planner["entries"] if e["plan"]["boundary"]]
    assert sent and all(0 < p["breakdown"]["uplink_ms"] < 1e3 for p in sent)
    # The tail is cut from the graph without the sizes: it serves any H and W.
    tail = onnx.load(lv.files.tail_path(cloud_only.cut_id))
    dims = [d.dim_param or d.dim_value for d in tail.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["N", 4, "H", "W"]


def test_without_declared_shapes_no_cut_inside_the_cloud_is_planned(tmp_path):
    _version(tmp_path, "")
    lv = Registry(str(tmp_path)).load("hw", "1")
    assert lv.files.sized_graph() is lv.files.splitter().graph
    assert lv.frontier.cuts == ()  # every boundary is of unknown size, priced above any real one


def test_shapes_the_partitioner_refuses_name_model_yaml(tmp_path):
    d = _version(tmp_path, "input_shapes: {x: [1, 4, 8, 8]}\nfrontier: {default_cut_count: 1}\n")
    files = Registry(str(tmp_path)).load("hw", "1").files
    files.config = dataclasses.replace(files.config, input_shapes={"x": (1, 5, 8, 8)})  # dim 1 is 4 in the model
    with pytest.raises(RegistryError) as e:
        files.sized_graph()
    assert str(d / "model.yaml") in str(e.value) and "input_shapes" in str(e.value)


def test_a_graph_whose_layers_differ_is_not_planned_on(caplog):
    graph = build_graph(any_hw_model())
    assert same_layers(graph, build_graph(any_hw_model(), input_shapes={"x": SHAPE}))
    other = conv_bn_relu_chain(2)
    [name] = [i.name for i in other.graph.input if i.name not in {w.name for w in other.graph.initializer}]
    shape = tuple(d.dim_value or 1 for d in other.graph.input[0].type.tensor_type.shape.dim)
    with caplog.at_level(logging.WARNING, logger="cluster._registry_sizes"):
        assert sized_graph(other, graph, input_shapes={name: shape}, samples=None) is graph
    assert "the layers differ" in caplog.text


def test_the_gateways_plan_uses_the_declared_shapes(tmp_path):
    from cluster._plan import GatewayPlanner, read_query

    _version(tmp_path, "input_shapes: {x: [1, 4, 8, 8]}\n")
    lv = Registry(str(tmp_path)).load("hw", "1")
    query = read_query({"model": "hw", "version": "1", "edge": "rpi4", "uplink": 500e6, "rtt": 5.0, "frontier": False})
    answer = GatewayPlanner().plan(lv, query)  # without the shapes: InvalidArgument, "boundary of unknown size"
    assert answer["plan"]["breakdown"]["total_ms"] > 0
    assert lv.files.resolve_cut(answer["cut_id"]).device == frozenset(answer["plan"]["edge_layers"])
