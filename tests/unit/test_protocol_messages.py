"""Messages and tensor frames: round trips, zero-copy, versions and validation."""

from __future__ import annotations

import struct
import tracemalloc

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from cluster.errors import ProtocolError, VersionMismatch
from cluster.protocol import _msgpack
from cluster.protocol.encoding import encode
from cluster.protocol.messages import (
    PROTOCOL_VERSION,
    ArtifactsChunk,
    ArtifactsRequest,
    ArtifactsResponse,
    ErrorInfo,
    InferRequest,
    InferResponse,
    PlanRequest,
    PlanResponse,
    StreamFrame,
)
from cluster.protocol.tensors import ALIGN_BYTES, DTYPE_CODES, EXT_ENCODED, EXT_TENSOR, EncodedTensor

BIG = 1 << 20  # above SMALL_FRAME_BYTES: decoded by the zero-copy walker


def _req(tensors, **kw) -> InferRequest:
    base = dict(
        request_id="r1", model="m", version="1", cut_id="c3", deadline_unix_ms=1_700_000_000_000, tensors=tensors
    )
    base.update(kw)
    return InferRequest(**base)


def _same(a, b) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a, b)


dtypes = st.sampled_from(sorted(DTYPE_CODES))
shapes = hnp.array_shapes(min_dims=0, max_dims=5, min_side=0, max_side=6)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), dtype=dtypes, shape=shapes, big=st.booleans())
def test_infer_request_round_trips_every_dtype_and_shape(data, dtype, shape, big):
    arr = data.draw(hnp.arrays(np.dtype(dtype), shape))
    tensors = {"t": arr}
    if big:  # push the frame over the small-frame path so the Python walker runs too
        tensors["pad"] = np.zeros(BIG // 4, np.float32)
    req = _req(tensors, priority=data.draw(st.integers(-5, 5)), device_id="dev")
    got = InferRequest.from_msgpack(req.to_msgpack())
    assert (got.request_id, got.model, got.version, got.cut_id) == ("r1", "m", "1", "c3")
    assert got.deadline_unix_ms == req.deadline_unix_ms and got.priority == req.priority
    assert got.v == PROTOCOL_VERSION and got.device_id == "dev"
    _same(got.tensors["t"], arr)


@pytest.mark.parametrize("big", [False, True])
def test_frames_are_plain_msgpack_for_other_languages(big):
    """The standard msgpack library reads our frames, and we read frames it writes."""
    arr = np.arange(BIG // 4 if big else 12, dtype=np.float32)
    frame = _req({"x": arr}).to_msgpack()
    seen = {}

    def hook(code, data):
        seen[code] = len(data)
        return msgpack.ExtType(code, data)

    d = msgpack.unpackb(frame, ext_hook=hook)
    assert d["v"] == list(PROTOCOL_VERSION) and set(seen) == {EXT_TENSOR}
    # Rebuild the ext payload by hand, as another language would, and pack it with msgpack.
    payload = struct.pack("<BBBB", 1, DTYPE_CODES["float32"], 1, 0) + struct.pack("<Q", arr.size) + arr.tobytes()
    d["tensors"] = {"x": msgpack.ExtType(EXT_TENSOR, payload)}
    got = InferRequest.from_msgpack(msgpack.packb(d))
    _same(got.tensors["x"], arr)


def test_big_tensor_decodes_zero_copy_as_read_only_view():
    arr = np.random.default_rng(0).standard_normal((4, 256, 256)).astype(np.float32)
    frame = _req({"x": arr}).to_msgpack()
    got = InferRequest.from_msgpack(frame).tensors["x"]
    _same(got, arr)
    assert np.shares_memory(got, np.frombuffer(frame, np.uint8))
    assert not got.flags.writeable
    base = got
    while getattr(base, "base", None) is not None and not isinstance(base, memoryview):
        base = base.base
    assert isinstance(base, memoryview) and base.obj is frame
    # The writer aligns tensor data within the frame.
    offset = got.__array_interface__["data"][0] - np.frombuffer(frame, np.uint8).__array_interface__["data"][0]
    assert offset % ALIGN_BYTES == 0


def test_encoding_a_big_tensor_copies_it_once():
    arr = np.ones(8 << 18, np.float32)  # 8 MiB
    req = _req({"x": arr})
    req.to_msgpack()
    tracemalloc.start()
    frame = req.to_msgpack()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(frame) > arr.nbytes
    assert peak < 1.25 * arr.nbytes, f"encode peaked at {peak} bytes for a {arr.nbytes}-byte tensor"


def test_non_contiguous_and_big_endian_arrays_travel_as_little_endian_c_order():
    a = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]
    b = np.arange(6, dtype=">i4")
    got = InferRequest.from_msgpack(_req({"a": a, "b": b}).to_msgpack()).tensors
    _same(got["a"], np.ascontiguousarray(a))
    assert got["b"].dtype == np.dtype("<i4") and got["b"].tolist() == b.tolist()


def test_encoded_tensors_travel_in_requests_and_responses():
    x = np.random.default_rng(1).standard_normal((2, 3, 4, 4)).astype(np.float32)
    t = encode(x, precision="int8", compression="lz4", per_channel=True)
    resp = InferResponse(request_id="r", outputs={"y": t, "z": x}, timings_ms={"compute": 1.5}, served_by="m@1")
    got = InferResponse.from_msgpack(resp.to_msgpack())
    e = got.outputs["y"]
    assert isinstance(e, EncodedTensor)
    assert (e.precision, e.compression, e.shape, e.axis) == ("int8", "lz4", (2, 3, 4, 4), 1)
    np.testing.assert_array_equal(e.scales, t.scales)
    assert bytes(e.payload) == bytes(t.payload)
    _same(got.outputs["z"], x)
    assert got.timings_ms == {"compute": 1.5} and got.served_by == "m@1"


def test_every_other_message_round_trips():
    msgs = [
        PlanRequest(request_id="p", query={"model": "m", "link": {"up_bps": 1e6}, "cuts": [1, 2]}),
        PlanResponse(request_id="p", plan={"cut": "c3", "total_ms": 12.5, "ok": True, "none": None}),
        ArtifactsRequest(model="m", version="2", device_id="d"),
        ArtifactsChunk(model="m", version="2", name="a.onnx", offset=4, total_bytes=9, data=b"hello"),
        ArtifactsResponse(model="m", version="2", files={"a": b"x" * 10, "b": b""}),
        ErrorInfo(code=5, error="UnknownModelError", message="no", fields={"model": "m", "known": []}),
    ]
    for m in msgs:
        assert type(m).from_msgpack(m.to_msgpack()) == m


def test_stream_frames_round_trip_and_carry_exactly_one_body():
    x = np.zeros(3, np.int64)
    for frame in (
        StreamFrame(seq=7, request=_req({"x": x})),
        StreamFrame(seq=8, response=InferResponse(request_id="r", outputs={"y": x})),
        StreamFrame(seq=None, error=ErrorInfo(code=3, error="ProtocolError", message="bad")),
    ):
        got = StreamFrame.from_msgpack(frame.to_msgpack())
        assert got.seq == frame.seq
        assert (got.request is None, got.response is None, got.error is None) == (
            frame.request is None,
            frame.response is None,
            frame.error is None,
        )
    with pytest.raises(ProtocolError, match="exactly one"):
        StreamFrame(seq=1)
    two = msgpack.packb({"v": [1, 0], "seq": 1, "error": {"v": [1, 0], "code": 1, "error": "", "message": ""},
                         "response": {"v": [1, 0], "request_id": "r", "outputs": {}}})
    with pytest.raises(ProtocolError, match="exactly one"):
        StreamFrame.from_msgpack(two)


def test_artifacts_are_chunked_and_reassembled():
    files = {"big.onnx": bytes(range(256)) * 10, "empty": b"", "small": b"abc"}
    resp = ArtifactsResponse(model="m", version="1", files=files)
    chunks = list(resp.to_chunks(chunk_bytes=1000))
    assert sum(c.name == "big.onnx" for c in chunks) == 3
    assert ArtifactsResponse.from_chunks(chunks).files == files
    with pytest.raises(ProtocolError, match="does not follow"):
        ArtifactsResponse.from_chunks(chunks[1:])
    with pytest.raises(ProtocolError, match="ended after"):
        ArtifactsResponse.from_chunks(chunks[:1])
    with pytest.raises(ProtocolError, match="chunk_bytes"):
        list(resp.to_chunks(chunk_bytes=0))


# --- versions ----------------------------------------------------------------------------


def _frame_dict(**over):
    d = msgpack.unpackb(_req({}).to_msgpack())
    d.update(over)
    return d


def test_newer_minor_with_unknown_fields_is_accepted():
    d = _frame_dict(v=[1, 9], some_future_field={"x": 1}, another=[1, 2])
    got = InferRequest.from_msgpack(msgpack.packb(d))
    assert got.v == (1, 9) and got.model == "m"


def test_optional_fields_default_when_an_older_sender_omits_them():
    d = _frame_dict()
    del d["priority"], d["device_id"]
    got = InferRequest.from_msgpack(msgpack.packb(d))
    assert got.priority == 0 and got.device_id == ""


def test_unknown_major_is_a_version_mismatch_naming_supported_versions():
    d = {"v": [2, 0], "totally": "different"}
    with pytest.raises(VersionMismatch, match=r"2\.0 is not supported; this server speaks 1\.x") as ei:
        InferRequest.from_msgpack(msgpack.packb(d))
    assert ei.value.got == [2, 0] and ei.value.supported == [1]


@pytest.mark.parametrize("v", [None, "1.0", [1], [1, -1], [True, 0], [1, 0, 0]])
def test_malformed_version_is_a_protocol_error(v):
    d = _frame_dict(v=v)
    with pytest.raises(ProtocolError, match="'v'"):
        InferRequest.from_msgpack(msgpack.packb(d))
    del d["v"]
    with pytest.raises(ProtocolError, match="missing required field 'v'"):
        InferRequest.from_msgpack(msgpack.packb(d))


# --- validation: every decode failure is a ProtocolError that says what was wrong --------


def _tensor_ext(payload: bytes, code: int = EXT_TENSOR, big: bool = False) -> bytes:
    d = _frame_dict(tensors={"x": msgpack.ExtType(code, payload)})
    if big:
        d["filler"] = b"\0" * BIG
    return msgpack.packb(d)


def _head(dtype_code: int, shape: tuple[int, ...], pad: int = 0) -> bytes:
    return struct.pack("<BBBB", 1, dtype_code, len(shape), pad) + struct.pack(f"<{len(shape)}Q", *shape) + bytes(pad)


@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize(
    "frame_fn, message",
    [
        (lambda big: _req({"x": np.ones(4, np.float32)}).to_msgpack()[:-3], "truncated"),
        (lambda big: b"", "empty frame"),
        (lambda big: b"\xc1", "invalid msgpack"),
        (lambda big: _tensor_ext(_head(1, (2, 2)) + b"\0" * 12, big=big), "needs 16 data bytes, the ext holds 12"),
        (lambda big: _tensor_ext(_head(99, (2,)) + b"\0" * 8, big=big), "unknown dtype code 99"),
        (lambda big: _tensor_ext(_head(1, (2,)), code=7, big=big), "unknown ext type code 7"),
        (lambda big: _tensor_ext(b"\x01\x01", big=big), "shorter than its"),
        (lambda big: _tensor_ext(b"\x02\x01\x01\x00" + b"\0" * 8, big=big), "layout 2 is unknown"),
        (lambda big: _tensor_ext(_head(1, (2,), pad=200)[:12], big=big), "too short"),
        (lambda big: _tensor_ext(b"\x01\x09\x00\x00\x00\x00\x00\x00" + b"\0" * 4, code=EXT_ENCODED, big=big), "unknown precision"),
        (lambda big: _tensor_ext(b"\x01\x02\x01\x01\x05\x00\x00\x00" + b"\0" * 8, code=EXT_ENCODED, big=big), "outside"),
        (lambda big: msgpack.packb({k: v for k, v in _frame_dict().items() if k != "model"}), "missing required field 'model'"),
        (lambda big: msgpack.packb(_frame_dict(model=5)), "field 'model' must be a str, got int"),
        (lambda big: msgpack.packb(_frame_dict(deadline_unix_ms="soon")), "'deadline_unix_ms' must be an int"),
        (lambda big: msgpack.packb(_frame_dict(tensors={"x": 3})), "must be a tensor ext value"),
        (lambda big: msgpack.packb(_frame_dict(tensors=[1])), "map with str keys"),
        (lambda big: msgpack.packb([1, 2, 3]), "expected a msgpack map"),
        (lambda big: _req({}).to_msgpack() + b"\x00", "trailing bytes"),
    ],
)
def test_malformed_frames_raise_protocol_errors_that_say_why(frame_fn, message, big):
    frame = frame_fn(big)
    with pytest.raises(ProtocolError, match=message):
        InferRequest.from_msgpack(frame)


def test_walker_rejects_deep_nesting_bad_utf8_bad_keys_and_huge_containers():
    hook = lambda code, data, off: None  # noqa: E731
    filler = b"\xc4\x00" * (BIG // 2)  # many empty bins push the frame onto the walker
    deep = b"\x91" * 40 + b"\xc0"
    with pytest.raises(ProtocolError, match="nesting deeper"):
        _msgpack.unpackb(b"\x92" + deep + b"\xdd" + struct.pack(">I", BIG // 2) + filler, hook)
    with pytest.raises(ProtocolError, match="UTF-8"):
        _msgpack.unpackb(b"\x92\xa2\xff\xfe\xdd" + struct.pack(">I", BIG // 2) + filler, hook)
    with pytest.raises(ProtocolError, match="map key"):
        _msgpack.unpackb(b"\x81\x90\x01" + b"\xc4\x00" * BIG, hook)
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        _msgpack.unpackb(b"\xdd" + struct.pack(">I", BIG) + b"\xc0" * BIG, hook)
    with pytest.raises(ProtocolError, match="truncated"):
        _msgpack.unpackb(b"\xdd" + struct.pack(">I", 2) + b"\xdb\xff\xff\xff\xff" + b"\0" * BIG, hook)


def test_walker_reads_every_msgpack_type():
    """Values of every msgpack family decode the same in our walker as in msgpack."""
    value = {
        "ints": [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32, 2**63, -1, -32, -33, -128, -129, -32769, -(2**31) - 1, -(2**63)],
        "floats": [0.5, -1.25e300],
        "str": ["", "x" * 31, "y" * 32, "z" * 300, "w" * 70000, "é"],
        "bin": [b"", b"a" * 300, b"b" * 70000],
        "nil": None,
        "bools": [True, False],
        "map16": {str(i): i for i in range(20)},
        "arr16": list(range(20)),
    }
    frame = msgpack.packb(value, use_single_float=False)
    assert len(frame) > _msgpack.SMALL_FRAME_BYTES
    assert _msgpack.unpackb(frame, lambda c, d, o: None) == value
    f32 = msgpack.packb([1.5], use_single_float=True) + b""
    assert _msgpack.unpackb(f32, lambda c, d, o: None) == [1.5]


def test_unpackb_rejects_non_bytes():
    with pytest.raises(ProtocolError, match="must be bytes"):
        _msgpack.unpackb("text", lambda c, d, o: None)  # type: ignore[arg-type]


def test_packing_unsupported_values_names_the_field():
    with pytest.raises(ProtocolError, match="PlanRequest"):
        PlanRequest(request_id="p", query={"x": object()}).to_msgpack()
    with pytest.raises(ProtocolError, match="dtype complex64 cannot be sent"):
        _req({"x": np.zeros(2, np.complex64)}).to_msgpack()
    with pytest.raises(ProtocolError, match="numpy array"):
        _req({"x": [1, 2]}).to_msgpack()
    with pytest.raises(ProtocolError, match="tensor names must be str"):
        _req({1: np.zeros(1)}).to_msgpack()
    with pytest.raises(ProtocolError, match="timings"):
        InferResponse(request_id="r", outputs={}, timings_ms={"a": "slow"}).to_msgpack()
    with pytest.raises(ProtocolError, match="no field"):
        InferResponse.write_field(_msgpack.Writer(), "nope", 1)


def test_decoding_leaves_no_reference_cycle_holding_the_frame():
    """A dropped request must free its frame at once, not at the next GC pass."""
    import gc
    import sys

    frame = _req({"x": np.zeros(BIG // 4, np.float32)}).to_msgpack()
    before = sys.getrefcount(frame)
    gc.disable()
    try:
        req = InferRequest.from_msgpack(frame)
        assert sys.getrefcount(frame) > before
        del req
        assert sys.getrefcount(frame) == before
        with pytest.raises(ProtocolError):
            InferRequest.from_msgpack(frame[:-1])
    finally:
        gc.enable()


def _enc_head(prec=0, comp=0, shape=(2,), axis=-1, pad=0, layout=1) -> bytes:
    return struct.pack("<BBBBbBH", layout, prec, comp, len(shape), axis, pad, 0) + struct.pack(f"<{len(shape)}Q", *shape)


@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize(
    "payload, code, message",
    [
        (struct.pack("<BBBB", 1, 1, 33, 0) + bytes(8 * 33), EXT_TENSOR, "33 dims, more than the limit"),
        (_head(1, (0, 2**62)), EXT_TENSOR, "cannot be built"),
        (_enc_head(layout=3) + bytes(8), EXT_ENCODED, "layout 3 is unknown"),
        (_enc_head(comp=9) + bytes(8), EXT_ENCODED, "unknown compression code 9"),
        (struct.pack("<BBBBbBH", 1, 0, 0, 40, -1, 0, 0), EXT_ENCODED, "40 dims"),
        (struct.pack("<BBBBbBH", 1, 0, 0, 2, -1, 0, 0) + bytes(8), EXT_ENCODED, "too short for its shape"),
        (_enc_head(prec=1, axis=0) + bytes(4), EXT_ENCODED, "must have axis -1"),
        (_enc_head(prec=2, shape=(1, 50), axis=1) + bytes(20), EXT_ENCODED, "too short for 50 scales"),
        (b"\x01\x00", EXT_ENCODED, "shorter than its header"),
    ],
)
def test_more_malformed_tensor_payloads(payload, code, message, big):
    with pytest.raises(ProtocolError, match=message):
        InferRequest.from_msgpack(_tensor_ext(payload, code=code, big=big))


@pytest.mark.parametrize(
    "cls, field, bad, message",
    [
        (ArtifactsChunk, "data", "text", "must be bin"),
        (ArtifactsResponse, "files", {"a": "text"}, "must be bin"),
        (InferResponse, "timings_ms", {"compute": "slow"}, "number of ms"),
        (StreamFrame, "seq", "one", "must be an int"),
    ],
)
def test_wrong_field_types_in_other_messages(cls, field, bad, message):
    good = {
        ArtifactsChunk: ArtifactsChunk(model="m", version="1", name="a", offset=0, total_bytes=1, data=b"x"),
        ArtifactsResponse: ArtifactsResponse(model="m", version="1", files={}),
        InferResponse: InferResponse(request_id="r", outputs={}),
        StreamFrame: StreamFrame(seq=1, response=InferResponse(request_id="r", outputs={})),
    }[cls]
    d = msgpack.unpackb(good.to_msgpack())
    d[field] = bad
    with pytest.raises(ProtocolError, match=message):
        cls.from_msgpack(msgpack.packb(d))


def test_small_frame_errors_are_protocol_errors():
    d = _frame_dict()
    frame = msgpack.packb(d)
    i = frame.index(b"\xa1m")  # the value "m" of model: make it invalid UTF-8
    with pytest.raises(ProtocolError, match="UTF-8"):
        InferRequest.from_msgpack(frame[:i] + b"\xa1\xff" + frame[i + 2 :])
    with pytest.raises(ProtocolError, match="invalid msgpack"):
        InferRequest.from_msgpack(b"\x81\x01\x02")  # int key: not allowed


def test_big_frames_report_unpackable_fields_and_bad_encoded_tensors():
    big = {"x": np.zeros(BIG // 4, np.float32)}
    with pytest.raises(ProtocolError, match="cannot pack"):
        _req(big, model=object()).to_msgpack()
    bad = EncodedTensor(precision="fp9", compression="none", shape=(1,), axis=-1,
                        scales=np.zeros(0, np.float32), zero_points=np.zeros(0, np.uint8), payload=b"\0" * 4)
    for tensors in ({"t": bad}, {"t": bad, **big}):
        with pytest.raises(ProtocolError, match="unknown precision/compression"):
            _req(tensors).to_msgpack()
    with pytest.raises(ProtocolError, match="dimensions exceed"):
        _req({"x": np.zeros((1,) * 33, np.float32)}).to_msgpack()
