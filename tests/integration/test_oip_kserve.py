"""The OIP doors with the KServe Python client (kserve.InferenceRESTClient and InferenceGRPCClient),
unchanged, against a real gateway.

KServe's clients cover health, model readiness and inference (they have no metadata or
configuration calls; tritonclient's tests cover those). Every answer is compared with ONNX
Runtime on the same model: the whole model as `m`, and each preloaded tail as `m.tail.<cut>` fed
the boundary tensors the head (run by ONNX Runtime) computes. The client runs in a process of
its own (tests/integration/_kserve_client.py says why); the gateway runs in this one.
`pip install splitinfer[test]` installs kserve; without it the module skips.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from tests.integration import _oip_grpc_support, _oip_support
from tests.integration._kserve_client import to_array, to_tensor

if importlib.util.find_spec("kserve") is None:
    pytest.skip("the test extra installs kserve (pip install splitinfer[test])", allow_module_level=True)

pytestmark = pytest.mark.grpc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def rest_door(tmp_path_factory):
    with _oip_support.oip_door(str(tmp_path_factory.mktemp("kserve-rest"))) as d:
        yield d


@pytest.fixture(scope="module")
def grpc_door(tmp_path_factory):
    with _oip_grpc_support.oip_grpc_door(str(tmp_path_factory.mktemp("kserve-grpc"))) as d:
        yield d


def cases(door, models, x: np.ndarray) -> list[dict[str, Any]]:
    """The whole model fed `x`, and each preloaded tail fed the head's boundary tensors for `x`."""
    out = [{"name": "m", "inputs": {"x": to_tensor(x)}}]
    for cut, boundary in _oip_support.head_boundaries(door, x):
        name = f"m.tail.{cut}"
        tail_lv, cut_id = models.resolve(name, "")
        meta = models.metadata(name, tail_lv, models.signature(tail_lv, cut_id))
        out.append({"name": name, "inputs": {i["name"]: to_tensor(boundary[i["name"]]) for i in meta["inputs"]}})
    assert len(out) > 1, "the default frontier preloads chain cuts besides the empty one"
    return out


def errors(x: np.ndarray) -> list[dict[str, Any]]:
    """An unknown model, and the whole model given a tensor of the wrong shape."""
    return [{"name": "nope", "inputs": {"x": to_tensor(x)}}, {"name": "m", "inputs": {"x": to_tensor(x[:, :3])}}]


def run_client(job: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "tests.integration._kserve_client"], input=json.dumps(job),
                          capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def check_answers(report: dict[str, Any], jobs: list[dict[str, Any]], model_path: str, x: np.ndarray) -> None:
    assert report["live"] is True and report["ready"] is True
    want = _oip_support.ort_run(model_path, {"x": x})["y"]
    assert report["model_ready"] == {c["name"]: True for c in jobs}
    assert set(report["outputs"]) == {c["name"] for c in jobs}
    for name, y in report["outputs"].items():
        np.testing.assert_allclose(to_array(y), want, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_rest_client_health_readiness_and_infer_on_the_whole_model_and_each_tail(rest_door, binary):
    x = np.random.default_rng(7).random((1, 4, 5, 5), dtype=np.float32)
    jobs = cases(rest_door, rest_door.oip.models, x)
    report = run_client({"door": "rest", "target": rest_door.url, "auth": dict(_oip_support.AUTH),
                         "binary": binary, "cases": jobs, "errors": errors(x)})
    check_answers(report, jobs, rest_door.model_path, x)
    (unknown, unknown_msg), (bad_shape, bad_shape_msg) = report["errors"]
    assert unknown == 404 and "nope" in unknown_msg
    assert bad_shape == 400 and "shape" in bad_shape_msg


def test_grpc_client_health_readiness_and_infer_on_the_whole_model_and_each_tail(grpc_door):
    x = np.random.default_rng(8).random((1, 4, 5, 5), dtype=np.float32)
    jobs = cases(grpc_door, grpc_door.models, x)
    report = run_client({"door": "grpc", "target": grpc_door.host, "auth": dict(_oip_grpc_support.AUTH),
                         "binary": True, "cases": jobs, "errors": errors(x)})
    check_answers(report, jobs, grpc_door.model_path, x)
    (unknown, unknown_msg), (bad_shape, bad_shape_msg) = report["errors"]
    assert unknown == "NOT_FOUND" and "nope" in unknown_msg
    assert bad_shape == "INVALID_ARGUMENT" and "shape" in bad_shape_msg
