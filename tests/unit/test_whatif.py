"""The typed what-if API: requests and answers round-trip exactly through JSON, requests
refuse values outside the limits whoever builds them, and the core answers what the
solver and the cost model say."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partitioner import Cut
from planner.costmodel import evaluate
from planner.errors import InfeasibleError, PlannerError
from planner.solvers import solve
from planner.synthetic import make_flops_profile
from planner.types import COMPRESSIONS, Constraints, Link, Objective
from planner.whatif import (
    ENCODING_CHOICES, MAX_SWEEP_POINTS, FrontierRequest, InvalidRequestError, NotFoundError, PlanAnswer,
    PlanRequest, Roofline, Scenario, SweepAnswer, SweepRequest, Workspace, frontier, plan, sweep,
)
from planner.whatif import limits
from tests.onnx_models import conv_bn_relu_chain, random_dag, write

_SETTINGS = settings(max_examples=60, deadline=None, database=None, derandomize=True,
                     suppress_health_check=list(HealthCheck))


def _in(limit: limits.Limit) -> st.SearchStrategy[float]:
    return st.floats(limit.lo, limit.hi, exclude_min=limit.lo_open, allow_nan=False)


rooflines = st.builds(Roofline, _in(limits.GFLOPS), _in(limits.FIXED_MS), _in(limits.POWER), _in(limits.POWER),
                      _in(limits.POWER))
devices = st.one_of(st.sampled_from(["rpi4", "t4", "board-1"]), rooflines)
constraints = st.builds(
    Constraints,
    device_memory_bytes=st.none() | st.integers(0, 2 ** 60),
    pinned_device_layers=st.frozensets(st.integers(0, 500), max_size=4),
    raw_input_stays_on_device=st.booleans(),
    first_k_local=st.integers(0, limits.MAX_FIRST_K_LOCAL),
    latency_slo_ms=st.none() | _in(limits.POSITIVE_DURATION),
)


def scenarios(objectives: tuple[Objective, ...] = tuple(Objective)) -> st.SearchStrategy[Scenario]:
    return st.builds(
        Scenario, model=st.sampled_from(["resnet50", "dag@10", "m"]), edge=devices, cloud=devices,
        rtt_ms=_in(limits.DURATION), loss=_in(limits.LOSS), objective=st.sampled_from(objectives),
        encoding=st.sampled_from(ENCODING_CHOICES), compression=st.sampled_from(COMPRESSIONS),
        constraints=constraints)


def _ordered(draw: st.DrawFn) -> tuple[float, float]:
    a, b = draw(_in(limits.RATE)), draw(_in(limits.RATE))
    return min(a, b), max(a, b)


@st.composite
def sweep_requests(draw: st.DrawFn) -> SweepRequest:
    lo, hi = _ordered(draw)
    return SweepRequest(draw(scenarios()), lo, hi, draw(st.integers(2, MAX_SWEEP_POINTS)),
                        draw(_in(limits.DOWN_RATIO)), draw(st.none() | _in(limits.RATE)))


@st.composite
def frontier_requests(draw: st.DrawFn) -> FrontierRequest:
    lo, hi = _ordered(draw)
    return FrontierRequest(draw(scenarios((Objective.LATENCY, Objective.ENERGY))), lo, hi, draw(_in(limits.DOWN_RATIO)))


plan_requests = st.builds(PlanRequest, scenarios(), _in(limits.RATE), st.none() | _in(limits.RATE))


@pytest.mark.parametrize("strategy", [plan_requests, sweep_requests(), frontier_requests()],
                         ids=["plan", "sweep", "frontier"])
def test_requests_round_trip_exactly_through_json(strategy: st.SearchStrategy) -> None:
    @given(strategy)
    @_SETTINGS
    def check(req: PlanRequest | SweepRequest | FrontierRequest) -> None:
        assert type(req).from_json(req.to_json()) == req
        assert type(req).from_dict(json.loads(json.dumps(req.to_dict()))) == req

    check()


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    d = tmp_path_factory.mktemp("m")
    paths = {"chain": write(conv_bn_relu_chain(3), d / "chain.onnx"), "dag": write(random_dag(3, 12), d / "dag.onnx")}
    return Workspace(registry_models=lambda: paths)


EDGE, CLOUD = Roofline(2.0, 0.5, compute_w=4.0, radio_tx_w=1.5, idle_w=0.4), Roofline(200.0, 1.0)


def test_answers_round_trip_exactly_through_json(chain: Workspace) -> None:
    @given(st.sampled_from(["chain", "dag"]), _in(limits.RATE), st.sampled_from(list(Objective)),
           st.sampled_from(ENCODING_CHOICES), st.floats(0, 100))
    @settings(max_examples=25, deadline=None, database=None, derandomize=True)
    def check(model: str, up: float, objective: Objective, encoding: str, rtt: float) -> None:
        sc = Scenario(model, EDGE, CLOUD, rtt_ms=rtt, objective=objective, encoding=encoding)
        answer = chain.plan(PlanRequest(sc, up))
        assert PlanAnswer.from_json(answer.to_json()) == answer
        swept = chain.sweep(SweepRequest(sc, up / 100 if up >= 100 else 1.0, up, points=5))
        assert SweepAnswer.from_json(swept.to_json()) == swept

    check()
    g = chain.graph("chain")
    measured = PlanRequest(Scenario("chain", make_flops_profile(g, device="board", gflops=3.0, fixed_ms=0.1), "t4"), 1e6)
    assert PlanRequest.from_json(measured.to_json()) == measured


def test_the_core_answers_what_the_solver_and_the_cost_model_say(chain: Workspace) -> None:
    g = chain.graph("dag")
    profs = [make_flops_profile(g, device=EDGE.device, gflops=2.0, fixed_ms=0.5, compute_w=4.0, radio_tx_w=1.5,
                                idle_w=0.4), make_flops_profile(g, device=CLOUD.device, gflops=200.0, fixed_ms=1.0)]
    req = PlanRequest(Scenario("dag", EDGE, CLOUD, rtt_ms=5.0), 10e6, 20e6)
    answer = plan(req, g, profs)
    link = Link(10e6, 20e6, 5.0)
    assert answer.plan == solve(g, profs, link)
    edge_only = evaluate(g, Cut(frozenset(range(len(g)))), profs, link)
    assert answer.edge_only.total_ms == edge_only.total_ms
    assert answer.gain_vs_edge_only == edge_only.total_ms / answer.plan.breakdown.total_ms
    assert (answer.edge_device, answer.cloud_device, answer.layers) == ("roofline-2gflops", "roofline-200gflops", len(g))
    assert chain.plan(req) == answer  # the workspace resolves the same tiers
    f = frontier(FrontierRequest(req.scenario, 1e5, 1e9), g, profs)
    at = solve(g, profs, Link(10e6, 10e6, 5.0))
    assert f.plan_at(10e6).breakdown.total_ms == pytest.approx(at.breakdown.total_ms, rel=1e-9)
    s = sweep(SweepRequest(req.scenario, 1e5, 1e9, points=9), g, profs)
    assert len(s.dag) == 9 and s.method == "frontier" and s.uplink_bps[0] == 1e5 and s.uplink_bps[-1] == 1e9


@pytest.mark.parametrize("build, field", [
    (lambda sc: PlanRequest(sc, 0.0), "uplink"),
    (lambda sc: PlanRequest(sc, 1e6, 2e15), "downlink"),
    (lambda sc: SweepRequest(sc, 1e6, 1e7, points=1), "points"),
    (lambda sc: SweepRequest(sc, 1e6, 1e7, points=MAX_SWEEP_POINTS + 1), "points"),
    (lambda sc: SweepRequest(sc, 1e6, 1e7, down_ratio=0.0), "down_ratio"),
    (lambda sc: FrontierRequest(Scenario("m", "a", "b", objective=Objective.THROUGHPUT), 1e6, 1e7), "objective"),
    (lambda sc: Scenario("m", "a", "b", rtt_ms=-1.0), "rtt"),
    (lambda sc: Scenario("m", "a", "b", loss=1.0), "loss"),
    (lambda sc: Scenario("m", "a", "b", encoding="bf16"), "encoding"),
    (lambda sc: Scenario("m", "a", "b", compression="gzip"), "compression"),
    (lambda sc: Scenario("m", "a", "b", constraints=Constraints(latency_slo_ms=2e9)), "slo"),
    (lambda sc: Scenario("m", "a", "b", constraints=Constraints(first_k_local=limits.MAX_FIRST_K_LOCAL + 1)),
     "first_k_local"),
    (lambda sc: Scenario("", "a", "b"), "model"),
    (lambda sc: Roofline(0.0), "gflops"),
    (lambda sc: Roofline(1.0, idle_w=-1.0), "idle_w"),
])
def test_a_request_outside_its_limits_is_refused_naming_the_json_field(build, field: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        build(Scenario("m", "a", "b"))
    assert e.value.field == field and field in e.value.message


def test_a_range_upside_down_is_unservable_not_malformed() -> None:
    with pytest.raises(PlannerError) as e:
        SweepRequest(Scenario("m", "a", "b"), 2e6, 1e6)
    assert not isinstance(e.value, InvalidRequestError) and e.value.field == "uplink_hi"
    assert "swap them" in e.value.message


@pytest.mark.parametrize("body, field", [
    ({"model": "m", "edge": "a", "cloud": "b", "uplink": "1mbit"}, "uplink"),
    ({"model": "m", "edge": "a", "cloud": "b", "uplink": 1e6, "extra": 1}, "extra"),
    ({"model": "m", "edge": {"gflops": "fast"}, "cloud": "b", "uplink": 1e6}, "edge.gflops"),
    ({"model": "m", "edge": "a", "cloud": "b"}, "uplink"),
    ([1], "(body)"),
])
def test_from_dict_refuses_what_is_not_the_canonical_form(body: object, field: str) -> None:
    with pytest.raises(InvalidRequestError) as e:
        PlanRequest.from_dict(body)
    assert e.value.field == field


def test_the_quantity_text_hook_reads_unit_strings() -> None:
    seen: list[tuple[str, str, str]] = []

    def text(key: str, value: str, limit: limits.Limit) -> float:
        seen.append((key, value, limit.name))
        return 5e6

    req = PlanRequest.from_dict({"model": "m", "edge": "a", "cloud": "b", "uplink": "5mbit"}, text)
    assert req.up_bps == req.down_bps == 5e6 and seen == [("uplink", "5mbit", "rate")]


def test_the_workspace_names_what_it_does_not_know(chain: Workspace) -> None:
    with pytest.raises(NotFoundError) as e:
        chain.plan(PlanRequest(Scenario("nope", EDGE, CLOUD), 1e6))
    assert e.value.field == "model" and "chain" in e.value.message
    with pytest.raises(NotFoundError) as e:
        chain.plan(PlanRequest(Scenario("chain", "no-such-board", CLOUD), 1e6))
    assert e.value.field == "edge"
    g = chain.graph("chain")
    assert chain.put_profile("board", make_flops_profile(g, device="board", gflops=1.0)) is True
    assert chain.put_profile("board", make_flops_profile(g, device="board", gflops=1.0)) is False
    assert chain.plan(PlanRequest(Scenario("chain", "board", CLOUD), 1e6)).edge_device == "board"
    assert len(chain.graph("dag")) > len(g)
    with pytest.raises(PlannerError, match="has no time for layer") as e:
        chain.plan(PlanRequest(Scenario("dag", "board", CLOUD), 1e6))
    assert e.value.field == "edge"


def test_an_infeasible_request_says_which_constraint() -> None:
    ws = Workspace()
    sc = Scenario("squeezenet", Roofline(1e-5), CLOUD, objective=Objective.ENERGY,
                  constraints=Constraints(latency_slo_ms=0.1))
    with pytest.raises(InfeasibleError) as e:
        ws.plan(PlanRequest(sc, 1e3))
    assert e.value.constraint == "latency_slo"
