"""The small-frame fast path (cluster.protocol._small) against the general path.

The fast path must write the bytes the general path writes, build the values
it builds, and, for anything it does not take, leave the decision (and the
exact error) to the general path.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from cluster.errors import ClusterError, ProtocolError, VersionMismatch
from cluster.protocol import _small
from cluster.protocol.encoding import encode
from cluster.protocol.messages import SUPPORTED_MAJORS, InferRequest, InferResponse, StreamFrame, _Message, encode_response_frame
from cluster.protocol.tensors import DTYPE_CODES, EncodedTensor


def _req(tensors, **kw) -> InferRequest:
    base = dict(request_id="r1", model="m", version="1", cut_id="c3", deadline_unix_ms=1_700_000_000_000,
                tensors=tensors)
    base.update(kw)
    return InferRequest(**base)


def _general_decode(cls, raw):
    return _Message.from_msgpack.__func__(cls, raw)


def _outcome(fn, raw):
    """('ok', fields) or (error class, message): what decoding `raw` gives."""
    try:
        msg = fn(raw)
    except ClusterError as e:  # ProtocolError, VersionMismatch
        return (type(e).__name__, str(e))
    fields = {}
    for k, v in vars(msg).items():
        if isinstance(v, dict):
            v = {n: (t.dtype.str, t.shape, t.tobytes()) if isinstance(t, np.ndarray) else repr(t) for n, t in v.items()}
        fields[k] = v
    return ("ok", fields)


dtypes = st.sampled_from(sorted(DTYPE_CODES))
shapes = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), dtype=dtypes, shape=shapes)
def test_fast_request_bytes_and_values_equal_the_general_path(data, dtype, shape):
    arr = data.draw(hnp.arrays(np.dtype(dtype), shape))
    req = _req({"t": arr, "u": np.arange(3, dtype=np.int64)}, priority=data.draw(st.integers(-3, 3)), device_id="d")
    fast = req.to_msgpack()
    assert _small.encode_request(req) is not None  # the fast path took it
    assert fast == _Message.to_msgpack(req)
    assert _outcome(InferRequest.from_msgpack, fast) == _outcome(lambda r: _general_decode(InferRequest, r), fast)
    got = InferRequest.from_msgpack(fast)
    assert got.tensors["t"].dtype == arr.dtype and got.tensors["t"].shape == arr.shape
    np.testing.assert_array_equal(got.tensors["t"], arr)
    assert not got.tensors["t"].flags.writeable


def test_fast_response_matches_the_general_path_and_carries_the_stage_timings():
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    resp = InferResponse(request_id="r", outputs={"y": x}, timings_ms={"queue": 1.5, "compute": 2}, served_by="m@1")
    raw = encode_response_frame(resp, 0.25)
    got = InferResponse.from_msgpack(raw)
    assert _outcome(InferResponse.from_msgpack, raw) == _outcome(lambda r: _general_decode(InferResponse, r), raw)
    assert got.timings_ms["decode"] == 0.25 and got.timings_ms["encode"] >= 0 and got.timings_ms["compute"] == 2.0
    np.testing.assert_array_equal(got.outputs["y"], x)
    assert got.served_by == "m@1" and got.v == (1, 0)


def test_stream_response_frames_take_the_fast_path_too():
    x = np.arange(4, dtype=np.float32)
    resp = InferResponse(request_id="r", outputs={"y": x}, timings_ms={}, served_by="m@1")
    frame = StreamFrame.from_msgpack(encode_response_frame(resp, 0.1, seq=7, stream=True))
    assert frame.seq == 7 and frame.response is not None
    np.testing.assert_array_equal(frame.response.outputs["y"], x)


@pytest.mark.parametrize(
    "tensor",
    [
        np.arange(6, dtype=">f4"),  # big-endian: the general path swaps it
        np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2],  # strided: the general path copies it
    ],
)
def test_arrays_the_fast_encoder_does_not_take_still_encode(tensor):
    req = _req({"t": tensor})
    assert _small.encode_request(req) is None
    got = InferRequest.from_msgpack(req.to_msgpack())
    np.testing.assert_array_equal(got.tensors["t"], tensor)
    assert got.tensors["t"].dtype == np.dtype("<f4")


def test_encoded_tensors_go_through_the_general_hook_and_decode_the_same():
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    req = _req({"q": encode(x, precision="int8", per_channel=True, axis=0), "x": x})
    raw = req.to_msgpack()
    got = InferRequest.from_msgpack(raw)
    assert isinstance(got.tensors["q"], EncodedTensor) and got.tensors["q"].axis == 0
    assert _outcome(InferRequest.from_msgpack, raw) == _outcome(lambda r: _general_decode(InferRequest, r), raw)


def test_missing_optional_fields_get_their_defaults_and_later_minor_keys_are_ignored():
    body = {"v": [1, 7], "request_id": "r", "model": "m", "version": "1", "cut_id": "c", "deadline_unix_ms": 5,
            "tensors": {}, "to_msgpack": "not a method", "extra": [1, 2]}
    req = InferRequest.from_msgpack(msgpack.packb(body))
    assert req.priority == 0 and req.device_id == "" and req.v == (1, 7)
    assert "extra" not in vars(req) and callable(req.to_msgpack)  # a frame's keys never become attributes
    resp = InferResponse.from_msgpack(msgpack.packb({"v": [1, 0], "request_id": "r", "outputs": {}}))
    assert resp.timings_ms == {} and resp.served_by == ""


def test_int_timings_and_bool_fields_are_left_to_the_general_path():
    ok = msgpack.packb({"v": [1, 0], "request_id": "r", "outputs": {}, "timings_ms": {"queue": 3}})
    assert _small.decode_response(InferResponse, ok, SUPPORTED_MAJORS) is None
    assert InferResponse.from_msgpack(ok).timings_ms == {"queue": 3.0}
    bad = msgpack.packb({"v": [1, 0], "request_id": "r", "model": "m", "version": "1", "cut_id": "c",
                         "deadline_unix_ms": True, "tensors": {}})
    with pytest.raises(ProtocolError, match="deadline_unix_ms"):
        InferRequest.from_msgpack(bad)


def test_an_unknown_major_is_still_a_version_mismatch():
    raw = msgpack.packb({"v": [2, 0], "request_id": "r", "model": "m", "version": "1", "cut_id": "c",
                         "deadline_unix_ms": 1, "tensors": {}})
    with pytest.raises(VersionMismatch):
        InferRequest.from_msgpack(raw)


_VALID = _req({"x": np.arange(8, dtype=np.float32).reshape(2, 4), "b": np.array([True, False])}).to_msgpack()


@settings(max_examples=300, deadline=None)
@given(
    cut=st.integers(0, len(_VALID)),
    flips=st.lists(st.tuples(st.integers(0, len(_VALID) - 1), st.integers(0, 255)), max_size=3),
)
def test_malformed_frames_get_the_general_paths_exact_outcome(cut, flips):
    buf = bytearray(_VALID[:cut])
    for pos, val in flips:
        if pos < len(buf):
            buf[pos] = val
    raw = bytes(buf)
    assert _outcome(InferRequest.from_msgpack, raw) == _outcome(lambda r: _general_decode(InferRequest, r), raw)


def test_big_tensors_are_left_to_the_single_copy_writer_before_any_copy():
    import tracemalloc

    big = np.zeros(1 << 18, np.float32)  # 1 MiB, above SMALL_FRAME_BYTES
    req = _req({"small": np.zeros(4, np.float32), "big": big})
    tracemalloc.start()
    try:
        assert _small.encode_request(req) is None
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < big.nbytes // 4


def _frame_outcome(raw):
    """What both paths make of a StreamFrame: ('ok', parts) or (error class, message)."""
    out = []
    for fn in (StreamFrame.from_msgpack, lambda r: StreamFrame.from_dict(_msgpack_general(r))):
        try:
            f = fn(raw)
        except ClusterError as e:
            out.append((type(e).__name__, str(e)))
            continue
        body = f.request or f.response or f.error
        out.append(("ok", f.seq, f.v, type(body).__name__, _outcome(lambda _: body, raw)))
    return out


def _msgpack_general(raw):
    from cluster.protocol._msgpack import unpackb
    from cluster.protocol.tensors import read_ext

    return unpackb(raw, read_ext)


def test_stream_frames_take_the_fast_path_both_ways_and_match_the_general_path():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    req_frame = StreamFrame(seq=3, request=_req({"x": x}))
    raw = req_frame.to_msgpack()
    assert _small.decode_stream_frame(StreamFrame, raw, SUPPORTED_MAJORS, InferRequest, InferResponse) is not None
    fast, general = _frame_outcome(raw)
    assert fast == general and fast[1] == 3
    resp = InferResponse(request_id="r", outputs={"y": x}, timings_ms={"queue": 1.0}, served_by="m@1")
    raw = encode_response_frame(resp, 0.5, seq=4, stream=True)
    fast, general = _frame_outcome(raw)
    assert fast == general and fast[3] == "InferResponse"


@settings(max_examples=200, deadline=None)
@given(
    cut=st.integers(0, 200),
    flips=st.lists(st.tuples(st.integers(0, 199), st.integers(0, 255)), max_size=3),
)
def test_malformed_stream_frames_get_the_general_paths_exact_outcome(cut, flips):
    valid = StreamFrame(seq=1, request=_req({"x": np.arange(4, dtype=np.float32)})).to_msgpack()
    buf = bytearray(valid[:cut])
    for pos, val in flips:
        if pos < len(buf):
            buf[pos] = val
    fast, general = _frame_outcome(bytes(buf))
    assert fast == general
