"""POST /v1/fleet/plan over real HTTP on 127.0.0.1: the plan; 400 naming the field for a spec that breaks
the OpenAPI document, 422 for one whose parts do not fit together."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest

from splitinfer.planner_http import PlannerHTTPServer, make_server
from tests.integration.test_planner_http import _request, serving
from tests.unit.test_fleet_spec import SPEC


@pytest.fixture()
def server(tmp_path) -> Iterator[PlannerHTTPServer]:
    yield from serving(make_server("127.0.0.1", 0, profiles_dir=str(tmp_path / "profiles")))


def test_fleet_plan_over_http(server: PlannerHTTPServer) -> None:
    code, body, ctype = _request(server, "POST", "/v1/fleet/plan", SPEC)
    assert code == 200 and ctype == "application/json"
    assert body["schema"] == "splitinfer.fleet-plan/1" and body["devices"] == 150
    assert isinstance(body["workers_needed"], int) and body["cloud"]["workers"] == 2
    code, doc, _ = _request(server, "GET", "/openapi.json")
    assert "/v1/fleet/plan" in doc["paths"] and set(doc["components"]["schemas"]["FleetSpec"]["properties"]) == set(SPEC)


@pytest.mark.parametrize("path, value, field, status", [
    (("cloud", "workers"), 0, "cloud.workers", 400),
    (("classes", 0, "fps"), -2, "classes[0].fps", 400),
    (("classes", 0, "device"), "rpi9", "classes[0].device", 422),
    (("classes", 0, "link", "rtt_ms"), 500, "models.resnet50.slo_ms", 422),
    (("classes", 0, "model"), "vgg", "classes[0].model", 422),
])
def test_bad_fleet_specs_get_400_or_422_with_the_message(server: PlannerHTTPServer, path, value, field: str,
                                                         status: int) -> None:
    d = copy.deepcopy(SPEC)
    node = d
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    code, body, _ = _request(server, "POST", "/v1/fleet/plan", d)
    assert code == status and body["field"] == field and field in body["error"]
    assert _request(server, "GET", "/healthz")[0] == 200  # the server lives on
