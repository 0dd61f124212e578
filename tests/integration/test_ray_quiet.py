"""The demo's Ray keeps its workers' log lines (Ray's C++ `E ...` lines among them) off the
console unless --verbose: `start_ray(quiet=True)` does not forward them to the driver."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.ray

_SCRIPT = textwrap.dedent("""
    import sys, time
    import ray
    from splitinfer.demo.stack import start_ray, stop_ray

    start_ray(quiet=sys.argv[1] == "quiet")

    @ray.remote
    def noisy():
        print("stdout-line-of-a-worker", flush=True)
        print("[E core_worker.cc:1] stderr-line-of-a-worker", file=sys.stderr, flush=True)
        return 1

    ray.get(noisy.remote())
    time.sleep(2)  # Ray forwards a worker's lines to the driver within about a second
    stop_ray()
""")


def _run(mode: str) -> str:
    r = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    return r.stdout + r.stderr


def test_demo_ray_keeps_worker_log_lines_off_the_console() -> None:
    out = _run("quiet")
    assert "line-of-a-worker" not in out
    assert "WARNING" not in out


def test_demo_ray_forwards_worker_log_lines_with_verbose() -> None:
    out = _run("verbose")
    assert "stdout-line-of-a-worker" in out and "[E core_worker.cc:1] stderr-line-of-a-worker" in out
