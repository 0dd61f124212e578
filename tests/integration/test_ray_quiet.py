"""The demo's Ray keeps its workers' log lines and the driver's own C++ `E ...` lines off the
console unless --verbose: `start_ray(quiet=True)` does not forward the workers' lines to
the driver, and sets the driver's C++ log level to FATAL."""

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

    @ray.remote(max_restarts=1)
    class Restartable:
        def __init__(self, blob):
            self.n = len(blob)

        def size(self):
            return self.n

    # Arguments this large travel through the object store, and the driver's C++ core
    # worker writes an error line for an actor that may restart (ray-project/ray#53727).
    ray.get(Restartable.remote(ray.put(bytes(1 << 20))).size.remote())
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
    assert "core_worker.cc" not in out and "logging.cc" not in out, out


def test_demo_ray_forwards_worker_log_lines_with_verbose() -> None:
    out = _run("verbose")
    assert "stdout-line-of-a-worker" in out and "[E core_worker.cc:1] stderr-line-of-a-worker" in out
    assert "has constructor arguments in the object store" in out
