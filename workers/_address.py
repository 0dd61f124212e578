"""Where a buffer lies in this process's memory: shared by the engine (bindings kept by
address) and the direct channel's arenas (regions found by address)."""

from __future__ import annotations

import ctypes

import numpy as np

__all__ = ["address"]


def address(data: memoryview | np.ndarray) -> int:
    """Where ``data``'s first byte lies in this process's memory (a C-contiguous
    buffer); -1 for read-only or empty buffers (never a reserved region: those are
    writable)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(data))  # a sixth of numpy's .ctypes.data
    except (TypeError, ValueError):
        return -1
