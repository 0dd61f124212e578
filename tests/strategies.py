"""Hypothesis strategies for layer graphs, profiles and links, and random flow networks.

Graphs come from `partitioner.synthetic` keyed by a drawn seed, so a failure replays
exactly from the seed hypothesis prints. Profiles put the device slower than the
cloud by a drawn factor, and links span 0.1 Mbit/s to 1 Gbit/s, so the optimum moves
between edge-only, cloud-only and interior cuts.
"""

from __future__ import annotations

import math
import random

from hypothesis import strategies as st

from partitioner.graph import LayerGraph
from partitioner.synthetic import make_chain_graph, make_random_graph
from planner.profile import Profile
from planner.synthetic import make_random_profile
from planner.types import Link

__all__ = ["graphs", "chain_graphs", "profiles_for", "profile_pairs", "links", "problems", "random_flow_network"]


@st.composite
def graphs(draw: st.DrawFn, min_layers: int = 1, max_layers: int = 10) -> LayerGraph:
    n = draw(st.integers(min_layers, max_layers))
    seed = draw(st.integers(0, 2**31 - 1))
    return make_random_graph(
        n,
        seed=seed,
        max_fanin=draw(st.integers(1, 3)),
        p_skip=draw(st.sampled_from([0.0, 0.3, 0.7])),
        p_input_reuse=draw(st.sampled_from([0.0, 0.2])),
        with_outputs=draw(st.sampled_from([None, 0, 2])),
        max_tensor_bytes=draw(st.sampled_from([1 << 12, 1 << 16, 1 << 20])),
    )


@st.composite
def chain_graphs(draw: st.DrawFn, min_layers: int = 1, max_layers: int = 30) -> LayerGraph:
    return make_chain_graph(draw(st.integers(min_layers, max_layers)), seed=draw(st.integers(0, 2**31 - 1)),
                            max_tensor_bytes=draw(st.sampled_from([1 << 12, 1 << 16, 1 << 20])))


@st.composite
def profiles_for(draw: st.DrawFn, graph: LayerGraph, device: str = "device", *, gflops: float | None = None,
                 corrections: bool | None = None, batching: bool = False) -> Profile:
    return make_random_profile(
        graph,
        draw(st.integers(0, 2**31 - 1)),
        device=device,
        gflops=gflops if gflops is not None else draw(st.floats(1.0, 2000.0)),
        jitter=draw(st.sampled_from([0.0, 0.5, 1.5])),
        corrections=draw(st.booleans()) if corrections is None else corrections,
        batching=batching,
    )


@st.composite
def profile_pairs(draw: st.DrawFn, graph: LayerGraph, *, batching: bool = False) -> tuple[Profile, Profile]:
    dev_gflops = draw(st.floats(1.0, 100.0))
    speedup = draw(st.sampled_from([0.5, 2.0, 10.0, 100.0]))
    return (
        draw(profiles_for(graph, "device", gflops=dev_gflops)),
        draw(profiles_for(graph, "cloud", gflops=dev_gflops * speedup, batching=batching)),
    )


@st.composite
def links(draw: st.DrawFn) -> Link:
    up = draw(st.floats(1e5, 1e9))
    return Link(
        up_bps=up,
        down_bps=up * draw(st.sampled_from([0.5, 1.0, 4.0])),
        rtt_ms=draw(st.sampled_from([0.0, 5.0, 50.0])),
        loss=draw(st.sampled_from([0.0, 0.01])),
    )


@st.composite
def problems(draw: st.DrawFn, max_layers: int = 10) -> tuple[LayerGraph, tuple[Profile, Profile], Link]:
    g = draw(graphs(max_layers=max_layers))
    return g, draw(profile_pairs(g)), draw(links())


def random_flow_network(rng: random.Random, n: int, density: float, spread: float = 0.0
                        ) -> tuple[list[int], list[int], list[float]]:
    """Arcs (tails, heads, capacities) of a random `n`-node network for the max-flow solvers:
    each ordered pair an arc with probability `density`; capacities 0, small integers,
    reals spread over `spread` decades either side of 0-10, or infinite, except into the
    sink (node n - 1), where they are finite (as pins make from the source)."""
    tails, heads, caps = [], [], []
    for u in range(n):
        for v in range(n):
            if u != v and rng.random() < density:
                tails.append(u)
                heads.append(v)
                c = rng.choice([0.0, rng.uniform(0, 10) * 10 ** rng.uniform(-spread, spread),
                                rng.randint(1, 5), math.inf])
                caps.append(rng.uniform(0, 10) if v == n - 1 else c)
    return tails, heads, caps

