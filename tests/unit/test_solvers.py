"""Solver behaviour and every raise in planner.solvers."""

from __future__ import annotations

import pytest

from partitioner.graph import LayerGraph
from partitioner.synthetic import make_chain_graph, make_random_graph
from planner.errors import InfeasibleError, PlannerError
from planner.memory import head_memory_bytes
from planner.profile import Profile
from planner.solvers import solve, solve_chain_scan
from planner.synthetic import make_flops_profile
from planner.types import Constraints, Encoding, Link, Objective


def _setup(n: int = 6, seed: int = 1) -> tuple[LayerGraph, list[Profile]]:
    g = make_chain_graph(n, seed=seed)
    return g, [make_flops_profile(g, device="dev", gflops=5.0, compute_w=3.0, radio_tx_w=1.0, idle_w=0.2),
               make_flops_profile(g, device="cloud", gflops=5000.0, fixed_ms=1.0)]


FAST = Link(1e9, 1e9, 1.0)
SLOW = Link(1e4, 1e4, 100.0)


def test_fast_link_offloads_and_slow_link_stays_local() -> None:
    g, profiles = _setup()
    assert solve(g, profiles, FAST).edge_layers == ()
    assert len(solve(g, profiles, SLOW).edge_layers) == len(g)


def test_best_encoding_is_chosen() -> None:
    g, profiles = _setup()
    link = Link(2e6, 2e6, 5.0)
    encs = (Encoding(), Encoding("fp16"), Encoding("int8", "zstd"))
    plan = solve(g, profiles, link, encodings=encs)
    alone = {e.key: solve(g, profiles, link, encodings=(e,)).breakdown.total_ms for e in encs}
    assert plan.breakdown.total_ms == pytest.approx(min(alone.values()))
    assert plan.encoding.key == min(alone, key=alone.get)


def test_raw_input_stays_on_device() -> None:
    g, profiles = _setup()
    plan = solve(g, profiles, FAST, constraints=Constraints(raw_input_stays_on_device=True))
    assert "input" not in plan.boundary
    assert 0 in plan.edge_layers


def test_pins_and_first_k_local_keep_layers_on_the_device() -> None:
    g, profiles = _setup()
    plan = solve(g, profiles, FAST, constraints=Constraints(pinned_device_layers=frozenset({3})))
    assert set(plan.edge_layers) >= {0, 1, 2, 3}
    plan = solve(g, profiles, FAST, constraints=Constraints(first_k_local=2))
    assert set(plan.edge_layers) >= {0, 1}


def test_profile_memory_is_the_default_limit() -> None:
    g, (dev, cloud) = _setup()
    free = solve(g, [dev, cloud], SLOW)
    need = head_memory_bytes(g, free.edge_layers)
    small = Profile(**{**dev.__dict__, "memory_bytes": need - 1})
    plan = solve(g, [small, cloud], SLOW)
    assert head_memory_bytes(g, plan.edge_layers) <= need - 1
    assert plan.breakdown.total_ms >= free.breakdown.total_ms


def test_slo_trades_energy_for_latency() -> None:
    g = make_random_graph(9, seed=4)
    dev = make_flops_profile(g, device="dev", gflops=50.0, compute_w=0.1, radio_tx_w=5.0, idle_w=0.0)
    cloud = make_flops_profile(g, device="cloud", gflops=5000.0)
    link = Link(5e6, 5e6, 10.0)
    frugal = solve(g, [dev, cloud], link, Objective.ENERGY)
    fastest = solve(g, [dev, cloud], link, Objective.LATENCY)
    slo = (frugal.breakdown.total_ms + fastest.breakdown.total_ms) / 2
    if frugal.breakdown.total_ms > fastest.breakdown.total_ms:
        plan = solve(g, [dev, cloud], link, Objective.ENERGY, Constraints(latency_slo_ms=slo))
        assert plan.breakdown.total_ms <= slo
        assert plan.breakdown.energy_j >= frugal.breakdown.energy_j


def test_infeasible_slo_says_by_how_much() -> None:
    g, profiles = _setup()
    fastest = solve(g, profiles, SLOW).breakdown.total_ms
    with pytest.raises(InfeasibleError) as e:
        solve(g, profiles, SLOW, Objective.ENERGY, Constraints(latency_slo_ms=fastest / 2))
    err = e.value
    assert err.constraint == "latency_slo" and err.unit == "ms"
    assert err.required == pytest.approx(fastest) and err.limit == fastest / 2
    assert f"{fastest:.3f} ms" in str(err) and "raise the latency SLO (--slo)" in str(err)


@pytest.mark.parametrize("exact_limit", [0, 20000])
def test_infeasible_memory_names_the_pinned_layers(exact_limit: int) -> None:
    g, profiles = _setup()
    need = head_memory_bytes(g, range(4))
    with pytest.raises(InfeasibleError) as e:
        solve(g, profiles, FAST, constraints=Constraints(device_memory_bytes=need - 1, first_k_local=4),
              exact_limit=exact_limit)
    err = e.value
    assert err.constraint == "device_memory" and err.unit == "bytes"
    assert err.required == need and err.limit == need - 1
    assert "keeps layers 0-3 local" in str(err) and "raise --device-memory or unpin layers" in str(err)


def test_infeasible_together_but_not_alone() -> None:
    g, profiles = _setup()
    edge_only = solve(g, profiles, SLOW).breakdown.total_ms  # the only fast plan keeps layers local
    with pytest.raises(InfeasibleError) as e:
        solve(g, profiles, SLOW, Objective.ENERGY,
              Constraints(latency_slo_ms=edge_only * 1.01, device_memory_bytes=0))
    assert e.value.constraint == "combined"


def test_solve_raises_on_bad_inputs() -> None:
    g, profiles = _setup()
    with pytest.raises(PlannerError, match="encodings is empty"):
        solve(g, profiles, FAST, encodings=())
    with pytest.raises(PlannerError, match="pinned layer 99 does not exist") as e:
        solve(g, profiles, FAST, constraints=Constraints(pinned_device_layers=frozenset({99})))
    assert e.value.layer == 99
    with pytest.raises(PlannerError, match="first_k_local is 7"):
        solve(g, profiles, FAST, constraints=Constraints(first_k_local=7))
    with pytest.raises(PlannerError, match="objective is 'speed'"):
        solve(g, profiles, FAST, "speed")
    with pytest.raises(PlannerError, match="need 2 link"):
        solve(g, profiles + [profiles[1]], FAST)
    empty = LayerGraph("empty", (), (), (), ())
    with pytest.raises(PlannerError, match="has no layers"):
        solve(empty, profiles, FAST)


def test_chain_scan_raises_on_three_tiers() -> None:
    g, profiles = _setup()
    with pytest.raises(PlannerError, match="two tiers"):
        solve_chain_scan(g, profiles + [profiles[1]], FAST)


def test_throughput_uses_cloud_batching() -> None:
    g = make_chain_graph(5, seed=3)
    dev = make_flops_profile(g, device="dev", gflops=1e4)
    total = sum(t.ms for t in make_flops_profile(g, device="c", gflops=10.0).layers.values())
    cloud = make_flops_profile(g, device="cloud", gflops=10.0, batch_ms={8: 2 * total})
    plan = solve(g, [dev, cloud], FAST, Objective.THROUGHPUT)
    assert plan.breakdown.batch in (1, 8)
    no_batch = solve(g, [dev, make_flops_profile(g, device="cloud", gflops=10.0)], FAST, Objective.THROUGHPUT)
    assert plan.breakdown.period_ms <= no_batch.breakdown.period_ms


def test_infeasible_slo_reports_the_fastest_encoding() -> None:
    g, profiles = _setup()
    link = Link(1e5, 1e5, 5.0)
    encs = (Encoding(), Encoding("int8"))
    fastest = min(solve(g, profiles, link, encodings=(e,)).breakdown.total_ms for e in encs)
    with pytest.raises(InfeasibleError) as e:
        solve(g, profiles, link, Objective.ENERGY, Constraints(latency_slo_ms=fastest / 3), encs)
    assert e.value.required == pytest.approx(fastest)
