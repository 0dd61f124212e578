"""The frontier: exactly the optima across the range, cheap lookups, exact JSON."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partitioner.synthetic import make_chain_graph
from planner.costmodel import evaluate
from planner.errors import PlannerError
from planner.frontier import Frontier, frontier
from planner.solvers import solve
from planner.synthetic import make_flops_profile
from planner.types import Encoding, Link, LinkRange, Objective
from tests.strategies import graphs, profile_pairs, profiles_for

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def link_ranges(draw: st.DrawFn) -> LinkRange:
    lo = draw(st.floats(1e4, 1e7))
    return LinkRange(lo, lo * draw(st.floats(1.0, 1e4)), draw(st.sampled_from([0.5, 1.0, 4.0])),
                     draw(st.sampled_from([0.0, 20.0])), draw(st.sampled_from([0.0, 0.02])))


def _value(plan, obj: Objective) -> float:
    b = getattr(plan, "breakdown", plan)
    return b.total_ms if obj is Objective.LATENCY else b.energy_j


def _samples(f: Frontier) -> list[float]:
    lr = f.link_range
    ups = list(np.geomspace(lr.up_lo_bps, lr.up_hi_bps, 12))
    for b in f.breakpoints_bps:
        ups += [b * (1 - 1e-6), b * (1 + 1e-6)]
    return [u for u in ups if lr.up_lo_bps <= u <= lr.up_hi_bps]


@SETTINGS
@given(st.data())
def test_frontier_plans_are_exactly_the_sampled_optima(data: st.DataObject) -> None:
    g = data.draw(graphs(max_layers=12))
    profiles = data.draw(profile_pairs(g))
    lr = data.draw(link_ranges())
    obj = data.draw(st.sampled_from([Objective.LATENCY, Objective.ENERGY]))
    encs = data.draw(st.sampled_from([(Encoding(),), (Encoding(), Encoding("int8"))]))
    f = frontier(g, profiles, lr, obj, encodings=encs)
    assert f.entries[0].up_lo_bps == lr.up_lo_bps and f.entries[-1].up_hi_bps == lr.up_hi_bps
    for a, b in zip(f.entries, f.entries[1:]):
        assert a.up_hi_bps == b.up_lo_bps and a.up_lo_bps <= a.up_hi_bps
        assert a.plan.key != b.plan.key
    assert f.solves <= 2 * len(f.entries) + 1
    seen = set()
    for up in _samples(f):
        got = f.plan_at(up)
        best = solve(g, profiles, lr.at(up), obj, encodings=encs)
        assert _value(got, obj) == pytest.approx(_value(best, obj), rel=1e-7, abs=1e-12)
        again = evaluate(g, got, profiles)
        assert _value(got, obj) == pytest.approx(_value(again, obj), rel=1e-9, abs=1e-12)
        assert got.breakdown.bottleneck == again.bottleneck
        seen.add(got.key)
    # every frontier plan is optimal somewhere: at its segment's geometric midpoint
    for e in f.entries:
        mid = math.sqrt(e.up_lo_bps * e.up_hi_bps)
        best = solve(g, profiles, lr.at(mid), obj, encodings=encs)
        assert _value(f.plan_at(mid), obj) == pytest.approx(_value(best, obj), rel=1e-7, abs=1e-12)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_frontier_round_trips_exactly(data: st.DataObject) -> None:
    g = data.draw(graphs(max_layers=10))
    profiles = data.draw(profile_pairs(g))
    f = frontier(g, profiles, data.draw(link_ranges()))
    back = Frontier.from_json(f.to_json())
    assert back == f
    up = math.sqrt(f.link_range.up_lo_bps * f.link_range.up_hi_bps)
    assert back.plan_at(up) == f.plan_at(up)


def test_three_tier_frontier_varies_the_first_hop() -> None:
    g = make_chain_graph(8, seed=2)
    dev = make_flops_profile(g, device="dev", gflops=20.0)
    server = make_flops_profile(g, device="server", gflops=200.0, fixed_ms=0.5)
    cloud = make_flops_profile(g, device="cloud", gflops=5000.0, fixed_ms=1.0)
    hop2 = Link(1e8, 1e8, 10.0)
    lr = LinkRange(1e5, 1e9, 1.0, 5.0)
    f = frontier(g, [dev, server, cloud], lr, next_links=(hop2,))
    for up in np.geomspace(1e5, 1e9, 9):
        best = solve(g, [dev, server, cloud], (lr.at(up), hop2))
        assert f.plan_at(up).breakdown.total_ms == pytest.approx(best.breakdown.total_ms, rel=1e-9)


def test_plan_at_clamps_outside_the_range_and_rejects_bad_rates() -> None:
    g = make_chain_graph(5, seed=1)
    profiles = [make_flops_profile(g, device="d", gflops=10.0), make_flops_profile(g, device="c", gflops=1e3)]
    lr = LinkRange(1e6, 1e7, 1.0, 10.0)
    f = frontier(g, profiles, lr)
    below = f.plan_at(1e5)
    assert below.cuts == f.entries[0].plan.cuts and below.link.up_bps == 1e5
    assert below.breakdown == evaluate(g, below, profiles) or below.breakdown.total_ms == pytest.approx(
        evaluate(g, below, profiles).total_ms)
    with pytest.raises(PlannerError, match="up_bps is 0"):
        f.plan_at(0)


def test_frontier_rejects_throughput() -> None:
    g = make_chain_graph(3, seed=1)
    profiles = [make_flops_profile(g, device="d", gflops=10.0), make_flops_profile(g, device="c", gflops=1e3)]
    with pytest.raises(PlannerError, match="latency and energy") as e:
        frontier(g, profiles, LinkRange(1e6, 1e7), Objective.THROUGHPUT)
    assert e.value.field == "objective"


def test_single_point_range() -> None:
    g = make_chain_graph(4, seed=5)
    profiles = [make_flops_profile(g, device="d", gflops=10.0), make_flops_profile(g, device="c", gflops=1e3)]
    f = frontier(g, profiles, LinkRange(3e6, 3e6, 1.0, 1.0))
    assert len(f.entries) == 1 and f.solves == 1
    assert f.plan_at(3e6).breakdown.total_ms == pytest.approx(
        solve(g, profiles, Link(3e6, 3e6, 1.0)).breakdown.total_ms)


def test_uses_profile_strategy() -> None:
    # profiles_for draws a usable profile for any graph (the lead's partitioner tests reuse it)
    @settings(max_examples=5, deadline=None)
    @given(st.data())
    def inner(data: st.DataObject) -> None:
        g = data.draw(graphs(max_layers=5))
        p = data.draw(profiles_for(g))
        assert set(p.layers) == set(range(len(g)))

    inner()
