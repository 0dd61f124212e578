"""Keep freed message buffers in the process instead of handing them back to the OS.

[Note: fresh pages]
A 1 MiB message crosses a server as a handful of 1 MiB buffers: gRPC's slices,
the Python bytes, the decoded and encoded frames. With glibc's default settings
each buffer of 128 KiB or more is freed back to the kernel (an munmap, or a trim
of the heap's top), so the next message writes into fresh pages and takes a page
fault for every 4 KiB of them. On the 2-core virtual machine this project is
measured on, those faults are most of a large round trip: a plain grpc.aio
msgpack echo of 1 MiB took 8.2 ms, and 3.2 ms once freed memory stayed in the
process; ours took 7.6 ms and 3.3 ms, the sync grpcio server 4.6 and 3.3 ms
(servers in their own processes, one run, side by side; docs/protocol.md,
"Fresh pages"). Profiles show the faults as time in libc's copy routines.

`keep_freed_memory()` raises glibc's mmap threshold to its ceiling (32 MiB on
64-bit builds, so buffers below it come from the heap) and its trim threshold
to 256 MiB (so up to that much free memory stays mapped). Both must move
together: setting either one turns off glibc's own adaptive threshold, and the
mmap threshold alone, or the trim threshold alone, made every round trip
slower (1 MiB: 10.2 and 8.4 ms in that run). The cost is resident memory: a
process keeps up to 256 MiB of freed memory per malloc arena. Processes that
move large tensors call it once at start (the gateway, the test and bench
servers, Ray workers); SPLITINFER_KEEP_FREED_MEMORY=0 turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

__all__ = ["MMAP_THRESHOLD_BYTES", "TRIM_THRESHOLD_BYTES", "keep_freed_memory"]

logger = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 32 << 20
"""glibc's ceiling for M_MMAP_THRESHOLD on 64-bit builds (half its 64 MiB heap size)."""
TRIM_THRESHOLD_BYTES = 256 << 20

# glibc's mallopt parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Applies [Note: fresh pages] to this process once; True if glibc took both settings.

    False (and nothing changed) off glibc, when SPLITINFER_KEEP_FREED_MEMORY=0, or
    when mallopt refuses a value. Safe to call more than once and from any thread.
    """
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("SPLITINFER_KEEP_FREED_MEMORY", "1") == "0":
        logger.info("allocator left at glibc's defaults (SPLITINFER_KEEP_FREED_MEMORY=0)")
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if not ok:
        logger.warning("mallopt refused the mmap/trim thresholds; large messages will page-fault (see workers/_malloc.py)")
    _applied = ok
    return ok
