"""A slower device emulated in time: the device's work here takes `factor` times its CPU time.

[Note: time-scaled device]
A device slower than this host is emulated by stretching each piece of the device's
work (an engine run, an encode of what crosses the link) to `factor` times the CPU time
the calling thread spent on it: after the work, the thread sleeps until that much wall
time has passed. With one ONNX Runtime thread the run's CPU time is the calling thread's
(`time.thread_time`), so other load on the host does not make the device slower, as it
would if the sleep were scaled from wall time. The device has one core: its work runs one
piece at a time, under a lock held through the sleep.

A CFS CPU quota, which emulated the device before, hands a job that starts after an idle
wait its whole slice at full speed: at the small quotas a slow device needs (0.03 CPU,
whose period is then 33 ms), SqueezeNet's 3.4 ms of CPU took 4 ms in one timing and 55-65 ms
in others, and whether a request of the same plan took 4 or 92 ms depended on the phase.
Stretching in time gives every run factor x its CPU time. What it leaves at this host's
speed is the agent's own Python (its HTTP, gRPC and policy), which the cost model prices
as the call's fixed cost.

A run's CPU time is itself not steady on a shared virtual machine: one single-thread
ResNet50 run here took 59-103 ms of CPU within one minute (median 80), alone on the host,
with no hardware counters to count its work instead. Stretched 5-14x, that spread would
make the device's time wander by hundreds of ms from run to run, and a benchmark's
strategies would differ by which runs met a busy moment of the host's neighbours. So a
piece of work that names itself (`key`: an engine and its input shapes) takes factor x
its reference CPU time: the median of that key's first `REFERENCE_RUNS` runs, fixed from
then on. The device's time per piece is then steady, as a real device's is far more than
a shared host's; a run the host cannot finish within it still takes its wall time. Work
without a key (an encode) is stretched from its own CPU time. A cancelled piece
(`workers.engine.RunCancel`) gives the device back at once, in its work or its stretch.
"""

from __future__ import annotations

import itertools
import math
import statistics
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np

from workers.engine import RunCancel

__all__ = ["REFERENCE_RUNS", "SlowDevice", "SlowedEngine"]

T = TypeVar("T")

_WINDOW = 256
"""Run times a slowed engine keeps for its stats (as workers.engine keeps its own)."""
_ENGINE_IDS = itertools.count()
REFERENCE_RUNS = 9
"""Runs of one key whose median CPU time is its reference ([Note: time-scaled device])."""


class SlowDevice:
    """The device's work, `factor` times slower than one thread here (1: as fast; no stretch)."""

    def __init__(self, factor: float = 1.0) -> None:
        self._lock = threading.Lock()
        self._cpu_s: dict[Hashable, list[float]] = {}
        self.factor = 1.0
        self.set_factor(factor)

    def set_factor(self, factor: float) -> None:
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor >= 1.0):
            raise ValueError(f"a device slowdown is {factor!r}; give a number >= 1 (1: this host's speed)")
        self.factor = float(factor)

    @property
    def active(self) -> bool:
        return self.factor > 1.0

    def reference_cpu_ms(self, key: Hashable) -> float | None:
        """The CPU ms that `key`'s runs are stretched from (None before its first run)."""
        seen = self._cpu_s.get(key)
        return statistics.median(seen) * 1e3 if seen else None

    def forget_references(self) -> None:
        """Every key's reference is taken again from its next runs."""
        self._cpu_s.clear()

    def _reference_s(self, key: Hashable | None, cpu_s: float) -> float:
        if key is None:
            return cpu_s
        seen = self._cpu_s.setdefault(key, [])
        if len(seen) < REFERENCE_RUNS:
            seen.append(cpu_s)
        return statistics.median(seen)

    def run(self, work: Callable[[], T], key: Hashable | None = None,
            cancel: RunCancel | None = None) -> tuple[T, float]:
        """`work()` and the ms it took on the emulated device: `factor` x the reference CPU
        time of `key` (or of this run, without a key), or its wall time where that is
        longer, as when the host is too busy to keep up. `cancel` (also `work`'s to honour)
        frees the device at once: a cancelled run raises `RunCancelledError` while it waits
        for the device or takes its time, and leaves the reference as it was."""
        if not self.active:
            t, c = time.perf_counter(), time.thread_time()
            out = work()
            self._reference_s(key, time.thread_time() - c)
            return out, (time.perf_counter() - t) * 1e3
        with self._lock:
            if cancel is not None:
                cancel.check("the device's work")
            t, c = time.perf_counter(), time.thread_time()
            out = work()
            device_s = self.factor * self._reference_s(key, time.thread_time() - c)
            left = device_s - (time.perf_counter() - t)
            if left > 0:
                if cancel is None:
                    time.sleep(left)
                elif cancel.wait(left):
                    cancel.check("the device's work")
            return out, (time.perf_counter() - t) * 1e3


class SlowedEngine:
    """An engine whose runs take the device's time (`SlowDevice.run`); its `stats()` report
    those times. Everything else is the engine's own."""

    def __init__(self, engine: Any, device: SlowDevice) -> None:
        self._engine = engine
        self._device = device
        self._ms: list[float] = []
        self._id = next(_ENGINE_IDS)
        self._last_key: Hashable | None = None

    def run(self, inputs: Mapping[str, np.ndarray], *, cancel: RunCancel | None = None,
            **kw: Any) -> dict[str, np.ndarray]:
        self._last_key = key = (self._id, tuple((k, np.shape(v)) for k, v in sorted(inputs.items())))
        out, ms = self._device.run(lambda: self._engine.run(inputs, cancel=cancel, **kw), key, cancel)
        self._ms.append(ms)
        if len(self._ms) > _WINDOW:
            del self._ms[: len(self._ms) - _WINDOW]
        return out

    def forget_times(self) -> None:
        """Drops the run times `stats()` reports (runs that were not the device's, as `settle_device`'s)."""
        self._ms.clear()

    def reference_cpu_ms(self) -> float | None:
        """The CPU ms that runs at the input shapes of the last run are stretched from."""
        return None if self._last_key is None else self._device.reference_cpu_ms(self._last_key)

    def stats(self) -> Any:
        base = self._engine.stats()
        if not self._device.active:
            return base
        ms = list(self._ms)
        med, p90 = (float(np.median(ms)), float(np.percentile(ms, 90))) if ms else (0.0, 0.0)
        return replace(base, median_ms=med, p90_ms=p90)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)
