"""The lossy codecs on the wire: EncodedTensor precision codes 3..7 (docs/protocol.md, ext type 2).

Each code round-trips through a real Infer frame with exact header fields and decodes
within the codec's measured error; the older fp16/int8 records keep their bytes; and
malformed lossy records are ProtocolErrors that name the field.
"""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import pytest

from cluster.protocol.client import make_request
from cluster.protocol.encoding import decode, encode
from cluster.protocol.errors import EncodingError, ProtocolError
from cluster.protocol.lossy import ImageNorm, encode_lossy, measure_lossy
from cluster.protocol.messages import InferRequest
from cluster.protocol.tensors import EXT_ENCODED, PRECISIONS, EncodedTensor, ext_default, read_ext

_RNG = np.random.default_rng(7)


def _image(shape=(2, 3, 24, 32)) -> np.ndarray:
    """A smooth image (what JPEG is made for), normalised the ImageNet way."""
    n, c, h, w = shape
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    base = np.stack([np.sin(3 * xx + k) * np.cos(2 * yy - k) for k in range(c)])
    pixels = (base[None] * 0.5 + 0.5) * np.linspace(0.8, 1.0, n)[:, None, None, None]
    mean, std = np.array((0.485, 0.456, 0.406))[:c], np.array((0.229, 0.224, 0.225))[:c]
    return ((pixels - mean[None, :, None, None]) / std[None, :, None, None]).astype(np.float32)


def _feature_map() -> np.ndarray:
    return np.maximum(_RNG.standard_normal((1, 9, 6, 6)), 0).astype(np.float32)


CASES = [
    # (precision, tensor, level, norm, axis, frames)
    ("jpeg", _image(), 90, ImageNorm.imagenet(), 1, 2),
    ("webp", _image(), 75, None, 1, 2),
    ("jpeg", np.moveaxis(_image((1, 3, 16, 16)), 1, 3).copy(), 80, None, 3, 1),
    ("tiled-jpeg", _feature_map(), 90, None, 1, 1),
    ("tiled-webp", _feature_map(), 60, None, 1, 1),
    ("bits", np.maximum(_RNG.standard_normal((1, 4, 8, 8)), 0).astype(np.float32), 4, None, 1, 1),
    ("bits", _feature_map(), 3, None, -1, 1),  # 36 values per channel: one affine for the tensor
    ("bits", _RNG.standard_normal((1, 10)).astype(np.float32), 6, None, -1, 1),
]


def _wire(t: EncodedTensor) -> EncodedTensor:
    """The tensor after a trip through an Infer frame's bytes."""
    frame = make_request("m", "1", "L", {"x": t}, timeout_s=5.0).to_msgpack()
    return InferRequest.from_msgpack(frame).tensors["x"]


@pytest.mark.parametrize("precision,x,level,norm,axis,frames", CASES,
                         ids=[f"{c[0]}-{c[1].ndim}d-{c[2]}" for c in CASES])
def test_each_lossy_code_round_trips_with_exact_header_fields(precision, x, level, norm, axis, frames) -> None:
    t = encode(x, precision=precision, level=level, norm=norm)
    ext = ext_default(t)
    assert ext.code == EXT_ENCODED
    layout, prec, comp, ndim, ax, pad, lvl = struct.unpack_from("<BBBBbBH", ext.data, 0)
    assert (layout, prec, comp, ndim, ax, pad, lvl) == (1, PRECISIONS[precision], 0, x.ndim, axis, 0, level)
    pos = 8 + 8 * ndim
    assert struct.unpack_from(f"<{ndim}Q", ext.data, 8) == x.shape
    dcode, _, _, nframes = struct.unpack_from("<BBHI", ext.data, pos)
    assert (dcode, nframes) == (1, frames)
    assert len(ext.data) == t.wire_bytes == encode_lossy(x, precision, level, norm=norm).wire_bytes

    got = _wire(t)
    assert (got.precision, got.level, got.shape, got.axis, got.dtype, got.frame_bytes) == \
        (precision, level, x.shape, axis, "float32", t.frame_bytes)
    y = decode(got)
    assert y.dtype == np.float32 and y.shape == x.shape
    np.testing.assert_array_equal(y, decode(t))
    # Within what the codec measured on the same tensor (the planner's figure).
    stats = measure_lossy(x, precision, level, norm=norm, repeats=1)
    assert float(np.abs(y - x).max()) <= stats.max_abs_err + 1e-6
    assert stats.max_abs_err < float(np.ptp(x))  # it is a codec, not noise


def test_uint8_pixels_travel_as_uint8() -> None:
    pixels = (np.clip(_image((2, 3, 16, 16)) * 40 + 128, 0, 255)).astype(np.uint8).transpose(0, 2, 3, 1).copy()
    got = _wire(encode(pixels, precision="jpeg", level=95))
    assert (got.dtype, got.axis) == ("uint8", 3)
    y = decode(got)
    assert y.dtype == np.uint8 and y.shape == pixels.shape
    assert np.abs(y.astype(int) - pixels).max() <= 12


# Fixed bytes of records written before the lossy codes: they must decode to the same
# values, and today's writer must still write exactly these bytes.
_OLD_FP16 = bytes.fromhex("01010001ff000000" "0200000000000000" "003c" "00c0")  # [1.0, -2.0]
_OLD_INT8 = bytes.fromhex("01020001ff000000" "0300000000000000" "0000003f" "0a" "0a0c08")  # scale .5, zp 10


@pytest.mark.parametrize("data,want,kw", [
    (_OLD_FP16, [1.0, -2.0], {"precision": "fp16"}),
    (_OLD_INT8, [0.0, 1.0, -1.0], {"precision": "int8"}),
])
def test_old_records_decode_unchanged_and_are_still_written_the_same(data, want, kw) -> None:
    t = read_ext(EXT_ENCODED, memoryview(data), 0)
    assert (t.level, t.frame_bytes, t.dtype) == (0, (), "float32")
    np.testing.assert_array_equal(decode(t), np.array(want, np.float32))
    if kw["precision"] == "fp16":
        assert ext_default(encode(np.array(want, np.float32), **kw)).data == data


def _lossy_record(prec=3, level=90, shape=(1, 3, 8, 8), axis=1, dcode=1, nframes=1, frames=(b"xx",),
                  comp=0, nq=None) -> bytes:
    nq = (1 if axis == -1 else shape[axis]) if nq is None else nq
    return (struct.pack("<BBBBbBH", 1, prec, comp, len(shape), axis, 0, level)
            + struct.pack(f"<{len(shape)}Q", *shape) + struct.pack("<BBHI", dcode, 0, 0, nframes)
            + np.zeros(2 * nq, "<f4").tobytes() + struct.pack(f"<{len(frames)}I", *map(len, frames))
            + b"".join(frames))


@pytest.mark.parametrize("data,match", [
    (_lossy_record(prec=9), "unknown precision code 9"),
    (_lossy_record(prec=200), "unknown precision code 200"),
    (_lossy_record(level=0), "quality 0, outside 1..100"),
    (_lossy_record(level=101), "quality 101, outside 1..100"),
    (_lossy_record(prec=7, level=9, shape=(1, 8), axis=-1), "bit depth 9, outside 2..8"),
    (_lossy_record(comp=1), "compression none"),
    (_lossy_record(dcode=3), "decoded dtype code 3"),
    (_lossy_record(prec=7, level=4, shape=(1, 8), axis=-1, dcode=5), "decodes to float32, not uint8"),
    (_lossy_record(shape=(1, 4, 8, 8)), r"needs an image \[N, 3\|1, H, W\]"),
    (_lossy_record(prec=5, shape=(1, 4, 8), axis=1), r"feature map \[N, C, H, W\]"),
    (_lossy_record(nframes=2, frames=(b"a", b"b")), "needs 1 frame"),
    (_lossy_record()[:-1], "frames declare 2 bytes, the ext holds 1"),
    (_lossy_record()[:40], "too short"),
])
def test_malformed_lossy_records_are_protocol_errors(data, match) -> None:
    with pytest.raises(ProtocolError, match=match):
        read_ext(EXT_ENCODED, memoryview(data), 0)


@pytest.mark.parametrize("frames,match", [
    ((b"not a jpeg at all",), "does not decode"),
    ((b"",), "does not decode"),
])
def test_a_frame_that_does_not_decode_is_a_protocol_error(frames, match) -> None:
    t = read_ext(EXT_ENCODED, memoryview(_lossy_record(frames=frames)), 0)
    with pytest.raises(ProtocolError, match=match):
        decode(t)


def test_an_image_of_another_size_is_refused_before_its_pixels_are_decoded() -> None:
    other = encode(_image((1, 3, 16, 16)), precision="jpeg")
    t = read_ext(EXT_ENCODED, memoryview(_lossy_record(frames=(bytes(other.payload),))), 0)
    with pytest.raises(ProtocolError, match="16x16, the shape needs 8x8"):
        decode(t)


def test_a_bits_frame_declaring_another_size_is_refused() -> None:
    good = encode(np.ones((1, 8), np.float32), precision="bits")
    t = read_ext(EXT_ENCODED, memoryview(_lossy_record(prec=7, level=4, shape=(1, 4096), axis=-1,
                                                       frames=(bytes(good.payload),))), 0)
    with pytest.raises(ProtocolError, match="declares 8 bytes, shape \\[1, 4096\\] needs 4096"):
        decode(t)


def test_encode_refuses_what_the_codecs_cannot_take() -> None:
    with pytest.raises(EncodingError, match="compresses by itself"):
        encode(_image(), precision="jpeg", compression="zstd")
    with pytest.raises(EncodingError, match="quality 0 is outside 1..100"):
        encode(_image(), precision="jpeg", level=0)
    with pytest.raises(EncodingError, match="not an image"):
        encode(_feature_map(), precision="webp")
    with pytest.raises(EncodingError, match="precision 'png' is unknown"):
        encode(_image(), precision="png")  # type: ignore[arg-type]


def test_a_lossy_tensor_in_a_big_frame_is_written_aligned_and_read_back() -> None:
    x = _image((4, 3, 64, 64))
    t = encode(x, precision="bits", level=8)
    req = make_request("m", "1", "L", {"a": np.zeros(70_000, np.float32), "x": t}, timeout_s=5.0)
    got = InferRequest.from_msgpack(req.to_msgpack()).tensors["x"]
    np.testing.assert_array_equal(decode(got), decode(t))
    assert msgpack.unpackb(req.to_msgpack(), ext_hook=lambda c, b: c, raw=False)["tensors"]["x"] == EXT_ENCODED


def test_a_lossy_record_with_a_level_out_of_range_is_not_written() -> None:
    import dataclasses

    t = encode(_image((1, 3, 8, 8)), precision="jpeg")
    with pytest.raises(ProtocolError, match="level 0, outside 1..100"):
        make_request("m", "1", "L", {"x": dataclasses.replace(t, level=0)}, timeout_s=5.0).to_msgpack()
    with pytest.raises(ProtocolError, match="dtype 'int8'; use float32 or uint8"):
        make_request("m", "1", "L", {"x": dataclasses.replace(t, dtype="int8")}, timeout_s=5.0).to_msgpack()
