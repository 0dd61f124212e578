"""The random graphs and profiles the property tests and benchmarks are built on."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from partitioner.cuts import candidate_cuts, chain_points
from partitioner.graph import LayerGraph
from partitioner.synthetic import make_chain_graph, make_random_graph
from planner.synthetic import make_flops_profile, make_random_profile
from tests.strategies import graphs


@settings(max_examples=60, deadline=None)
@given(graphs(max_layers=40))
def test_random_graphs_are_valid_layer_graphs(g: LayerGraph) -> None:
    assert LayerGraph.from_json(g.to_json()) == g
    names = {t.name for t in g.tensors}
    for layer in g.layers:
        assert set(layer.inputs) <= names and set(layer.outputs) <= names
        for t in layer.inputs:
            info = g.tensor[t]
            assert layer.id in info.consumers
            assert info.producer is None or info.producer < layer.id  # topological
    for t in g.tensors:
        assert t.consumers or t.is_output, f"{t.name} is neither read nor an output"
        assert list(t.consumers) == sorted(set(t.consumers))
        assert (t.name in g.outputs) == t.is_output
        assert t.bytes_per_sample and t.bytes_per_sample > 0


def test_same_seed_same_graph_and_branches_exist() -> None:
    assert make_random_graph(30, seed=7) == make_random_graph(30, seed=7)
    assert make_random_graph(30, seed=7) != make_random_graph(30, seed=8)
    # with branches, some cuts are not prefixes of the topological order
    g = make_random_graph(30, seed=7, p_branch=0.5)
    prefixes = {frozenset(range(i)) for i in range(len(g) + 1)}
    assert any(c.device not in prefixes for c in candidate_cuts(g))


def test_chain_graph_is_a_chain() -> None:
    g = make_chain_graph(9, seed=3)
    assert chain_points(g) == tuple(range(9))
    assert all(len(layer.inputs) == 1 for layer in g.layers)


def test_taper_shrinks_late_tensors() -> None:
    g = make_random_graph(200, seed=1, taper=0.001, with_outputs=0)
    sizes = [g.tensor[f"t{i}"].bytes_per_sample for i in range(199)]
    assert max(sizes[150:]) < max(sizes[:50])


@pytest.mark.parametrize("kw, match", [({"n_layers": 0}, "n_layers is 0"), ({"max_fanin": 0}, "max_fanin is 0")])
def test_bad_arguments_raise(kw: dict, match: str) -> None:
    args = {"n_layers": 3, "seed": 0} | kw
    with pytest.raises(ValueError, match=match):
        make_random_graph(**args)


def test_profiles_cover_every_layer() -> None:
    g = make_random_graph(20, seed=2)
    p = make_random_profile(g, 3, corrections=True, batching=True)
    assert set(p.layers) == set(range(20)) and p.corrections is not None and p.batch_ms
    f = make_flops_profile(g, device="d", gflops=10.0)
    assert f.layers[4].ms == pytest.approx(g.layers[4].flops / 10e9 * 1e3)
