"""Property tests: the solvers against brute force over every valid placement."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from partitioner.cuts import Cut, make_tiers
from partitioner.graph import LayerGraph
from planner.costmodel import evaluate
from planner.errors import InfeasibleError
from planner import maxflow
from planner.maxflow import max_flow_edmonds_karp, min_cut, min_cut_dinic
from planner.memory import head_memory_bytes
from planner.solvers import solve, solve_chain_scan
from planner.types import Constraints, Encoding, Link, Objective
from tests.strategies import chain_graphs, graphs, links, problems, profile_pairs, profiles_for, random_flow_network

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ENCODINGS = [(Encoding(),), (Encoding(), Encoding("fp16"), Encoding("int8", "zstd"))]


def _placements(graph: LayerGraph, k: int) -> list[tuple[Cut, ...]]:
    """Every chain of k-1 nested down-closed cuts, by plain recursion (no solver code)."""
    out = []
    labels = [0] * len(graph)

    def rec(v: int) -> None:
        if v == len(graph):
            out.append(tuple(Cut(frozenset(i for i, x in enumerate(labels) if x <= h)) for h in range(k - 1)))
            return
        lo = max((labels[p] for p in graph.preds[v]), default=0)
        for lab in range(lo, k):
            labels[v] = lab
            rec(v + 1)

    rec(0)
    return out


def _value(b, obj: Objective) -> float:
    return {Objective.LATENCY: b.total_ms, Objective.ENERGY: b.energy_j, Objective.THROUGHPUT: b.period_ms}[obj]


def _brute(graph, profiles, links_, obj, encodings, constraints=None, batches=(1,)):
    best = math.inf
    for cuts in _placements(graph, len(profiles)):
        if constraints is not None and not _feasible(graph, cuts, profiles, links_, constraints):
            continue
        for enc in encodings:
            for b in batches:
                best = min(best, _value(evaluate(graph, cuts, profiles, links_, enc, batch=b), obj))
    return best


def _feasible(graph, cuts, profiles, links_, c: Constraints) -> bool:
    dev = cuts[0].device
    pinned = set(c.pinned_device_layers) | set(range(c.first_k_local))
    if c.raw_input_stays_on_device:
        for name in graph.inputs:
            pinned |= set(graph.tensor[name].consumers)
    if not pinned <= dev:
        return False
    if c.device_memory_bytes is not None and head_memory_bytes(graph, dev) > c.device_memory_bytes:
        return False
    if c.latency_slo_ms is not None:
        if evaluate(graph, cuts, profiles, links_).total_ms > c.latency_slo_ms:
            return False
    return True


def _close(a: float, b: float) -> bool:
    return a == pytest.approx(b, rel=1e-7, abs=1e-9)


@SETTINGS
@given(st.data())
def test_latency_and_energy_optimum_equal_brute_force(data: st.DataObject) -> None:
    g, profiles, link = data.draw(problems(max_layers=9))
    encs = data.draw(st.sampled_from(ENCODINGS))
    for obj in (Objective.LATENCY, Objective.ENERGY):
        plan = solve(g, profiles, link, obj, encodings=encs)
        assert _close(_value(plan.breakdown, obj), _brute(g, profiles, link, obj, encs))
        assert evaluate(g, plan, profiles) == plan.breakdown


@SETTINGS
@given(st.data())
def test_push_relabel_path_equals_brute_force(data: st.DataObject) -> None:
    """The same optimum when push-relabel (not Dinic) finds every cut, pins included."""
    g, profiles, link = data.draw(problems(max_layers=9))
    c = Constraints(pinned_device_layers=frozenset(data.draw(st.lists(st.integers(0, len(g) - 1), max_size=1))),
                    raw_input_stays_on_device=data.draw(st.booleans()))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(maxflow, "_DINIC_PHASES", 0)
        for obj in (Objective.LATENCY, Objective.ENERGY):
            plan = solve(g, profiles, link, obj, c)
            assert _close(_value(plan.breakdown, obj), _brute(g, profiles, link, obj, (Encoding(),), c))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_three_tier_optimum_equals_brute_force(data: st.DataObject) -> None:
    g = data.draw(graphs(max_layers=6))
    dev, cloud = data.draw(profile_pairs(g))
    server = data.draw(profiles_for(g, "server", gflops=data.draw(st.floats(5.0, 500.0))))
    hops = (data.draw(links()), data.draw(links()))
    for obj in Objective:
        plan = solve(g, [dev, server, cloud], hops, obj)
        assert len(plan.cuts) == 2 and plan.cuts[0].device <= plan.cuts[1].device
        assert _close(_value(plan.breakdown, obj), _brute(g, [dev, server, cloud], hops, obj, (Encoding(),)))
        assert evaluate(g, plan, [dev, server, cloud]) == plan.breakdown
    heuristic = solve(g, [dev, server, cloud], hops, Objective.THROUGHPUT, exact_limit=0)
    brute = _brute(g, [dev, server, cloud], hops, Objective.THROUGHPUT, (Encoding(),))
    assert heuristic.breakdown.period_ms >= brute * (1 - 1e-9)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_throughput_exact_on_small_graphs_and_sound_on_big(data: st.DataObject) -> None:
    g = data.draw(graphs(max_layers=8))
    profiles = data.draw(profile_pairs(g, batching=data.draw(st.booleans())))
    link = data.draw(links())
    batches = (1,) + tuple(sorted(profiles[1].batch_ms or ()))
    brute = _brute(g, profiles, link, Objective.THROUGHPUT, (Encoding(),), batches=batches)
    plan = solve(g, profiles, link, Objective.THROUGHPUT)
    assert _close(plan.breakdown.period_ms, brute)
    assert evaluate(g, plan, profiles) == plan.breakdown
    heuristic = solve(g, profiles, link, Objective.THROUGHPUT, exact_limit=0)
    make_tiers(g, [c.device for c in heuristic.cuts])
    assert heuristic.breakdown.period_ms >= brute * (1 - 1e-9)
    assert evaluate(g, heuristic, profiles) == heuristic.breakdown


@SETTINGS
@given(st.data())
def test_more_bandwidth_never_worsens_the_optimum(data: st.DataObject) -> None:
    g, profiles, link = data.draw(problems(max_layers=12))
    factor = data.draw(st.floats(1.0, 100.0))
    faster = Link(link.up_bps * factor, link.down_bps * factor, link.rtt_ms, link.loss)
    for obj in Objective:
        slow = _value(solve(g, profiles, link, obj).breakdown, obj)
        fast = _value(solve(g, profiles, faster, obj).breakdown, obj)
        assert fast <= slow * (1 + 1e-9) + 1e-12


@SETTINGS
@given(st.data())
def test_chain_scan_equals_min_cut_on_chains(data: st.DataObject) -> None:
    g = data.draw(chain_graphs(max_layers=30))
    profiles = data.draw(profile_pairs(g))
    link = data.draw(links())
    encs = data.draw(st.sampled_from(ENCODINGS))
    for obj in (Objective.LATENCY, Objective.ENERGY):
        scan = solve_chain_scan(g, profiles, link, obj, encs)
        cut = solve(g, profiles, link, obj, encodings=encs)
        assert _close(_value(scan.breakdown, obj), _value(cut.breakdown, obj))
        assert evaluate(g, scan, profiles) == scan.breakdown
    if len(g) <= 12:
        scan = solve_chain_scan(g, profiles, link, Objective.THROUGHPUT)
        assert _close(scan.breakdown.period_ms, _brute(g, profiles, link, Objective.THROUGHPUT, (Encoding(),)))


@SETTINGS
@given(st.data())
def test_chain_scan_never_beats_min_cut_on_dags(data: st.DataObject) -> None:
    g, profiles, link = data.draw(problems(max_layers=14))
    scan = solve_chain_scan(g, profiles, link)
    best = solve(g, profiles, link)
    assert best.breakdown.total_ms <= scan.breakdown.total_ms * (1 + 1e-9)


@st.composite
def _constraints(draw: st.DrawFn, g: LayerGraph) -> Constraints:
    n = len(g)
    total = g.total_param_bytes + sum(t.bytes_per_sample or 0 for t in g.tensors)
    return Constraints(
        device_memory_bytes=draw(st.one_of(st.none(), st.integers(0, max(total, 1)))),
        pinned_device_layers=frozenset(draw(st.lists(st.integers(0, n - 1), max_size=2))),
        raw_input_stays_on_device=draw(st.booleans()),
        first_k_local=draw(st.integers(0, min(2, n))),
        latency_slo_ms=draw(st.one_of(st.none(), st.floats(1.0, 5000.0))),
    )


@SETTINGS
@given(st.data())
def test_constraints_respected_and_infeasible_exactly_when_nothing_fits(data: st.DataObject) -> None:
    g, profiles, link = data.draw(problems(max_layers=8))
    c = data.draw(_constraints(g))
    obj = data.draw(st.sampled_from(list(Objective)))
    brute = _brute(g, profiles, link, obj, (Encoding(),), c)
    try:
        plan = solve(g, profiles, link, obj, c)
    except InfeasibleError as e:
        assert brute == math.inf, f"solver says infeasible ({e}) but brute force found {brute}"
        assert e.constraint in ("latency_slo", "device_memory", "combined")
        return
    assert brute < math.inf
    assert _feasible(g, plan.cuts, profiles, link, c)
    assert _close(_value(plan.breakdown, obj), brute)


@SETTINGS
@given(st.data())
def test_big_graph_search_is_sound(data: st.DataObject) -> None:
    """With enumeration off, every returned plan still meets the constraints."""
    g, profiles, link = data.draw(problems(max_layers=8))
    c = data.draw(_constraints(g))
    obj = data.draw(st.sampled_from(list(Objective)))
    brute = _brute(g, profiles, link, obj, (Encoding(),), c)
    try:
        plan = solve(g, profiles, link, obj, c, exact_limit=0)
    except InfeasibleError as e:
        if e.constraint == "latency_slo":
            assert brute == math.inf  # the SLO check is exact
        return
    assert _feasible(g, plan.cuts, profiles, link, c)
    assert _value(plan.breakdown, obj) >= brute * (1 - 1e-9) - 1e-12


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 30), st.integers(0, 2**31 - 1), st.floats(0.05, 0.6))
def test_max_flow_implementations_agree(n: int, seed: int, density: float) -> None:
    rng = random.Random(seed)
    tails, heads, caps = random_flow_network(rng, n, density)
    assume(tails)
    s, t = 0, n - 1
    order = list(range(n))
    rng.shuffle(order)
    results = [f(n, tails, heads, caps, s, t) for f in (min_cut, min_cut_dinic, max_flow_edmonds_karp)]
    # push-relabel alone (no Dinic phases), seeded by a greedy pass along any order
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(maxflow, "_DINIC_PHASES", 0)
        results.append(min_cut(n, tails, heads, caps, s, t, order))
        results.append(min_cut(n, tails, heads, caps, s, t))
    # Dinic stopped after its first augmenting path, push-relabel finishing from that flow
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(maxflow, "_DINIC_WORK", 0)
        results.append(min_cut(n, tails, heads, caps, s, t, order))
    flows = [r[0] for r in results]
    assert flows[0] == pytest.approx(flows[1], rel=1e-9, abs=1e-9)
    for f in flows[2:]:
        assert flows[0] == pytest.approx(f, rel=1e-9, abs=1e-9)
    for _, side in results:
        assert side[s] and not side[t]
        cut = sum(c for u, v, c in zip(tails, heads, caps) if side[u] and not side[v])
        assert cut == pytest.approx(flows[0], rel=1e-9, abs=1e-9)
