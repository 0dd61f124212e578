"""Cuts: validity, boundaries, chain points, tiers; plus properties on random DAGs."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partitioner import (
    Cut,
    PartitionError,
    boundary,
    build_graph,
    candidate_cuts,
    chain_points,
    cloud_outputs,
    device_outputs,
    down_closure,
    is_down_closed,
    make_cut,
    make_inputs,
    make_tiers,
    plan_memory,
    random_cut,
    split,
    split_tiers,
    verify,
)
from partitioner.build import node_names
from partitioner.zoo import ZOO_MODELS, zoo_path
from tests.onnx_models import random_dag, residual_block


def test_make_cut_names_the_missing_producer() -> None:
    g = build_graph(residual_block())
    with pytest.raises(PartitionError, match=r"layer 1 \(conv_b\) is on the device but its producer layer 0 \(conv_a\)"):
        make_cut(g, [1])


def test_make_cut_rejects_unknown_layers() -> None:
    g = build_graph(residual_block())
    with pytest.raises(PartitionError, match="unknown layer 7"):
        make_cut(g, [0, 7])
    with pytest.raises(PartitionError, match="not an integer"):
        make_cut(g, ["zero"])


def test_fanned_out_model_input_crosses_once() -> None:
    g = build_graph(residual_block())
    # layer 0 on the device: its output and the model input x (read by layer 1) cross
    cut = make_cut(g, [0])
    assert set(boundary(g, cut)) == {"ar", "x"}
    assert boundary(g, Cut(frozenset())) == ("x",)
    assert boundary(g, make_cut(g, [0, 1])) == ()
    assert device_outputs(g, make_cut(g, [0, 1])) == ("y",)
    assert cloud_outputs(g, cut) == ("y",)


def test_chain_points_exclude_skip_connections() -> None:
    g = build_graph(residual_block())
    # after layer 0, x still crosses to layer 1: not a chain point
    assert chain_points(g) == (1,)


def test_tiers_must_be_nested() -> None:
    g = build_graph(random_dag(3, 12))
    a = down_closure(g, [len(g) // 2])
    tiers = make_tiers(g, [sorted(a), list(range(len(g)))])
    assert tiers[0].device <= tiers[1].device
    bigger = sorted(down_closure(g, [len(g) - 1]))
    smaller = sorted(down_closure(g, [0]))
    if not set(bigger) <= set(smaller):
        with pytest.raises(PartitionError, match="nested"):
            make_tiers(g, [bigger, smaller])


def _brute_boundary(model, graph, cut: Cut) -> set[str]:
    """Crossing tensors computed on ONNX nodes, independently of the layer bookkeeping."""
    names = node_names(model)
    side = {}
    for layer in graph.layers:
        for n in layer.nodes:
            side[n] = layer.id in cut.device
    producer_on_device = {x: True for x in graph.inputs}
    for name, node in zip(names, model.graph.node):
        if name in side:
            for o in node.output:
                producer_on_device[o] = side[name]
    out = set()
    for name, node in zip(names, model.graph.node):
        if name in side and not side[name]:
            for x in node.input:
                if producer_on_device.get(x):
                    out.add(x)
    return out


def _all_down_sets(graph) -> list[frozenset[int]]:
    n = len(graph)
    return [
        frozenset(s)
        for k in range(n + 1)
        for s in itertools.combinations(range(n), k)
        if is_down_closed(graph, s)
    ]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), n=st.integers(2, 9))
def test_candidates_are_valid_and_boundary_matches_brute_force(seed: int, n: int) -> None:
    model = random_dag(seed, n)
    g = build_graph(model)
    for cut in candidate_cuts(g):
        assert is_down_closed(g, cut.device)
    for device in _all_down_sets(g) if len(g) <= 9 else []:
        cut = Cut(device)
        got = boundary(g, cut)
        assert len(got) == len(set(got)), "a crossing tensor was counted twice"
        assert set(got) == _brute_boundary(model, g, cut)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 14))
def test_memory_plan_never_overlaps_live_tensors(seed: int, n: int) -> None:
    g = build_graph(random_dag(seed, n))
    rng = random.Random(seed)
    for layers in (None, sorted(random_cut(g, rng).device)):
        plan = plan_memory(g, layers)
        allocs = plan.allocations
        for a, b in itertools.combinations(allocs, 2):
            if a.size_bytes and b.size_bytes and a.first_step <= b.last_step and b.first_step <= a.last_step:
                assert a.offset_bytes + a.size_bytes <= b.offset_bytes or b.offset_bytes + b.size_bytes <= a.offset_bytes
        live = [sum(x.size_bytes for x in allocs if x.first_step <= s <= x.last_step) for s in range(max(plan.steps, 1))]
        assert plan.lower_bound_bytes == max(live, default=0)
        assert plan.peak_bytes >= plan.lower_bound_bytes
        assert plan.peak_bytes <= plan.naive_bytes


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), n=st.integers(3, 12))
def test_segments_in_order_equal_the_whole_model(seed: int, n: int) -> None:
    model = random_dag(seed, n)
    g = build_graph(model)
    rng = random.Random(seed)
    x = make_inputs(model, g, seed=seed)
    cut = random_cut(g, rng)
    verify(model, list(split(model, cut, graph=g)), x, graph=g)
    inner = down_closure(g, sorted(cut.device)[: len(cut.device) // 2])
    tiers = make_tiers(g, [sorted(inner), sorted(cut.device)])
    verify(model, split_tiers(model, tiers, graph=g), x, graph=g)


@pytest.mark.parametrize("name", ZOO_MODELS)
def test_memory_plan_peak_within_10_percent_of_lower_bound(name: str) -> None:
    g = build_graph(zoo_path(name), name=name)
    plan = plan_memory(g)
    assert plan.peak_bytes <= 1.10 * plan.lower_bound_bytes
    assert plan.saving > 0.25
    assert np.isclose(plan.naive_bytes, sum(t.bytes_per_sample for t in g.tensors))


def test_big_segments_are_saved_with_external_weights(tmp_path, monkeypatch) -> None:
    """Models over 2 GB keep weights in a side file; the threshold is lowered to test it."""
    import onnx

    import partitioner.export as export

    model = residual_block()
    g = build_graph(model)
    head, tail = split(model, make_cut(g, [0]), graph=g)
    monkeypatch.setattr(export, "_TWO_GB", 16)
    export.save_segment(tail, tmp_path / "tail.onnx", external_min_bytes=0)
    assert (tmp_path / "tail.onnx.data").exists()
    loaded = onnx.load(str(tmp_path / "tail.onnx"))
    assert all(i.data_location == onnx.TensorProto.DEFAULT for i in loaded.graph.initializer)
    x = make_inputs(model, g, seed=2)
    reloaded = export.Segment(tail.index, tail.layers, tail.inputs, tail.outputs, loaded)
    verify(model, [head, reloaded], x, graph=g)


def test_cut_keys_round_trip() -> None:
    g = build_graph(random_dag(5, 12))
    rng = random.Random(5)
    for _ in range(20):
        cut = random_cut(g, rng)
        assert Cut.from_key(cut.key) == cut
    assert Cut(frozenset()).key == "L"
    assert Cut(frozenset({0, 1, 2, 5, 7, 8})).key == "L0-2_5_7-8"
    big = Cut(frozenset(range(0, 400, 2)))
    assert big.key.startswith("H") and Cut.from_key(big.key) is None
    with pytest.raises(PartitionError, match="malformed"):
        Cut.from_key("Lx-y")
