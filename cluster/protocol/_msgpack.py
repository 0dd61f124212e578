"""A msgpack reader that leaves ext payloads in the received buffer, and a writer
that joins big payloads into the frame with a single copy.

[Note: why not msgpack.unpackb with ext_hook]
The C unpacker hands every ext payload to the hook as a fresh `bytes` object: one
full copy of each tensor. Frames here are small maps around a few big ext
values, so walking the frame in Python costs microseconds, and the hook gets a
`memoryview` slice of the received buffer, which `np.frombuffer` turns into a
read-only array without a copy. Plain values are packed by the C packer;
tensors are passed to `bytes.join` as buffers, which copies each byte once.

Frames of at most `SMALL_FRAME_BYTES` are decoded by the C unpacker instead:
their ext payloads are small, so copying them costs less than the Python walk.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from typing import Any

import msgpack

from cluster.protocol.errors import ProtocolError

__all__ = ["Writer", "unpackb", "pack_small", "MAX_DEPTH", "MAX_CONTAINER_LEN", "SMALL_FRAME_BYTES"]

#: Deepest nesting of maps and arrays a frame may have.
MAX_DEPTH = 32
#: Most entries in one map or array; frames carry few fields and short shapes.
MAX_CONTAINER_LEN = 1 << 16
#: Frames up to this size go through the C unpacker (ext payloads copied once).
SMALL_FRAME_BYTES = 64 << 10

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_I8 = struct.Struct(">b")
_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_I64 = struct.Struct(">q")
_F32 = struct.Struct(">f")
_F64 = struct.Struct(">d")

ExtHook = Callable[[int, memoryview, int], Any]


class Writer:
    """Collects the parts of one frame; `getvalue()` joins them with one copy."""

    __slots__ = ("parts", "nbytes")

    def __init__(self) -> None:
        self.parts: list[Any] = []
        self.nbytes = 0

    def raw(self, data: bytes | memoryview) -> None:
        self.parts.append(data)
        self.nbytes += data.nbytes if isinstance(data, memoryview) else len(data)

    def value(self, obj: Any, where: str = "") -> None:
        """Packs a value that holds no tensors with the C packer."""
        self.raw(_packb(obj, where))

    def map_with(self, plain: dict[str, Any], total: int, where: str = "") -> None:
        """Starts a map of `total` entries whose first entries are `plain` (packed in C);
        the caller appends the other `total - len(plain)` key/value pairs."""
        packed = _packb(plain, where)
        if total == len(plain):
            self.raw(packed)
            return
        b0 = packed[0]
        skip = 1 if b0 <= 0x8F else 3 if b0 == 0xDE else 5
        self.map_header(total)
        self.raw(packed[skip:])

    def map_header(self, n: int) -> None:
        if n < 16:
            self.raw(bytes((0x80 | n,)))
        elif n < 1 << 16:
            self.raw(b"\xde" + _U16.pack(n))
        else:
            self.raw(b"\xdf" + _U32.pack(n))

    @staticmethod
    def ext_header_len(length: int) -> int:
        return 3 if length < 1 << 8 else 4 if length < 1 << 16 else 6

    def getvalue(self) -> bytes:
        return b"".join(self.parts)


def _packb(obj: Any, where: str) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError(
            reason=f"cannot pack {type(obj).__name__} value: {e}; send plain str/int/float/bool/bytes/list/dict",
            where=where,
        ) from e


_local = threading.local()


def _small_packer() -> msgpack.Packer:
    # One Packer per thread: msgpack.packb builds a new one per call, and a Packer
    # is not safe to share between threads. It resets itself after each pack, and
    # after a failed one.
    packer = getattr(_local, "packer", None)
    if packer is None:
        from cluster.protocol.tensors import ext_default  # tensors imports this module

        packer = _local.packer = msgpack.Packer(use_bin_type=True, default=ext_default)
    return packer


def pack_small(obj: Any, where: str) -> bytes:
    """Packs a frame whose tensors are small in one C call; tensors become ExtType
    through `tensors.ext_default` (bodies copied, alignment not kept)."""
    try:
        return _small_packer().pack(obj)
    except ProtocolError:
        raise
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError(
            reason=f"cannot pack: {e}; send plain str/int/float/bool/bytes/list/dict and numpy tensors",
            where=where,
        ) from e


_SMALL_HOOKS: dict[ExtHook, Callable[[int, bytes], Any]] = {}


def _small_hook(ext_hook: ExtHook) -> Callable[[int, bytes], Any]:
    hook = _SMALL_HOOKS.get(ext_hook)
    if hook is None:
        def hook(code: int, data: bytes) -> Any:
            return ext_hook(code, memoryview(data), -1)

        if len(_SMALL_HOOKS) < 16:  # one per hook function in practice (tensors.read_ext)
            _SMALL_HOOKS[ext_hook] = hook
    return hook


def _unpack_small(buf: bytes | bytearray | memoryview, ext_hook: ExtHook) -> Any:
    hook = _small_hook(ext_hook)
    try:
        return msgpack.unpackb(buf, ext_hook=hook, raw=False, strict_map_key=True)
    except ProtocolError:
        raise
    except msgpack.ExtraData as e:
        raise ProtocolError(reason=f"{len(e.extra)} trailing bytes after the message") from e
    except UnicodeDecodeError as e:
        raise ProtocolError(reason=f"str is not valid UTF-8 ({e.reason})") from e
    except (ValueError, TypeError, msgpack.FormatError, msgpack.StackError) as e:
        text = str(e) or type(e).__name__
        if "incomplete" in text:
            text = "truncated msgpack: the frame ends inside a value"
        raise ProtocolError(reason=f"invalid msgpack: {text}") from e


def _err(reason: str, pos: int) -> ProtocolError:
    return ProtocolError(reason=f"{reason} at byte {pos}")


def unpackb(buf: bytes, ext_hook: ExtHook) -> Any:
    """Decodes one msgpack value that must fill `buf` exactly.

    `ext_hook(code, payload, offset)` gets each ext payload as a view of `buf`
    and its offset in `buf` (for small frames: a view of a copy, offset -1).
    Every failure is a `ProtocolError`.
    """
    if type(buf) is bytes and 0 < len(buf) <= SMALL_FRAME_BYTES:
        return _unpack_small(buf, ext_hook)
    if not isinstance(buf, (bytes, bytearray, memoryview)):
        raise ProtocolError(reason=f"frame must be bytes, got {type(buf).__name__}")
    mv = memoryview(buf)
    if mv.ndim != 1 or mv.itemsize != 1:
        mv = mv.cast("B")
    size = mv.nbytes
    if size == 0:
        raise ProtocolError(reason="empty frame; expected a msgpack map")
    if size <= SMALL_FRAME_BYTES:
        return _unpack_small(mv, ext_hook)

    def need(pos: int, n: int, what: str) -> None:
        if pos + n > size:
            raise _err(f"truncated msgpack: {what} needs {n} bytes, only {size - pos} left", pos)

    def read(pos: int, depth: int) -> tuple[Any, int]:
        # Same shape per format byte on purpose: one branch per msgpack format, in the
        # spec's terms, so each can be read against the spec's table.
        need(pos, 1, "type byte")
        b = mv[pos]
        pos += 1
        if b <= 0x7F:
            return b, pos
        if b >= 0xE0:
            return b - 0x100, pos
        if 0xA0 <= b <= 0xBF:
            return text(pos, b & 0x1F)
        if 0x80 <= b <= 0x8F:
            return mapping(pos, b & 0x0F, depth)
        if 0x90 <= b <= 0x9F:
            return array(pos, b & 0x0F, depth)
        if b == 0xC0:
            return None, pos
        if b == 0xC2:
            return False, pos
        if b == 0xC3:
            return True, pos
        if b == 0xCC:
            need(pos, 1, "uint8")
            return mv[pos], pos + 1
        if b == 0xCD:
            need(pos, 2, "uint16")
            return _U16.unpack_from(mv, pos)[0], pos + 2
        if b == 0xCE:
            need(pos, 4, "uint32")
            return _U32.unpack_from(mv, pos)[0], pos + 4
        if b == 0xCF:
            need(pos, 8, "uint64")
            return _U64.unpack_from(mv, pos)[0], pos + 8
        if b == 0xD0:
            need(pos, 1, "int8")
            return _I8.unpack_from(mv, pos)[0], pos + 1
        if b == 0xD1:
            need(pos, 2, "int16")
            return _I16.unpack_from(mv, pos)[0], pos + 2
        if b == 0xD2:
            need(pos, 4, "int32")
            return _I32.unpack_from(mv, pos)[0], pos + 4
        if b == 0xD3:
            need(pos, 8, "int64")
            return _I64.unpack_from(mv, pos)[0], pos + 8
        if b == 0xCA:
            need(pos, 4, "float32")
            return _F32.unpack_from(mv, pos)[0], pos + 4
        if b == 0xCB:
            need(pos, 8, "float64")
            return _F64.unpack_from(mv, pos)[0], pos + 8
        if b == 0xD9:
            need(pos, 1, "str8 length")
            return text(pos + 1, mv[pos])
        if b == 0xDA:
            need(pos, 2, "str16 length")
            return text(pos + 2, _U16.unpack_from(mv, pos)[0])
        if b == 0xDB:
            need(pos, 4, "str32 length")
            return text(pos + 4, _U32.unpack_from(mv, pos)[0])
        if b == 0xC4:
            need(pos, 1, "bin8 length")
            return binary(pos + 1, mv[pos])
        if b == 0xC5:
            need(pos, 2, "bin16 length")
            return binary(pos + 2, _U16.unpack_from(mv, pos)[0])
        if b == 0xC6:
            need(pos, 4, "bin32 length")
            return binary(pos + 4, _U32.unpack_from(mv, pos)[0])
        if b == 0xDC:
            need(pos, 2, "array16 length")
            return array(pos + 2, _U16.unpack_from(mv, pos)[0], depth)
        if b == 0xDD:
            need(pos, 4, "array32 length")
            return array(pos + 4, _U32.unpack_from(mv, pos)[0], depth)
        if b == 0xDE:
            need(pos, 2, "map16 length")
            return mapping(pos + 2, _U16.unpack_from(mv, pos)[0], depth)
        if b == 0xDF:
            need(pos, 4, "map32 length")
            return mapping(pos + 4, _U32.unpack_from(mv, pos)[0], depth)
        if 0xD4 <= b <= 0xD8:
            return ext(pos, 1 << (b - 0xD4))
        if b == 0xC7:
            need(pos, 1, "ext8 length")
            return ext(pos + 1, mv[pos])
        if b == 0xC8:
            need(pos, 2, "ext16 length")
            return ext(pos + 2, _U16.unpack_from(mv, pos)[0])
        if b == 0xC9:
            need(pos, 4, "ext32 length")
            return ext(pos + 4, _U32.unpack_from(mv, pos)[0])
        raise _err(f"invalid msgpack type byte 0x{b:02x}", pos - 1)

    def text(pos: int, n: int) -> tuple[str, int]:
        need(pos, n, "str")
        try:
            return str(mv[pos : pos + n], "utf-8"), pos + n
        except UnicodeDecodeError as e:
            raise _err(f"str is not valid UTF-8 ({e.reason})", pos) from e

    def binary(pos: int, n: int) -> tuple[bytes, int]:
        need(pos, n, "bin")
        return mv[pos : pos + n].tobytes(), pos + n

    def ext(pos: int, n: int) -> tuple[Any, int]:
        need(pos, 1 + n, "ext")
        code = _I8.unpack_from(mv, pos)[0]
        start = pos + 1
        return ext_hook(code, mv[start : start + n], start), start + n

    def array(pos: int, n: int, depth: int) -> tuple[list[Any], int]:
        if depth >= MAX_DEPTH:
            raise _err(f"nesting deeper than {MAX_DEPTH}", pos)
        if n > MAX_CONTAINER_LEN:
            raise _err(f"array of {n} entries exceeds the limit of {MAX_CONTAINER_LEN}", pos)
        out = []
        for _ in range(n):
            item, pos = read(pos, depth + 1)
            out.append(item)
        return out, pos

    def mapping(pos: int, n: int, depth: int) -> tuple[dict[Any, Any], int]:
        if depth >= MAX_DEPTH:
            raise _err(f"nesting deeper than {MAX_DEPTH}", pos)
        if n > MAX_CONTAINER_LEN:
            raise _err(f"map of {n} entries exceeds the limit of {MAX_CONTAINER_LEN}", pos)
        out: dict[Any, Any] = {}
        for _ in range(n):
            kpos = pos
            key, pos = read(pos, depth + 1)
            if not isinstance(key, (str, bytes)):
                raise _err(f"map key must be str or bin, got {type(key).__name__}", kpos)
            value, pos = read(pos, depth + 1)
            out[key] = value
        return out, pos

    try:
        obj, end = read(0, 0)
    finally:
        # The helpers refer to each other through closure cells. That cycle would keep
        # the frame (and every tensor body in it) alive until the cyclic GC runs, so
        # big frames would pile up; break it now.
        need = read = text = binary = ext = array = mapping = None  # type: ignore[assignment]
    if end != size:
        raise _err(f"{size - end} trailing bytes after the message", end)
    return obj
