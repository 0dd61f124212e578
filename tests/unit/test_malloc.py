"""workers._malloc: freed large buffers stay in the process ([Note: fresh pages]).

Each case runs in a fresh interpreter, since the allocator settings are process-wide.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="mallopt tuning is glibc-only"
)

_PROBE = r"""
import json, resource, sys
from workers._malloc import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "tune" else False
again = keep_freed_memory() if sys.argv[1] == "tune" else False
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def burst():  # what a message's trip through a server leaves: a few 1 MiB buffers at once
    bufs = [bytearray(1 << 20) for _ in range(4)]  # zero-filled: every page is touched
    del bufs
for _ in range(5):  # warm up: the heap grows once
    burst()
f0 = faults()
for _ in range(50):
    burst()
print(json.dumps({"applied": applied, "again": again, "faults": faults() - f0}))
"""


def _probe(mode: str, **env: str) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True,
                         cwd=root, env={**os.environ, **env}, timeout=60)
    return json.loads(out.stdout)


def test_freed_megabyte_buffers_are_reused_without_page_faults():
    plain = _probe("plain")
    tuned = _probe("tune")
    assert tuned["applied"] and tuned["again"]
    # Untuned, glibc trims the freed 4 MiB off the heap's top after each burst, so
    # the next burst faults its pages in again: about 256 faults per MiB.
    assert plain["faults"] > 50 * 4 * 100, plain
    assert tuned["faults"] * 20 < plain["faults"], (tuned, plain)


def test_opt_out_leaves_the_allocator_alone():
    off = _probe("tune", SPLITINFER_KEEP_FREED_MEMORY="0")
    assert off["applied"] is False
    plain = _probe("plain")
    assert off["faults"] > plain["faults"] / 2, (off, plain)
