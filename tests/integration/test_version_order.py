"""One version order over the wire: the gateway's Plan RPC (real gRPC on 127.0.0.1) and the
planner's HTTP service with `--registry` plan the version the registry serves as latest."""

from __future__ import annotations

import asyncio
import http.client
import json

import pytest

from cluster.gateway import Gateway, LocalPoolFactory
from cluster.protocol.client import SyncInferenceClient
from cluster.registry import Registry
from cluster.server import serve_in_thread
from splitinfer.planner_http import make_server
from tests.unit.test_version_order import MODELS, make_versions


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, int]]:
    root = str(tmp_path_factory.mktemp("registry"))
    return root, make_versions(root)


@pytest.mark.grpc
def test_the_gateways_plan_rpc_plans_the_registrys_latest(repo: tuple[str, dict[str, int]], tmp_path) -> None:
    root, layers = repo
    registry = Registry(root, cache_dir=str(tmp_path))
    registry.load_all()
    gateway = Gateway(registry, LocalPoolFactory())
    server = serve_in_thread(gateway)
    try:
        with SyncInferenceClient(server.address) as client:
            for model, versions in MODELS.items():
                for asked in ("", "latest"):
                    query = {"model": model, "version": asked, "edge": {"gflops": 1.0}, "uplink": 1e9,
                             "rtt": 5.0, "frontier": False}
                    answer = client.plan(query).plan
                    assert answer["version"] == versions[-1]
                    assert answer["plan"]["layers"] == layers[f"{model}@{versions[-1]}"]
    finally:
        asyncio.run_coroutine_threadsafe(gateway.close(), server._loop).result()
        server.stop()


def test_the_planner_http_service_plans_the_registrys_latest(repo: tuple[str, dict[str, int]]) -> None:
    root, layers = repo
    srv = make_server("127.0.0.1", 0, registry_dir=root)
    srv.start()
    try:
        for model, versions in MODELS.items():
            body = {"model": model, "edge": {"gflops": 1.0}, "cloud": {"gflops": 100.0}, "uplink": "1gbit"}
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
            try:
                conn.request("POST", "/v1/plan", body=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                answer = json.loads(resp.read())
            finally:
                conn.close()
            assert resp.status == 200, answer
            assert answer["layers"] == layers[f"{model}@{versions[-1]}"]
    finally:
        srv.shutdown()
        srv.server_close()
