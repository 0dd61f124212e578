"""The what-if service as pure functions: requests in, JSON-ready answers out (no sockets)."""

from __future__ import annotations

import json
import logging
import math

import pytest

from partitioner import Cut, build_graph
from planner.costmodel import evaluate
from planner.errors import InfeasibleError
from planner.whatif import FrontierRequest, InvalidRequestError, PlanRequest, Roofline, SweepRequest
from splitinfer.planner_api import NotFoundError, PlannerService, RequestError, UnitParsers, status_of
from planner.solvers import solve, solve_chain_scan
from planner.synthetic import make_flops_profile
from planner.types import Constraints, Encoding, Link
from splitinfer.plan_cmd import make_service
from tests.onnx_models import conv_bn_relu_chain, random_dag, write

EDGE = {"gflops": 2.0, "fixed_ms": 0.5}
CLOUD = {"gflops": 200.0, "fixed_ms": 1.0}


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> str:
    d = tmp_path_factory.mktemp("registry")
    write(conv_bn_relu_chain(3), d / "chain.onnx")
    for version in ("2", "10"):
        (d / "dag" / version).mkdir(parents=True)
        write(random_dag(3 if version == "2" else 4, 12), d / "dag" / version / "model.onnx")
    return str(d)


@pytest.fixture()
def service(registry: str) -> PlannerService:
    return make_service(registry_dir=registry)


def _base(model: str = "chain", **kw: object) -> dict:
    return {"model": model, "edge": EDGE, "cloud": CLOUD, "rtt": "5ms", **kw}


def _call(s: PlannerService, method: str, path: str, body: object = None) -> tuple[int, dict]:
    raw = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    r = s.handle(method, path, raw)
    return r.status, json.loads(r.to_json())


def test_plan_matches_the_solver_and_the_cost_model(service: PlannerService, registry: str) -> None:
    out = service.plan(_base("dag@2", uplink="10mbit", downlink=20e6))
    g = build_graph(f"{registry}/dag/2/model.onnx", name="dag@2")
    profs = [make_flops_profile(g, device="e", **EDGE), make_flops_profile(g, device="c", **CLOUD)]
    link = Link(10e6, 20e6, 5.0)
    want = solve(g, profs, link)
    assert out["edge_layers"] == list(want.edge_layers)
    assert out["predicted"]["total_ms"] == pytest.approx(want.breakdown.total_ms)
    for key in ("edge_layers", "boundary", "encoding", "objective", "predicted", "breakdown", "cuts"):
        assert key in out
    for key in ("edge_ms", "transfer_ms", "cloud_ms", "total_ms"):
        assert key in out["predicted"]
    edge_only = evaluate(g, Cut(frozenset(range(len(g)))), profs, link)
    assert out["baselines"]["edge_only"]["total_ms"] == pytest.approx(edge_only.total_ms)
    assert out["gain"]["edge_only"] == pytest.approx(edge_only.total_ms / want.breakdown.total_ms)
    assert out["gain"]["edge_only"] >= 1 - 1e-9 and out["gain"]["cloud_only"] >= 1 - 1e-9


def test_unit_strings_and_numbers_agree(service: PlannerService) -> None:
    a = service.plan(_base(uplink="18.88mbit", rtt="0.02s", device_memory="1MiB"))
    b = service.plan(_base(uplink=18.88e6, rtt=20, device_memory=1 << 20))
    assert a == b


def test_auto_encoding_is_never_worse_than_fp32(service: PlannerService) -> None:
    fp32 = service.plan(_base(uplink="1mbit"))
    auto = service.plan(_base(uplink="1mbit", encoding="auto"))
    assert auto["predicted"]["total_ms"] <= fp32["predicted"]["total_ms"] + 1e-9


@pytest.mark.parametrize("body, status, field", [
    (b"{not json", 400, "(body)"),
    (b"", 400, "(body)"),
    (b"[1, 2]", 400, "(body)"),
    (b'{"model": "chain", "edge": {"gflops": 2}, "cloud": {"gflops": 9}, "uplink": NaN}', 400, "uplink"),
    (b"[" * 100000, 400, "(body)"),
    ({"edge": EDGE, "cloud": CLOUD, "uplink": 1e6}, 400, "model"),
    (_base(), 400, "uplink"),
    (_base(uplink="18.88mbps"), 400, "uplink"),
    (_base(uplink=True), 400, "uplink"),
    (_base(uplink=0), 400, "uplink"),
    (_base(uplink="1mbit", rtt="soon"), 400, "rtt"),
    (_base(uplink="1mbit", uplnk=3), 400, "uplnk"),
    (_base(uplink="1mbit", objective="speed"), 400, "objective"),
    (_base(uplink="1mbit", encoding="bf16"), 400, "encoding"),
    (_base(uplink="1mbit", first_k_local=-1), 400, "first_k_local"),
    (_base(uplink="1mbit", first_k_local=10**6), 422, "first_k_local"),
    (_base(uplink="1mbit", pinned_device_layers=[999]), 422, "pinned_device_layers"),
    (_base(uplink="1mbit", pinned_device_layers="0"), 400, "pinned_device_layers"),
    (_base(uplink="1mbit", keep_input_local="yes"), 400, "keep_input_local"),
    (_base(uplink="1mbit", device_memory="lots"), 400, "device_memory"),
    (_base(uplink="1mbit", edge=[1]), 400, "edge"),
    (_base(uplink="1mbit", edge={"gflops": -1}), 400, "edge.gflops"),
    (_base(uplink="1mbit", edge={"speed": 1}), 400, "edge.gflops"),
    (_base(uplink="1mbit", edge={"gflops": 1, "watts": 2}), 400, "edge.watts"),
    (_base(uplink="1mbit", cloud={"schema": "splitinfer.profile/1", "device": "x", "layers": {"0": {}}}), 422,
     "cloud.layers.0.ms"),
    (_base("resnet51", uplink="1mbit"), 404, "model"),
    (_base(uplink="1mbit", edge="rpi9"), 404, "edge"),
])
def test_bad_plan_requests_name_the_field(service: PlannerService, body: object, status: int, field: str) -> None:
    code, out = _call(service, "POST", "/v1/plan", body)
    assert (code, out.get("field")) == (status, field), out
    assert out["error"]


def test_infeasible_says_which_constraint_and_by_how_much(service: PlannerService) -> None:
    code, out = _call(service, "POST", "/v1/plan", _base(uplink="1kbit", objective="energy", slo="0.1ms"))
    assert code == 422
    assert out["constraint"] == "latency_slo" and out["unit"] == "ms"
    assert out["limit"] == 0.1 and out["excess"] == pytest.approx(out["required"] - 0.1)
    assert out["excess"] > 0


def test_profiles_put_list_get_and_use(registry: str) -> None:
    saved: list[str] = []
    s = make_service(registry_dir=registry, on_profile_saved=lambda name, p: saved.append(name))
    g = s.graph("chain")
    edge = make_flops_profile(g, device="board", gflops=2.0, fixed_ms=0.5)
    code, out = _call(s, "PUT", "/v1/profiles/board-1", edge.to_dict())
    assert (code, out["created"], out["layers"]) == (200, True, len(g))
    assert saved == ["board-1"]
    code, listed = _call(s, "GET", "/v1/profiles")
    assert [p["name"] for p in listed["profiles"]] == ["board-1"]
    assert _call(s, "GET", "/v1/profiles/board-1") == (200, json.loads(edge.to_json()))
    by_name = s.plan(_base(uplink="5mbit", edge="board-1"))
    inline = s.plan(_base(uplink="5mbit"))
    assert by_name["predicted"] == inline["predicted"]
    assert by_name["edge_device"] == "board"


def test_profile_put_errors(service: PlannerService) -> None:
    g = service.graph("chain")
    good = make_flops_profile(g, device="x", gflops=1.0).to_dict()
    assert _call(service, "PUT", "/v1/profiles/..%2F", good)[0] == 400
    code, out = _call(service, "PUT", "/v1/profiles/ok", {**good, "schema": "v0"})
    assert (code, out["field"]) == (422, "schema")
    assert _call(service, "PUT", "/v1/profiles/ok", [good])[0] == 400
    assert _call(service, "GET", "/v1/profiles/missing")[0] == 404


def test_a_profile_of_another_model_is_refused(service: PlannerService) -> None:
    g = service.graph("chain")
    _call(service, "PUT", "/v1/profiles/small", make_flops_profile(g, device="x", gflops=1.0).to_dict())
    code, out = _call(service, "POST", "/v1/plan", _base("dag@2", uplink="1mbit", edge="small"))
    assert code == 422 and out["field"] == "edge"
    assert "has no time for layer" in out["error"]


def test_graphs_are_cached(service: PlannerService) -> None:
    for up in ("1mbit", "2mbit", "3mbit"):
        service.plan(_base(uplink=up))
    service.sweep(_base(uplink_lo="1mbit", uplink_hi="2mbit", points=3))
    assert service.graph_builds == 1


def test_models_list_zoo_and_registry(service: PlannerService) -> None:
    names = {(m["name"], m["source"]) for m in service.models()["models"]}
    assert {("resnet50", "zoo"), ("chain", "registry"), ("dag@2", "registry"), ("dag@10", "registry"),
            ("dag", "registry")} <= names
    # a bare name is the highest version in natural order (10 > 2)
    assert service.workspace.model_path("dag") == service.workspace.model_path("dag@10")


def test_sweep_series_are_ordered_and_the_frontier_is_exact(service: PlannerService, registry: str) -> None:
    out = service.sweep(_base("dag@2", uplink_lo="0.1mbit", uplink_hi="1gbit", points=40))
    assert out["method"] == "frontier"
    s = out["series"]
    for e, c, ch, d in zip(s["edge_only"], s["cloud_only"], s["chain"], s["dag"]):
        assert d <= ch * (1 + 1e-9) <= min(e, c) * (1 + 1e-9) + 1e-9
    ups = out["uplink_bps"]
    assert ups[0] == pytest.approx(1e5) and ups[-1] == pytest.approx(1e9)
    bps = [b["up_bps"] for b in out["breakpoints"]]
    assert bps == sorted(bps) and all(1e5 <= b <= 1e9 for b in bps) and all(b["exact"] for b in out["breakpoints"])
    # the frontier's answer at a sample equals a fresh solve there
    g = service.graph("dag@2")
    profs = [service.workspace.profile(g, Roofline(**EDGE), "edge"), service.workspace.profile(g, Roofline(**CLOUD), "cloud")]
    for i in (0, 13, 27, 39):
        plan = solve(g, profs, Link(ups[i], ups[i], 5.0))
        assert s["dag"][i] == pytest.approx(plan.breakdown.total_ms, rel=1e-9)


@pytest.mark.parametrize("objective, encoding", [("latency", "fp32"), ("energy", "auto")])
def test_sweep_baselines_equal_direct_evaluation_at_every_point(service: PlannerService, objective: str,
                                                                encoding: str) -> None:
    # the sweep fills the affine series from a few evaluations; check every sample
    edge = {**EDGE, "compute_w": 4.0, "radio_tx_w": 1.5, "idle_w": 0.4}
    out = service.sweep(_base("dag@2", edge=edge, uplink_lo="10kbit", uplink_hi="1gbit", points=30,
                              objective=objective, encoding=encoding, down_ratio=3.0))
    g = service.graph("dag@2")
    profs = [service.workspace.profile(g, Roofline(**edge), "edge"), service.workspace.profile(g, Roofline(**CLOUD), "cloud")]
    encs = [Encoding(p) for p in (("fp32", "fp16", "int8") if encoding == "auto" else ("fp32",))]

    def metric(b: object) -> float:
        return b.total_ms if objective == "latency" else b.energy_j * 1000.0  # type: ignore[attr-defined]

    for i, up in enumerate(out["uplink_bps"]):
        link = Link(up, 3.0 * up, 5.0)
        chain = solve_chain_scan(g, profs, link, objective, encs)
        assert out["series"]["chain"][i] == pytest.approx(metric(chain.breakdown), rel=1e-9)
        cloud = min(metric(evaluate(g, Cut(frozenset()), profs, link, e)) for e in encs)
        assert out["series"]["cloud_only"][i] == pytest.approx(cloud, rel=1e-9)
        edge_only = evaluate(g, Cut(frozenset(range(len(g)))), profs, link, encs[0])
        assert out["series"]["edge_only"][i] == pytest.approx(metric(edge_only), rel=1e-9)


def test_sweep_with_a_fixed_downlink_solves_per_point(service: PlannerService) -> None:
    out = service.sweep(_base(uplink_lo="1mbit", uplink_hi="100mbit", points=6, downlink="50mbit"))
    assert out["method"] == "per-point" and out["solves"] == 6
    assert set(out["downlink_bps"]) == {50e6}
    assert all(not b["exact"] for b in out["breakpoints"])


def test_sweep_marks_infeasible_points_as_null(service: PlannerService) -> None:
    # a very slow device: only offloading meets the SLO, and only on a fast link
    body = _base(uplink_lo="1kbit", uplink_hi="1gbit", points=8, objective="energy", slo="20ms",
                 edge={"gflops": 1e-5})
    out = service.sweep(body)
    dag = out["series"]["dag"]
    assert dag[0] is None and dag[-1] is not None


def test_throughput_sweep_and_frontier_refusal(service: PlannerService) -> None:
    out = service.sweep(_base(uplink_lo="1mbit", uplink_hi="10mbit", points=3, objective="throughput"))
    assert out["metric"] == "period_ms" and out["method"] == "per-point"
    code, err = _call(service, "POST", "/v1/frontier", _base(uplink_lo="1mbit", uplink_hi="2mbit",
                                                             objective="throughput"))
    assert (code, err["field"]) == (400, "objective")


def test_frontier_endpoint(service: PlannerService) -> None:
    code, out = _call(service, "POST", "/v1/frontier", _base(uplink_lo="0.1mbit", uplink_hi="1gbit"))
    assert code == 200
    assert out["breakpoints_bps"] == [e["up_lo_bps"] for e in out["entries"][1:]]
    code, err = _call(service, "POST", "/v1/frontier", _base(uplink_lo="2mbit", uplink_hi="1mbit"))
    assert (code, err["field"]) == (422, "uplink_hi")


def test_requests_round_trip() -> None:
    units = make_service().units
    for cls, body in (
        (PlanRequest, _base(uplink="1mbit", slo="30ms", device_memory="2MiB", pinned_device_layers=[1, 0])),
        (SweepRequest, _base(uplink_lo="1mbit", uplink_hi="1gbit", points=7, downlink="3mbit")),
        (FrontierRequest, _base(uplink_lo="1mbit", uplink_hi="1gbit", down_ratio=2.0, encoding="auto")),
    ):
        req = cls.from_dict(body, units.quantity_text())
        assert cls.from_dict(json.loads(json.dumps(req.to_dict()))) == req
    assert PlanRequest.from_dict(_base(uplink=1e6, rtt=5)).scenario.constraints == Constraints()
    assert [e.precision for e in FrontierRequest.from_dict(
        _base(uplink_lo=1, uplink_hi=2, encoding="auto", rtt=5)).scenario.encodings] == ["fp32", "fp16", "int8"]


def test_without_unit_parsers_strings_are_refused() -> None:
    with pytest.raises(InvalidRequestError) as e:
        PlanRequest.from_dict(_base(uplink="1mbit", rtt=5), UnitParsers().quantity_text())
    assert e.value.field == "uplink" and "plain numbers" in e.value.message


def test_routing_errors(service: PlannerService) -> None:
    assert _call(service, "DELETE", "/v1/plan")[0] == 405
    assert _call(service, "GET", "/v1/plan")[0] == 405
    assert _call(service, "DELETE", "/v1/profiles/x")[0] == 405
    assert _call(service, "GET", "/nope")[0] == 404
    assert _call(service, "GET", "/healthz") == (200, {"status": "ok"})
    assert _call(service, "GET", "/readyz?verbose=1") == (200, {"status": "ready"})
    assert _call(service, "POST", "/v1/plan", b"x" * ((16 << 20) + 1))[0] == 413


def test_unexpected_errors_are_500_with_a_generic_message(service: PlannerService, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    def boom(body: object) -> dict:
        raise RuntimeError("secret detail")

    monkeypatch.setattr(service, "plan", boom)
    with caplog.at_level(logging.ERROR, logger="splitinfer.planner_api.service"):
        code, out = _call(service, "POST", "/v1/plan", _base(uplink=1))
    assert code == 500 and "secret" not in out["error"]
    assert "secret detail" in caplog.text


def test_status_table() -> None:
    assert status_of(NotFoundError("x")) == 404
    assert status_of(RequestError("x", field="f", status=400)) == 400
    assert status_of(InfeasibleError("x", constraint="latency_slo")) == 422
    assert status_of(ValueError("x")) == 500


def test_answers_are_strict_json(service: PlannerService) -> None:
    r = service.handle("POST", "/v1/plan", json.dumps(_base(uplink="1mbit", objective="throughput")).encode())
    text = r.to_json()
    assert "Infinity" not in text and "NaN" not in text
    assert all(math.isfinite(v) for v in json.loads(text)["predicted"].values() if isinstance(v, float))


def test_encodings_are_passed_through(service: PlannerService) -> None:
    out = service.plan(_base(uplink="1mbit", encoding="int8", compression="zstd"))
    assert Encoding.from_dict(out["encoding"]) == Encoding("int8", "zstd")


def test_reference_devices_by_name(service: PlannerService) -> None:
    devices = pytest.importorskip("planner.devices")
    names = service.profiles()["reference_devices"]
    assert "rpi4" in names and "t4" in names
    out = service.plan({"model": "chain", "edge": "rpi4", "cloud": "t4", "uplink": "20mbit", "rtt": 10})
    g = service.graph("chain")
    want = solve(g, [devices.reference_profile("rpi4", g), devices.reference_profile("t4", g)],
                 Link(20e6, 20e6, 10.0))
    assert out["edge_device"] == "rpi4" and out["edge_layers"] == list(want.edge_layers)
    assert out["predicted"]["total_ms"] == pytest.approx(want.breakdown.total_ms)


def test_sweep_over_a_single_rate(service: PlannerService) -> None:
    # found by the OpenAPI fuzz test: lo == hi divided by zero
    out = service.sweep(_base(uplink_lo="5mbit", uplink_hi="5mbit", points=4))
    assert out["uplink_bps"] == [5e6] * 4 and len(set(out["series"]["dag"])) == 1
    assert out["breakpoints"] == []


def test_a_profile_with_an_infinite_time_says_finite_number(service: PlannerService) -> None:
    body = b'{"schema": "splitinfer.profile/1", "device": "x", "layers": {"0": {"ms": Infinity}}}'
    code, out = _call(service, "PUT", "/v1/profiles/inf", body)
    assert (code, out["field"]) == (422, "layers.0.ms")
    assert out["error"] == "profile field layers.0.ms is inf; it must be a finite number >= 0"


def test_profiles_too_large_to_add_up_get_a_422_not_nulls(service: PlannerService) -> None:
    huge = {"schema": "splitinfer.profile/1", "device": "x",
            "layers": {str(i): {"ms": 1.7e308} for i in range(len(service.graph("chain")))}}
    for path, extra in (("/v1/plan", {"uplink": "1mbit"}), ("/v1/frontier", {"uplink_lo": "1mbit", "uplink_hi": "2mbit"})):
        code, out = _call(service, "POST", path, _base(edge=huge, **extra))
        assert (code, out["field"]) == (422, "(profiles)"), out
        assert "is not a finite number" in out["error"]
