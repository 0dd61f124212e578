"""The demo's edge device: the edge agent daemon in its own process, its device emulated in time.

The agent runs with one ONNX Runtime thread and `emulate.slowdown` set (edge_agent.device,
[Note: time-scaled device]): every engine run and encode takes the slowdown times its CPU
time. The device profile given to the planner is the one-thread profile measured in this
run stretched by the same factor (`splitinfer.demo.setup.emulate_device`); the report
compares that prediction with the local latencies the agent actually shows.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

import yaml

from splitinfer.emulate import die_with_parent

__all__ = ["AGENT_SETTINGS", "ENCODINGS", "EdgeProcess"]

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

class EdgeProcess:
    """`splitinfer edge run` as a child process in its own process group."""

    def __init__(self, *, work_dir: str, gateway: str, model: str, device_profile_path: str,
                 remote_timeout_ms: float, slowdown: float) -> None:
        self.work_dir = work_dir
        self.socket_path = os.path.join(work_dir, "edge.sock")
        self.log_path = os.path.join(work_dir, "edge-agent.log")
        self.proc: subprocess.Popen[bytes] | None = None
        self.config = {
            "gateway": gateway, "model": f"{model}@1", "api_socket": self.socket_path,
            "cache_dir": os.path.join(work_dir, "edge-cache"), "device_profile": device_profile_path,
            **AGENT_SETTINGS, "remote_timeout_ms": remote_timeout_ms,
        }
        if slowdown > 1.0:
            self.config["emulate"] = {"slowdown": slowdown}

    def start(self, timeout_s: float = 240.0) -> float:
        """Starts the agent and waits until /readyz is 200; returns the seconds taken."""
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
            self.proc = None
        return p.returncode
