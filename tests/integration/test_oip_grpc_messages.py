"""The OIP gRPC door over a raw gRPC channel with the project's own messages (cluster._oip_pb).

The same door as tests/integration/test_oip_grpc.py, which uses tritonclient.grpc; these run
wherever grpcio is, so the door is covered where tritonclient[grpc] cannot be installed.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from cluster._oip_pb import oip_pb2 as pb
from tests.integration._oip_grpc_support import AUTH, oip_grpc_door

pytestmark = pytest.mark.grpc

_SERVICE = "/inference.GRPCInferenceService/"
MD = tuple(AUTH.items())


@pytest.fixture(scope="module")
def door(tmp_path_factory):
    with oip_grpc_door(str(tmp_path_factory.mktemp("oipmsg"))) as d:
        with grpc.insecure_channel(d.host) as channel:
            yield d, channel


def rpc(channel, method: str, request, answer_cls, metadata=MD, timeout: float = 30):
    fn = channel.unary_unary(_SERVICE + method, request_serializer=lambda m: m.SerializeToString(),
                             response_deserializer=answer_cls.FromString)
    return fn(request, metadata=metadata, timeout=timeout)


def infer_request(x: np.ndarray, model: str = "m", **fields) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name=model, **fields)
    req.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    req.raw_input_contents.append(x.tobytes())
    return req


def ort_y(model_path: str, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(model_path, providers=["CPUExecutionProvider"])
    return np.concatenate([sess.run(["y"], {"x": x[i:i + 1]})[0] for i in range(len(x))])


def output(resp: pb.ModelInferResponse, i: int = 0) -> np.ndarray:
    return np.frombuffer(resp.raw_output_contents[i], np.float32).reshape(list(resp.outputs[i].shape))


def test_health_metadata_config_and_index(door):
    d, ch = door
    assert rpc(ch, "ServerLive", pb.ServerLiveRequest(), pb.ServerLiveResponse).live
    assert rpc(ch, "ServerReady", pb.ServerReadyRequest(), pb.ServerReadyResponse).ready
    assert rpc(ch, "ModelReady", pb.ModelReadyRequest(name="m", version="1"), pb.ModelReadyResponse).ready
    meta = rpc(ch, "ModelMetadata", pb.ModelMetadataRequest(name="m"), pb.ModelMetadataResponse)
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("x", "FP32", [-1, 4, 5, 5])]
    config = rpc(ch, "ModelConfig", pb.ModelConfigRequest(name="m"), pb.ModelConfigResponse).config
    assert config.max_batch_size == 8 and list(config.input[0].dims) == [4, 5, 5]
    assert config.input[0].data_type == pb.TYPE_FP32 and config.WhichOneof("scheduling_choice") == "dynamic_batching"
    index = rpc(ch, "RepositoryIndex", pb.RepositoryIndexRequest(), pb.RepositoryIndexResponse)
    assert index.models[0].name == "m" and all(m.state == "READY" for m in index.models) and len(index.models) > 1


def test_infer_raw_and_typed_equal_onnx_runtime_and_statistics_count_them(door):
    d, ch = door
    x = np.random.default_rng(7).random((2, 4, 5, 5), dtype=np.float32)
    stats = lambda: rpc(ch, "ModelStatistics", pb.ModelStatisticsRequest(name="m"),  # noqa: E731
                        pb.ModelStatisticsResponse).model_stats
    before = sum(s.inference_stats.success.count for s in stats())
    resp = rpc(ch, "ModelInfer", infer_request(x, id="a"), pb.ModelInferResponse)
    assert (resp.model_name, resp.model_version, resp.id) == ("m", "1", "a")
    np.testing.assert_allclose(output(resp), ort_y(d.model_path, x), rtol=1e-5, atol=1e-5)
    typed = pb.ModelInferRequest(model_name="m")
    typed.inputs.add(name="x", datatype="FP32", shape=[2, 4, 5, 5]).contents.fp32_contents.extend(x.ravel().tolist())
    np.testing.assert_allclose(output(rpc(ch, "ModelInfer", typed, pb.ModelInferResponse)),
                               ort_y(d.model_path, x), rtol=1e-5, atol=1e-5)
    assert sum(s.inference_stats.success.count for s in stats()) == before + 2


def test_stream_answers_each_request_in_order_with_errors_inline(door):
    d, ch = door
    xs = [np.random.default_rng(20 + i).random((1, 4, 5, 5), dtype=np.float32) for i in range(3)]
    reqs = [infer_request(xs[0], id="0"), infer_request(xs[1], model="nope", id="1"), infer_request(xs[2], id="2")]
    stream = ch.stream_stream(_SERVICE + "ModelStreamInfer", request_serializer=lambda m: m.SerializeToString(),
                              response_deserializer=pb.ModelStreamInferResponse.FromString)
    got = list(stream(iter(reqs), metadata=MD, timeout=30))
    assert [g.error_message.split(":")[0] for g in got] == ["", "NOT_FOUND", ""]
    assert [g.infer_response.id for g in got] == ["0", "", "2"]
    for g, x in ((got[0], xs[0]), (got[2], xs[2])):
        np.testing.assert_allclose(output(g.infer_response), ort_y(d.model_path, x), rtol=1e-5, atol=1e-5)


def test_errors_come_back_with_the_documented_codes(door):
    d, ch = door
    x = np.zeros((1, 4, 5, 5), np.float32)
    C = grpc.StatusCode
    timeout = infer_request(x)
    timeout.parameters["timeout"].int64_param = 1
    cases = [
        ("ModelInfer", infer_request(x, model="nope"), MD, C.NOT_FOUND, "unknown model 'nope'"),
        ("ModelInfer", infer_request(x, model_version="9"), MD, C.NOT_FOUND, "no version '9'"),
        ("ModelInfer", infer_request(x[:, :3]), MD, C.INVALID_ARGUMENT, "has shape [-1, 4, 5, 5]"),
        ("ModelInfer", infer_request(x), (), C.UNAUTHENTICATED, "authorization"),
        ("ModelInfer", timeout, MD, C.DEADLINE_EXCEEDED, "deadline exceeded"),
        ("ModelMetadata", pb.ModelMetadataRequest(name="m.tail.L9"), MD, C.NOT_FOUND, "m.tail."),
        ("ModelConfig", pb.ModelConfigRequest(name="m"), (), C.UNAUTHENTICATED, "authorization"),
    ]
    for method, req, md, code, words in cases:
        with pytest.raises(grpc.RpcError) as e:
            rpc(ch, method, req, pb.ModelInferResponse, metadata=md)
        assert e.value.code() == code and words in e.value.details(), (method, e.value.code(), e.value.details())
    # A timeout at int64's limit is beyond any clock: held to the longest deadline and answered.
    endless = infer_request(x)
    endless.parameters["timeout"].int64_param = 2**63 - 1
    assert rpc(ch, "ModelInfer", endless, pb.ModelInferResponse, metadata=MD).raw_output_contents
