"""Fuzzing the OIP gRPC door of a real gateway with malformed requests over a raw gRPC channel.

Random bytes to every method, and valid ModelInferRequests mutated one field at a time: each
call must end with a clear status (never INTERNAL or UNKNOWN, and no hang), the server must
answer a good request afterwards, and the process's memory stay flat from the first of five
rounds of 1,000 calls to the last. One channel carries them all, as a client keeps its own;
hypothesis draws five per example, a third of the cost of one per example. Runs with the
project's own messages (cluster._oip_pb), so it needs no tritonclient.
"""

from __future__ import annotations


import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from cluster._oip_pb import oip_pb2 as pb
from tests.integration._oip_grpc_support import AUTH, oip_grpc_door
from tests.integration._rss import rss_bytes

pytestmark = [pytest.mark.grpc, pytest.mark.slow]

ROUNDS = 5
PER_ROUND = 500
"""Calls of each kind (random bytes, mutated requests) per round: 5,000 in all. The first round
warms the process up, the rest must not grow it."""
PER_EXAMPLE = 5
"""Calls drawn per hypothesis example."""
PAD_BYTES = 16 << 10
"""Each mutated request but those cut or flipped (9 kinds of 11) carries this much more (an input
parameter the door ignores), so a server that kept each one would grow by PAD_BYTES x 2,000 x
9/11 = 26 MiB over the last four rounds (29 MiB measured with the door's requests kept in a list)."""
RSS_BOUND_BYTES = 8 << 20
"""Growth of the process's RSS (_rss_bytes) allowed from the end of the first round to the end of
the last: the gateway, the client and hypothesis grow 1.3 MiB without a leak."""
_PAD = "p" * PAD_BYTES
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


def good_request(pad: bool = False) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="m", model_version="1", id="g")
    req.inputs.add(name="x", datatype="FP32", shape=[1, 4, 5, 5])
    if pad:
        req.inputs[0].parameters["pad"].string_param = _PAD
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
    how = draw(st.sampled_from(["datatype", "shape", "raw", "count", "name", "model", "version", "param",
                                "contents", "truncate", "flip"]))
    req = good_request(pad=how not in ("truncate", "flip"))  # the cuts and flips land in the request itself
    t = req.inputs[0]
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


def test_malformed_requests_get_a_clear_status_and_the_server_stays_up(door):
    channel = door[1]
    seen: dict[grpc.StatusCode, int] = {}

    def count(code: grpc.StatusCode) -> None:
        seen[code] = seen.get(code, 0) + 1

    rss: list[int] = []
    examples = PER_ROUND // PER_EXAMPLE

    def fuzz_round(round_seed: int) -> None:
        @seed(round_seed)
        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(st.lists(st.tuples(st.sampled_from(_METHODS), st.binary(max_size=256)),
                        min_size=PER_EXAMPLE, max_size=PER_EXAMPLE))
        def random_bytes(calls):
            for method, raw in calls:
                count(call(channel, method, raw))

        @seed(round_seed + 1)
        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(st.lists(mutated(), min_size=PER_EXAMPLE, max_size=PER_EXAMPLE))
        def mutated_infer(raws):
            for raw in raws:
                count(call(channel, "ModelInfer", raw))

        random_bytes()
        mutated_infer()

    assert_alive(channel)
    for r in range(ROUNDS):
        fuzz_round(31 + 2 * r)
        rss.append(rss_bytes())
    assert sum(seen.values()) == 2 * ROUNDS * PER_ROUND, seen
    assert {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND} <= set(seen), seen
    assert_alive(channel)
    assert call(channel, "ServerLive", b"") is grpc.StatusCode.OK
    # Statistics keep only names that resolve: client-sent names cannot grow them.
    assert {s["name"] for s in door[0].models.stats.to_json(None, None)["model_stats"]} <= {"m"}
    grew = rss[-1] - rss[0]
    assert grew < RSS_BOUND_BYTES, (f"RSS grew {grew >> 20} MiB from the first to the last round "
                                    f"(MiB after each round: {[r >> 20 for r in rss]}; {seen})")
