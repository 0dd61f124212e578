"""Emulating a slower edge device, and its link, on this host.

Used by `splitinfer demo` (its edge agent) and by `splitinfer edge run --emulate-device
DEVICE [--emulate-link RATE[,rtt=D][,down=RATE]]` (see `run_emulated`).

[Note: edge throttle]
An edge device is a CPU-throttled process (docs/architecture.md, "Measuring"): a cgroup
CPU quota where the machine allows it, otherwise one thread. The agent runs as a child process with one
ONNX Runtime thread and, where a cgroup CPU controller is writable (v2 `cpu.max`, else
v1 `cpu.cfs_quota_us`), is put in a cgroup with a quota of q CPUs once it is ready
(start-up is not throttled, so nobody waits on it). A CFS quota of q CPUs stretches a
single thread's CPU time by 1/q. The demo measures the one-thread profile here and
scales it by what the model takes inside the quota. `edge run --emulate-device rpi4`
goes the other way: the agent plans with the reference device's roofline profile of the
model (planner.devices), and the quota is the ratio of the model's one-thread time here
to that profile's, so the throttled agent takes about the device's time. Without a
writable controller the agent runs with one thread, unthrottled, and the factor by
which it is faster than the emulated device is said at start. The whole agent process
is throttled (its Python, gRPC and encoding too), as the whole device would be slower.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edge_agent.config import EdgeConfig

__all__ = ["CHILD_FLAG", "CpuQuota", "EmulatedLink", "check_emulation", "die_with_parent", "link_from_config",
           "parse_link_spec", "quota_cpus", "run_emulated"]

logger = logging.getLogger(__name__)

_V2_ROOT = "/sys/fs/cgroup"
_V1_ROOT = "/sys/fs/cgroup/cpu"
# A short CFS period keeps a throttled run smooth: with 100 ms a 150 ms inference would
# run in 25 ms bursts with 75 ms stalls, and latencies would depend on the phase.
PERIOD_US = 10_000
# The kernel's smallest CFS quota: below 0.1 CPU the period grows so the quota stays at it.
_MIN_QUOTA_US = 1000
_MIN_CPUS = 0.01
"""The smallest quota `quota_cpus` asks for (a device 100x slower than one core here)."""
CHILD_FLAG = "--emulated-child"
"""`edge run`'s hidden flag for the agent `run_emulated` starts: run the agent itself, not another supervisor."""
DOWN_RATIO = 4.0
"""An emulated link's downlink per uplink when none is given: the agent's default link range's."""


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def die_with_parent() -> None:
    """In a child before exec: SIGTERM when its parent dies, even by SIGKILL (Linux only)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class CpuQuota:
    """A cgroup with a CPU quota, or nothing where no controller is writable (`.kind` says which)."""

    def __init__(self, cpus: float, name: str) -> None:
        self.cpus = cpus
        self.path: str | None = None
        self.kind = "none"
        self.why_not = ""
        if cpus <= 0:
            self.why_not = "throttling is off (0 CPUs asked)"
            return
        period_us = max(PERIOD_US, math.ceil(_MIN_QUOTA_US / cpus))
        quota_us = max(_MIN_QUOTA_US, int(cpus * period_us))
        attempts = []
        v2 = os.path.join(_V2_ROOT, "cgroup.controllers")
        if os.path.exists(v2):
            attempts.append(("v2", os.path.join(_V2_ROOT, name)))
        if os.path.isdir(_V1_ROOT):
            attempts.append(("v1", os.path.join(_V1_ROOT, name)))
        errors = []
        for kind, path in attempts:
            try:
                os.makedirs(path, exist_ok=True)
                if kind == "v2":
                    _write(os.path.join(path, "cpu.max"), f"{quota_us} {period_us}")
                else:
                    _write(os.path.join(path, "cpu.cfs_period_us"), str(period_us))
                    _write(os.path.join(path, "cpu.cfs_quota_us"), str(quota_us))
                self.path, self.kind = path, f"cgroup {kind}"
                return
            except OSError as e:
                errors.append(f"{kind}: {e.strerror or e}")
                with contextlib.suppress(OSError):
                    os.rmdir(path)
        self.why_not = "no writable cgroup CPU controller (" + ("; ".join(errors) or "none mounted") + ")"

    @property
    def active(self) -> bool:
        return self.path is not None

    def add(self, pid: int) -> None:
        assert self.path is not None
        _write(os.path.join(self.path, "cgroup.procs"), str(pid))

    def remove(self) -> None:
        """Deletes the cgroup (its processes must have exited)."""
        if self.path is None:
            return
        for _ in range(50):
            try:
                os.rmdir(self.path)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)  # the kernel frees an exited process's membership shortly after
        else:
            logger.warning("could not remove the cgroup %s; remove it with rmdir", self.path)
        self.path = None


def quota_cpus(device_ms: float, host_one_thread_ms: float) -> float:
    """CPUs of the quota that makes one thread here as slow as the device; 0: no throttle needed.

    `device_ms` is the model's whole time as the device's profile predicts it and
    `host_one_thread_ms` what one ONNX Runtime thread takes here; see [Note: edge throttle]."""
    if not (device_ms > 0 and host_one_thread_ms > 0) or device_ms <= host_one_thread_ms:
        return 0.0
    return max(_MIN_CPUS, host_one_thread_ms / device_ms)


# -- the link ------------------------------------------------------------------------


@dataclass(frozen=True)
class EmulatedLink:
    """A fixed link the agent's gateway connection goes through (`splitinfer netem`'s proxy)."""

    up_bps: float
    """Uplink, bits/s (> 0)."""
    down_bps: float
    """Downlink, bits/s (> 0); DOWN_RATIO times the uplink unless given."""
    rtt_ms: float = 0.0
    """Round-trip time the link adds, ms (>= 0)."""

    def describe(self) -> str:
        from splitinfer.units import format_duration_ms, format_rate_bps

        return (f"up {format_rate_bps(self.up_bps)}, down {format_rate_bps(self.down_bps)}, "
                f"rtt {format_duration_ms(self.rtt_ms)}")


_LINK_SPEC = "RATE[,rtt=DURATION][,down=RATE], e.g. 10mbit or 10mbit,rtt=5ms,down=40mbit"


def parse_link_spec(spec: str) -> dict[str, str]:
    """`--emulate-link`'s text as the config keys it sets: {'emulate_uplink': ..., 'emulate_rtt': ...}.

    Values stay text; `check_emulation` parses them, for the flag and edge.yaml alike."""
    parts = [p.strip() for p in str(spec).split(",")]
    if not parts[0] or "=" in parts[0]:
        raise ValueError(f"--emulate-link {spec!r} does not start with the uplink rate; write {_LINK_SPEC}")
    out = {"emulate_uplink": parts[0]}
    for part in parts[1:]:
        key, sep, value = part.partition("=")
        knob = {"rtt": "emulate_rtt", "down": "emulate_downlink"}.get(key.strip())
        if not sep or knob is None or not value.strip():
            raise ValueError(f"--emulate-link {spec!r}: {part!r} is not rtt=DURATION or down=RATE; write {_LINK_SPEC}")
        if knob in out:
            raise ValueError(f"--emulate-link {spec!r} gives {key.strip()} twice; keep one")
        out[knob] = value.strip()
    return out


def _quantity(config: EdgeConfig, key: str, parse: Callable[[str], float], example: str, positive: bool) -> float:
    from edge_agent.errors import ConfigError

    text = getattr(config, f"emulate_{key}")
    try:
        value = parse(text)
    except ValueError as e:
        raise ConfigError(key=f"emulate.{key}", reason=f"is {text!r}: {e}", fix=f"e.g. {key}: {example}") from None
    if value < 0 or (positive and value == 0):
        raise ConfigError(key=f"emulate.{key}", reason=f"is {text!r}, which is {'not > 0' if positive else 'negative'}",
                          fix=f"e.g. {key}: {example}")
    return value


def link_from_config(config: EdgeConfig) -> EmulatedLink | None:
    """The link `config` asks to emulate (None: none); ConfigError names a bad key."""
    from edge_agent.errors import ConfigError
    from splitinfer.units import parse_duration_ms, parse_rate_bps

    if config.emulate_uplink is None:
        for key in ("downlink", "rtt"):
            if getattr(config, f"emulate_{key}") is not None:
                raise ConfigError(key=f"emulate.{key}", reason="is set without emulate.uplink",
                                  fix="give the uplink too, e.g. emulate: {uplink: 10mbit, rtt: 5ms}")
        return None
    up = _quantity(config, "uplink", parse_rate_bps, "10mbit", True)
    down = up * DOWN_RATIO if config.emulate_downlink is None else _quantity(
        config, "downlink", parse_rate_bps, "40mbit", True)
    rtt = 0.0 if config.emulate_rtt is None else _quantity(config, "rtt", parse_duration_ms, "5ms", False)
    return EmulatedLink(up, down, rtt)


def check_emulation(config: EdgeConfig) -> None:
    """ConfigError for emulation settings that cannot be run (the device is checked by EdgeConfig)."""
    link_from_config(config)


# -- the supervisor ------------------------------------------------------------------


def _free_port(host: str) -> int:
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _child_config(config: EdgeConfig, gateway: str) -> dict[str, Any]:
    d = {k: v for k, v in dataclasses.asdict(config).items() if v is not None}
    d.update(gateway=gateway, intra_op_threads=1, encodings=list(config.encodings))
    for key in ("emulate_uplink", "emulate_downlink", "emulate_rtt"):
        d.pop(key, None)
    return d


class _Stop:
    """SIGTERM/SIGINT: passed on to the agent once; the supervisor waits for it to exit."""

    def __init__(self, child: subprocess.Popen[bytes]) -> None:
        self.child = child
        self.signalled = False
        main = threading.current_thread() is threading.main_thread()  # signal.signal works only there
        self._old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)} if main else {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self.signalled and self.child.poll() is None:
            self.signalled = True
            with contextlib.suppress(ProcessLookupError):
                self.child.send_signal(signal.SIGTERM)

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def _wait_ready(child: subprocess.Popen[bytes], config: EdgeConfig, stop: _Stop, timeout_s: float) -> dict[str, Any] | None:
    """The agent's /v1/status once /readyz is 200; None if it exited or was stopped first."""
    from edge_agent.client import EdgeClient

    url = f"http://{config.api_host}:{config.api_port}"
    t0 = time.monotonic()
    with EdgeClient(url, unix_socket=config.api_socket, timeout_s=5.0) as c:
        while child.poll() is None and not stop.signalled:
            if time.monotonic() - t0 > timeout_s:
                logger.error("the edge agent was not ready after %.0f s; stopping it", timeout_s)
                return None
            with contextlib.suppress(OSError, ValueError):
                if c.ready():
                    return c.status()
            time.sleep(0.25)
    return None


def _throttle(child: subprocess.Popen[bytes], config: EdgeConfig, status: dict[str, Any]) -> CpuQuota | None:
    """Puts the ready agent under the quota that makes it as slow as the emulated device; logs how."""
    device = config.emulate_device
    device_ms, host_ms = float(status.get("local_ms") or 0.0), float(status.get("measured_local_ms") or 0.0)
    cpus = quota_cpus(device_ms, host_ms)
    ratio = device_ms / host_ms if host_ms > 0 else math.nan
    if cpus == 0.0:
        logger.warning("emulating %s: one ONNX Runtime thread here takes %.1f ms for the model and the %s estimate is "
                       "%.1f ms; this host is not faster, so the agent runs unthrottled with one thread",
                       device, host_ms, device, device_ms)
        return None
    quota = CpuQuota(cpus, f"splitinfer-edge-{child.pid}")
    if not quota.active:
        logger.warning("emulating %s: %s; the agent runs with one thread, unthrottled, %.1fx faster than the %s "
                       "estimate (%.1f ms here, %.1f ms on %s): it still plans with the %s profile, and its "
                       "measured local answers correct that as they come", device, quota.why_not, ratio, device,
                       host_ms, device_ms, device, device)
        return None
    try:
        quota.add(child.pid)
    except OSError as e:
        logger.warning("emulating %s: could not move the agent into %s (%s); it runs unthrottled with one thread",
                       device, quota.path, e.strerror or e)
        quota.remove()
        return None
    logger.info("emulating %s: the agent runs with one thread in a %s quota of %.3g CPU: the model takes %.1f ms "
                "with one thread here and %.1f ms on %s (roofline estimate), %.1fx", device, quota.kind, cpus,
                host_ms, device_ms, device, ratio)
    return quota


def run_emulated(config: EdgeConfig, *, log_level: str = "info", ready_timeout_s: float = 600.0) -> int:
    """`splitinfer edge run` with `emulate` set: the link emulator here, the agent as a throttled child.

    Returns the agent's exit code. Everything started is stopped, and the cgroup and the
    child's config file removed, on every way out."""
    from splitinfer.netem import ThreadedLinkEmulator
    from splitinfer.netem import LinkSetting

    link = link_from_config(config)
    if config.api_socket is None and config.api_port == 0:
        # The supervisor must find the agent's API to throttle it once ready: any free port, chosen here.
        config = dataclasses.replace(config, api_port=_free_port(config.api_host))
    work = tempfile.mkdtemp(prefix="splitinfer-edge-")
    emu: ThreadedLinkEmulator | None = None
    child: subprocess.Popen[bytes] | None = None
    quota: CpuQuota | None = None
    stop: _Stop | None = None
    try:
        gateway = config.gateway
        if link is not None:
            host, _, port = config.gateway.rpartition(":")
            emu = ThreadedLinkEmulator(upstream=(host.strip("[]"), int(port)),
                                       setting=LinkSetting(link.up_bps, link.down_bps, link.rtt_ms)).start()
            gateway = f"127.0.0.1:{emu.port}"
            logger.info("emulated link: %s, between the agent and the gateway at %s (via 127.0.0.1:%d)",
                        link.describe(), config.gateway, emu.port)
            if config.tls_ca is not None:
                logger.warning("the agent reaches the gateway through the emulator at 127.0.0.1, so TLS verifies "
                               "the gateway's certificate for 127.0.0.1; a certificate that does not name it fails")
        import yaml

        cfg_path = os.path.join(work, "edge.yaml")
        with open(cfg_path, "w", encoding="utf-8") as fh:
            yaml.safe_dump(_child_config(config, gateway), fh, sort_keys=False)
        child = subprocess.Popen(
            [sys.executable, "-m", "splitinfer", "edge", "run", "--config", cfg_path, "--log-level", log_level,
             CHILD_FLAG],
            stdin=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1"), preexec_fn=die_with_parent)
        stop = _Stop(child)
        status = _wait_ready(child, config, stop, ready_timeout_s) if config.emulate_device else None
        if status is not None:
            quota = _throttle(child, config, status)
        elif config.emulate_device and child.poll() is None and not stop.signalled:
            child.send_signal(signal.SIGTERM)
        return child.wait()
    finally:
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(10)
        if stop is not None:
            stop.restore()
        if quota is not None:
            quota.remove()
        if emu is not None:
            emu.stop()
        import shutil

        shutil.rmtree(work, ignore_errors=True)
