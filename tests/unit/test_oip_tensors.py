"""The OIP REST door's pure parts: tensor codec (JSON and Triton binary data) and the status table."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest

from cluster._oip_tensors import check_inputs, decode_body, encode_outputs
from cluster.errors import (
    DeadlineExceeded,
    InternalError,
    NotSupported,
    PermissionDenied,
    ProtocolError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    UnknownCutError,
    UnknownModelError,
    UnknownVersionError,
    VersionMismatch,
)
from cluster.oip_rest import HTTP_STATUS_OF, http_status, to_answer


def body(*inputs: dict, **top) -> bytes:
    return json.dumps({"inputs": list(inputs), **top}).encode()


def test_json_data_flat_or_nested_decodes_to_the_shape():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    for data in (a.ravel().tolist(), a.tolist()):
        _, [t] = decode_body(body({"name": "x", "shape": [2, 3], "datatype": "FP32", "data": data}), None)
        assert t.name == "x" and t.array.dtype == np.float32 and np.array_equal(t.array, a)
    _, [b] = decode_body(body({"name": "b", "shape": [2], "datatype": "BOOL", "data": [True, False]}), None)
    assert b.array.tolist() == [True, False]


def test_binary_inputs_follow_the_json_in_order():
    a, b = np.arange(4, dtype=np.uint32).reshape(2, 2), np.array([1, 0, 1], np.bool_)
    head = body({"name": "a", "shape": [2, 2], "datatype": "UINT32", "parameters": {"binary_data_size": 16}},
                {"name": "b", "shape": [3], "datatype": "BOOL", "parameters": {"binary_data_size": 3}})
    _, [ta, tb] = decode_body(head + a.tobytes() + b.tobytes(), len(head))
    assert np.array_equal(ta.array, a) and np.array_equal(tb.array, b)


@pytest.mark.parametrize("raw,header,words", [
    (b"\xff\xfe", None, "not JSON"),
    (b"[]", None, "JSON list"),
    (b'{"inputs": []}', None, "no 'inputs' list"),
    (body({"name": "x", "shape": [2], "datatype": "FP32", "data": [1.0]}), None, "has 1 data elements"),
    (body({"name": "x", "shape": [1], "datatype": "INT32", "data": [1.5]}), None, "numbers only"),
    (body({"name": "x", "shape": [1], "datatype": "INT8", "data": [999]}), None, "out of range"),
    (body({"name": "x", "shape": [1], "datatype": "FP32", "data": ["a"]}), None, "holds 'a'"),
    (body({"name": "x", "shape": [-1], "datatype": "FP32", "data": []}), None, "non-negative integers"),
    (body({"name": "x", "shape": [1], "datatype": "FLOAT", "data": [1.0]}), None, "use one of BOOL"),
    (body({"name": "x", "shape": [1], "datatype": "FP32"}), None, "neither 'data'"),
    (body({"name": "x", "shape": [2], "datatype": "FP32", "parameters": {"binary_data_size": 4}}), 0,
     "binary_data_size 4"),
])
def test_malformed_bodies_are_protocol_errors_naming_the_problem(raw, header, words):
    if header == 0:
        header = len(raw)
        raw += bytes(4)
    with pytest.raises(ProtocolError) as e:
        decode_body(raw, header)
    assert words in str(e.value) and http_status(e.value) == 400


def test_outputs_are_binary_when_asked_and_json_otherwise():
    y, z = np.array([[1.5, 2.5]], np.float32), np.array([7], np.int64)
    head = {"model_name": "m", "id": "1"}
    out, n = encode_outputs({"parameters": {"binary_data_output": True}}, {"y": y, "z": z}, head)
    doc = json.loads(out[:n])
    assert [o["parameters"]["binary_data_size"] for o in doc["outputs"]] == [8, 8]
    assert out[n:] == y.tobytes() + z.tobytes()
    out, n = encode_outputs({"outputs": [{"name": "z"}]}, {"y": y, "z": z}, head)
    assert n is None and json.loads(out)["outputs"] == [{"name": "z", "datatype": "INT64", "shape": [1], "data": [7]}]
    with pytest.raises(ProtocolError, match="asks for output 'w'"):
        encode_outputs({"outputs": [{"name": "w"}]}, {"y": y}, head)


def test_inputs_are_checked_against_the_models_signature():
    specs = [("x", "FP32", (-1, 3))]
    _, got = decode_body(body({"name": "x", "shape": [2, 3], "datatype": "FP32", "data": [0.0] * 6}), None)
    check_inputs(got, specs, "m")
    for shape, dt, words in [([2, 4], "FP32", "has shape [-1, 3]"), ([2, 3], "FP64", "is FP32, the request gives FP64"),
                             ([0, 3], "FP32", "batch of 0")]:
        _, got = decode_body(body({"name": "x", "shape": shape, "datatype": dt, "data": [0.0] * int(np.prod(shape))}),
                             None)
        with pytest.raises(ProtocolError, match=words.replace("[", r"\[")):
            check_inputs(got, specs, "m")


@pytest.mark.parametrize("exc,status", [
    (ProtocolError(reason="r"), 400),
    (VersionMismatch(got=(2, 0), supported=(1, 0)), 400),
    (UnknownModelError(model="m"), 404),
    (UnknownVersionError(model="m", version="2"), 404),
    (UnknownCutError(model="m", version="1", cut_id="L9"), 404),
    (Unauthenticated(reason="no token"), 401),
    (PermissionDenied(principal="p", action="infer"), 403),
    (ResourceExhausted(resource="queue", limit=1, retry_after_ms=1500.0), 429),
    (NotSupported(what="x"), 501),
    (Unavailable(reason="down"), 503),
    (DeadlineExceeded(where="here"), 504),
    (InternalError(detail="bug"), 500),
    (RuntimeError("a bug"), 500),
])
def test_every_error_class_has_its_http_status_and_an_error_body(exc, status):
    answer = to_answer(exc, "test")
    assert answer.status == status
    error = json.loads(answer.body)["error"]
    assert error == ("internal error" if isinstance(exc, RuntimeError) else exc.message)
    if status == 429:
        assert answer.headers == (("Retry-After", "2"),)


def test_the_status_table_covers_every_code_the_cluster_errors_use():
    from cluster.protocol.status import STATUS_OF

    assert set(STATUS_OF.values()) - {grpc.StatusCode.INTERNAL} <= set(HTTP_STATUS_OF)
