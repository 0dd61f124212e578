"""The OpenAPI document: it lists exactly what the service reads and serves, and its
references resolve. (Responses are checked against it by tests/integration/test_openapi_fuzz.py.)"""

from __future__ import annotations

import json
from typing import Any

import pytest

from planner.service import PlannerService
from planner.service_openapi import make_openapi
from planner.service_requests import FrontierRequest, PlanRequest, SweepRequest


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return ([node["$ref"]] if "$ref" in node else []) + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def test_document_is_json_and_references_resolve() -> None:
    doc = json.loads(json.dumps(make_openapi(), allow_nan=False))
    assert doc["openapi"] == "3.0.3"
    schemas = doc["components"]["schemas"]
    for ref in _refs(doc):
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas, ref


@pytest.mark.parametrize("name, cls", [("PlanRequest", PlanRequest), ("SweepRequest", SweepRequest),
                                       ("FrontierRequest", FrontierRequest)])
def test_request_schemas_list_exactly_the_fields_read(name: str, cls: type) -> None:
    schema = make_openapi()["components"]["schemas"][name]
    assert set(schema["properties"]) == set(cls.FIELDS)
    assert schema["additionalProperties"] is False
    assert set(schema["required"]) <= set(cls.FIELDS)


def test_every_path_and_method_is_routed() -> None:
    svc = PlannerService()
    for path, item in make_openapi()["paths"].items():
        for method in item:
            if method == "parameters":
                continue
            concrete = path.replace("{name}", "probe")
            status = svc.handle(method.upper(), concrete, b"{}").status
            assert status not in (404, 405) or concrete == "/v1/profiles/probe", (method, path, status)
            documented = {int(c) for c in item[method]["responses"]}
            assert status in documented, (method, path, status, documented)
