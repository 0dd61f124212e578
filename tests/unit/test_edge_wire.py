"""Local API bodies: JSON/base64 and msgpack tensors, and errors naming the fix."""

import numpy as np
import pytest

from edge_agent import wire
from edge_agent.errors import RequestError


@pytest.mark.parametrize("ctype", [wire.JSON, wire.MSGPACK])
def test_round_trip(ctype):
    binary = ctype == wire.MSGPACK
    x = {"x": np.arange(24, dtype=np.float32).reshape(2, 3, 4), "ids": np.array([1, 2], dtype=np.int64)}
    body = wire.dumps({"inputs": wire.encode_tensors(x, binary), "id": "r1"}, ctype)
    got, rid = wire.decode_tensors(wire.loads(body, ctype), binary)
    assert rid == "r1" and set(got) == {"x", "ids"}
    for k in x:
        assert got[k].dtype == x[k].dtype and np.array_equal(got[k], x[k])


def test_values_form_for_hand_written_requests():
    got, rid = wire.decode_tensors({"inputs": {"x": {"dtype": "float32", "values": [[1, 2], [3, 4]]}}}, False)
    assert rid is None and got["x"].shape == (2, 2) and got["x"].dtype == np.float32


@pytest.mark.parametrize("body,match", [
    ({}, "no 'inputs'"),
    ({"inputs": {"x": 3}}, "is a int"),
    ({"inputs": {"x": {"dtype": "complex64", "shape": [1], "data": ""}}}, "dtype"),
    ({"inputs": {"x": {"dtype": "float32", "shape": [2], "data": "AAAA"}}}, "needs 8"),
    ({"inputs": {"x": {"dtype": "float32", "shape": [1], "data": "!!"}}}, "not base64"),
    ({"inputs": {"x": {"dtype": "float32", "shape": "1"}}}, "shape"),
    ({"inputs": {}, "id": 5}, "'id'"),
])
def test_bad_bodies(body, match):
    with pytest.raises(RequestError, match=match):
        wire.decode_tensors(body, False)


def test_bad_encoding():
    with pytest.raises(RequestError, match="not valid JSON"):
        wire.loads(b"{", wire.JSON)
    with pytest.raises(RequestError, match="not valid msgpack"):
        wire.loads(b"\xc1", wire.MSGPACK)


@pytest.mark.parametrize("body,ctype,match", [
    (b"[" * 100_000, wire.JSON, "nested too deeply"),
    (b"\xff\xfe\x00", wire.JSON, "not valid JSON"),
    (b"\x81\x91\x01\x02", wire.MSGPACK, "not valid msgpack"),  # a list as a map key
    (b"\xd4\xff\x00", wire.MSGPACK, "not valid msgpack"),  # a timestamp of the wrong length
    (b"\x91" * 5000 + b"\xc0", wire.MSGPACK, "not valid msgpack"),
])
def test_undecodable_bodies_are_request_errors(body, ctype, match):
    with pytest.raises(RequestError, match=match):
        wire.loads(body, ctype)


@pytest.mark.parametrize("tensor,match", [
    ({"dtype": ["float32"], "shape": [1], "data": "AAAAAA=="}, "dtype"),
    ({"dtype": "float32", "shape": [2**40, 2**40], "data": ""}, "elements, over"),
    ({"dtype": "float32", "shape": [2**70], "data": ""}, "elements, over"),
    ({"dtype": "float32", "shape": [1] * 40, "data": "AAAAAA=="}, "at most 32"),
    ({"dtype": "float32", "shape": [True], "data": "AAAAAA=="}, "shape"),
    ({"dtype": "float32", "shape": [1], "data": "\u00e9\u00e9\u00e9\u00e9"}, "not base64"),
    ({"dtype": "float32", "values": [[1, 2], [3]]}, "'values' are not"),
    ({"dtype": "float32", "values": "abc"}, "'values' are not"),
    ({"dtype": "int8", "values": [2**80]}, "'values' are not"),
    ({"dtype": "float32", "shape": [2, 2], "values": [1, 2, 3]}, "'values' are not"),
])
def test_malformed_tensors_are_request_errors_naming_the_field(tensor, match):
    with pytest.raises(RequestError, match=match):
        wire.decode_tensors({"inputs": {"x": tensor}}, False)


def test_errors_do_not_echo_a_huge_value_back():
    with pytest.raises(RequestError) as e:
        wire.decode_tensors({"inputs": {"x" * 10_000: {"dtype": "d" * 10_000}}}, False)
    assert len(str(e.value)) < 400
