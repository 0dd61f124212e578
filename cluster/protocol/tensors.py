"""Tensors as msgpack ext values.

Two ext types carry tensors (byte layouts in docs/protocol.md):

- `EXT_TENSOR` (1): a raw tensor: dtype code, shape, zero padding, then the
  C-order little-endian bytes. It decodes to a read-only `np.ndarray` that is
  a view of the received frame (no copy).
- `EXT_ENCODED` (2): an `EncodedTensor`, a float tensor sent as fp32, fp16 or
  int8 with scale and zero point, optionally compressed (see `encoding.py`), or
  through one of the lossy codecs of `lossy.py` (precision codes 3..7: the model
  input as JPEG/WebP images, feature maps as tiled images or as levels of 2..8 bits).
  The older records' bytes do not depend on these codes, and a reader that knows only
  codes 0..2 refuses a lossy record as an unknown precision code.

The writer pads so that tensor data starts at a multiple of `ALIGN_BYTES` from
the start of the frame, which keeps the decoded views aligned for numpy and ONNX
Runtime when the receive buffer itself is aligned.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from cluster.protocol.errors import ProtocolError
from cluster.protocol._msgpack import Writer

__all__ = [
    "EXT_TENSOR",
    "EXT_ENCODED",
    "ALIGN_BYTES",
    "DTYPE_CODES",
    "EncodedTensor",
    "PRECISIONS",
    "LOSSY_PRECISIONS",
    "COMPRESSIONS",
    "write_tensor",
    "read_ext",
    "as_wire_array",
    "tensor_nbytes",
    "ext_default",
]

EXT_TENSOR = 1
EXT_ENCODED = 2
ALIGN_BYTES = 64
_LAYOUT = 1
_MAX_NDIM = 32

#: Wire dtype codes. Stable: new dtypes get new codes, codes are never reused.
DTYPE_CODES: dict[str, int] = {
    "float32": 1,
    "float16": 2,
    "float64": 3,
    "int8": 4,
    "uint8": 5,
    "int16": 6,
    "uint16": 7,
    "int32": 8,
    "uint32": 9,
    "int64": 10,
    "uint64": 11,
    "bool": 12,
}
_DTYPE_OF_CODE = {code: np.dtype(name).newbyteorder("<") for name, code in DTYPE_CODES.items()}
# Keyed by dtype object: `dtype.name` is computed in Python and shows up in profiles.
_CODE_OF_DTYPE = {np.dtype(name): code for name, code in DTYPE_CODES.items()}

#: Precision codes of EncodedTensor: the lossless casts, then the lossy codecs (lossy.py).
PRECISIONS: dict[str, int] = {"fp32": 0, "fp16": 1, "int8": 2, "jpeg": 3, "webp": 4, "tiled-jpeg": 5,
                              "tiled-webp": 6, "bits": 7}
#: The precisions that are lossy codecs; their records carry a level, an affine per channel and frames.
LOSSY_PRECISIONS: tuple[str, ...] = ("jpeg", "webp", "tiled-jpeg", "tiled-webp", "bits")
_IMAGE_PRECISIONS = ("jpeg", "webp")
_LEVELS = {"jpeg": (1, 100), "webp": (1, 100), "tiled-jpeg": (1, 100), "tiled-webp": (1, 100), "bits": (2, 8)}
_LOSSY_DTYPES = {1: "float32", 5: "uint8"}  # decoded dtype, by DTYPE_CODES
_LOSSY_DTYPE_CODES = {v: k for k, v in _LOSSY_DTYPES.items()}
#: Lossless compression codes of EncodedTensor.
COMPRESSIONS: dict[str, int] = {"none": 0, "zstd": 1, "lz4": 2}
_PRECISION_OF_CODE = {v: k for k, v in PRECISIONS.items()}
_COMPRESSION_OF_CODE = {v: k for k, v in COMPRESSIONS.items()}

_TENSOR_HEAD = struct.Struct("<BBBB")  # layout, dtype, ndim, pad
_DIMS = [struct.Struct(f"<{n}Q") for n in range(_MAX_NDIM + 1)]
_ENCODED_HEAD = struct.Struct("<BBBBbBH")  # layout, precision, compression, ndim, axis, pad, level (0 for fp32/fp16/int8)
_LOSSY_HEAD = struct.Struct("<BBHI")  # decoded dtype code, reserved, reserved, frame count
_EMPTY_F32 = np.zeros(0, dtype="<f4")


@dataclass(frozen=True, eq=False)
class EncodedTensor:
    """A float32 tensor as it crosses the cut: maybe reduced, maybe compressed, maybe
    through a lossy codec.

    Build one with `encoding.encode`; turn it back into float32 with `encoding.decode`.
    """

    precision: str
    """'fp32', 'fp16' or 'int8' (affine uint8: x = (q - zero_point) * scale), or a lossy
    codec of LOSSY_PRECISIONS (decoded per channel as x = offsets[c] + scales[c] * level)."""
    compression: str
    """'none', 'zstd' or 'lz4': applied to the body after the precision step."""
    shape: tuple[int, ...]
    """Shape of the original tensor."""
    axis: int
    """Channel axis of per-channel int8 scales (of the lossy affine); -1 for one per tensor."""
    scales: np.ndarray
    """float32 scales: empty for fp32/fp16, one per tensor or one per channel for int8 and the
    lossy codecs (the value of one level)."""
    zero_points: np.ndarray
    """uint8 zero points, one per int8 scale; empty for the lossy codecs."""
    payload: bytes | memoryview
    """The body: fp32/fp16/uint8 values in C order, little-endian, then compressed; for the
    lossy codecs the frames one after another."""
    level: int = 0
    """Lossy codecs: the image quality (1..100) or the bit depth ('bits', 2..8); else 0."""
    offsets: np.ndarray = field(default_factory=lambda: _EMPTY_F32)
    """Lossy codecs: float32 value of level 0, one per scale; else empty."""
    frame_bytes: tuple[int, ...] = ()
    """Lossy codecs: the size of each frame of the payload (one image per sample, or one
    zstd frame for 'bits'); else empty."""
    dtype: str = "float32"
    """What decoding returns: 'float32', or 'uint8' for pixels sent as JPEG/WebP as they are."""

    @property
    def lossy(self) -> bool:
        return self.precision in LOSSY_PRECISIONS

    @property
    def payload_bytes(self) -> int:
        p = self.payload
        return p.nbytes if isinstance(p, memoryview) else len(p)

    @property
    def wire_bytes(self) -> int:
        """Size of the ext payload on the wire, without alignment padding."""
        n = len(self.scales)
        if self.lossy:
            extra = _LOSSY_HEAD.size + 8 * n + 4 * len(self.frame_bytes)
            return _ENCODED_HEAD.size + 8 * len(self.shape) + extra + self.payload_bytes
        return _ENCODED_HEAD.size + 8 * len(self.shape) + 5 * n + self.payload_bytes

    @property
    def raw_bytes(self) -> int:
        """Size of the same tensor as plain float32."""
        return 4 * int(np.prod(self.shape, dtype=np.int64))

    def __repr__(self) -> str:
        return (
            f"EncodedTensor(precision={self.precision!r}, compression={self.compression!r}, "
            f"shape={self.shape}, axis={self.axis}, payload_bytes={self.payload_bytes}"
            + (f", level={self.level}, dtype={self.dtype!r})" if self.lossy else ")")
        )


def as_wire_array(arr: np.ndarray, where: str = "") -> np.ndarray:
    """Returns `arr` as a C-contiguous little-endian array (a copy only if it is not one)."""
    if not isinstance(arr, np.ndarray):
        raise ProtocolError(reason=f"tensor must be a numpy array, got {type(arr).__name__}", where=where)
    dt = arr.dtype
    if dt not in _CODE_OF_DTYPE:
        if dt.kind in "biuf" and dt.byteorder == ">" and dt.newbyteorder("<") in _CODE_OF_DTYPE:
            arr = arr.astype(dt.newbyteorder("<"))
        else:
            raise ProtocolError(
                reason=f"dtype {dt} cannot be sent; use one of {', '.join(DTYPE_CODES)}", where=where
            )
    if arr.ndim > _MAX_NDIM:
        raise ProtocolError(reason=f"{arr.ndim} dimensions exceed the limit of {_MAX_NDIM}", where=where)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return arr


def _pad_for(writer: Writer, head_bytes: int, body_bytes: int) -> tuple[int, int]:
    """Chooses padding so the body starts aligned; returns (pad, ext payload length)."""
    # The ext header size depends on the payload length, which depends on the pad:
    # size the header for the largest pad so the choice is stable.
    hdr = Writer.ext_header_len(head_bytes + body_bytes + ALIGN_BYTES - 1)
    start = writer.nbytes + hdr + head_bytes
    pad = -start % ALIGN_BYTES
    length = head_bytes + pad + body_bytes
    return pad, length


def _ext_header_fixed(writer: Writer, code: int, length: int, sized_for: int) -> None:
    fmt_len = Writer.ext_header_len(sized_for)
    if fmt_len == 3:
        writer.raw(struct.pack(">BBb", 0xC7, length, code))
    elif fmt_len == 4:
        writer.raw(struct.pack(">BHb", 0xC8, length, code))
    else:
        writer.raw(struct.pack(">BIb", 0xC9, length, code))


def _body_view(arr: np.ndarray) -> memoryview | bytes:
    if arr.nbytes == 0:
        return b""
    return memoryview(arr).cast("B")


def _tensor_head(arr: np.ndarray, pad: int) -> bytes:
    nd = arr.ndim
    head = _TENSOR_HEAD.pack(_LAYOUT, _CODE_OF_DTYPE[arr.dtype], nd, pad) + _DIMS[nd].pack(*arr.shape)
    return head + bytes(pad) if pad else head


def _encoded_head(t: EncodedTensor, pad: int, where: str) -> bytes:
    try:
        prec = PRECISIONS[t.precision]
        comp = COMPRESSIONS[t.compression]
    except KeyError as e:
        raise ProtocolError(reason=f"EncodedTensor has unknown precision/compression {e}", where=where) from e
    ndim = len(t.shape)
    scales = np.ascontiguousarray(t.scales, dtype="<f4")
    if t.lossy:
        dcode = _LOSSY_DTYPE_CODES.get(t.dtype)
        if dcode is None:
            raise ProtocolError(reason=f"EncodedTensor of {t.precision} has dtype {t.dtype!r}; use float32 or uint8",
                                where=where)
        lo, hi = _LEVELS[t.precision]
        if not lo <= t.level <= hi:
            raise ProtocolError(reason=f"EncodedTensor of {t.precision} has level {t.level}, outside {lo}..{hi}",
                                where=where)
        return (
            _ENCODED_HEAD.pack(_LAYOUT, prec, comp, ndim, t.axis, pad, t.level)
            + struct.pack(f"<{ndim}Q", *t.shape)
            + _LOSSY_HEAD.pack(dcode, 0, 0, len(t.frame_bytes))
            + np.ascontiguousarray(t.offsets, dtype="<f4").tobytes()
            + scales.tobytes()
            + struct.pack(f"<{len(t.frame_bytes)}I", *t.frame_bytes)
            + bytes(pad)
        )
    zps = np.ascontiguousarray(t.zero_points, dtype=np.uint8)
    return (
        _ENCODED_HEAD.pack(_LAYOUT, prec, comp, ndim, t.axis, pad, 0)
        + struct.pack(f"<{ndim}Q", *t.shape)
        + scales.tobytes()
        + zps.tobytes()
        + bytes(pad)
    )


def tensor_nbytes(value: Any) -> int:
    """Body size of a tensor value (0 for anything else): decides small vs big frames."""
    if isinstance(value, np.ndarray):
        return value.nbytes
    if isinstance(value, EncodedTensor):
        return value.payload_bytes
    return 0


def ext_default(value: Any) -> msgpack.ExtType:
    """`default=` hook of msgpack.packb for small frames: tensors become ExtType values.

    This copies each body (tobytes), so it is only used when bodies are small; big
    frames go through `write_tensor`, which does not.
    """
    if isinstance(value, EncodedTensor):
        head = _encoded_head(value, 0, "")
        return msgpack.ExtType(EXT_ENCODED, head + bytes(value.payload))
    if isinstance(value, np.ndarray):
        arr = as_wire_array(value)
        return msgpack.ExtType(EXT_TENSOR, _tensor_head(arr, 0) + arr.tobytes())
    raise TypeError(f"cannot pack {type(value).__name__}")


def write_tensor(writer: Writer, value: Any, where: str = "") -> None:
    """Appends a tensor (ndarray or EncodedTensor) as an ext value; big bodies are not copied."""
    if isinstance(value, EncodedTensor):
        head = _encoded_head(value, 0, where)
        body = value.payload_bytes
        pad, length = _pad_for(writer, len(head), body)
        if pad:
            head = _encoded_head(value, pad, where)
        _ext_header_fixed(writer, EXT_ENCODED, length, len(head) - pad + body + ALIGN_BYTES - 1)
        writer.raw(head)
        if body:
            writer.raw(value.payload)
        return
    arr = as_wire_array(value, where)
    head_bytes = _TENSOR_HEAD.size + 8 * arr.ndim
    body = arr.nbytes
    pad, length = _pad_for(writer, head_bytes, body)
    _ext_header_fixed(writer, EXT_TENSOR, length, head_bytes + body + ALIGN_BYTES - 1)
    writer.raw(_tensor_head(arr, pad))
    if body:
        writer.raw(_body_view(arr))


def _bad(reason: str, offset: int) -> ProtocolError:
    at = f" (ext payload at byte {offset})" if offset >= 0 else ""
    return ProtocolError(reason=f"{reason}{at}")


def _read_tensor(data: memoryview, offset: int) -> np.ndarray:
    n = data.nbytes
    if n < _TENSOR_HEAD.size:
        raise _bad(f"tensor ext of {n} bytes is shorter than its {_TENSOR_HEAD.size}-byte header", offset)
    layout, dcode, ndim, pad = _TENSOR_HEAD.unpack_from(data, 0)
    if layout != _LAYOUT:
        raise _bad(f"tensor layout {layout} is unknown; this side reads layout {_LAYOUT}", offset)
    dtype = _DTYPE_OF_CODE.get(dcode)
    if dtype is None:
        raise _bad(f"unknown dtype code {dcode}; known codes: {sorted(_DTYPE_OF_CODE)}", offset)
    if ndim > _MAX_NDIM:
        raise _bad(f"tensor has {ndim} dims, more than the limit of {_MAX_NDIM}", offset)
    start = _TENSOR_HEAD.size + 8 * ndim
    if n < start + pad:
        raise _bad(f"tensor ext of {n} bytes is too short for {ndim} dims and {pad} pad bytes", offset)
    shape = _DIMS[ndim].unpack_from(data, _TENSOR_HEAD.size)
    count = 1
    for d in shape:
        count *= d
    expected = count * dtype.itemsize
    start += pad
    if n - start != expected:
        raise _bad(
            f"shape {list(shape)} of {dtype.name} needs {expected} data bytes, the ext holds {n - start}",
            offset,
        )
    try:
        arr = np.frombuffer(data, dtype=dtype, count=count, offset=start).reshape(shape)
    except ValueError as e:
        raise _bad(f"shape {list(shape)} cannot be built: {e}", offset) from e
    if arr.flags.writeable:
        # The frame's buffer may be writable (bytearray); the contract is a read-only view.
        arr.flags.writeable = False
    return arr


def _read_encoded(data: memoryview, offset: int) -> EncodedTensor:
    n = data.nbytes
    if n < _ENCODED_HEAD.size:
        raise _bad(f"encoded tensor ext of {n} bytes is shorter than its header", offset)
    layout, prec, comp, ndim, axis, pad, level = _ENCODED_HEAD.unpack_from(data, 0)
    if layout != _LAYOUT:
        raise _bad(f"encoded tensor layout {layout} is unknown; this side reads layout {_LAYOUT}", offset)
    precision = _PRECISION_OF_CODE.get(prec)
    if precision is None:
        raise _bad(f"unknown precision code {prec}; known: {PRECISIONS}", offset)
    compression = _COMPRESSION_OF_CODE.get(comp)
    if compression is None:
        raise _bad(f"unknown compression code {comp}; known: {COMPRESSIONS}", offset)
    if ndim > _MAX_NDIM:
        raise _bad(f"encoded tensor has {ndim} dims, more than the limit of {_MAX_NDIM}", offset)
    pos = _ENCODED_HEAD.size
    if n < pos + 8 * ndim:
        raise _bad("encoded tensor ext is too short for its shape", offset)
    shape = struct.unpack_from(f"<{ndim}Q", data, pos)
    pos += 8 * ndim
    if precision in LOSSY_PRECISIONS:
        return _read_lossy(data, offset, precision, compression, shape, axis, pad, level, pos)
    if precision != "int8":
        nq = 0
        if axis != -1:
            raise _bad(f"{precision} tensor must have axis -1, got {axis}", offset)
    elif axis == -1:
        nq = 1
    elif 0 <= axis < ndim:
        nq = shape[axis]
    else:
        raise _bad(f"int8 axis {axis} is outside a {ndim}-dim shape", offset)
    if n < pos + 5 * nq + pad:
        raise _bad(f"encoded tensor ext is too short for {nq} scales and zero points", offset)
    scales = np.frombuffer(data, dtype="<f4", count=nq, offset=pos)
    pos += 4 * nq
    zps = np.frombuffer(data, dtype=np.uint8, count=nq, offset=pos)
    pos += nq + pad
    return EncodedTensor(
        precision=precision,
        compression=compression,
        shape=tuple(int(d) for d in shape),
        axis=axis,
        scales=scales,
        zero_points=zps,
        payload=data[pos:],
    )


def _lossy_layout(precision: str, shape: tuple[int, ...], axis: int, dtype: str) -> str | None:
    """Why this shape, axis and dtype do not fit the codec, or None when they do."""
    ndim = len(shape)
    if dtype == "uint8" and precision not in _IMAGE_PRECISIONS:
        return f"{precision} decodes to float32, not uint8"
    if precision in _IMAGE_PRECISIONS:
        if ndim == 3 and axis == -1 and dtype == "uint8":
            return None  # grey pixels [N, H, W]
        if ndim == 4 and axis in (1, 3) and shape[axis] in (1, 3):
            return None
        return f"{precision} needs an image [N, 3|1, H, W] (axis 1) or [N, H, W, 3|1] (axis 3)"
    if precision.startswith("tiled-"):
        return None if ndim == 4 and axis == 1 else f"{precision} needs a feature map [N, C, H, W] with axis 1"
    return None if axis == -1 or (axis == 1 and ndim >= 2) else "bits needs axis -1 (per tensor) or 1 (per channel)"


def _read_lossy(data: memoryview, offset: int, precision: str, compression: str, shape: tuple[int, ...],
                axis: int, pad: int, level: int, pos: int) -> EncodedTensor:
    n = data.nbytes
    lo_level, hi_level = _LEVELS[precision]
    if not lo_level <= level <= hi_level:
        what = "bit depth" if precision == "bits" else "quality"
        raise _bad(f"{precision} tensor has {what} {level}, outside {lo_level}..{hi_level}", offset)
    if compression != "none":
        raise _bad(f"{precision} tensor must have compression none, got {compression}", offset)
    if n < pos + _LOSSY_HEAD.size:
        raise _bad(f"{precision} tensor ext is too short for its codec header", offset)
    dcode, _, _, nframes = _LOSSY_HEAD.unpack_from(data, pos)
    pos += _LOSSY_HEAD.size
    dtype = _LOSSY_DTYPES.get(dcode)
    if dtype is None:
        raise _bad(f"{precision} tensor has decoded dtype code {dcode}; known: 1 (float32), 5 (uint8)", offset)
    why = _lossy_layout(precision, shape, axis, dtype)
    if why is not None:
        raise _bad(f"{why}; got shape {list(shape)}, axis {axis}, dtype {dtype}", offset)
    expected_frames = 1 if precision == "bits" else shape[0]
    if nframes != expected_frames:
        raise _bad(f"{precision} tensor of shape {list(shape)} needs {expected_frames} frame(s), the record "
                   f"declares {nframes}", offset)
    nq = 1 if axis == -1 else shape[axis]
    if n < pos + 8 * nq + 4 * nframes + pad:
        raise _bad(f"{precision} tensor ext is too short for {nq} channel(s) and {nframes} frame(s)", offset)
    offsets = np.frombuffer(data, dtype="<f4", count=nq, offset=pos)
    pos += 4 * nq
    scales = np.frombuffer(data, dtype="<f4", count=nq, offset=pos)
    pos += 4 * nq
    frame_bytes = struct.unpack_from(f"<{nframes}I", data, pos)
    pos += 4 * nframes + pad
    if sum(frame_bytes) != n - pos:
        raise _bad(f"{precision} frames declare {sum(frame_bytes)} bytes, the ext holds {n - pos}", offset)
    return EncodedTensor(
        precision=precision, compression=compression, shape=tuple(int(d) for d in shape), axis=axis,
        scales=scales, zero_points=np.zeros(0, np.uint8), payload=data[pos:], level=level, offsets=offsets,
        frame_bytes=tuple(frame_bytes), dtype=dtype,
    )


def read_ext(code: int, data: memoryview, offset: int) -> Any:
    """The ext hook of every frame: tensors and encoded tensors, nothing else."""
    if code == EXT_TENSOR:
        return _read_tensor(data, offset)
    if code == EXT_ENCODED:
        return _read_encoded(data, offset)
    raise _bad(
        f"unknown ext type code {code}; this side reads {EXT_TENSOR} (tensor) and {EXT_ENCODED} (encoded tensor)",
        offset,
    )
