"""Fuzz the planner's HTTP API from its own OpenAPI document (schemathesis) over real
HTTP on 127.0.0.1: no request, valid or not, may get a 5xx, and every 2xx answer must
match the documented response schema.

Two passes, a few hundred cases in all:
* broad: the served document as is, positive and negative data (most requests name
  unknown models and profiles, and exercise validation);
* deep: the same document with ``model`` narrowed to a small registry model and the
  tiers to stored profiles or rooflines, so generated requests reach the solver,
  the sweep and the frontier (and their answers are checked against the schemas).

Then schemathesis's own command line runs every check it has (``--checks all``: among
them, schema-valid data is accepted, schema-invalid data refused, an undeclared method
gets a 405) over both documents, with a bounded number of examples. The one setting it
is given: a schema-valid request may get a 422, the service's answer for a request
that keeps the document but cannot be served as asked (no plan meets the constraints,
uplink_hi below uplink_lo, a profile that does not fit the model), which no schema can
state. A request the validator refuses although the document allows it gets a 400, and
that check still fails on it.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import urllib.request
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance, not_a_server_error, response_schema_conformance,
)

from partitioner import build_graph  # noqa: E402
from planner.synthetic import make_flops_profile  # noqa: E402
from splitinfer.planner_http import PlannerHTTPServer, make_server  # noqa: E402
from tests.onnx_models import conv_bn_relu_chain, write  # noqa: E402

pytestmark = pytest.mark.slow

_CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PlannerHTTPServer, str]]:
    reg = tmp_path_factory.mktemp("registry")
    path = write(conv_bn_relu_chain(3), reg / "tiny.onnx")
    srv = make_server("127.0.0.1", 0, registry_dir=str(reg),
                      profiles_dir=str(tmp_path_factory.mktemp("profiles")))
    srv.start()
    url = f"http://127.0.0.1:{srv.port}"
    g = build_graph(path, name="tiny")
    for name, gflops in (("tiny-edge", 2.0), ("tiny-cloud", 200.0)):
        body = make_flops_profile(g, device=name, gflops=gflops, fixed_ms=0.5).to_json().encode()
        req = urllib.request.Request(f"{url}/v1/profiles/{name}", data=body, method="PUT")
        assert urllib.request.urlopen(req).status == 200
    try:
        yield srv, url
    finally:
        srv.shutdown()
        srv.server_close()


def _spec(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/openapi.json") as r:
        return json.load(r)


def _fuzz(spec: dict[str, Any], url: str, modes: tuple[GenerationMode, ...], examples: dict[str, int],
          *, validate: bool) -> Counter[tuple[str, int]]:
    schema = schemathesis.openapi.from_dict(spec)
    seen: Counter[tuple[str, int]] = Counter()
    for result in schema.get_all_operations():
        op = result.ok()
        n = examples.get(op.path, 3)
        for mode in modes:
            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=n, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            def run(case: Any) -> None:
                resp = case.call(base_url=url, timeout=60)
                seen[(f"{op.method.upper()} {op.path}", resp.status_code)] += 1
                assert resp.status_code < 500, (case.method, case.path, case.body, resp.text)
                if validate and mode is GenerationMode.POSITIVE:
                    case.validate_response(resp, checks=_CHECKS)

            try:
                run()
            except Unsatisfiable:
                # an operation without a body or parameters has no invalid form
                if mode is GenerationMode.POSITIVE:
                    raise
    return seen


def test_broad_fuzz_never_5xx(server: tuple[PlannerHTTPServer, str]) -> None:
    _, url = server
    n = {"/v1/plan": 25, "/v1/sweep": 15, "/v1/frontier": 15, "/v1/profiles/{name}": 15}
    seen = _fuzz(_spec(url), url, (GenerationMode.POSITIVE, GenerationMode.NEGATIVE), n, validate=True)
    assert not [k for k in seen if k[1] >= 500], seen
    assert sum(seen.values()) >= 150
    # the negative pass reaches validation and is refused with a 4xx
    assert any(k[0] == "POST /v1/plan" and 400 <= k[1] < 500 for k in seen)


def _narrow(spec: dict[str, Any]) -> dict[str, Any]:
    spec = copy.deepcopy(spec)
    schemas = spec["components"]["schemas"]
    tier = {"anyOf": [{"type": "string", "enum": ["tiny-edge", "tiny-cloud"]},
                      {"$ref": "#/components/schemas/Roofline"}]}
    for name in ("PlanRequest", "SweepRequest", "FrontierRequest"):
        props = schemas[name]["properties"]
        props["model"] = {"type": "string", "enum": ["tiny"]}
        props["edge"] = props["cloud"] = tier
        props["pinned_device_layers"]["maxItems"] = 3
        props["pinned_device_layers"]["items"]["maximum"] = 4
        props["first_k_local"]["maximum"] = 4
    schemas["SweepRequest"]["properties"]["points"]["maximum"] = 12
    return spec


def test_deep_fuzz_reaches_the_solver(server: tuple[PlannerHTTPServer, str]) -> None:
    srv, url = server
    n = {"/v1/plan": 40, "/v1/sweep": 25, "/v1/frontier": 25}
    spec = _narrow(_spec(url))
    spec["paths"] = {p: spec["paths"][p] for p in n}
    seen = _fuzz(spec, url, (GenerationMode.POSITIVE,), n, validate=True)
    assert not [k for k in seen if k[1] >= 500], seen
    ok = {k[0] for k in seen if k[1] == 200}
    assert ok == {"POST /v1/plan", "POST /v1/sweep", "POST /v1/frontier"}, seen
    # one model, built once however many requests used it
    assert srv.service.graph_builds == 1


_ST_CONFIG = """\
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "404", "422"]
"""


def _schemathesis_all_checks(schema: str, url: str, tmp_path, examples: int) -> str:
    config = tmp_path / "schemathesis.toml"
    config.write_text(_ST_CONFIG)
    cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run", schema, "--url", url,
           "--checks", "all", "--max-examples", str(examples), "--generation-deterministic", "--no-color",
           "--report-dir", str(tmp_path / "reports")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert " passed" in out and "failures" not in out.split("SUMMARY")[-1], out[-3000:]
    return out


def test_schemathesis_all_checks_are_clean(server: tuple[PlannerHTTPServer, str], tmp_path) -> None:
    _, url = server
    _schemathesis_all_checks(url + "/openapi.json", url, tmp_path, 25)


def test_schemathesis_all_checks_are_clean_on_the_solver(server: tuple[PlannerHTTPServer, str], tmp_path) -> None:
    _, url = server
    spec = _narrow(_spec(url))
    spec["paths"] = {p: spec["paths"][p] for p in ("/v1/plan", "/v1/sweep", "/v1/frontier")}
    path = tmp_path / "narrowed.json"
    path.write_text(json.dumps(spec))
    _schemathesis_all_checks(str(path), url, tmp_path, 15)
