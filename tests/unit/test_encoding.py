"""Boundary encodings: exactness, error bounds, compression and their failures."""

from __future__ import annotations

import lz4.frame
import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from cluster.errors import EncodingError, ProtocolError
from cluster.protocol.encoding import CodecStats, decode, encode, measure_codec
from cluster.protocol.messages import InferRequest
from cluster.protocol.tensors import EncodedTensor

COMPRESSIONS = ["none", "zstd", "lz4"]
floats = st.floats(-1e4, 1e4, width=32, allow_nan=False, allow_infinity=False)
shapes = hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=8)


def _wire(t: EncodedTensor) -> EncodedTensor:
    """Sends `t` through a message frame and returns what the receiver sees."""
    req = InferRequest(request_id="r", model="m", version="1", cut_id="c", deadline_unix_ms=1, tensors={"t": t})
    return InferRequest.from_msgpack(req.to_msgpack()).tensors["t"]


@settings(max_examples=25, deadline=None)
@given(x=hnp.arrays(np.float32, shapes, elements=floats), comp=st.sampled_from(COMPRESSIONS))
def test_fp32_is_exact_with_every_compression(x, comp):
    got = decode(_wire(encode(x, precision="fp32", compression=comp)))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, x)


@settings(max_examples=25, deadline=None)
@given(x=hnp.arrays(np.float32, shapes, elements=floats), comp=st.sampled_from(COMPRESSIONS))
def test_fp16_error_is_within_half_precision(x, comp):
    got = decode(_wire(encode(x, precision="fp16", compression=comp)))
    np.testing.assert_array_equal(got, x.astype(np.float16).astype(np.float32))
    assert np.all(np.abs(got - x) <= np.abs(x) * 2**-11 + 2**-24)


@settings(max_examples=25, deadline=None)
@given(
    x=hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=4, min_side=1, max_side=8), elements=floats),
    comp=st.sampled_from(COMPRESSIONS),
    per_channel=st.booleans(),
)
def test_int8_error_is_at_most_half_a_step(x, comp, per_channel):
    t = encode(x, precision="int8", compression=comp, per_channel=per_channel)
    got = decode(_wire(t))
    if per_channel:
        assert t.axis == 1 and len(t.scales) == x.shape[1]
        bound = np.asarray(t.scales).reshape([1, -1] + [1] * (x.ndim - 2)) / 2
    else:
        assert t.axis == -1 and len(t.scales) == 1
        bound = float(t.scales[0]) / 2
    slack = 1e-6 * max(1.0, float(np.abs(x).max()))
    assert np.all(np.abs(got - x) <= bound + slack)


def test_int8_keeps_zero_exact_and_per_channel_beats_per_tensor_on_uneven_channels():
    rng = np.random.default_rng(0)
    x = np.maximum(rng.standard_normal((2, 4, 8, 8)), 0).astype(np.float32)
    x *= np.array([0.01, 1.0, 10.0, 100.0], np.float32).reshape(1, 4, 1, 1)
    for per_channel in (False, True):
        got = decode(encode(x, precision="int8", per_channel=per_channel))
        assert np.all(got[x == 0] == 0)
    small = x[:, 0]
    err_t = np.abs(decode(encode(x, precision="int8"))[:, 0] - small).max()
    err_c = np.abs(decode(encode(x, precision="int8", per_channel=True))[:, 0] - small).max()
    assert err_c * 100 < err_t


def test_constant_and_empty_tensors_encode():
    for x in (np.zeros((2, 3), np.float32), np.full((2, 3), -4.0, np.float32), np.zeros((0, 3), np.float32)):
        for prec in ("fp32", "fp16", "int8"):
            for pc in (False, True):
                got = decode(_wire(encode(x, precision=prec, per_channel=pc, compression="zstd")))
                np.testing.assert_allclose(got, x, atol=1e-6)


def test_uncompressed_fp32_decode_is_a_view_of_the_frame():
    x = np.arange(1 << 18, dtype=np.float32)
    req = InferRequest(request_id="r", model="m", version="1", cut_id="c", deadline_unix_ms=1,
                       tensors={"t": encode(x)})
    frame = req.to_msgpack()
    got = decode(InferRequest.from_msgpack(frame).tensors["t"])
    assert np.shares_memory(got, np.frombuffer(frame, np.uint8))
    np.testing.assert_array_equal(got, x)


def test_compression_shrinks_compressible_tensors():
    x = np.zeros((64, 64), np.float32)
    x[::7] = 1.0
    for comp in ("zstd", "lz4"):
        t = encode(x, compression=comp)
        assert t.payload_bytes * 10 < x.nbytes
        assert t.raw_bytes == x.nbytes


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(precision="fp8"), "precision 'fp8' is unknown"),
        (dict(compression="gzip"), "compression 'gzip' is unknown"),
        (dict(precision="int8", per_channel=True, axis=3), "axis 3 is outside"),
    ],
)
def test_bad_options_raise_encoding_errors(kwargs, message):
    with pytest.raises(EncodingError, match=message):
        encode(np.zeros((2, 3), np.float32), **kwargs)


def test_unencodable_values_raise_encoding_errors_with_a_fix():
    with pytest.raises(EncodingError, match="float tensors, got int64.*plain arrays"):
        encode(np.arange(3))
    with pytest.raises(EncodingError, match="float tensors, got list"):
        encode([1.0])  # type: ignore[arg-type]
    with pytest.raises(EncodingError, match="NaN or infinity.*fp32 or fp16"):
        encode(np.array([1.0, np.nan], np.float32), precision="int8")
    with pytest.raises(EncodingError, match="overflows fp16.*fp32 or int8"):
        encode(np.array([1e6], np.float32), precision="fp16")
    inf = decode(encode(np.array([np.inf, 1.0], np.float32), precision="fp16"))
    assert np.isinf(inf[0]) and inf[1] == 1.0


def _replace(t: EncodedTensor, **kw) -> EncodedTensor:
    fields = dict(precision=t.precision, compression=t.compression, shape=t.shape, axis=t.axis,
                  scales=t.scales, zero_points=t.zero_points, payload=t.payload)
    fields.update(kw)
    return EncodedTensor(**fields)


def test_bodies_that_do_not_match_the_shape_are_protocol_errors():
    x = np.ones((4, 4), np.float32)
    with pytest.raises(ProtocolError, match="needs 64 bytes, got 60"):
        decode(_replace(encode(x), payload=bytes(encode(x).payload)[:60]))
    z = encode(x, compression="zstd")
    with pytest.raises(ProtocolError, match="zstd frame declares 64 bytes, shape \\[8, 4\\] needs 128"):
        decode(_replace(z, shape=(8, 4)))
    no_size = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 64)
    with pytest.raises(ProtocolError, match="zstd frame declares"):
        decode(_replace(z, payload=no_size))
    with pytest.raises(ProtocolError, match="does not decompress"):
        decode(_replace(z, payload=b"garbage"))
    # An lz4 bomb: 64 MiB of zeros in a small frame must not inflate past the shape's size.
    bomb = lz4.frame.compress(b"\0" * (64 << 20))
    with pytest.raises(ProtocolError, match="lz4 frame is truncated or inflates past"):
        decode(_replace(encode(x, compression="lz4"), payload=bomb))
    with pytest.raises(ProtocolError, match="does not decompress"):
        decode(_replace(encode(x, compression="lz4"), payload=b"\x04\x22\x4d\x18garbage"))
    with pytest.raises(ProtocolError, match="takes an EncodedTensor"):
        decode(x)  # type: ignore[arg-type]


def test_measure_codec_reports_sizes_times_and_error():
    x = np.random.default_rng(2).standard_normal((1, 8, 16, 16)).astype(np.float32)
    fp32 = measure_codec(x, repeats=2)
    assert fp32.raw_bytes == x.nbytes and fp32.max_abs_err == 0.0 and fp32.encoded_bytes > x.nbytes
    q = measure_codec(x, precision="int8", compression="zstd", per_channel=True, repeats=2)
    assert q.ratio > 3.0 and 0 < q.max_abs_err < 0.05
    assert q.encode_ms >= 0 and q.decode_ms >= 0
    assert CodecStats.from_json(q.to_json()) == q
    with pytest.raises(EncodingError, match="repeats=0"):
        measure_codec(x, repeats=0)


def test_int8_handles_subnormal_ranges_without_overflow():
    x = np.array([[0.0, 1e-40, 3e-39]], np.float32)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        t = encode(x, precision="int8", per_channel=True, axis=1)
    got = decode(t)
    assert np.all(np.isfinite(got)) and np.abs(got - x).max() <= 1e-30
