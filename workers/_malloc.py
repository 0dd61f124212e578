"""Keep freed message buffers in the process instead of handing them back to the OS.

[Note: fresh pages]
A 1 MiB message crosses a server as a handful of 1 MiB buffers: gRPC's slices,
the Python bytes, the decoded and encoded frames. With glibc's default settings
each buffer of 128 KiB or more is freed back to the kernel (an munmap, or a trim
of the heap's top), so the next message writes into fresh pages and takes a page
fault for every 4 KiB of them. On the 2-core virtual machine this project is
measured on, those faults were most of a large round trip. bench/transport.py,
servers in their own processes, run twice in a row with this on and off for
every server: our 1 MiB Infer took 3.10 ms against 5.46 ms, 8 MiB 20.9 against
35.9 ms; a plain grpc.aio msgpack echo 3.04 against 5.72 ms at 1 MiB; the sync
grpcio server 2.91 against 3.24 ms (docs/protocol.md, "Measured cost").
An earlier native profile of a grpc.aio server put this time in libc's copy
routines, which is where a fault taken while copying into a fresh page is counted.

`keep_freed_memory()` raises glibc's mmap threshold to its ceiling (32 MiB on
64-bit builds, so buffers below it come from the heap) and its trim threshold
to 256 MiB (so up to that much free memory stays mapped). Both must move
together: setting either one turns off glibc's own adaptive threshold, and
either one alone made round trips slower than glibc's defaults (1 MiB: about
10 ms for every server, with client and servers all set that way). The cost is
resident memory: a process keeps up to 256 MiB of freed memory per malloc arena.
`cluster.server.serve` (the gateway, and every test and bench server),
`SegmentHost` (Ray workers) and `splitinfer edge run` (the agent, a gRPC client) call
it; SPLITINFER_KEEP_FREED_MEMORY=0 turns it off. The client side: with grpcio 1.85.3
in the client and the bench's servers on 1.78.2, runs alternating, our 1 MiB Infer
took 1.61 / 1.71 ms from a client that keeps freed memory and 3.05 / 2.66 ms from one
at glibc's defaults (on grpcio 1.78.2 the client's setting made no difference).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

__all__ = ["MMAP_THRESHOLD_BYTES", "TRIM_THRESHOLD_BYTES", "freed_memory_kept_by_default", "keep_freed_memory"]

logger = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 32 << 20
"""glibc's ceiling for M_MMAP_THRESHOLD on 64-bit builds (half its 64 MiB heap size)."""
TRIM_THRESHOLD_BYTES = 256 << 20

# glibc's mallopt parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_applied: bool | None = None


def freed_memory_kept_by_default() -> bool:
    """Whether this environment lets `keep_freed_memory` act (SPLITINFER_KEEP_FREED_MEMORY is not 0)."""
    return os.environ.get("SPLITINFER_KEEP_FREED_MEMORY", "1") != "0"


def keep_freed_memory() -> bool:
    """Applies [Note: fresh pages] to this process once; True if glibc took both settings.

    False (and nothing changed) off glibc, when SPLITINFER_KEEP_FREED_MEMORY=0, or
    when mallopt refuses a value. Safe to call more than once and from any thread.
    """
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if not freed_memory_kept_by_default():
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
