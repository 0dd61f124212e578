"""Fuzzing the OIP gRPC door of a real gateway with malformed requests over a raw gRPC channel.

Random bytes to every method, and valid ModelInferRequests mutated one field at a time: each
call must end with a clear status (never INTERNAL or UNKNOWN, and no hang), the server must
answer a good request afterwards, and the process's memory stay flat over the second of two
rounds. Runs with the project's own messages (cluster._oip_pb), so it needs no tritonclient.
"""

from __future__ import annotations

import os

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from cluster._oip_pb import oip_pb2 as pb
from tests.integration._oip_grpc_support import AUTH, oip_grpc_door

pytestmark = [pytest.mark.grpc, pytest.mark.slow]

N_PER_ROUND = 650
"""Of each kind (random bytes, mutated requests) per round; two rounds: 2,600 requests in all.
The first round warms the process up, the second must not grow it."""
_PAGE = os.sysconf("SC_PAGE_SIZE")
_METHODS = ["ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer",
            "ModelConfig", "ModelStatistics", "RepositoryIndex"]
_CLEAR = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
          grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
          grpc.StatusCode.FAILED_PRECONDITION}
_DATATYPES = ["BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "UINT64", "FP16", "FP32", "FP64", "BYTES", "", "fp32"]


@pytest.fixture(scope="module")
def door(tmp_path_factory):
    with oip_grpc_door(str(tmp_path_factory.mktemp("oipgrpcfuzz"))) as d:
        with grpc.insecure_channel(d.host) as channel:
            yield d, channel


def call(channel, method: str, raw: bytes) -> grpc.StatusCode:
    fn = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
    try:
        fn(raw, metadata=tuple(AUTH.items()), timeout=10)
    except grpc.RpcError as e:
        assert e.code() in _CLEAR, (method, raw[:80], e.code(), e.details())
        assert e.details(), (method, raw[:80], e.code())
        return e.code()
    return grpc.StatusCode.OK


def good_request() -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="m", model_version="1", id="g")
    req.inputs.add(name="x", datatype="FP32", shape=[1, 4, 5, 5])
    req.raw_input_contents.append(np.full(100, 0.5, np.float32).tobytes())
    return req


def assert_alive(channel) -> None:
    resp = pb.ModelInferResponse.FromString(
        channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(
            good_request().SerializeToString(), metadata=tuple(AUTH.items()), timeout=30))
    assert resp.outputs[0].name == "y" and len(resp.raw_output_contents[0]) == 12


@st.composite
def mutated(draw) -> bytes:
    """A valid request wrong in one way, or its bytes cut or flipped."""
    req = good_request()
    t = req.inputs[0]
    how = draw(st.sampled_from(["datatype", "shape", "raw", "count", "name", "model", "version", "param",
                                "contents", "truncate", "flip"]))
    if how == "datatype":
        t.datatype = draw(st.sampled_from(_DATATYPES))
    elif how == "shape":
        del t.shape[:]
        t.shape.extend(draw(st.lists(st.integers(-3, 1 << 45), max_size=20)))
    elif how == "raw":
        req.raw_input_contents[0] = draw(st.binary(max_size=800))
    elif how == "count":
        req.raw_input_contents.extend(draw(st.lists(st.binary(max_size=8), min_size=1, max_size=3)))
    elif how == "name":
        t.name = draw(st.text(max_size=8))
    elif how == "model":
        req.model_name = draw(st.sampled_from(["", "nope", "m.tail.", "m.tail.L9", "m.tail.x", "m/1"]))
    elif how == "version":
        req.model_version = draw(st.text(max_size=6))
    elif how == "param":
        p = req.parameters[draw(st.sampled_from(["timeout", "device_id", "priority", "x"]))]
        kind = draw(st.sampled_from(["bool_param", "int64_param", "string_param", "double_param", "uint64_param"]))
        setattr(p, kind, {"bool_param": True, "int64_param": draw(st.integers(-(1 << 63), (1 << 63) - 1)),
                          "string_param": "d", "double_param": 1.5, "uint64_param": 7}[kind])
    elif how == "contents":
        del req.raw_input_contents[:]
        field = draw(st.sampled_from(["bool_contents", "int_contents", "int64_contents", "uint_contents",
                                      "uint64_contents", "fp32_contents", "fp64_contents", "bytes_contents"]))
        values = draw(st.lists(st.integers(0, 255), max_size=120))
        getattr(t.contents, field).extend(
            [bytes([v]) for v in values] if field == "bytes_contents" else
            [bool(v & 1) for v in values] if field == "bool_contents" else values)
    raw = req.SerializeToString()
    if how == "truncate":
        raw = raw[:draw(st.integers(0, len(raw) - 1))]
    elif how == "flip":
        i = draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + bytes([raw[i] ^ draw(st.integers(1, 255))]) + raw[i + 1:]
    return raw


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def test_malformed_requests_get_a_clear_status_and_the_server_stays_up(door):
    channel = door[1]
    seen: dict[grpc.StatusCode, int] = {}

    def count(code: grpc.StatusCode) -> None:
        seen[code] = seen.get(code, 0) + 1

    def fuzz_round(round_seed: int) -> None:
        @seed(round_seed)
        @settings(max_examples=N_PER_ROUND, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(method=st.sampled_from(_METHODS), raw=st.binary(max_size=256))
        def random_bytes(method, raw):
            count(call(channel, method, raw))

        @seed(round_seed + 1)
        @settings(max_examples=N_PER_ROUND, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(raw=mutated())
        def mutated_infer(raw):
            count(call(channel, "ModelInfer", raw))

        random_bytes()
        mutated_infer()

    assert_alive(channel)
    fuzz_round(31)
    rss0 = _rss_bytes()
    fuzz_round(33)
    grew = _rss_bytes() - rss0
    assert sum(seen.values()) >= 4 * N_PER_ROUND
    assert {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND} <= set(seen), seen
    assert_alive(channel)
    assert call(channel, "ServerLive", b"") is grpc.StatusCode.OK
    # Statistics keep only names that resolve: client-sent names cannot grow them.
    assert {s["name"] for s in door[0].models.stats.to_json(None, None)["model_stats"]} <= {"m"}
    assert grew < 16 << 20, f"RSS grew {grew >> 20} MiB over the second round ({seen})"
