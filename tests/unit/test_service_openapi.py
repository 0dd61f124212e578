"""The OpenAPI document: it lists exactly what the service reads and serves, and its
references resolve. (Responses are checked against it by tests/integration/test_openapi_fuzz.py.)"""

from __future__ import annotations

import json
from typing import Any

import pytest

from planner.whatif import FrontierRequest, PlanRequest, SweepRequest
from splitinfer.planner_api import PlannerService, make_openapi


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


# Values at and around each stated limit, in both forms. For each, the document's verdict
# (a JSON Schema validator on the field's schema) must be the service's (400 or not).
_EDGE_VALUES = {
    "uplink": [1, 0.999, 1e15, 1.0000001e15, 0, -5, "0bit", "1bit", "0.5bit", "0.001kbit", "0.0009kbit",
               "999tbit", "1000tbit", "18.88mbit", "500kbit/s", ".5mbit", "007mbit", "5Mbit", "1e6bit",
               "-5mbit", "5", "5 mbit", "mbit", ""],
    "rtt": [0, 1e9, 1e9 + 1, -1, "0ms", "0.000us", "999999999ms", "1000000000ms", "9999min", "10000min",
            "20 ms", "1e3ms", "-20ms", "20"],
    "slo": [0, 5e-324, 1e9, "0ms", "0.0s", "0.000000000001us", "1us", "100ms", "-1ms"],
    "device_memory": [0, 2.0 ** 60, 2.0 ** 61, "0", "64MiB", "64 MiB", "999999TiB", "1000000TiB", "64mib",
                      "1e3B", "-1B"],
}


@pytest.mark.parametrize("field", sorted(_EDGE_VALUES))
def test_schema_and_validator_agree_at_the_limits(field: str) -> None:
    import jsonschema

    from splitinfer.plan_cmd import make_service

    svc = make_service()
    schema = make_openapi()["components"]["schemas"]["PlanRequest"]["properties"][field]
    base = {"model": "no-such-model", "edge": {"gflops": 1}, "cloud": {"gflops": 100}, "uplink": "1mbit"}
    for value in _EDGE_VALUES[field]:
        valid = jsonschema.Draft4Validator(schema).is_valid(value)
        # a valid request goes on to look the model up (404); an invalid one stops at 400
        status = svc.handle("POST", "/v1/plan", json.dumps({**base, field: value}).encode()).status
        assert (status == 404) == valid and status in (400, 404), (field, value, valid, status)


@pytest.mark.parametrize("gflops, valid", [(5e-324, False), (0, False), (1e-6, True), (1e9, True), (1.1e9, False)])
def test_roofline_speed_limits_agree(gflops: float, valid: bool) -> None:
    import jsonschema

    from splitinfer.plan_cmd import make_service

    roofline = make_openapi()["components"]["schemas"]["Roofline"]
    assert jsonschema.Draft4Validator(roofline).is_valid({"gflops": gflops}) is valid
    body = {"model": "no-such-model", "edge": {"gflops": gflops}, "cloud": {"gflops": 100}, "uplink": "1mbit"}
    assert make_service().handle("POST", "/v1/plan", json.dumps(body).encode()).status == (404 if valid else 400)


@pytest.mark.parametrize("name", ["RATE", "DURATION", "POSITIVE_DURATION", "SIZE"])
def test_every_string_a_pattern_matches_parses_into_its_range(name: str) -> None:
    """[Note: quantity strings]: a pattern matches only strings whose value is in range."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    import splitinfer.planner_api.quantities as units
    from splitinfer.plan_cmd import parse_size_bytes
    from splitinfer.units import parse_duration_ms, parse_rate_bps

    kind = getattr(units, name)
    parse = {"RATE": parse_rate_bps, "SIZE": parse_size_bytes}.get(name, parse_duration_ms)

    @given(st.from_regex(kind.pattern))
    @settings(max_examples=300, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def check(text: str) -> None:
        value = parse(text)
        assert kind.lo <= value <= kind.hi and not (kind.lo_open and value == kind.lo), (text, value)

    check()
