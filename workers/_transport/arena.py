"""Shared memory that one end of a direct channel lends to the other.

[Note: channel arena]
Over a Unix-domain socket both ends run on one machine, so an array need not travel
through the kernel's socket buffers (a copy in, a copy out, and a wake-up of both
processes per socket buffer's worth): the sender copies it once into a region of its
arena, a ``memfd`` that the peer mapped when the connection opened, and the frame
carries only where it lies. The receiver reads the region in place until it hands it
back: a frame lists the peer's regions that its sender is done with.

An arena is sparse: it takes the memory of the most bytes in flight at once, and
when nothing is lent it gives back what lies above ``ARENA_KEEP_BYTES``.

The worker holds the pool's regions as its requests' input arrays (no copy: the
engine binds or copies them into its own buffers) and returns them with the answer.
The pool's callers get an answer's arrays as views of the worker's region, not
copies: when the last array (or view of one) that reads a region is freed, a
finalizer queues the region, and it goes back with the pool's next frame. A caller
that keeps answers keeps that much of the worker's arena lent; once it is full,
answers travel in the frame. An arena that is full, or a buffer under
``ARENA_MIN_BYTES``, travels in the frame; so does everything over TCP.
Nobody else can reach an arena: the fd is passed over the connection, after its
token, and the memory is never named in a file system.

[Note: inputs kept in the arena]
A caller's arrays are copied into the arena with each request: 1 MiB took 149 us right
after a transformer run here, 69 us warm. A caller that keeps a region of its own
(:meth:`Arena.pin_array`, ``ReplicaPool.shared_array``) writes its inputs there and sends
them as they lie: the frame names the region, and the worker's handing it back does
not free it; only :meth:`Arena.unpin` does. As with Triton's system shared memory,
the caller must not write the region while a request that reads it is in flight.
"""

from __future__ import annotations

import bisect
import math
import mmap
import os

import numpy as np

from workers._address import address

__all__ = ["ARENA_BYTES", "ARENA_KEEP_BYTES", "ARENA_MIN_BYTES", "Arena", "PeerArena", "address", "arenas_supported"]

ARENA_BYTES = 256 << 20
"""Address space per arena. A memfd is sparse: only the pages ever used take memory,
and first-fit keeps reuse at the low end, so what is resident tracks the most bytes
in flight at once."""
ARENA_MIN_BYTES = 32 << 10
"""Smaller buffers go in the frame: copying them through the socket costs less than
the bookkeeping."""
ARENA_KEEP_BYTES = 32 << 20
"""Memory an idle arena keeps: when nothing is lent, the pages above this are given
back to the system (a burst of large requests does not stay resident for the
connection's life)."""
_ALIGN = 64
_MAX_MADE = 64
"""Arrays an arena keeps made over its regions ([Note: arrays made once]); when full, it forgets them all."""


def _made_once(made: dict[tuple, np.ndarray], buffer: mmap.mmap, offset: int, dtype: np.dtype,
               shape: tuple) -> np.ndarray:
    """The array of ``dtype`` and ``shape`` at ``offset`` of ``buffer``, kept in ``made``
    by the three ([Note: arrays made once]); a full ``made`` forgets them all."""
    key = (offset, dtype, shape)
    array = made.get(key)
    if array is None:
        if len(made) >= _MAX_MADE:
            made.clear()
        array = made[key] = np.ndarray(shape, dtype, buffer=buffer, offset=offset)
    return array


def arenas_supported() -> bool:
    return hasattr(os, "memfd_create") and hasattr(mmap, "MADV_REMOVE")


class Arena:
    """The sender's side: regions are allocated, filled, lent, and freed when the peer
    hands them back. Used from one event loop thread only."""

    def __init__(self, size_bytes: int = ARENA_BYTES) -> None:
        self.fd = os.memfd_create("splitinfer-channel", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size_bytes)
            self._map = mmap.mmap(self.fd, size_bytes)
        except BaseException:
            os.close(self.fd)
            raise
        self.size_bytes = size_bytes
        self._view = memoryview(self._map)
        self._free_offsets = [0]  # sorted; _free_sizes[i] belongs to _free_offsets[i]
        self._free_sizes = [size_bytes]
        self._lent: dict[int, int] = {}
        self._touched = 0
        """End of the highest region used since the arena last gave memory back."""
        self.fallbacks = 0
        """Buffers sent in the frame because the arena had no room."""
        self._reserved: dict[int, int] = {}
        """Regions given by :meth:`place` and not yet in a frame: address -> offset."""
        self._pinned: dict[int, int] = {}
        """Regions given by :meth:`pin_array`: offset -> bytes; lent until unpinned."""
        self._base = address(self._view)
        self._made: dict[tuple, np.ndarray] = {}
        """Arrays made over regions, by (offset, dtype, shape) ([Note: arrays made once])."""
        self._made_at: dict[int, tuple[np.ndarray, int]] = {}
        """Arrays made over regions by id, each with its offset (held, so ids stay theirs)."""

    @property
    def lent_bytes(self) -> int:
        return sum(self._lent.values())

    def _allocate(self, nbytes: int) -> int | None:
        need = -(-nbytes // _ALIGN) * _ALIGN
        for i, size in enumerate(self._free_sizes):
            if size >= need:
                offset = self._free_offsets[i]
                if size == need:
                    del self._free_offsets[i], self._free_sizes[i]
                else:
                    self._free_offsets[i] += need
                    self._free_sizes[i] -= need
                self._lent[offset] = need
                self._touched = max(self._touched, offset + need)
                return offset
        return None

    def put(self, data: memoryview, *, counted: bool = True) -> int | None:
        """Copies ``data`` (bytes, contiguous) into a free region and returns its
        offset, or None when no region is large enough (``counted``: as a fallback, the
        buffer then going in the frame). ``data`` that already lies in a region
        :meth:`place` gave is not copied: that region is its place."""
        if self._reserved:
            offset = self._reserved.pop(address(data), None)
            if offset is not None:
                return offset
        if self._pinned:
            # [Note: inputs kept in the arena]
            offset = address(data) - self._base
            if data.nbytes <= self._pinned.get(offset, -1):
                return offset
        offset = self._allocate(data.nbytes)
        if offset is None:
            self.fallbacks += counted
        else:
            self._view[offset:offset + data.nbytes] = data
        return offset

    def _array(self, offset: int, dtype: np.dtype, shape: tuple) -> np.ndarray:
        """The array of ``dtype`` and ``shape`` at ``offset``, made once ([Note: arrays made once]).

        [Note: arrays made once]
        Making an array over a region takes numpy a call or two, and finding where an
        array lies takes ctypes two; right after an engine run each costs 25-35 us here,
        against 1.4 us warm. Regions recur (first-fit hands a steady stream of lone
        requests the same few offsets), so an arena keeps the arrays it made, by offset,
        dtype and shape, and knows each one's offset by its identity: :meth:`place`
        gives an engine's output its array with no numpy call once its region has been
        placed before, and :meth:`take` finds a placed or pinned array's offset by a dict
        lookup. The worker's end makes a request's arrays over the caller's arena once
        per region in the same way (:meth:`PeerArena.array`). The arrays hold no memory
        of their own (the arena's mapping does), and the arena holds each of them, so
        their ids are not reused while they are known. With these, a tensor frame's
        layout checked once (workers/_transport/codec.py) and no generator on a request's
        path, against none of them (bench/results/transport_layers_arrays_made_once.json,
        20 alternating pairs): c1 serving overhead with the input kept in shared memory
        0.239 -> 0.223 ms for the transformer and 0.203 -> 0.192 ms for ResNet50, beyond
        the pairs' spread; ResNet50 at c32 790 -> 832 /s.
        """
        array = _made_once(self._made, self._map, offset, dtype, shape)
        entry = self._made_at.get(id(array))
        if entry is None or entry[0] is not array:
            if len(self._made_at) >= _MAX_MADE:
                self._made_at.clear()
            self._made_at[id(array)] = (array, offset)
        return array

    def place(self, like: np.ndarray) -> tuple[np.ndarray, int] | None:
        """A region for an array of ``like``'s dtype and shape, to write before sending
        (an engine's output: [Note: outputs placed] in workers/engine.py): the array
        there and its address, or None when it is too small to go through the arena or
        no region is free. :meth:`take` and :meth:`put` find it in place; :meth:`unreserve`
        frees what no frame carried."""
        nbytes = like.nbytes
        if nbytes < ARENA_MIN_BYTES:
            return None
        offset = self._allocate(nbytes)
        if offset is None:
            return None
        at = self._base + offset
        self._reserved[at] = offset
        return self._array(offset, like.dtype, like.shape), at

    def take(self, array: np.ndarray) -> int | None:
        """The offset of an array that :meth:`place` or :meth:`pin_array` made, when it
        may go as it lies (placed and not yet sent, or still pinned); None for any other
        array, which :meth:`put` copies."""
        entry = self._made_at.get(id(array))
        if entry is None or entry[0] is not array:
            return None
        offset = entry[1]
        if self._reserved.pop(self._base + offset, None) is not None or offset in self._pinned:
            return offset
        return None

    def pin_array(self, shape: tuple, dtype: np.dtype) -> np.ndarray | None:
        """A writable array of ``shape`` and ``dtype`` in a region that the caller keeps
        until :meth:`unpin`: it, and arrays that start where it does, go in place however
        often they are sent ([Note: inputs kept in the arena]), and :meth:`take` finds it
        by identity ([Note: arrays made once]). None when it is too small to go through
        the arena or no region is free."""
        dtype = np.dtype(dtype)
        shape = tuple(int(d) for d in shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < ARENA_MIN_BYTES:
            return None
        offset = self._allocate(nbytes)
        if offset is None:
            return None
        self._pinned[offset] = nbytes
        return self._array(offset, dtype, shape)

    def unpin(self, region: np.ndarray) -> None:
        """Frees a region that :meth:`pin_array` gave (no request that reads it may be in
        flight); raises ValueError for anything else."""
        offset = address(region) - self._base
        if self._pinned.pop(offset, None) is None:
            raise ValueError("unpin: not a region that this arena's pin_array() gave")
        self.release(offset)

    @property
    def pinned_bytes(self) -> int:
        return sum(self._pinned.values())

    def unreserve(self) -> None:
        """Frees the regions that :meth:`place` gave and no frame has carried."""
        while self._reserved:
            _, offset = self._reserved.popitem()
            self.release(offset)

    def release(self, offset: int) -> None:
        """The peer is done with the region at ``offset``; raises ValueError for an
        offset that is not lent (a garbled frame). A pinned region stays lent."""
        if offset in self._pinned:
            return
        size = self._lent.pop(offset, None)
        if size is None:
            raise ValueError(f"released arena offset {offset} is not lent; not a channel frame")
        i = bisect.bisect_left(self._free_offsets, offset)
        # Merge with the free neighbours so that large regions form again.
        if i < len(self._free_offsets) and offset + size == self._free_offsets[i]:
            size += self._free_sizes[i]
            del self._free_offsets[i], self._free_sizes[i]
        if i > 0 and self._free_offsets[i - 1] + self._free_sizes[i - 1] == offset:
            self._free_sizes[i - 1] += size
        else:
            self._free_offsets.insert(i, offset)
            self._free_sizes.insert(i, size)
        if not self._lent and self._touched > ARENA_KEEP_BYTES:
            # Idle after a burst: the pages above the keep go back (the peer's mapping
            # reads zeros there until they are written again).
            self._map.madvise(mmap.MADV_REMOVE, ARENA_KEEP_BYTES, self._touched - ARENA_KEEP_BYTES)
            self._touched = ARENA_KEEP_BYTES

    @property
    def resident_bytes(self) -> int:
        """Memory the arena holds now (pages written and not given back)."""
        return os.fstat(self.fd).st_blocks * 512

    def close(self) -> None:
        """Closes the fd; the mapping goes when the last view of it does."""
        self._made.clear()
        self._made_at.clear()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class PeerArena:
    """The receiver's mapping of the other end's arena."""

    def __init__(self, fd: int) -> None:
        try:
            self.size_bytes = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, self.size_bytes)
        finally:
            os.close(fd)
        self._view = memoryview(self._map)
        self.buffer = self._map
        """The mapping, for arrays built on it (``np.ndarray(..., buffer=, offset=)``)."""
        self.base = address(self._view)
        """Where the mapping starts in this process's memory."""
        self._made: dict[tuple, np.ndarray] = {}
        """Arrays made over the peer's regions ([Note: arrays made once])."""

    def check(self, offset: int, nbytes: int) -> None:
        """Raises ValueError when ``nbytes`` at ``offset`` is not a place in the arena."""
        if offset + nbytes > self.size_bytes or offset % _ALIGN:
            raise ValueError(f"frame places {nbytes} bytes at arena offset {offset}, outside the "
                             f"{self.size_bytes}-byte arena; not a channel frame")

    def region(self, offset: int, nbytes: int) -> memoryview:
        """The region in place; raises ValueError when it lies outside the arena."""
        self.check(offset, nbytes)
        return self._view[offset:offset + nbytes]

    def array(self, offset: int, nbytes: int, dtype: np.dtype, shape: tuple) -> np.ndarray:
        """The array at ``offset``, made once per offset, dtype and shape ([Note: arrays
        made once]), for a receiver that reads regions only until it hands them back,
        never one whose arrays live on in its callers; raises ValueError when its
        ``nbytes`` lie outside the arena."""
        array = self._made.get((offset, dtype, shape))
        if array is None:
            self.check(offset, nbytes)
            array = _made_once(self._made, self._map, offset, dtype, shape)
        return array

    def close(self) -> None:
        """Forgets the arrays it made; the mapping goes when the last view of it does."""
        self._made.clear()
