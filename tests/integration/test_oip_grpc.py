"""The OIP gRPC door with the real tritonclient.grpc client, against a real gateway on loopback.

The gateway runs m@1 with in-process pools; every answer is compared with ONNX Runtime on the
same model: the whole model as `m`, and each preloaded tail as `m.tail.<cut>` fed the boundary
tensors that the head (run by ONNX Runtime) computes. Typed contents and byte-level errors go
through tritonclient's own generated stub, so the messages are the spec's as another
implementation of it writes them.
"""

from __future__ import annotations

import queue

import grpc
import numpy as np
import pytest

from tests.integration._oip_grpc_support import AUTH, import_tritonclient_grpc, oip_grpc_door
from tests.integration._oip_support import head_boundaries, ort_per_sample, ort_run, tails

triton = import_tritonclient_grpc()
from tritonclient.grpc import service_pb2, service_pb2_grpc  # noqa: E402 - after the skip
from tritonclient.utils import InferenceServerException  # noqa: E402

pytestmark = pytest.mark.grpc


# Same shape as test_oip_rest.py's door and client fixtures on purpose: each door has its own
# support module and tritonclient module, and a fixture is the one place each test file names them.
@pytest.fixture(scope="module")
def door(tmp_path_factory):
    with oip_grpc_door(str(tmp_path_factory.mktemp("oipgrpc"))) as d:
        yield d


@pytest.fixture()
def client(door):
    c = triton.InferenceServerClient(door.host)
    yield c
    c.close()


@pytest.fixture()
def stub(door):
    with grpc.insecure_channel(door.host) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def inputs_of(arrays: dict[str, np.ndarray], datatype: str = "FP32") -> list:
    out = []
    for name, a in arrays.items():
        i = triton.InferInput(name, list(a.shape), datatype)
        i.set_data_from_numpy(a)
        out.append(i)
    return out


def expect(call, code: grpc.StatusCode, words: str) -> None:
    with pytest.raises(InferenceServerException) as e:
        call()
    assert e.value.status() == str(code), e.value
    assert words in e.value.message(), e.value


def test_health_metadata_and_repository_index(door, client):
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata(as_json=True)
    assert meta["extensions"] == ["binary_tensor_data", "model_configuration", "statistics"]
    assert client.is_model_ready("m", headers=AUTH) and client.is_model_ready("m", "1", headers=AUTH)
    model = client.get_model_metadata("m", headers=AUTH)
    assert list(model.versions) == ["1"] and model.platform == "onnxruntime_onnx"
    assert [(t.name, t.datatype, list(t.shape)) for t in model.inputs] == [("x", "FP32", [-1, 4, 5, 5])]
    assert [(t.name, t.datatype, list(t.shape)) for t in model.outputs] == [("y", "FP32", [-1, 3])]
    cuts = tails(door)
    assert cuts, "the default frontier preloads chain cuts besides the empty one"
    index = client.get_model_repository_index(headers=AUTH)
    assert [(m.name, m.version, m.state) for m in index.models] == [
        (n, "1", "READY") for n in ["m"] + [f"m.tail.{c}" for c in cuts]]
    for cut in cuts:
        assert client.is_model_ready(f"m.tail.{cut}", headers=AUTH)
        tail = client.get_model_metadata(f"m.tail.{cut}", "1", headers=AUTH)
        assert tail.name == f"m.tail.{cut}" and tail.inputs and tail.outputs[0].name == "y"


def test_config_names_max_batch_size_and_stats_count_requests(door, client):
    config = client.get_model_config("m", headers=AUTH).config
    assert config.max_batch_size == 8 and list(config.input[0].dims) == [4, 5, 5]
    assert config.input[0].data_type == 11 and config.platform == "onnxruntime_onnx"  # TYPE_FP32
    assert list(config.version_policy.specific.versions) == [1]
    x = np.random.default_rng(1).random((2, 4, 5, 5), dtype=np.float32)
    metrics = door.gateway.metrics
    ok = {"model": "m", "version": "1", "status": "OK"}
    batches = metrics.sample("splitinfer_batch_size_count") or 0
    served = metrics.sample("splitinfer_requests_total", ok) or 0
    count = lambda: sum(s.inference_stats.success.count  # noqa: E731
                        for s in client.get_inference_statistics("m", headers=AUTH).model_stats)
    before = count()
    client.infer("m", inputs_of({"x": x}), headers=AUTH)
    # The request went through the native path's batcher and metrics.
    assert metrics.sample("splitinfer_batch_size_count") == batches + 1
    assert metrics.sample("splitinfer_requests_total", ok) == served + 1
    assert count() == before + 1


def test_infer_whole_model_equals_onnx_runtime(door, client):
    x = np.random.default_rng(2).random((3, 4, 5, 5), dtype=np.float32)
    r = client.infer("m", inputs_of({"x": x}), headers=AUTH, request_id="r1",
                     outputs=[triton.InferRequestedOutput("y")])
    np.testing.assert_allclose(r.as_numpy("y"), ort_per_sample(door.model_path, x), rtol=1e-5, atol=1e-5)
    answer = r.get_response()
    assert answer.model_version == "1" and answer.id == "r1" and answer.model_name == "m"


def test_infer_with_typed_contents_equals_onnx_runtime(door, stub):
    x = np.random.default_rng(4).random((1, 4, 5, 5), dtype=np.float32)
    req = service_pb2.ModelInferRequest(model_name="m", model_version="1")
    t = req.inputs.add(name="x", datatype="FP32", shape=[1, 4, 5, 5])
    t.contents.fp32_contents.extend(x.ravel().tolist())
    resp = stub.ModelInfer(req, metadata=tuple(AUTH.items()), timeout=30)
    [out] = resp.outputs
    y = np.frombuffer(resp.raw_output_contents[0], np.float32).reshape(list(out.shape))
    np.testing.assert_allclose(y, ort_run(door.model_path, {"x": x})["y"], rtol=1e-5, atol=1e-5)


def test_infer_each_tail_on_the_heads_boundary_equals_the_whole_model(door, client):
    x = np.random.default_rng(3).random((1, 4, 5, 5), dtype=np.float32)
    want = ort_run(door.model_path, {"x": x})["y"]
    for cut, boundary in head_boundaries(door, x):
        meta = client.get_model_metadata(f"m.tail.{cut}", headers=AUTH)
        feeds = {i.name: boundary[i.name] for i in meta.inputs}
        r = client.infer(f"m.tail.{cut}", inputs_of(feeds), headers=AUTH)
        np.testing.assert_allclose(r.as_numpy("y"), want, rtol=1e-5, atol=1e-5, err_msg=cut)


def test_stream_infer_answers_in_order_and_a_bad_request_does_not_end_the_stream(door, client):
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)), headers=AUTH)
    try:
        xs = [np.random.default_rng(10 + i).random((1, 4, 5, 5), dtype=np.float32) for i in range(3)]
        client.async_stream_infer("m", inputs_of({"x": xs[0]}), request_id="0")
        client.async_stream_infer("nope", inputs_of({"x": xs[1]}), request_id="bad")
        for i in (1, 2):
            client.async_stream_infer("m", inputs_of({"x": xs[i]}), request_id=str(i))
        got = [answers.get(timeout=30) for _ in range(4)]
    finally:
        client.stop_stream()
    assert [r.get_response().id if r is not None else None for r, _ in got] == ["0", None, "1", "2"]
    assert "NOT_FOUND" in got[1][1].message() and "unknown model 'nope'" in got[1][1].message()
    for (r, _), x in zip([got[0], got[2], got[3]], xs):
        np.testing.assert_allclose(r.as_numpy("y"), ort_run(door.model_path, {"x": x})["y"], rtol=1e-5, atol=1e-5)


def test_errors_come_back_with_the_documented_codes(door, client):
    x = np.zeros((1, 4, 5, 5), np.float32)
    C = grpc.StatusCode
    expect(lambda: client.get_model_metadata("nope", headers=AUTH), C.NOT_FOUND, "unknown model 'nope'")
    expect(lambda: client.get_model_metadata("m", "9", headers=AUTH), C.NOT_FOUND, "no version '9'")
    expect(lambda: client.is_model_ready("m.tail.L9", headers=AUTH), C.NOT_FOUND, "m.tail.")
    expect(lambda: client.infer("nope", inputs_of({"x": x}), headers=AUTH), C.NOT_FOUND, "unknown model")
    expect(lambda: client.infer("m", inputs_of({"x": x}), model_version="9", headers=AUTH), C.NOT_FOUND,
           "no version '9'")
    expect(lambda: client.infer("m", inputs_of({"x": x[:, :3]}), headers=AUTH), C.INVALID_ARGUMENT,
           "has shape [-1, 4, 5, 5]")
    expect(lambda: client.infer("m", inputs_of({"x": x.astype(np.float64)}, "FP64"), headers=AUTH),
           C.INVALID_ARGUMENT, "is FP32, the request gives FP64")
    expect(lambda: client.infer("m", inputs_of({"z": x}), headers=AUTH), C.INVALID_ARGUMENT, "takes inputs ['x']")
    expect(lambda: client.infer("m", inputs_of({"x": x})), C.UNAUTHENTICATED, "authorization")
    expect(lambda: client.infer("nope", inputs_of({"x": x})), C.UNAUTHENTICATED, "authorization")
    expect(lambda: client.get_model_metadata("m"), C.UNAUTHENTICATED, "authorization")
    expect(lambda: client.get_inference_statistics("m"), C.UNAUTHENTICATED, "authorization")
    expect(lambda: client.infer("m", inputs_of({"x": x}), headers=AUTH, timeout=1), C.DEADLINE_EXCEEDED,
           "deadline exceeded")
    assert client.is_server_live()


def test_byte_length_and_contents_errors_are_invalid_argument(door, stub):
    md = tuple(AUTH.items())
    cases = []
    short = service_pb2.ModelInferRequest(model_name="m")
    short.inputs.add(name="x", datatype="FP32", shape=[1, 4, 5, 5])
    short.raw_input_contents.append(b"\0" * 396)
    cases.append((short, "has 396 raw bytes but shape [1, 4, 5, 5] of FP32 is 400 bytes"))
    both = service_pb2.ModelInferRequest()
    both.CopyFrom(short)
    both.raw_input_contents[0] = b"\0" * 400
    both.inputs[0].contents.fp32_contents.append(1.0)
    cases.append((both, "use one or the other"))
    few = service_pb2.ModelInferRequest(model_name="m")
    few.inputs.add(name="x", datatype="FP32", shape=[1, 4, 5, 5]).contents.fp32_contents.extend([0.5] * 99)
    cases.append((few, "has 99 values in contents.fp32_contents but shape [1, 4, 5, 5] needs 100"))
    wide = service_pb2.ModelInferRequest(model_name="m")
    wide.inputs.add(name="x", datatype="INT8", shape=[1]).contents.int_contents.append(300)
    cases.append((wide, "outside INT8's range"))
    half = service_pb2.ModelInferRequest(model_name="m")
    half.inputs.add(name="x", datatype="FP16", shape=[1])
    cases.append((half, "travels only as raw_input_contents"))
    for req, words in cases:
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(req, metadata=md, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details(), e.value


def test_a_request_over_the_size_limit_is_resource_exhausted(tmp_path):
    # A request larger than the version's max_request_bytes is refused for capacity, as on the native door.
    with oip_grpc_door(str(tmp_path), model_yaml="max_request_bytes: 1000\n") as d:
        c = triton.InferenceServerClient(d.host)
        try:
            c.infer("m", inputs_of({"x": np.zeros((2, 4, 5, 5), np.float32)}), headers=AUTH)  # 800 bytes
            expect(lambda: c.infer("m", inputs_of({"x": np.zeros((3, 4, 5, 5), np.float32)}), headers=AUTH),
                   grpc.StatusCode.RESOURCE_EXHAUSTED, "request size of m@1")
        finally:
            c.close()


def test_device_id_parameter_routes_the_canary_as_on_the_native_door(tmp_path):
    with oip_grpc_door(str(tmp_path), versions=("1", "2")) as d:
        registry = d.gateway.registry
        registry.set_default("m", "1")
        registry.set_canary("m", "2", 50.0)
        devices = {registry.resolve("m", "", f"dev{i}").version: f"dev{i}" for i in range(64)}
        assert set(devices) == {"1", "2"}
        c = triton.InferenceServerClient(d.host)
        try:
            x = np.zeros((1, 4, 5, 5), np.float32)
            for version, device in devices.items():
                r = c.infer("m", inputs_of({"x": x}), headers=AUTH, parameters={"device_id": device})
                assert r.get_response().model_version == version
            expect(lambda: c.infer("m", inputs_of({"x": x}), headers=AUTH, parameters={"device_id": 7}),
                   grpc.StatusCode.INVALID_ARGUMENT, "device_id 7 is not a string_param")
        finally:
            c.close()


def test_tls_serves_the_oip_door_on_the_same_port(tmp_path):
    from cluster.auth import load_server_credentials
    from tests.integration.test_gateway_auth import _certs

    ca, (crt, key), _ = _certs(tmp_path, "oip")
    with oip_grpc_door(str(tmp_path), credentials=load_server_credentials(crt, key)) as d:
        x = np.random.default_rng(5).random((1, 4, 5, 5), dtype=np.float32)
        secure = triton.InferenceServerClient(d.host, ssl=True, root_certificates=ca)
        plain = triton.InferenceServerClient(d.host)
        try:
            r = secure.infer("m", inputs_of({"x": x}), headers=AUTH)
            np.testing.assert_allclose(r.as_numpy("y"), ort_run(d.model_path, {"x": x})["y"], rtol=1e-5, atol=1e-5)
            expect(lambda: plain.is_server_live(client_timeout=5), grpc.StatusCode.UNAVAILABLE, "")
        finally:
            secure.close()
            plain.close()


def test_a_malformed_message_is_counted_as_a_refusal(door):
    metrics = door.gateway.metrics
    labels = {"model": "-", "reason": "malformed"}  # a message that names no model
    before = metrics.sample("splitinfer_refusals_total", labels) or 0
    with grpc.insecure_channel(door.host) as channel:
        with pytest.raises(grpc.RpcError) as e:
            channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(b"\xff\xff", timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a valid ModelInferRequest" in e.value.details()
    assert metrics.sample("splitinfer_refusals_total", labels) == before + 1
