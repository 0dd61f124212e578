"""The agent plans a model with symbolic input dims at model.yaml's declared sizes: the graph
the gateway ships model.yaml for is sized as the registry sizes its own, so the agent's
frontier can place the image codec the accuracy table measured."""

from __future__ import annotations

import io
import json

import numpy as np
import onnx

from edge_agent.engines import make_frontier
from edge_agent.model_inputs import declared_inputs, planning_graph
from partitioner import Cut, Splitter
from planner import make_flops_profile
from planner.accuracy import AccuracyEntry, AccuracyTable
from tests.onnx_models import image_classifier

L = Cut(frozenset()).key


def symbolic_image_model() -> onnx.ModelProto:
    """x [1, 3, H, W] -> Conv -> Relu -> GlobalAveragePool -> Flatten -> Gemm -> y [1, 5]."""
    return image_classifier("H", "W")


def _setup(tmp_path):
    path = str(tmp_path / "model.onnx")
    onnx.save(symbolic_image_model(), path)
    graph = Splitter(path).graph
    x_bytes = 3 * 64 * 64 * 4
    table = AccuracyTable("img", "f", 4, (AccuracyEntry(L, "jpeg@90", 0.995, "y", "rel_l2", 4, x_bytes / 20, 0.2),))
    front = {"schema": "splitinfer.registry-frontier/1", "source": "planner", "cuts": [], "min_agreement": 0.99,
             "planner": {"link_range": {"up_lo_bps": 1e4, "up_hi_bps": 1e9, "down_ratio": 4.0, "rtt_ms": 20.0,
                                        "loss": 0.0}}}
    files = {"accuracy.json": table.to_json().encode(), "frontier.json": json.dumps(front).encode()}
    return path, graph, files


def _frontier_keys(graph, files) -> set[str]:
    device = make_flops_profile(graph, device="slow", gflops=1e-3, unknown_flops_ms=0.0)
    cloud = make_flops_profile(graph, device="fast", gflops=100.0, unknown_flops_ms=0.0)
    files = files | {"profiles/cloud.json": cloud.to_json().encode()}
    return {e.plan.encoding.key for e in make_frontier(graph, device, files, "latency", ("fp32",)).entries}


def test_the_agent_plans_at_model_yaml_input_shapes_and_places_the_jpeg(tmp_path) -> None:
    path, graph, files = _setup(tmp_path)
    assert graph.bytes_total(["x"]).exact is None  # symbolic H, W: the frame's size is unknown
    assert "jpeg@90" not in _frontier_keys(planning_graph(path, graph, files), files)
    files |= {"model.yaml": b"input_shapes: {x: [1, 3, 64, 64]}\nmin_agreement: 0.99\n"}
    sized = planning_graph(path, graph, files)
    assert sized.bytes_total(["x"]).exact == 3 * 64 * 64 * 4
    assert [layer.nodes for layer in sized.layers] == [layer.nodes for layer in graph.layers]
    assert "jpeg@90" in _frontier_keys(sized, files)


def test_sample_inputs_shipped_beside_model_yaml_size_the_graph(tmp_path) -> None:
    path, graph, _ = _setup(tmp_path)
    buf = io.BytesIO()
    np.savez(buf, x=np.zeros((1, 3, 16, 24), np.float32))
    files = {"model.yaml": b"sample_inputs: inputs.npz\n", "inputs.npz": buf.getvalue()}
    shapes, samples = declared_inputs(files)
    assert shapes == {} and samples is not None and samples["x"].shape == (1, 3, 16, 24)
    assert planning_graph(path, graph, files).bytes_total(["x"]).exact == 3 * 16 * 24 * 4
    # model.yaml names a file the gateway did not ship: no sizes, no failure.
    assert declared_inputs({"model.yaml": b"sample_inputs: inputs.npz\n"}) == ({}, None)


def test_unusable_declared_inputs_leave_the_graph_unsized_and_say_why(tmp_path, caplog) -> None:
    path, graph, _ = _setup(tmp_path)
    for text in (b"input_shapes: [1, 3]\n", b"input_shapes: {x: [1, 3, 0, 4]}\n", b"input_shapes: {x: 1x3xAx4}\n",
                 b"{not: yaml: [\n", b"sample_inputs: s.npz\n"):
        files = {"model.yaml": text, "s.npz": b"not a zip"}
        assert planning_graph(path, graph, files) is graph
    assert caplog.text.count("planning without model.yaml's input sizes") == 5
    # A shape the model refuses (4 channels into a 3-channel conv) is logged, not raised.
    caplog.clear()
    assert planning_graph(path, graph, {"model.yaml": b"input_shapes: {x: [1, 4, 8, 8]}\n"}) is graph
    assert "planning without" in caplog.text or "layers differ" in caplog.text
    assert planning_graph(path, graph, {}) is graph
