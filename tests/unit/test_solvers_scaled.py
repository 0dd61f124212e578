"""The compiled (integer-scaled, certified) min-cut path against the pure-Python solvers."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from partitioner.synthetic import make_random_graph
from planner import maxflow
from planner.costmodel import _stages, _summaries, _tables
from planner.maxflow import _scaled_min_cut, max_flow_edmonds_karp, min_cut, min_cut_dinic
from planner.mincut import _ones, _solve_labels
from planner.solvers import solve
from planner.synthetic import make_flops_profile
from planner.types import Encoding, Link
from tests.strategies import random_flow_network

pytest.importorskip("scipy")


def _cut(tails, heads, caps, side) -> float:
    return sum(c for u, v, c in zip(tails, heads, caps) if side[u] and not side[v])


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 30), st.integers(0, 2**31 - 1), st.floats(0.05, 0.6), st.sampled_from([0.0, 2.0, 4.0]))
def test_scaled_cut_is_certified_minimum_or_declined(n: int, seed: int, density: float, spread: float) -> None:
    """When the compiled path answers, its cut is a minimum cut (capacities spread over
    up to 8 decades included); when it declines, min_cut still answers exactly."""
    rng = random.Random(seed)
    tails, heads, caps = random_flow_network(rng, n, density, spread)
    assume(tails)
    s, t = 0, n - 1
    ref, _ = max_flow_edmonds_karp(n, tails, heads, caps, s, t)
    got = _scaled_min_cut(n, tails, heads, caps, s, t)
    if got is not None:
        flow, side = got
        assert side[s] and not side[t]
        assert flow == pytest.approx(ref, rel=1e-9, abs=1e-9)
        assert _cut(tails, heads, caps, side) == pytest.approx(ref, rel=1e-9, abs=1e-9)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(maxflow, "_SCALED_MIN_ARCS", 0)
        flow, side = min_cut(n, tails, heads, caps, s, t, list(range(n)))
    assert flow == pytest.approx(ref, rel=1e-9, abs=1e-9)
    assert _cut(tails, heads, caps, side) == pytest.approx(ref, rel=1e-9, abs=1e-9)


def test_scaled_path_answers_and_matches_dinic_on_a_planner_network() -> None:
    """On a real planner network (a 300-layer DAG at a slow link, where the input's
    flow spreads over the graph) the compiled path answers, with Dinic's cut."""
    g = make_random_graph(300, seed=2)
    dev = make_flops_profile(g, device="dev", gflops=20.0, fixed_ms=1.0)
    cloud = make_flops_profile(g, device="cloud", gflops=2000.0, fixed_ms=2.0)
    captured = []

    def spy(*args):
        captured.append(args)
        return min_cut_dinic(*args)

    for up_bps in (2e5, 1e7, 5e8):
        tb = _tables(g, [dev, cloud], (Link(up_bps, 2 * up_bps, 20.0),), Encoding())
        _solve_labels(tb, _ones(2), (0, 1), np.zeros(tb.n, dtype=bool), None, spy)
    for n, tails, heads, caps, s, t, _ in captured:
        got = _scaled_min_cut(n, tails, heads, caps, s, t)
        assert got is not None
        ref_flow, ref_side = min_cut_dinic(n, tails, heads, caps, s, t)
        assert got[0] == pytest.approx(ref_flow, rel=1e-9)
        # SciPy's residual, read like Dinic's, leaves the same (smallest) source side
        assert (got[1] == ref_side).all()


def test_declines_when_it_cannot_certify() -> None:
    """No rounds: no flow to certify the cut by, so it declines; min_cut falls back."""
    rng = random.Random(5)
    tails, heads, caps = random_flow_network(rng, 25, 0.3, 2.0)
    ref, _ = max_flow_edmonds_karp(25, tails, heads, caps, 0, 24)
    assert ref > 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(maxflow, "_SCALED_ROUNDS", 0)
        assert _scaled_min_cut(25, tails, heads, caps, 0, 24) is None
        mp.setattr(maxflow, "_SCALED_MIN_ARCS", 0)
        flow, side = min_cut(25, tails, heads, caps, 0, 24)
    assert flow == pytest.approx(ref, rel=1e-9)
    assert _cut(tails, heads, caps, side) == pytest.approx(ref, rel=1e-9)


def test_infinite_cut_is_declined() -> None:
    """A pinned-like infinite arc with no finite cut around it is never 'certified'."""
    assert _scaled_min_cut(3, [0, 1], [1, 2], [math.inf, math.inf], 0, 2) is None


def test_solve_same_plan_either_path() -> None:
    """The whole planner gives the same plan cost with or without the compiled path."""
    g = make_random_graph(400, seed=7, p_skip=0.5, taper=0.01)
    dev = make_flops_profile(g, device="dev", gflops=20.0, fixed_ms=0.5)
    cloud = make_flops_profile(g, device="cloud", gflops=2000.0, fixed_ms=1.0)
    for up_bps in (2e5, 3e6, 1e8):
        link = Link(up_bps, 2 * up_bps, 20.0)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(maxflow, "_SCALED_MIN_ARCS", 0)
            fast = solve(g, [dev, cloud], link)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(maxflow, "_SCALED_MIN_ARCS", 10**9)
            slow = solve(g, [dev, cloud], link)
        assert fast.breakdown.total_ms == pytest.approx(slow.breakdown.total_ms, rel=1e-12)
        tb = _tables(g, [dev, cloud], (link,), Encoding())
        for plan in (fast, slow):
            labels = np.array([0 if v in plan.edge_layers else 1 for v in range(len(g))])
            assert float(_summaries(tb, _stages(tb, labels[None, :]))["total"][0]) == pytest.approx(
                plan.breakdown.total_ms, rel=1e-12)
