"""Lossy codecs: the model input as a JPEG or WebP image, and feature maps as tiled images
or as integers of a chosen bit depth.

Three families, each a pair ``encode_* -> LossyTensor -> decode_lossy``:

* ``jpeg`` / ``webp`` (:func:`encode_image`): the model input is an image tensor (float
  ``[N, 3|1, H, W]`` or ``[N, H, W, 3|1]``, or uint8 pixels). Each sample becomes one
  image at the given quality; the receiver decodes it and normalises it back. The
  normalisation is declared with :class:`ImageNorm` (``x = (pixel / scale - mean) / std``
  per channel, the torchvision form; ``ImageNorm.imagenet()`` is the usual one), or fitted
  to the tensor's per-channel range when none is declared (two floats per channel then
  travel beside the images).
* ``tiled-jpeg`` / ``tiled-webp`` (:func:`encode_tiled`): a feature map ``[N, C, H, W]`` is
  quantised to 8 bits per channel and its C channels tiled into one grey image per
  sample (BottleNet's scheme), then compressed as an image.
* ``bits`` (:func:`encode_bits`): any float tensor quantised (per channel where channels
  are large) to ``2**bits - 1`` levels (2..8 bits), one level per byte, then zstd: the
  entropy coder packs the unused high bits, so 4-bit levels cost about half of int8's
  bytes without a bit packer.

The codec library is Pillow (libjpeg-turbo and libwebp inside its wheels; the ``image``
extra): bench/codecs.py times it against simplejpeg and PyTurboJPEG, and
bench/results/codecs.json holds the figures. Pillow is imported only when an image codec
runs, so the wire protocol imports without it.

Every ``encode_*`` raises :class:`EncodingError` naming the value and the fix for input
it cannot take (an array that is not an image, a quality outside 1..100, a bit depth
outside 2..8, a non-float feature map, NaN or infinity). On the wire a `LossyTensor`
travels as an `EncodedTensor` of the codec's precision code (:func:`to_encoded`,
:func:`from_encoded`; byte layout in docs/protocol.md), and `encoding.encode` /
`encoding.decode` take the codec names as precisions. :func:`measure_lossy` gives the
planner their sizes and times like `measure_codec` does.
"""

from __future__ import annotations

import io
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from collections.abc import Callable
from typing import Any, Literal, Self, TypeVar

import numpy as np
import zstandard

from cluster.protocol.errors import EncodingError, ProtocolError
from cluster.protocol.tensors import EncodedTensor

T = TypeVar("T")

__all__ = [
    "IMAGE_FORMATS",
    "LOSSY_CODECS",
    "ImageNorm",
    "LossyStats",
    "RoundTripStats",
    "LossyTensor",
    "check_quality",
    "decode_lossy",
    "encode_bits",
    "encode_image",
    "encode_lossy",
    "encode_tiled",
    "from_encoded",
    "image_layout",
    "measure_lossy",
    "time_round_trips",
    "to_encoded",
]

ImageFormat = Literal["jpeg", "webp"]
IMAGE_FORMATS: tuple[str, ...] = ("jpeg", "webp")
#: Codec names: the image codecs, the tiled feature-map codecs and the bit-depth codec.
LOSSY_CODECS: tuple[str, ...] = ("jpeg", "webp", "tiled-jpeg", "tiled-webp", "bits")

_MIN_PER_CHANNEL = 64  # values per channel below which 'bits' uses one scale for the tensor
_MAX_SIDE = 16383  # WebP's limit (JPEG's is 65535): one limit for both formats
_PIL_FORMAT = {"jpeg": "JPEG", "webp": "WEBP"}


@dataclass(frozen=True)
class ImageNorm:
    """How a pixel (0..scale) becomes the model's input value, per channel:
    ``x = (pixel / scale - mean[c]) / std[c]``."""

    mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    """Per-channel mean subtracted after scaling (one value applies to every channel)."""
    std: tuple[float, ...] = (1.0, 1.0, 1.0)
    """Per-channel divisor, each > 0."""
    scale: float = 255.0
    """What a pixel is divided by first: 255 maps pixels onto [0, 1]; 1 keeps 0..255."""
    layout: str = "NCHW"
    """'NCHW' (channels first, the ONNX convention) or 'NHWC'."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mean", tuple(float(v) for v in self.mean))
        object.__setattr__(self, "std", tuple(float(v) for v in self.std))
        if self.layout not in ("NCHW", "NHWC"):
            raise EncodingError(reason=f"image layout {self.layout!r} is unknown", fix="use 'NCHW' or 'NHWC'")
        if not self.mean or not self.std or not all(math.isfinite(v) for v in self.mean):
            raise EncodingError(reason=f"image mean {self.mean!r} is empty or not finite",
                                fix="give one finite value per channel, e.g. (0.485, 0.456, 0.406)")
        if not all(math.isfinite(v) and v > 0 for v in self.std):
            raise EncodingError(reason=f"image std {self.std!r} holds a value <= 0 or not finite",
                                fix="give one positive value per channel, e.g. (0.229, 0.224, 0.225)")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise EncodingError(reason=f"image scale {self.scale!r} is not a positive number",
                                fix="use 255 for pixels mapped onto [0, 1], or 1 for pixels kept as 0..255")

    @classmethod
    def imagenet(cls, layout: str = "NCHW") -> ImageNorm:
        """The torchvision ImageNet normalisation."""
        return cls((0.485, 0.456, 0.406), (0.229, 0.224, 0.225), 255.0, layout)

    def affine(self, channels: int) -> tuple[np.ndarray, np.ndarray]:
        """(lo, step) per channel: ``x = lo + step * pixel``."""
        mean, std = self._per_channel(self.mean, channels), self._per_channel(self.std, channels)
        return (-mean / std).astype(np.float32), (1.0 / (self.scale * std)).astype(np.float32)

    def _per_channel(self, values: tuple[float, ...], channels: int) -> np.ndarray:
        if len(values) == 1:
            return np.full(channels, values[0], np.float64)
        if len(values) != channels:
            raise EncodingError(reason=f"the norm gives {len(values)} values {values} for an image of {channels} "
                                       "channels", fix=f"give {channels} values, or one for all channels")
        return np.asarray(values, np.float64)

    def to_dict(self) -> dict[str, Any]:
        return {"mean": list(self.mean), "std": list(self.std), "scale": self.scale, "layout": self.layout}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ImageNorm:
        return cls(tuple(d.get("mean", (0.0,))), tuple(d.get("std", (1.0,))), float(d.get("scale", 255.0)),
                   str(d.get("layout", "NCHW")))


@dataclass(frozen=True)
class LossyTensor:
    """A tensor sent through a lossy codec. Decoded value per channel: ``lo + step * level``."""

    codec: str
    """One of LOSSY_CODECS."""
    level: int
    """Image quality 1..100, or the bit depth for 'bits'."""
    shape: tuple[int, ...]
    """The tensor's shape."""
    dtype: str
    """What decoding returns: 'float32', or 'uint8' for pixels sent as they are."""
    frames: tuple[bytes, ...]
    """One compressed image per sample; one zstd frame for 'bits'."""
    lo: np.ndarray = field(repr=False)
    """float32 per channel: the value of level 0."""
    step: np.ndarray = field(repr=False)
    """float32 per channel: the value of one level."""
    layout: str = "NCHW"
    """Images: where the channels are ('NCHW' or 'NHWC')."""

    @property
    def raw_bytes(self) -> int:
        """The tensor as float32 (uint8 pixels: as they are)."""
        return int(np.prod(self.shape, dtype=np.int64)) * (1 if self.dtype == "uint8" else 4)

    @property
    def wire_bytes(self) -> int:
        """What the codec sends: the size of its wire record (`to_encoded(t).wire_bytes`): an
        8-byte header, 8 bytes per dim and 8 of codec header, the per-channel affine, a
        4-byte size per frame and the frames."""
        return 16 + 8 * len(self.shape) + 8 * len(self.lo) + 4 * len(self.frames) + sum(len(f) for f in self.frames)


def check_quality(quality: Any) -> int:
    """``quality`` as an int in 1..100; EncodingError naming it otherwise."""
    if isinstance(quality, bool) or not isinstance(quality, (int, np.integer)) or not 1 <= int(quality) <= 100:
        raise EncodingError(reason=f"image quality {quality!r} is outside 1..100",
                            fix="pass an integer quality from 1 (smallest) to 100 (best), e.g. 90")
    return int(quality)


def _check_format(fmt: str) -> str:
    if fmt not in IMAGE_FORMATS:
        raise EncodingError(reason=f"image format {fmt!r} is unknown", fix=f"use one of {', '.join(IMAGE_FORMATS)}")
    return fmt


def _check_finite(x: np.ndarray, codec: str) -> None:
    if x.size and not np.isfinite(x).all():
        raise EncodingError(reason=f"the tensor holds NaN or infinity, which {codec} cannot represent",
                            fix="send it as fp32 or fp16")


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError as e:  # pragma: no cover - the test install has Pillow
        raise EncodingError(reason="the image codecs need Pillow, which is not installed",
                            fix="install the 'image' extra: pip install 'splitinfer[image]'") from e
    return Image


def image_layout(x: np.ndarray, layout: str | None = None) -> str:
    """'NCHW' or 'NHWC' for an image tensor; EncodingError for anything that is not one.

    An image is rank 4 with 1 or 3 channels on axis 1 (NCHW) or 3 (NHWC), or uint8
    ``[N, H, W]`` (grey). ``layout`` decides when both axes could hold the channels."""
    if not isinstance(x, np.ndarray):
        raise EncodingError(reason=f"an image codec takes a numpy array, got {type(x).__name__}",
                            fix="pass the model input as a numpy array")
    if x.dtype != np.uint8 and x.dtype.kind != "f":
        raise EncodingError(reason=f"an image codec takes float or uint8 pixels, got dtype {x.dtype}",
                            fix="send this tensor with a boundary encoding (fp16, int8) instead")
    if x.dtype == np.uint8 and x.ndim == 3:
        return "NHWC"
    fits = [] if x.ndim != 4 else [lay for lay, ax in (("NCHW", 1), ("NHWC", 3)) if x.shape[ax] in (1, 3)]
    if not fits:
        raise EncodingError(
            reason=f"a tensor of shape {list(x.shape)} is not an image ([N, 3|1, H, W] or [N, H, W, 3|1])",
            fix="send it with a boundary encoding (fp16, int8) or a feature-map codec (tiled-jpeg, bits)")
    if layout is not None and layout in fits:
        return layout
    if layout is not None:
        raise EncodingError(reason=f"a tensor of shape {list(x.shape)} has no 1 or 3 channels where layout "
                                   f"{layout} puts them", fix=f"declare layout {fits[0]}")
    return fits[0]


def _to_levels(x: np.ndarray, lo: np.ndarray, step: np.ndarray, axis: int, top: int) -> np.ndarray:
    shape = [1] * x.ndim
    shape[axis] = -1
    q = (x.astype(np.float32) - lo.reshape(shape)) / step.reshape(shape)
    np.rint(q, out=q)
    np.clip(q, 0, top, out=q)
    return q.astype(np.uint8)


def _fit(x: np.ndarray, axis: int, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel (lo, step) that map the channel's range onto 0..top."""
    others = tuple(i for i in range(x.ndim) if i != axis)
    if x.size == 0:
        n = x.shape[axis]
        return np.zeros(n, np.float32), np.ones(n, np.float32)
    lo = x.min(axis=others).astype(np.float32)
    step = ((x.max(axis=others) - lo) / np.float32(top)).astype(np.float32)
    step[step <= 0] = 1.0
    return lo, step


def _save(img: Any, fmt: str, quality: int) -> bytes:
    buf = io.BytesIO()
    if fmt == "jpeg":
        img.save(buf, format="JPEG", quality=quality)
    else:
        img.save(buf, format="WEBP", quality=quality, method=0)  # method 0: the fastest encoder
    return buf.getvalue()


def _open(frame: bytes, size: tuple[int, int], mode: str) -> np.ndarray:
    Image = _pil()
    try:
        img = Image.open(io.BytesIO(frame))
        # The size is checked before the pixels are decoded: a frame from a peer that
        # declares a huge image must not allocate it.
        if img.size != size:
            raise ProtocolError(reason=f"image frame is {img.size[0]}x{img.size[1]}, the shape needs "
                                       f"{size[0]}x{size[1]}")
        img.load()
        return np.asarray(img.convert(mode), dtype=np.uint8)
    except ProtocolError:
        raise
    except Exception as e:  # noqa: BLE001 - Pillow raises many types for a corrupt image
        raise ProtocolError(reason=f"image frame does not decode: {type(e).__name__}: {e}") from e


def encode_image(x: np.ndarray, *, fmt: str = "jpeg", quality: int = 90,
                 norm: ImageNorm | None = None) -> LossyTensor:
    """Each sample of an image tensor as one JPEG or WebP image at ``quality``.

    Float input is turned back into pixels with ``norm`` (or the tensor's per-channel
    range when None); uint8 input is sent as its pixels."""
    _check_format(fmt)
    quality = check_quality(quality)
    layout = image_layout(x, None if norm is None else norm.layout)
    if x.dtype == np.uint8 and x.ndim == 3:
        pixels = x[..., None]
    else:
        pixels = x if layout == "NHWC" else np.moveaxis(x, 1, 3)
    n, h, w, c = pixels.shape
    if max(h, w) > _MAX_SIDE:
        raise EncodingError(reason=f"an image of {w}x{h} exceeds the {_MAX_SIDE}-pixel side the image formats "
                                   "allow", fix="send it with a boundary encoding (fp16, int8)")
    if x.dtype == np.uint8:
        lo, step, levels = np.zeros(c, np.float32), np.ones(c, np.float32), pixels
    else:
        _check_finite(x, fmt)
        lo, step = norm.affine(c) if norm is not None else _fit(pixels, 3, 255)
        levels = _to_levels(pixels, lo, step, 3, 255)
    Image = _pil()
    mode = "RGB" if c == 3 else "L"
    frames = tuple(_save(Image.fromarray(np.ascontiguousarray(levels[i] if c == 3 else levels[i, ..., 0]), mode),
                         fmt, quality) for i in range(n))
    return LossyTensor(codec=fmt, level=quality, shape=tuple(int(d) for d in x.shape),
                       dtype="uint8" if x.dtype == np.uint8 else "float32", frames=frames, lo=lo, step=step,
                       layout=layout)


def _grid(channels: int) -> tuple[int, int]:
    cols = math.ceil(math.sqrt(channels))
    return math.ceil(channels / cols), cols


def encode_tiled(x: np.ndarray, *, fmt: str = "jpeg", quality: int = 90) -> LossyTensor:
    """A float feature map ``[N, C, H, W]``: 8 bits per channel, the channels tiled into one
    grey image per sample, compressed as JPEG or WebP at ``quality``."""
    _check_format(fmt)
    quality = check_quality(quality)
    if not isinstance(x, np.ndarray) or x.dtype.kind != "f" or x.ndim != 4:
        got = f"dtype {x.dtype}, shape {list(x.shape)}" if isinstance(x, np.ndarray) else type(x).__name__
        raise EncodingError(reason=f"the tiled codec takes a float feature map [N, C, H, W], got {got}",
                            fix="send other tensors with 'bits' or a boundary encoding (fp16, int8)")
    _check_finite(x, f"tiled-{fmt}")
    n, c, h, w = x.shape
    rows, cols = _grid(c)
    if max(rows * h, cols * w) > _MAX_SIDE:
        raise EncodingError(reason=f"{c} channels of {h}x{w} tile into {cols * w}x{rows * h} pixels, past the "
                                   f"{_MAX_SIDE}-pixel side the image formats allow",
                            fix="send this boundary with 'bits' or int8")
    lo, step = _fit(x, 1, 255)
    levels = _to_levels(x, lo, step, 1, 255)
    padded = np.zeros((n, rows * cols, h, w), np.uint8)
    padded[:, :c] = levels
    tiles = padded.reshape(n, rows, cols, h, w).transpose(0, 1, 3, 2, 4).reshape(n, rows * h, cols * w)
    Image = _pil()
    frames = tuple(_save(Image.fromarray(np.ascontiguousarray(tiles[i]), "L"), fmt, quality) for i in range(n))
    return LossyTensor(codec=f"tiled-{fmt}", level=quality, shape=(n, c, h, w), dtype="float32", frames=frames,
                       lo=lo, step=step)


def encode_bits(x: np.ndarray, *, bits: int = 4, level: int = 3) -> LossyTensor:
    """A float tensor quantised to ``2**bits - 1`` levels, one per byte, zstd-compressed at
    ``level``: per channel (axis 1) where each channel holds 64 values or more, else per tensor."""
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 2 <= int(bits) <= 8:
        raise EncodingError(reason=f"bit depth {bits!r} is outside 2..8",
                            fix="pass bits from 2 to 8 (8 is int8; fewer bits, fewer bytes, more error)")
    if not isinstance(x, np.ndarray) or x.dtype.kind != "f":
        got = f"dtype {x.dtype}" if isinstance(x, np.ndarray) else type(x).__name__
        raise EncodingError(reason=f"the bits codec takes float tensors, got {got}",
                            fix="send integer and bool tensors as plain arrays")
    _check_finite(x, "bits")
    top = 2 ** int(bits) - 1
    # Per channel only where a channel holds enough values to pay for its 8 bytes of affine:
    # a [N, 1000] vector of logits would otherwise carry more affine than levels.
    per_channel = x.ndim >= 2 and x.shape[1] and x.size // x.shape[1] >= _MIN_PER_CHANNEL
    flat = x if per_channel else x.reshape(-1, 1)  # one column: one (lo, step) for the tensor
    lo, step = _fit(flat, 1, top)
    levels = _to_levels(flat, lo, step, 1, top)
    frame = zstandard.ZstdCompressor(level=level, write_content_size=True).compress(levels.tobytes())
    return LossyTensor(codec="bits", level=int(bits), shape=tuple(int(d) for d in x.shape), dtype="float32",
                       frames=(frame,), lo=lo, step=step, layout="NCHW" if per_channel else "")


def encode_lossy(x: np.ndarray, codec: str, level: int, *, norm: ImageNorm | None = None) -> LossyTensor:
    """Dispatches on the codec name: 'jpeg'/'webp' (level = quality), 'tiled-jpeg'/'tiled-webp'
    (quality) or 'bits' (bit depth)."""
    if codec in IMAGE_FORMATS:
        return encode_image(x, fmt=codec, quality=level, norm=norm)
    if codec in ("tiled-jpeg", "tiled-webp"):
        return encode_tiled(x, fmt=codec.split("-", 1)[1], quality=level)
    if codec == "bits":
        return encode_bits(x, bits=level)
    raise EncodingError(reason=f"lossy codec {codec!r} is unknown", fix=f"use one of {', '.join(LOSSY_CODECS)}")


def _affine(levels: np.ndarray, lo: np.ndarray, step: np.ndarray, axis: int) -> np.ndarray:
    shape = [1] * levels.ndim
    shape[axis] = -1
    out = levels.astype(np.float32)
    out *= step.reshape(shape)
    out += lo.reshape(shape)
    return out


def decode_lossy(t: LossyTensor) -> np.ndarray:
    """The tensor back: float32 (or uint8 pixels) of ``t.shape``."""
    if not isinstance(t, LossyTensor):
        raise ProtocolError(reason=f"decode_lossy takes a LossyTensor, got {type(t).__name__}")
    if t.codec == "bits":
        count = int(np.prod(t.shape, dtype=np.int64))
        try:
            declared = zstandard.get_frame_parameters(t.frames[0]).content_size
            if declared != count:  # bounds the allocation by the shape before inflating
                raise ProtocolError(reason=f"bits frame declares {declared} bytes, shape {list(t.shape)} needs "
                                           f"{count}; write the content size into the frame")
            body = zstandard.ZstdDecompressor().decompress(t.frames[0], max_output_size=count)
        except zstandard.ZstdError as e:
            raise ProtocolError(reason=f"bits body does not decompress: {e}") from e
        if len(body) != count:
            raise ProtocolError(reason=f"bits body inflates to {len(body)} bytes, shape {list(t.shape)} needs {count}")
        levels = np.frombuffer(body, np.uint8).reshape(t.shape if t.layout else (count, 1))
        return _affine(levels, t.lo, t.step, 1).reshape(t.shape)
    if t.codec.startswith("tiled-"):
        n, c, h, w = t.shape
        rows, cols = _grid(c)
        tiles = np.stack([_open(f, (cols * w, rows * h), "L") for f in t.frames]) if n else \
            np.zeros((0, rows * h, cols * w), np.uint8)
        levels = tiles.reshape(n, rows, h, cols, w).transpose(0, 1, 3, 2, 4).reshape(n, rows * cols, h, w)[:, :c]
        return _affine(levels, t.lo, t.step, 1)
    if t.codec not in IMAGE_FORMATS:
        raise ProtocolError(reason=f"lossy codec {t.codec!r} is unknown; known: {LOSSY_CODECS}")
    grey = len(t.shape) == 3
    if grey:
        n, h, w = t.shape
        c = 1
    elif t.layout == "NHWC":
        n, h, w, c = t.shape
    else:
        n, c, h, w = t.shape
    mode = "RGB" if c == 3 else "L"
    pix = np.stack([_open(f, (w, h), mode) for f in t.frames]) if n else np.zeros((0, h, w, c), np.uint8)
    pix = pix.reshape(n, h, w, c)
    if t.dtype == "uint8":
        out: np.ndarray = pix[..., 0] if grey else pix
    else:
        out = _affine(pix, t.lo, t.step, 3)
    if not grey and t.layout == "NCHW":
        out = np.ascontiguousarray(np.moveaxis(out, 3, 1))
    return out


def _axis(t: LossyTensor) -> int:
    if t.codec == "bits":
        return 1 if t.layout else -1
    if t.codec.startswith("tiled-"):
        return 1
    if len(t.shape) == 3:
        return -1  # grey pixels [N, H, W]
    return 3 if t.layout == "NHWC" else 1


def to_encoded(t: LossyTensor) -> EncodedTensor:
    """The wire record of a lossy tensor (precision = the codec's name)."""
    return EncodedTensor(
        precision=t.codec, compression="none", shape=t.shape, axis=_axis(t),
        scales=np.ascontiguousarray(t.step, dtype="<f4"), zero_points=np.zeros(0, np.uint8),
        payload=b"".join(t.frames), level=t.level, offsets=np.ascontiguousarray(t.lo, dtype="<f4"),
        frame_bytes=tuple(len(f) for f in t.frames), dtype=t.dtype,
    )


def from_encoded(t: EncodedTensor) -> LossyTensor:
    """The lossy tensor a wire record carries; ProtocolError for one of another precision."""
    if t.precision not in LOSSY_CODECS:
        raise ProtocolError(reason=f"precision {t.precision!r} is not a lossy codec; known: {LOSSY_CODECS}")
    if sum(t.frame_bytes) != t.payload_bytes:
        raise ProtocolError(reason=f"{t.precision} frames declare {sum(t.frame_bytes)} bytes, the payload holds "
                                   f"{t.payload_bytes}")
    body = memoryview(t.payload) if not isinstance(t.payload, memoryview) else t.payload
    frames, pos = [], 0
    for size in t.frame_bytes:
        frames.append(body[pos:pos + size])
        pos += size
    if t.precision == "bits":
        layout = "NCHW" if t.axis == 1 else ""
    elif len(t.shape) == 3 or t.axis == 3:
        layout = "NHWC"
    else:
        layout = "NCHW"
    return LossyTensor(codec=t.precision, level=t.level, shape=t.shape, dtype=t.dtype, frames=tuple(frames),
                       lo=np.asarray(t.offsets, np.float32), step=np.asarray(t.scales, np.float32), layout=layout)


@dataclass(frozen=True)
class RoundTripStats:
    """What one encoding of one tensor costs and loses; `LossyStats` here and
    `encoding.CodecStats` add what names the encoding."""

    raw_bytes: int
    """The tensor as float32."""
    encoded_bytes: int
    """What goes on the wire for it."""
    ratio: float
    """raw_bytes / encoded_bytes."""
    encode_ms: float
    """Median time of the encoder."""
    decode_ms: float
    """Median time of the decoder."""
    max_abs_err: float
    """Largest |decode(encode(x)) - x|."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Self:
        return cls(**json.loads(text))


def time_round_trips(encode: Callable[[], T], decode: Callable[[T], np.ndarray],
                     repeats: int) -> tuple[T, np.ndarray, float, float]:
    """Runs ``decode(encode())`` ``repeats`` times: the last encoded value, the last decoded
    array and the median encode and decode times in ms."""
    if repeats < 1:
        raise EncodingError(reason=f"repeats={repeats} measures nothing", fix="pass repeats >= 1")
    enc_s: list[float] = []
    dec_s: list[float] = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        t = encode()
        t1 = time.perf_counter()
        out = decode(t)
        t2 = time.perf_counter()
        enc_s.append(t1 - t0)
        dec_s.append(t2 - t1)
    return t, out, statistics.median(enc_s) * 1e3, statistics.median(dec_s) * 1e3


@dataclass(frozen=True)
class LossyStats(RoundTripStats):
    """What one lossy codec costs and loses on one tensor; `encoded_bytes` is
    `LossyTensor.wire_bytes`."""

    codec: str
    """One of LOSSY_CODECS."""
    level: int
    """Quality 1..100, or the bit depth for 'bits'."""
    rel_l2_err: float
    """||decode(encode(x)) - x|| / ||x||."""


def measure_lossy(x: np.ndarray, codec: str, level: int, *, norm: ImageNorm | None = None,
                  repeats: int = 5) -> LossyStats:
    """Encodes and decodes ``x`` ``repeats`` times; sizes, median times and the error."""
    t, out, encode_ms, decode_ms = time_round_trips(lambda: encode_lossy(x, codec, level, norm=norm),
                                                    decode_lossy, repeats)
    ref = x.astype(np.float64)
    diff = out.astype(np.float64) - ref
    ref_norm = float(np.linalg.norm(ref))
    return LossyStats(
        codec=codec, level=int(level), raw_bytes=int(x.size) * 4, encoded_bytes=t.wire_bytes,
        ratio=int(x.size) * 4 / max(1, t.wire_bytes), encode_ms=encode_ms, decode_ms=decode_ms,
        max_abs_err=float(np.abs(diff).max()) if diff.size else 0.0,
        rel_l2_err=float(np.linalg.norm(diff)) / ref_norm if ref_norm else 0.0,
    )
