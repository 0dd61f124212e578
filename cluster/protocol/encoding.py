"""Boundary encodings: fp32, fp16 and int8, each optionally compressed without loss, and
the lossy codecs of `lossy.py` by their names (jpeg, webp, tiled-jpeg, tiled-webp, bits).

int8 is *affine uint8*: q = clip(rint(x / scale) + zero_point, 0, 255) and
x' = (q - zero_point) * scale, with the range [min(x, 0), max(x, 0)] mapped onto
0..255 so that 0.0 is exact (ReLU outputs, padding). Affine rather than
symmetric because boundary tensors after ReLU are one-sided: symmetric int8
would waste half the levels on negatives that never occur. The error is at most
scale / 2 per element (plus float rounding). Per-channel uses one scale and
zero point per index along `axis` (1 for NCHW).

Compression ('zstd' with `zstandard`, 'lz4' with `lz4.frame`) is applied to the
body after the precision step. Decompression is bounded by the size the shape
implies, so a small frame cannot inflate into a huge one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

import lz4.frame
import numpy as np
import zstandard

from cluster.protocol.errors import EncodingError, ProtocolError
from cluster.protocol.lossy import (
    ImageNorm,
    RoundTripStats,
    decode_lossy,
    encode_lossy,
    from_encoded,
    time_round_trips,
    to_encoded,
)
from cluster.protocol.tensors import COMPRESSIONS, LOSSY_PRECISIONS, PRECISIONS, EncodedTensor

__all__ = ["encode", "decode", "measure_codec", "CodecStats", "Precision", "Compression"]

Precision = Literal["fp32", "fp16", "int8", "jpeg", "webp", "tiled-jpeg", "tiled-webp", "bits"]
Compression = Literal["none", "zstd", "lz4"]

_FP16_MAX = 65504.0
_MIN_SCALE = 1e-30
_ITEMSIZE = {"fp32": 4, "fp16": 2, "int8": 1}
_EMPTY_F32 = np.zeros(0, dtype="<f4")
_EMPTY_U8 = np.zeros(0, dtype=np.uint8)
_local = threading.local()


def _zstd_compressor(level: int) -> zstandard.ZstdCompressor:
    # Compressor objects are not safe to share between threads; keep one per thread and level.
    cache = getattr(_local, "zc", None)
    if cache is None:
        cache = _local.zc = {}
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return c


def _zstd_decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "zd", None)
    if d is None:
        d = _local.zd = zstandard.ZstdDecompressor()
    return d


def _check_choice(name: str, value: str, choices: dict[str, int]) -> None:
    if value not in choices:
        raise EncodingError(reason=f"{name} {value!r} is unknown", fix=f"use one of {', '.join(choices)}")


def _quantize(x: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if axis == -1:
        lo = np.minimum(x.min(), 0.0).reshape(1).astype(np.float32)
        hi = np.maximum(x.max(), 0.0).reshape(1).astype(np.float32)
        bshape: tuple[int, ...] = ()
    else:
        others = tuple(i for i in range(x.ndim) if i != axis)
        lo = np.minimum(x.min(axis=others), 0.0).astype(np.float32)
        hi = np.maximum(x.max(axis=others), 0.0).astype(np.float32)
        bshape = tuple(x.shape[i] if i == axis else 1 for i in range(x.ndim))
    if not (np.isfinite(lo).all() and np.isfinite(hi).all()):
        raise EncodingError(
            reason="the tensor holds NaN or infinity, which int8 cannot represent",
            fix="send it as fp32 or fp16",
        )
    scale = (hi - lo) / np.float32(255.0)
    scale[scale == 0] = 1.0
    # A subnormal range would make 1/scale overflow; a floor of 1e-30 loses nothing that matters.
    np.maximum(scale, np.float32(_MIN_SCALE), out=scale)
    zp = np.clip(np.rint(-lo / scale), 0, 255).astype(np.uint8)
    inv = (1.0 / scale).astype(np.float32)
    if bshape:
        inv_b, zp_b = inv.reshape(bshape), zp.astype(np.float32).reshape(bshape)
    else:
        inv_b, zp_b = inv[0], np.float32(zp[0])
    q = x * inv_b
    q += zp_b
    np.rint(q, out=q)
    np.clip(q, 0, 255, out=q)
    return q.astype(np.uint8), scale.astype(np.float32), zp


def encode(
    arr: np.ndarray,
    *,
    precision: Precision = "fp32",
    compression: Compression = "none",
    per_channel: bool = False,
    axis: int = 1,
    level: int | None = None,
    norm: ImageNorm | None = None,
) -> EncodedTensor:
    """Encodes a float tensor for the wire.

    `per_channel` applies to int8 only and uses one scale per index of `axis`.
    `level` is the compression level (zstd default 1, lz4 default 0: speed first,
    the link is usually slower than either codec). For the lossy codecs it is the
    image quality (1..100, default 90) or the bit depth of 'bits' (2..8, default 4), and
    `norm` the image normalisation of jpeg/webp (`lossy.ImageNorm`; None fits each
    channel's range). The lossy codecs take compression 'none'.
    """
    _check_choice("precision", precision, PRECISIONS)
    _check_choice("compression", compression, COMPRESSIONS)
    if precision in LOSSY_PRECISIONS:
        if compression != "none":
            raise EncodingError(reason=f"the lossy codec {precision} compresses by itself, compression "
                                       f"{compression!r} does not apply", fix="pass compression='none'")
        default = 4 if precision == "bits" else 90
        return to_encoded(encode_lossy(arr, precision, default if level is None else level, norm=norm))
    if not isinstance(arr, np.ndarray) or arr.dtype.kind != "f":
        got = arr.dtype if isinstance(arr, np.ndarray) else type(arr).__name__
        raise EncodingError(
            reason=f"encodings apply to float tensors, got {got}",
            fix="send integer and bool tensors as plain arrays",
        )
    x = np.ascontiguousarray(arr, dtype="<f4")
    q_axis = -1
    scales, zps = _EMPTY_F32, _EMPTY_U8
    if precision == "fp32":
        body = x
    elif precision == "fp16":
        if x.size:
            peak = max(abs(float(x.min())), abs(float(x.max())))
            # inf and NaN exist in fp16; only finite values past its range are lost.
            if np.isfinite(peak) and peak > _FP16_MAX:
                raise EncodingError(
                    reason=f"max |x| = {peak:g} overflows fp16 (max {_FP16_MAX:g})",
                    fix="send it as fp32 or int8",
                )
        body = x.astype("<f2")
    else:
        if per_channel:
            if not 0 <= axis < x.ndim:
                raise EncodingError(
                    reason=f"per-channel axis {axis} is outside a {x.ndim}-dim tensor of shape {x.shape}",
                    fix="pass axis= a valid dimension or per_channel=False",
                )
            q_axis = axis
        if x.size == 0:
            body = np.zeros(x.shape, np.uint8)
            n = x.shape[q_axis] if q_axis >= 0 else 1
            scales, zps = np.ones(n, np.float32), np.zeros(n, np.uint8)
        else:
            body, scales, zps = _quantize(x, q_axis)
    raw = memoryview(body).cast("B") if body.nbytes else b""
    if compression == "none":
        payload: bytes | memoryview = raw
    elif compression == "zstd":
        payload = _zstd_compressor(1 if level is None else level).compress(raw)
    else:
        payload = lz4.frame.compress(raw, compression_level=0 if level is None else level, store_size=True)
    return EncodedTensor(
        precision=precision,
        compression=compression,
        shape=tuple(int(d) for d in x.shape),
        axis=q_axis,
        scales=scales,
        zero_points=zps,
        payload=payload,
    )


def _decompress(t: EncodedTensor, expected: int) -> bytes | memoryview:
    if t.compression == "none":
        if t.payload_bytes != expected:
            raise ProtocolError(
                reason=f"{t.precision} body of shape {list(t.shape)} needs {expected} bytes, got {t.payload_bytes}"
            )
        return t.payload
    try:
        if t.compression == "zstd":
            size = zstandard.get_frame_parameters(t.payload).content_size
            if size != expected:
                raise ProtocolError(
                    reason=f"zstd frame declares {size} bytes, shape {list(t.shape)} needs {expected}; "
                    "write the content size into the frame"
                )
            out = _zstd_decompressor().decompress(t.payload, max_output_size=expected)
        else:
            d = lz4.frame.LZ4FrameDecompressor()
            out = d.decompress(t.payload, max_length=expected)
            if not d.eof:
                raise ProtocolError(
                    reason=f"lz4 frame is truncated or inflates past the {expected} bytes shape {list(t.shape)} needs"
                )
    except (zstandard.ZstdError, RuntimeError) as e:
        raise ProtocolError(reason=f"{t.compression} body does not decompress: {e}") from e
    if len(out) != expected:
        raise ProtocolError(
            reason=f"{t.compression} body inflates to {len(out)} bytes, shape {list(t.shape)} needs {expected}"
        )
    return out


def decode(t: EncodedTensor) -> np.ndarray:
    """Returns the float32 tensor (uint8 pixels for a uint8 image sent as jpeg/webp); a
    read-only view of the frame for uncompressed fp32."""
    if not isinstance(t, EncodedTensor):
        raise ProtocolError(reason=f"decode takes an EncodedTensor, got {type(t).__name__}")
    if t.lossy:
        return decode_lossy(from_encoded(t))
    count = 1
    for d in t.shape:
        count *= d
    body = _decompress(t, count * _ITEMSIZE[t.precision])
    if t.precision == "fp32":
        return np.frombuffer(body, dtype="<f4", count=count).reshape(t.shape)
    if t.precision == "fp16":
        return np.frombuffer(body, dtype="<f2", count=count).reshape(t.shape).astype(np.float32)
    q = np.frombuffer(body, dtype=np.uint8, count=count).reshape(t.shape)
    if t.axis == -1:
        out = q.astype(np.float32)
        out -= np.float32(t.zero_points[0])
        out *= np.float32(t.scales[0])
        return out
    bshape = tuple(t.shape[i] if i == t.axis else 1 for i in range(len(t.shape)))
    out = q.astype(np.float32)
    out -= t.zero_points.astype(np.float32).reshape(bshape)
    out *= t.scales.astype(np.float32).reshape(bshape)
    return out


@dataclass(frozen=True)
class CodecStats(RoundTripStats):
    """What one encoding costs and loses on one tensor (the planner's codec model);
    `encoded_bytes` is the ext payload (header, scales and body; no alignment padding)."""

    precision: str
    """'fp32', 'fp16' or 'int8'."""
    compression: str
    """'none', 'zstd' or 'lz4'."""
    per_channel: bool
    """int8 scales per channel (True) or per tensor."""


def measure_codec(
    arr: np.ndarray,
    *,
    precision: Precision = "fp32",
    compression: Compression = "none",
    per_channel: bool = False,
    axis: int = 1,
    repeats: int = 5,
) -> CodecStats:
    """Encodes and decodes `arr` `repeats` times and reports sizes, median times and the error."""
    t, out, encode_ms, decode_ms = time_round_trips(
        lambda: encode(arr, precision=precision, compression=compression, per_channel=per_channel, axis=axis),
        decode, repeats)
    x = np.asarray(arr, dtype=np.float32)
    err = float(np.max(np.abs(out - x))) if x.size else 0.0
    return CodecStats(
        precision=precision,
        compression=compression,
        per_channel=per_channel,
        raw_bytes=t.raw_bytes,
        encoded_bytes=t.wire_bytes,
        ratio=t.raw_bytes / max(1, t.wire_bytes),
        encode_ms=encode_ms,
        decode_ms=decode_ms,
        max_abs_err=err,
    )
