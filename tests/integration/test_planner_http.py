"""The planner service over real HTTP on 127.0.0.1 (port 0), and the sweep plot."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from partitioner import build_graph
from planner.synthetic import make_flops_profile
from splitinfer.planner_http import PlannerHTTPServer, make_server, planner_main
from tests.onnx_models import random_dag, write

EDGE = {"gflops": 1.0, "fixed_ms": 0.3}
CLOUD = {"gflops": 100.0, "fixed_ms": 1.0}


@pytest.fixture()
def registry(tmp_path) -> str:
    d = tmp_path / "registry"
    (d / "dag" / "1").mkdir(parents=True)
    write(random_dag(7, 14), d / "dag" / "1" / "model.onnx")
    return str(d)


@pytest.fixture()
def server(registry: str, tmp_path) -> Iterator[PlannerHTTPServer]:
    yield from serving(make_server("127.0.0.1", 0, registry_dir=registry, profiles_dir=str(tmp_path / "profiles")))


def serving(srv: PlannerHTTPServer) -> Iterator[PlannerHTTPServer]:
    """`srv` started; shut down and closed when the generator closes (a fixture's body)."""
    srv.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def _request(srv: PlannerHTTPServer, method: str, path: str, body: Any = None,
             headers: dict[str, str] | None = None) -> tuple[int, Any, str]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    try:
        raw = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(method, path, body=raw, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, json.loads(data), resp.getheader("Content-Type") or ""
    finally:
        conn.close()


def _base(**kw: Any) -> dict[str, Any]:
    return {"model": "dag@1", "edge": EDGE, "cloud": CLOUD, "rtt": "10ms", **kw}


def test_health_models_and_openapi(server: PlannerHTTPServer) -> None:
    assert _request(server, "GET", "/healthz")[:2] == (200, {"status": "ok"})
    assert _request(server, "GET", "/readyz")[:2] == (200, {"status": "ready"})
    code, models, ctype = _request(server, "GET", "/v1/models")
    assert code == 200 and ctype == "application/json"
    assert {"name": "dag@1", "source": "registry"} in models["models"]
    code, spec, _ = _request(server, "GET", "/openapi.json")
    assert code == 200 and spec["openapi"].startswith("3.")
    assert set(spec["paths"]) >= {"/v1/plan", "/v1/sweep", "/v1/frontier", "/v1/models", "/v1/profiles",
                                  "/v1/profiles/{name}", "/openapi.json", "/healthz", "/readyz"}


def test_plan_sweep_frontier(server: PlannerHTTPServer) -> None:
    code, plan, _ = _request(server, "POST", "/v1/plan", _base(uplink="18.88mbit"))
    assert code == 200 and plan["schema"] == "splitinfer.plan/1"
    assert plan["link"]["up_bps"] == 18.88e6
    code, sweep, _ = _request(server, "POST", "/v1/sweep", _base(uplink_lo="0.1mbit", uplink_hi="1gbit", points=30))
    assert code == 200 and len(sweep["series"]["dag"]) == 30
    code, front, _ = _request(server, "POST", "/v1/frontier", _base(uplink_lo="0.1mbit", uplink_hi="1gbit"))
    assert code == 200
    # the sweep's exact breakpoints are the frontier's
    assert [b["up_bps"] for b in sweep["breakpoints"]] == pytest.approx(front["breakpoints_bps"])


@pytest.mark.parametrize("method, path, body, status", [
    ("POST", "/v1/plan", b"{oops", 400),
    ("POST", "/v1/plan", None, 400),
    ("POST", "/v1/plan", {"model": "resnet51", "edge": EDGE, "cloud": CLOUD, "uplink": 1e6}, 404),
    ("POST", "/v1/plan", _base(uplink="fast"), 400),
    ("POST", "/v1/plan", _base(uplink="1kbit", objective="energy", slo="0.001ms"), 422),
    ("PUT", "/v1/plan", {}, 405),
    ("GET", "/v2/plan", None, 404),
])
def test_errors_over_http(server: PlannerHTTPServer, method: str, path: str, body: Any, status: int) -> None:
    code, out, ctype = _request(server, method, path, body)
    assert code == status and ctype == "application/json"
    assert isinstance(out["error"], str) and out["error"]


@pytest.mark.parametrize("method", ["TRACE", "OPTIONS", "CONNECT", "BREW"])
def test_unsupported_method_gets_a_json_405_with_allow(server: PlannerHTTPServer, method: str) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request(method, "/v1/plan")
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert (resp.status, resp.getheader("Allow"), resp.getheader("Content-Type")) == (
            405, "POST", "application/json")
        assert body == {"error": f"{method} is not allowed on /v1/plan; use POST", "field": "(method)"}
        conn.request(method, "/v1/profiles/x")
        resp = conn.getresponse()
        resp.read()
        assert (resp.status, resp.getheader("Allow")) == (405, "GET, PUT")
    finally:
        conn.close()


def test_head_gets_the_headers_without_a_body(server: PlannerHTTPServer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("HEAD", "/healthz")
        resp = conn.getresponse()
        assert resp.status == 405 and resp.getheader("Allow") == "GET" and resp.read() == b""
        # the connection is still in step: the next answer is read whole
        conn.request("GET", "/healthz")
        assert json.loads(conn.getresponse().read()) == {"status": "ok"}
    finally:
        conn.close()


def test_a_request_http_server_refuses_gets_json(server: PlannerHTTPServer) -> None:
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nX-Long: " + b"a" * 70000 + b"\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431") and b"application/json" in head
    assert json.loads(body) == {"error": "Line too long", "field": "(request)"}


def test_bad_content_length(server: PlannerHTTPServer) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.putrequest("POST", "/v1/plan")
        conn.putheader("Content-Length", "many")
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 400 and "Content-Length" in json.loads(resp.read())["error"]
    finally:
        conn.close()


def test_profiles_persist_across_restarts(server: PlannerHTTPServer, registry: str, tmp_path) -> None:
    g = build_graph(f"{registry}/dag/1/model.onnx", name="dag@1")
    prof = make_flops_profile(g, device="jetson", gflops=20.0, fixed_ms=0.4)
    code, out, _ = _request(server, "PUT", "/v1/profiles/jetson", prof.to_dict())
    assert code == 200 and out["created"] is True
    assert (tmp_path / "profiles" / "jetson.json").exists()
    again = make_server("127.0.0.1", 0, registry_dir=registry, profiles_dir=str(tmp_path / "profiles"))
    again.start()
    try:
        code, listed, _ = _request(again, "GET", "/v1/profiles")
        assert [p["name"] for p in listed["profiles"]] == ["jetson"]
        code, plan, _ = _request(again, "POST", "/v1/plan", _base(uplink="5mbit", edge="jetson"))
        assert code == 200 and plan["edge_device"] == "jetson"
    finally:
        again.shutdown()
        again.server_close()


def test_concurrent_requests_share_one_graph(server: PlannerHTTPServer) -> None:
    results: list[int] = []
    lock = threading.Lock()

    def worker(i: int) -> None:
        code, _, _ = _request(server, "POST", "/v1/plan", _base(uplink=f"{i + 1}mbit"))
        with lock:
            results.append(code)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 12
    # concurrent first requests wait for one build
    assert server.service.graph_builds == 1


def test_sweep_plot_from_the_cli(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from splitinfer.plan_cmd import sweep_main

    png = tmp_path / "out" / "sweep.png"
    assert sweep_main(["squeezenet", "--edge", "5gflops", "--cloud", "200gflops", "--rtt", "20ms",
                       "--uplink", "0.1mbit..1gbit", "--points", "60", "--plot", str(png), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["breakpoints"]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_planner_main_usage() -> None:
    with pytest.raises(SystemExit) as e:
        planner_main([])
    assert e.value.code == 2
