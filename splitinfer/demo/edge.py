"""The demo's edge device: the edge agent daemon in its own process, CPU-throttled.

The throttle is splitinfer.emulate's (see [Note: edge throttle] there): the agent runs
with one ONNX Runtime thread and, where a cgroup CPU controller is writable, in a cgroup
with a quota of `edge_cpus` CPUs once it is ready. The device profile given to the
planner is the one-thread profile measured in this run scaled to the whole-model time
measured inside the quota (`ThrottledTimer`); the report compares that prediction with
the local latencies the throttled agent actually shows. Without a writable controller
the agent runs with one thread, unthrottled, and the profile is the one-thread profile
as measured.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import yaml

from splitinfer.emulate import PERIOD_US, CpuQuota, die_with_parent

__all__ = ["AGENT_SETTINGS", "ENCODINGS", "CpuQuota", "EdgeProcess", "ThrottledTimer", "set_quota"]

logger = logging.getLogger(__name__)

# The boundary encodings the demo's agent may choose: fp16 halves what crosses the link
# for an output within 1e-2 of the whole model's (`splitinfer.demo.stream.REL_TOL`).
ENCODINGS = ("fp32", "fp16")

# The demo agent's edge.yaml keys besides its addresses and paths. The policy and the link
# monitor run on their defaults: tests/e2e/test_demo_steady.py replays the demo's steady
# 5.85 Mbit/s phase through them in simulated time and counts the switches.
AGENT_SETTINGS: dict[str, object] = {
    "device_id": "demo-device", "intra_op_threads": 1, "encodings": list(ENCODINGS), "probe_interval_s": 1.0,
    "dwell_s": 1.0, "breaker_open_s": 2.0, "startup_timeout_s": 30.0,
}

# The timing child idles three quota periods before each timed run, and times at least
# this many runs: see [Note: quota bursts].
_IDLE_BEFORE_RUN_S = 3 * PERIOD_US / 1e6
_MIN_TIMED_RUNS = 7


class EdgeProcess:
    """`splitinfer edge run` as a child process in its own process group."""

    def __init__(self, *, work_dir: str, gateway: str, model: str, device_profile_path: str,
                 remote_timeout_ms: float, quota: CpuQuota) -> None:
        self.work_dir = work_dir
        self.socket_path = os.path.join(work_dir, "edge.sock")
        self.log_path = os.path.join(work_dir, "edge-agent.log")
        self.quota = quota
        self.proc: subprocess.Popen[bytes] | None = None
        self.config = {
            "gateway": gateway, "model": f"{model}@1", "api_socket": self.socket_path,
            "cache_dir": os.path.join(work_dir, "edge-cache"), "device_profile": device_profile_path,
            **AGENT_SETTINGS, "remote_timeout_ms": remote_timeout_ms,
        }

    def start(self, timeout_s: float = 240.0) -> float:
        """Starts the agent, waits until /readyz is 200, then throttles it; returns the seconds taken."""
        from edge_agent.client import EdgeClient

        cfg_path = os.path.join(self.work_dir, "edge.yaml")
        with open(cfg_path, "w", encoding="utf-8") as fh:
            yaml.safe_dump(self.config, fh, sort_keys=False)
        t0 = time.monotonic()
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child holds it; closed below
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "splitinfer", "edge", "run", "--config", cfg_path, "--log-level", "info"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                env=dict(os.environ, OMP_NUM_THREADS="1"), preexec_fn=die_with_parent)
        finally:
            log.close()
        with EdgeClient(unix_socket=self.socket_path, timeout_s=5.0) as c:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the edge agent exited with code {self.proc.returncode} while starting; "
                                       f"its log ends with:\n{self.log_tail()}")
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"the edge agent was not ready after {timeout_s:.0f} s; its log ends with:\n"
                                       f"{self.log_tail()}")
                with contextlib.suppress(OSError, ValueError, Exception):
                    if os.path.exists(self.socket_path) and c.ready():
                        break
                time.sleep(0.25)
        if self.quota.active:
            self.quota.add(self.proc.pid)
        return time.monotonic() - t0

    def status(self) -> dict[str, Any]:
        from edge_agent.client import EdgeClient

        with EdgeClient(unix_socket=self.socket_path, timeout_s=10.0) as c:
            return c.status()

    def log_tail(self, n: int = 15) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                return "".join(fh.readlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM to the process group (the agent drains), SIGKILL after `grace_s`; returns the exit code."""
        p = self.proc
        if p is None:
            return None
        try:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(grace_s)
                except subprocess.TimeoutExpired:
                    logger.warning("the edge agent did not stop within %.0f s of SIGTERM; killing it", grace_s)
            # Whatever else is left in its group (there should be nothing) goes too.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
        finally:
            self.quota.remove()
            self.proc = None
        return p.returncode


def set_quota(quota: CpuQuota, cpus: float) -> None:
    """Rewrites the limit of `quota`'s cgroup in place (a CpuQuota of the same name does it);
    processes inside it stay there."""
    assert quota.path is not None
    CpuQuota(cpus, os.path.basename(quota.path))
    quota.cpus = cpus


class ThrottledTimer:
    """Times the whole model with one thread inside the quota's cgroup, in a child process.

    The child loads ONNX Runtime and the model unthrottled, says so, and is moved into the
    cgroup; each `time()` then times a few inferences under the quota's current limit and
    returns the median in ms. This is how fast the emulated device really is on this host
    now (other load included), which no arithmetic on the quota can say. `gap_parts()`
    times, in the same quota, what else a local answer costs the agent: see [Note: local gap].
    """

    def __init__(self, model_path: str, quota: CpuQuota, runs: int) -> None:
        self.quota = quota
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "splitinfer.demo.edge", model_path, str(runs)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"), preexec_fn=die_with_parent)
        self._moved = False

    def _ask(self, command: str) -> str:
        p = self.proc
        assert p.stdin is not None and p.stdout is not None
        if not self._moved:
            line = p.stdout.readline().decode().strip()
            if line != "ready":
                raise RuntimeError(f"the timing child did not start (said {line!r}, code {p.poll()})")
            if self.quota.active:
                self.quota.add(p.pid)
            self._moved = True
        p.stdin.write(f"{command}\n".encode())
        p.stdin.flush()
        line = p.stdout.readline().decode().strip()
        if not line:
            raise RuntimeError(f"the timing child exited (code {p.poll()}) before answering {command!r}")
        return line

    def time(self) -> float:
        """Median ms of one inference, each after an idle wait (see [Note: quota bursts])."""
        return float(self._ask("go"))

    def gap_parts(self) -> dict[str, float]:
        """Median ms inside the quota of: an inference back to back with the one before
        (`back_to_back_ms`), and the agent's hand-offs of one local answer without the
        inference (`handoff_ms`: the request's msgpack decode, the hop to the engine's
        thread and back, the answer's encode)."""
        return {k: float(v) for k, v in json.loads(self._ask("parts")).items()}

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _time_runs(run: Callable[[], object], n: int, idle_s: float) -> float:
    from statistics import median

    times = []
    for _ in range(n):
        if idle_s:
            time.sleep(idle_s)
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(median(times))


def _handoff(feed: dict[str, Any], outputs: dict[str, Any], pool: concurrent.futures.Executor) -> None:
    """What the agent does for a local answer besides the inference, as its API does it."""
    from edge_agent import wire

    body = wire.dumps({"inputs": wire.encode_tensors(feed, True)}, wire.MSGPACK)
    inputs, _ = wire.decode_tensors(wire.loads(body, wire.MSGPACK), True)
    pool.submit(lambda: inputs).result()
    wire.dumps({"outputs": wire.encode_tensors(outputs, True)}, wire.MSGPACK)


def _time_model_main(argv: list[str]) -> int:
    import numpy as np
    import onnxruntime as ort

    path, runs = argv[0], max(int(argv[1]), _MIN_TIMED_RUNS)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    sess = ort.InferenceSession(path, sess_options=opts, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feed = {i.name: rng.standard_normal([d if isinstance(d, int) and d > 0 else 1 for d in i.shape]).astype(np.float32)
            for i in sess.get_inputs()}
    names = [o.name for o in sess.get_outputs()]
    outputs = dict(zip(names, sess.run(None, feed)))
    pool = concurrent.futures.ThreadPoolExecutor(1)
    _handoff(feed, outputs, pool)  # imports and first-use costs, outside the quota
    print("ready", flush=True)
    for line in sys.stdin:
        command = line.strip()
        sess.run(None, feed)
        if command == "go":
            # [Note: quota bursts] requests reach the device after an idle wait, and a CFS
            # quota hands a job that starts after one its whole slice at full speed, so a
            # short model runs faster then than back to back (ShuffleNet inside 0.2 CPU: a
            # median 40 ms back to back, 26-34 ms after 30 ms pauses). Time it the way it is used.
            print(f"{_time_runs(lambda: sess.run(None, feed), runs, _IDLE_BEFORE_RUN_S):.3f}", flush=True)
        elif command == "parts":
            parts = {"back_to_back_ms": _time_runs(lambda: sess.run(None, feed), runs, 0.0),
                     "handoff_ms": _time_runs(lambda: _handoff(feed, outputs, pool), runs, _IDLE_BEFORE_RUN_S)}
            print(json.dumps(parts), flush=True)
        else:
            print("", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_time_model_main(sys.argv[1:]))
