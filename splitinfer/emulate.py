"""Emulating a slower edge device, and its link, on this host.

Used by `splitinfer demo` (its edge agent) and by `splitinfer edge run --emulate-device
DEVICE [--emulate-link RATE[,rtt=D][,down=RATE]]` (see `run_emulated`).

[Note: edge emulation]
An edge device is the agent with one ONNX Runtime thread whose work is stretched in time
(edge_agent.device, [Note: time-scaled device]): every engine run and encode takes
`slowdown` times the CPU time it took here. `edge run --emulate-device rpi4` plans with
the reference device's roofline profile of the model (planner.devices) and sets the
slowdown to that profile's whole-model time over the model's one-thread time here, so the
agent takes about the device's time; `emulate.slowdown` sets it directly. The link, when
one is asked for, is the user-space emulator (splitinfer.netem) between the agent and the
gateway, run by a supervisor with the agent as its child.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from edge_agent.config import EdgeConfig

__all__ = ["CHILD_FLAG", "EmulatedLink", "check_emulation", "die_with_parent", "link_from_config",
           "parse_link_spec", "run_emulated"]

logger = logging.getLogger(__name__)

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


def run_emulated(config: EdgeConfig, *, log_level: str = "info") -> int:
    """`splitinfer edge run` with an emulated link: the link emulator here, the agent as a child
    (which emulates the device itself, [Note: edge emulation]).

    Returns the agent's exit code. Everything started is stopped, and the child's config
    file removed, on every way out."""
    from splitinfer.netem import LinkSetting, ThreadedLinkEmulator

    link = link_from_config(config)
    assert link is not None, "run_emulated needs an emulated link"
    work = tempfile.mkdtemp(prefix="splitinfer-edge-")
    emu: ThreadedLinkEmulator | None = None
    child: subprocess.Popen[bytes] | None = None
    stop: _Stop | None = None
    try:
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
        if emu is not None:
            emu.stop()
        import shutil

        shutil.rmtree(work, ignore_errors=True)
