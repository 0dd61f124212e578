"""Kernels that ONNX Runtime runs inside an If, Loop or Scan are placed on that node's layer."""

from __future__ import annotations

from partitioner import build_graph
from partitioner.subgraphs import subgraphs
from tests.control_flow_models import if_model, loop_model, nested_model
from workers.profile import map_nodes


def _inner_names(node):
    out, stack = [], list(subgraphs(node))
    while stack:
        g = stack.pop()
        for n in g.node:
            if n.name:
                out.append(n.name)
            stack.extend(subgraphs(n))
    return out


def _name_inner_nodes(model):
    """Names for unnamed nodes in subgraphs (ORT's trace names every node)."""
    count = 0
    stack = [g for n in model.graph.node for g in subgraphs(n)]
    while stack:
        g = stack.pop()
        for n in g.node:
            if not n.name:
                n.name = f"{n.op_type}_inner{count}"
                count += 1
            stack.extend(subgraphs(n))
    return model


def test_nodes_inside_subgraphs_map_to_their_control_flow_layer():
    for model in (if_model(), loop_model(), nested_model()):
        model = _name_inner_nodes(model)
        g = build_graph(model)
        checked = 0
        for node in model.graph.node:
            inner = _inner_names(node)
            if not inner:
                continue
            placed = map_nodes(g, model, names=inner)  # the names a trace would hold
            layer = next(lay.id for lay in g.layers if node.name in lay.nodes)
            assert {placed.get(n) for n in inner} == {layer}, (model.graph.name, node.name)
            checked += len(inner)
        assert checked, model.graph.name
