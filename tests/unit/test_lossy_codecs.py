"""The lossy codecs round-trip within their measured error, and refuse what they cannot take."""

from __future__ import annotations

import numpy as np
import pytest

from cluster.protocol.errors import EncodingError, ProtocolError
from cluster.protocol.lossy import (
    ImageNorm,
    decode_lossy,
    encode_bits,
    encode_image,
    encode_lossy,
    encode_tiled,
    image_layout,
    measure_lossy,
)


def _photo(n: int = 2, size: int = 48) -> np.ndarray:
    """Smooth colour gradients with an edge, as pixels in 0..255 (what cameras see)."""
    yy, xx = np.mgrid[0:size, 0:size] / size
    chans = [np.sin(6 * xx + k) * 0.4 + 0.5 + 0.1 * (yy > 0.5) for k in range(3)]
    one = np.stack(chans, axis=-1)
    return np.clip(np.stack([np.roll(one, 5 * i, axis=1) for i in range(n)]) * 255, 0, 255)


def _normalised(layout: str = "NCHW") -> tuple[np.ndarray, ImageNorm]:
    norm = ImageNorm.imagenet(layout)
    x = (_photo() / 255.0 - np.array(norm.mean)) / np.array(norm.std)
    x = x.astype(np.float32)
    return (np.ascontiguousarray(np.moveaxis(x, 3, 1)) if layout == "NCHW" else x), norm


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


@pytest.mark.parametrize("fmt", ["jpeg", "webp"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_image_round_trip_is_within_the_measured_error_and_higher_quality_is_closer(fmt: str, layout: str) -> None:
    x, norm = _normalised(layout)
    errs = []
    for q in (10, 95):
        t = encode_image(x, fmt=fmt, quality=q, norm=norm)
        back = decode_lossy(t)
        assert back.shape == x.shape and back.dtype == np.float32
        stats = measure_lossy(x, fmt, q, norm=norm, repeats=1)
        assert _rel(back, x) == pytest.approx(stats.rel_l2_err, rel=1e-6)
        assert float(np.abs(back - x).max()) == pytest.approx(stats.max_abs_err, rel=1e-6)
        assert stats.encoded_bytes < stats.raw_bytes / 4  # smaller than int8
        errs.append(stats.rel_l2_err)
    assert errs[1] < errs[0] < 0.25


def test_declared_norm_reproduces_the_pixels_exactly_through_lossless_steps() -> None:
    x, norm = _normalised()
    lo, step = norm.affine(3)
    pixels = np.rint((np.moveaxis(x, 1, 3) - lo) / step)
    assert np.allclose(pixels, np.rint(_photo()), atol=0.51)


def test_fitted_norm_without_a_declaration_still_round_trips() -> None:
    x, _ = _normalised()
    back = decode_lossy(encode_image(x, quality=95))
    assert _rel(back, x) < 0.05


def test_uint8_pixels_come_back_as_pixels() -> None:
    u = _photo().astype(np.uint8)
    back = decode_lossy(encode_image(u, quality=95))
    assert back.dtype == np.uint8 and back.shape == u.shape
    assert float(np.mean(np.abs(back.astype(np.int16) - u))) < 3.0
    grey = u[..., 0]
    back = decode_lossy(encode_image(grey, fmt="webp", quality=90))
    assert back.shape == grey.shape


def _feature_map(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:14, 0:14] / 14
    base = np.stack([np.sin(3 * xx * (1 + c % 4) + c) + np.cos(2 * yy + c) for c in range(20)])
    return np.maximum(base[None] + 0.1 * rng.standard_normal((2, 20, 14, 14)), 0).astype(np.float32)


@pytest.mark.parametrize("codec,level,max_rel", [("tiled-jpeg", 90, 0.1), ("tiled-webp", 90, 0.1),
                                                 ("bits", 4, 0.1), ("bits", 6, 0.03), ("bits", 8, 0.01)])
def test_feature_map_codecs_round_trip_within_their_measured_error(codec: str, level: int, max_rel: float) -> None:
    fm = _feature_map()
    t = encode_lossy(fm, codec, level)
    back = decode_lossy(t)
    assert back.shape == fm.shape and back.dtype == np.float32
    stats = measure_lossy(fm, codec, level, repeats=1)
    assert float(np.abs(back - fm).max()) == pytest.approx(stats.max_abs_err, rel=1e-6)
    assert stats.rel_l2_err < max_rel
    assert stats.encoded_bytes < fm.nbytes / 2


def test_bits_error_is_at_most_half_a_level() -> None:
    fm = _feature_map(1)
    for bits in (3, 5, 7):
        t = encode_bits(fm, bits=bits)
        err = np.abs(decode_lossy(t) - fm).max(axis=(0, 2, 3))
        assert np.all(err <= t.step / 2 + 1e-5)
    fewer = encode_bits(fm, bits=4).wire_bytes
    assert fewer < encode_bits(fm, bits=8).wire_bytes


def test_bits_takes_any_rank() -> None:
    v = np.linspace(-3, 3, 17, dtype=np.float32)
    assert np.abs(decode_lossy(encode_bits(v, bits=8)) - v).max() <= 6 / 255 / 2 + 1e-6


def test_image_layout_finds_the_channels() -> None:
    assert image_layout(np.zeros((1, 3, 8, 8), np.float32)) == "NCHW"
    assert image_layout(np.zeros((1, 8, 8, 3), np.float32)) == "NHWC"
    assert image_layout(np.zeros((1, 3, 8, 3), np.float32), "NHWC") == "NHWC"


@pytest.mark.parametrize("arr", [np.zeros((1, 64, 7, 7), np.float32), np.zeros((1, 1000), np.float32),
                                 np.zeros((1, 3, 8, 8), np.int64)])
def test_a_non_image_tensor_given_jpeg_is_a_clear_error(arr: np.ndarray) -> None:
    with pytest.raises(EncodingError) as e:
        encode_image(arr, quality=90)
    assert str(list(arr.shape)) in str(e.value) or str(arr.dtype) in str(e.value)
    assert "boundary encoding" in str(e.value)


@pytest.mark.parametrize("q", [0, 101, -5, 90.5, True, "90"])
def test_quality_outside_1_to_100_is_a_clear_error(q: object) -> None:
    img = np.zeros((1, 3, 8, 8), np.float32)
    with pytest.raises(EncodingError, match=r"quality .* is outside 1\.\.100.*from 1 \(smallest\) to 100"):
        encode_image(img, quality=q)  # type: ignore[arg-type]
    with pytest.raises(EncodingError, match="outside 1..100"):
        encode_tiled(np.zeros((1, 4, 8, 8), np.float32), quality=q)  # type: ignore[arg-type]


@pytest.mark.parametrize("call,match", [
    (lambda: encode_tiled(np.zeros((1, 4, 8, 8), np.int32)), "float feature map .*dtype int32"),
    (lambda: encode_tiled(np.zeros((1, 16), np.float32)), r"shape \[1, 16\].*use 'bits'|shape \[1, 16\]"),
    (lambda: encode_bits(np.zeros(4, np.float32), bits=1), "bit depth 1 is outside 2..8"),
    (lambda: encode_bits(np.zeros(4, np.float32), bits=9), "bit depth 9"),
    (lambda: encode_bits(np.zeros(4, np.int8)), "float tensors, got dtype int8"),
    (lambda: encode_bits(np.array([1.0, np.nan], np.float32)), "NaN or infinity"),
    (lambda: encode_image(np.full((1, 3, 4, 4), np.inf, np.float32)), "NaN or infinity"),
    (lambda: encode_image(np.zeros((1, 3, 4, 4), np.float32), fmt="png"), "image format 'png' is unknown"),
    (lambda: encode_lossy(np.zeros((1, 3, 4, 4), np.float32), "avif", 50), "lossy codec 'avif' is unknown"),
    (lambda: encode_image(np.zeros((1, 4, 4, 4), np.float32), norm=ImageNorm.imagenet()), "not an image"),
    (lambda: encode_image(np.zeros((1, 1, 4, 4), np.float32), norm=ImageNorm.imagenet()), "3 values"),
    (lambda: ImageNorm(std=(0.0, 1.0, 1.0)), r"std .* <= 0"),
    (lambda: ImageNorm(layout="CHW"), "layout 'CHW' is unknown"),
    (lambda: ImageNorm(scale=-1.0), "scale -1.0"),
    (lambda: measure_lossy(np.zeros(4, np.float32), "bits", 4, repeats=0), "repeats=0"),
])
def test_bad_input_is_a_clear_error(call, match: str) -> None:
    with pytest.raises(EncodingError, match=match):
        call()


def test_a_corrupt_frame_is_a_protocol_error() -> None:
    import dataclasses

    t = encode_image(np.zeros((1, 3, 8, 8), np.float32), quality=50)
    with pytest.raises(ProtocolError, match="does not decode"):
        decode_lossy(dataclasses.replace(t, frames=(b"not a jpeg",)))
    small = encode_image(np.zeros((1, 3, 4, 4), np.float32), quality=50)
    with pytest.raises(ProtocolError, match="the shape needs 8x8"):
        decode_lossy(dataclasses.replace(t, frames=small.frames))
    b = encode_bits(np.zeros(16, np.float32))
    with pytest.raises(ProtocolError, match="inflates|decompress|declares"):
        decode_lossy(dataclasses.replace(b, shape=(32,)))


def test_norm_round_trips_through_a_dict() -> None:
    n = ImageNorm.imagenet("NHWC")
    assert ImageNorm.from_dict(n.to_dict()) == n
