"""The OIP REST door with the real tritonclient HTTP client and with plain HTTP, against a real gateway.

The gateway runs m@1 with in-process pools; every answer is compared with ONNX Runtime on the
same model: the whole model as `m`, and each preloaded tail as `m.tail.<cut>` fed the
boundary tensors that the head (run by ONNX Runtime) computes.
"""

from __future__ import annotations

import http.client
import json

import numpy as np
import pytest

from tests.integration._oip_support import AUTH, head_boundaries, oip_door, ort_per_sample, ort_run, tails

triton = pytest.importorskip("tritonclient.http", reason="the test extra installs tritonclient[http]")
from tritonclient.utils import InferenceServerException  # noqa: E402 - after the importorskip

pytestmark = pytest.mark.grpc


@pytest.fixture(scope="module")
def door(tmp_path_factory):
    with oip_door(str(tmp_path_factory.mktemp("oip"))) as d:
        yield d


@pytest.fixture()
def client(door):
    c = triton.InferenceServerClient(door.host)
    yield c
    c.close()


def auth() -> dict[str, str]:
    return dict(AUTH)  # tritonclient writes its own headers into the dict it is given


def raw(door, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None):
    conn = http.client.HTTPConnection(door.host, timeout=10)
    try:
        conn.request(method, path, body=body, headers={**AUTH, **(headers or {})})
        r = conn.getresponse()
        return r.status, r.read(), dict(r.getheaders())
    finally:
        conn.close()


def infer_inputs(arrays: dict[str, np.ndarray], *, binary: bool) -> list:
    out = []
    for name, a in arrays.items():
        i = triton.InferInput(name, list(a.shape), "FP32")
        i.set_data_from_numpy(a, binary_data=binary)
        out.append(i)
    return out


def test_health_server_metadata_and_model_metadata(door, client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.get_server_metadata()["extensions"] == ["binary_tensor_data", "model_configuration", "statistics"]
    assert client.is_model_ready("m", headers=auth()) and client.is_model_ready("m", "1", headers=auth())
    meta = client.get_model_metadata("m", headers=auth())
    assert meta["versions"] == ["1"] and meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4, 5, 5]}]
    assert meta["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 3]}]
    cuts = tails(door)
    assert cuts, "the default frontier preloads chain cuts besides the empty one"
    index = client.get_model_repository_index(headers=auth())
    assert index == [{"name": n, "version": "1", "state": "READY"} for n in ["m"] + [f"m.tail.{c}" for c in cuts]]
    for cut in cuts:
        tail = client.get_model_metadata(f"m.tail.{cut}", "1", headers=auth())
        assert tail["name"] == f"m.tail.{cut}" and tail["inputs"] and tail["outputs"][0]["name"] == "y"


def test_config_names_max_batch_size_and_stats_count_requests(door, client):
    config = client.get_model_config("m", headers=auth())
    assert config["max_batch_size"] == 8 and config["input"][0]["dims"] == [4, 5, 5]
    x = np.random.default_rng(1).random((2, 4, 5, 5), dtype=np.float32)
    metrics = door.gateway.metrics
    ok = {"model": "m", "version": "1", "status": "OK"}
    batches = metrics.sample("splitinfer_batch_size_count") or 0
    served = metrics.sample("splitinfer_requests_total", ok) or 0
    before = client.get_inference_statistics("m", headers=auth())["model_stats"]
    client.infer("m", infer_inputs({"x": x}, binary=True), headers=auth())
    after = client.get_inference_statistics("m", headers=auth())["model_stats"]
    # The request went through the native path's batcher and metrics.
    assert metrics.sample("splitinfer_batch_size_count") == batches + 1
    assert metrics.sample("splitinfer_requests_total", ok) == served + 1
    count = lambda stats: sum(s["inference_stats"]["success"]["count"] for s in stats)  # noqa: E731
    assert count(after) == count(before) + 1
    assert sum(s["inference_count"] for s in after) >= 2


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_whole_model_equals_onnx_runtime(door, client, binary):
    x = np.random.default_rng(2).random((3, 4, 5, 5), dtype=np.float32)
    outputs = None if binary else [triton.InferRequestedOutput("y", binary_data=False)]
    r = client.infer("m", infer_inputs({"x": x}, binary=binary), outputs=outputs, headers=auth())
    assert (r.get_output("y").get("parameters", {}).get("binary_data_size") is not None) == binary
    np.testing.assert_allclose(r.as_numpy("y"), ort_per_sample(door.model_path, x), rtol=1e-5, atol=1e-5)
    assert r.get_response()["model_version"] == "1"


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_infer_each_tail_on_the_heads_boundary_equals_the_whole_model(door, client, binary):
    x = np.random.default_rng(3).random((1, 4, 5, 5), dtype=np.float32)
    want = ort_run(door.model_path, {"x": x})["y"]
    for cut, boundary in head_boundaries(door, x):
        meta = client.get_model_metadata(f"m.tail.{cut}", headers=auth())
        feeds = {i["name"]: boundary[i["name"]] for i in meta["inputs"]}
        r = client.infer(f"m.tail.{cut}", infer_inputs(feeds, binary=binary), headers=auth(),
                         outputs=[triton.InferRequestedOutput("y", binary_data=binary)])
        np.testing.assert_allclose(r.as_numpy("y"), want, rtol=1e-5, atol=1e-5, err_msg=cut)


def test_curl_style_json_request_gets_a_json_answer(door):
    x = np.arange(100, dtype=np.float32).reshape(1, 4, 5, 5) / 100
    body = json.dumps({"id": "r1", "inputs": [{"name": "x", "shape": [1, 4, 5, 5], "datatype": "FP32",
                                               "data": x.tolist()}]}).encode()
    status, out, headers = raw(door, "POST", "/v2/models/m/versions/1/infer", body,
                               {"Content-Type": "application/json"})
    assert status == 200 and "Inference-Header-Content-Length" not in headers, out
    doc = json.loads(out)
    assert doc["id"] == "r1" and doc["model_name"] == "m" and doc["outputs"][0]["shape"] == [1, 3]
    np.testing.assert_allclose(np.array(doc["outputs"][0]["data"], np.float32).reshape(1, 3),
                               ort_run(door.model_path, {"x": x})["y"], rtol=1e-5, atol=1e-5)


def expect(client_call, status: int, words: str) -> None:
    with pytest.raises(InferenceServerException) as e:
        client_call()
    assert e.value.status() == str(status), e.value
    assert words in e.value.message(), e.value


def test_errors_come_back_with_the_documented_codes(door, client):
    x = np.zeros((1, 4, 5, 5), np.float32)
    expect(lambda: client.get_model_metadata("nope", headers=auth()), 404, "unknown model 'nope'")
    expect(lambda: client.get_model_metadata("m", "9", headers=auth()), 404, "no version '9'")
    expect(lambda: client.get_model_metadata("m.tail.L9", headers=auth()), 404, "m.tail.")
    expect(lambda: client.infer("nope", infer_inputs({"x": x}, binary=True), headers=auth()), 404, "unknown model")
    expect(lambda: client.infer("m", infer_inputs({"x": x[:, :3]}, binary=True), headers=auth()), 400,
           "has shape [-1, 4, 5, 5]")
    i = triton.InferInput("x", [1, 4, 5, 5], "FP64")
    i.set_data_from_numpy(x.astype(np.float64))
    expect(lambda: client.infer("m", [i], headers=auth()), 400, "is FP32, the request gives FP64")
    expect(lambda: client.infer("m", infer_inputs({"z": x}, binary=True), headers=auth()), 400, "takes inputs ['x']")
    expect(lambda: client.infer("m", infer_inputs({"x": x}, binary=True)), 401, "authorization")
    expect(lambda: client.get_model_metadata("m"), 401, "authorization")
    # Who asks is checked first: a caller without a token learns nothing about model names.
    expect(lambda: client.infer("nope", infer_inputs({"x": x}, binary=True)), 401, "authorization")
    expect(lambda: client.get_inference_statistics("m"), 401, "authorization")
    expect(lambda: client.infer("m", infer_inputs({"x": x}, binary=True), headers=auth(), timeout=0), 504,
           "deadline exceeded")
    expect(lambda: client.infer("m", infer_inputs({"x": x}, binary=True), headers=auth(), timeout=1), 504,
           "deadline exceeded while the backend ran")


def test_byte_length_and_malformed_bodies_are_400_and_the_server_stays_up(door):
    head = json.dumps({"inputs": [{"name": "x", "shape": [1, 4, 5, 5], "datatype": "FP32",
                                   "parameters": {"binary_data_size": 400}}]}).encode()
    for body, n, words in [
        (head + b"\0" * 399, len(head), "needs 400 binary bytes"),
        (head + b"\0" * 401, len(head), "1 bytes after the last binary input"),
        (head.replace(b"400", b"396") + b"\0" * 396, len(head), "binary_data_size 396"),
        (head + b"\0" * 400, len(head) + 1, "not JSON"),
        (b"{not json", None, "not JSON"),
        (b"[1, 2]", None, "JSON list"),
        (head + b"\0" * 400, len(head) * 9, "outside the body"),
    ]:
        extra = {} if n is None else {"Inference-Header-Content-Length": str(n)}
        status, out, _ = raw(door, "POST", "/v2/models/m/infer", body, extra)
        assert status == 400, (status, out)
        assert words in json.loads(out)["error"], out
    assert raw(door, "GET", "/v2/health/live")[0] == 200
    assert raw(door, "POST", "/v2/models/m/ready")[0] == 405
    assert raw(door, "GET", "/v2/models/m/infer")[0] == 405
    assert raw(door, "GET", "/v2/nothing")[0] == 404
    assert raw(door, "GET", "/metrics")[0] == 200  # the metrics routes are untouched


def test_device_id_parameter_routes_the_canary_as_on_the_native_door(tmp_path):
    with oip_door(str(tmp_path), versions=("1", "2")) as d2:
        registry = d2.gateway.registry
        registry.set_default("m", "1")
        registry.set_canary("m", "2", 50.0)
        devices = {registry.resolve("m", "", f"dev{i}").version: f"dev{i}" for i in range(64)}
        assert set(devices) == {"1", "2"}
        x = np.zeros((1, 4, 5, 5), np.float32)
        for version, device in devices.items():
            body = json.dumps({"parameters": {"device_id": device},
                               "inputs": [{"name": "x", "shape": [1, 4, 5, 5], "datatype": "FP32",
                                           "data": x.ravel().tolist()}]}).encode()
            status, out, _ = raw(d2, "POST", "/v2/models/m/infer", body)
            assert status == 200 and json.loads(out)["model_version"] == version, out
        status, out, _ = raw(d2, "POST", "/v2/models/m/infer", body.replace(f'"{device}"'.encode(), b"7"))
        assert status == 400 and "device_id 7 is not a string" in json.loads(out)["error"], out


def test_an_http11_connection_is_kept_for_v2_and_closed_after_other_routes(door):
    conn = http.client.HTTPConnection(door.host, timeout=10)
    try:
        for _ in range(3):
            conn.request("GET", "/v2/models/m/config", headers=AUTH)
            r = conn.getresponse()
            assert r.status == 200 and r.version == 11 and not r.will_close
            r.read()
        sock = conn.sock
        conn.request("GET", "/v2/health/live")
        r = conn.getresponse()
        r.read()
        assert conn.sock is sock  # the same connection served four requests
        conn.request("GET", "/metrics")  # the metrics routes answer HTTP/1.0 and close
        r = conn.getresponse()
        assert r.status == 200 and r.will_close and b"splitinfer_requests_total" in r.read()
        conn.request("POST", "/v2/models/m/infer", body=b"{", headers={**AUTH, "Connection": "close"})
        r = conn.getresponse()
        assert r.status == 400 and r.will_close
    finally:
        conn.close()


def test_an_idle_kept_connection_is_closed_after_the_idle_timeout(door):
    door.oip.idle_timeout_s = 0.2
    conn = http.client.HTTPConnection(door.host, timeout=10)
    try:
        conn.request("GET", "/v2/health/live")
        r = conn.getresponse()
        r.read()
        assert not r.will_close
        conn.sock.settimeout(5)
        assert conn.sock.recv(1) == b""  # the server closed it after 0.2 s without a request
    finally:
        conn.close()
        door.oip.idle_timeout_s = 120.0


def test_server_ready_is_400_with_the_reason_until_the_registry_is_loaded(tmp_path):
    from cluster.gateway import Gateway, LocalPoolFactory
    from cluster.oip_rest import OipRest
    from cluster.registry import Registry

    (tmp_path / "repo" / "m" / "1").mkdir(parents=True)
    gateway = Gateway(Registry(str(tmp_path / "repo")), LocalPoolFactory())
    answer = OipRest(gateway, loop=None).handle("GET", "/v2/health/ready", {})  # type: ignore[arg-type]
    assert answer.status == 400 and json.loads(answer.body)["error"].startswith("not ready: ")
    assert OipRest(gateway, loop=None).handle("GET", "/v2/health/live", {}).status == 200  # type: ignore[arg-type]
