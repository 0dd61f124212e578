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
