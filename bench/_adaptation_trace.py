"""Where each request's time goes in the adaptation benchmark (see bench/adaptation.py,
[Note: local baseline]): engine-thread wait, engine CPU/wall/emulated sleep, time from the
run's end to the answer, the agent's link work and policy evaluations overlapping it,
event-loop lag and collector pauses."""

from __future__ import annotations

import asyncio
import collections
import contextvars
import gc
import statistics
import threading
import time
from typing import Any

__all__ = ["RID", "Tracer", "summarise_breakdown"]


RID: contextvars.ContextVar[str] = contextvars.ContextVar("adaptation_request_id", default="")


class Tracer:
    """Per request: where its time went, to tell the agent's own work from the device's queue.

    It wraps, on the runner instance only, the device's work (the time each piece waits for an
    executor thread, its CPU part and its emulated sleep, the engine it ran, and the time from
    its end until the app has the answer), the agent's link work (reachability checks, RTT
    checks, bandwidth probes, policy evaluations), and samples the event loop's lag and the
    collector's pauses.
    """

    def __init__(self, runner: Any, engine_names: dict[int, str]) -> None:
        self.runs: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
        self.activities: list[tuple[str, float, float]] = []
        self.lags: list[tuple[float, float]] = []
        self.gc_pauses: list[tuple[float, float]] = []
        self.cpu: list[tuple[float, float, float]] = []
        self._gc_start = 0.0
        self._names = engine_names
        self._install(runner)

    def _install(self, runner: Any) -> None:
        # Every piece of the device's work goes through `Runner._on_device` (engine runs, the early
        # local run, the hedge's tail, the boundary's encode); an engine's run names itself.
        on_device = runner._on_device
        named = threading.local()
        models = runner.models
        engines = {id(e): e for c in models.cuts.values() for e in (c.head, c.tail) if e is not None}
        engines[id(models.full)] = models.full
        for engine in engines.values():
            name = self._names.get(id(engine), "?")

            def run(*a: Any, _run: Any = engine.run, _name: str = name, **k: Any) -> Any:
                named.engine = _name
                return _run(*a, **k)

            engine.run = run

        def traced(work: Any) -> Any:
            rec: dict[str, Any] = {"engine": "encode", "call_s": time.monotonic()}
            self.runs[RID.get()].append(rec)

            def job() -> Any:
                named.engine = "encode"
                rec["start_s"] = time.monotonic()
                cpu_s = time.thread_time()
                try:
                    return work()
                finally:
                    rec["end_s"] = time.monotonic()
                    rec["engine"] = named.engine
                    # The device's wall time, the CPU time here, and the rest: the stretch and the wait
                    # for the device's one core ([Note: device emulation] in bench.adaptation).
                    run_ms, cpu_ms = (rec["end_s"] - rec["start_s"]) * 1e3, (time.thread_time() - cpu_s) * 1e3
                    rec["run_ms"], rec["cpu_ms"], rec["sleep_ms"] = run_ms, cpu_ms, max(0.0, run_ms - cpu_ms)

            fut = on_device(job)
            fut.add_done_callback(lambda _: rec.__setitem__("resumed_s", time.monotonic()))
            return fut

        runner._on_device = traced
        for name in ("probe", "probe_rtt", "check_reachable"):
            orig = getattr(runner, name)

            def wrap(orig: Any = orig, name: str = name) -> Any:
                async def traced(*a: Any, **k: Any) -> Any:
                    t = time.monotonic()
                    try:
                        return await orig(*a, **k)
                    finally:
                        self.activities.append((name, t, time.monotonic()))
                return traced

            setattr(runner, name, wrap())
        for name in ("reevaluate", "decide"):
            orig = getattr(runner, name)

            def wrap_sync(orig: Any = orig, name: str = name) -> Any:
                def traced(*a: Any, **k: Any) -> Any:
                    t = time.monotonic()
                    try:
                        return orig(*a, **k)
                    finally:
                        self.activities.append((name, t, time.monotonic()))
                return traced

            setattr(runner, name, wrap_sync())
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_start = time.monotonic()
        elif info.get("generation", 0) >= 1:
            self.gc_pauses.append((self._gc_start, time.monotonic()))

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    async def sample_lag(self) -> None:
        """Event-loop lag every 10 ms, and every 0.5 s the CPU time of the loop's thread (the agent,
        the in-process emulator and gateway) and of the whole process."""
        last = time.monotonic()
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.01)
            lag = time.monotonic() - t - 0.01
            if lag > 0.005:
                self.lags.append((t, lag * 1e3))
            if t - last >= 0.5:
                last = t
                self.cpu.append((t, time.thread_time(), time.process_time()))

    def cpu_ms_per_s(self, start_s: float, end_s: float) -> dict[str, float]:
        """Between two monotonic times: CPU ms per second of the loop's thread, of the whole process,
        and of the engine runs in that time (their thread CPU)."""
        pts = [p for p in self.cpu if start_s <= p[0] <= end_s]
        if len(pts) < 2:
            return {}
        span = pts[-1][0] - pts[0][0]
        engine_ms = sum(r.get("cpu_ms", 0.0) for rs in self.runs.values() for r in rs
                        if "end_s" in r and pts[0][0] <= r["end_s"] <= pts[-1][0])
        return {"loop_thread": (pts[-1][1] - pts[0][1]) * 1e3 / span,
                "process": (pts[-1][2] - pts[0][2]) * 1e3 / span,
                "engine_runs": engine_ms / span}

    def breakdown(self, rid: str, sent_s: float, done_s: float, t0: float) -> dict[str, Any]:
        """One request: its engine runs and what else ran between its arrival and its answer."""
        runs = self.runs.get(rid, [])
        out: dict[str, Any] = {}
        if runs and "end_s" in runs[-1]:
            first, last = runs[0], runs[-1]
            out["before_run_ms"] = (first["call_s"] - sent_s) * 1e3
            out["queued_ms"] = sum(r["start_s"] - r["call_s"] for r in runs) * 1e3
            out["engine_run_ms"] = sum(r["run_ms"] for r in runs)
            out["engine_cpu_ms"] = sum(r["cpu_ms"] for r in runs)
            out["engine_sleep_ms"] = sum(r["sleep_ms"] for r in runs)
            out["after_run_ms"] = (done_s - last["end_s"]) * 1e3
            out["engines"] = [r["engine"] for r in runs]
            # Another request's engine run in progress when this one asked for its own: device queueing.
            out["behind_other_run"] = any(
                r.get("start_s", 1e18) <= first["call_s"] < r.get("end_s", 0.0)
                for k, rs in self.runs.items() if k != rid for r in rs)
        overlap = [k for k, a, b in self.activities if a < done_s and b > sent_s]
        out["agent_work_during"] = dict(collections.Counter(overlap))
        out["agent_work_ms"] = sum((min(b, done_s) - max(a, sent_s)) * 1e3
                                   for k, a, b in self.activities if a < done_s and b > sent_s
                                   and k in ("reevaluate", "decide"))
        lags = [ms for t, ms in self.lags if sent_s <= t <= done_s]
        out["loop_lag_max_ms"] = max(lags, default=0.0)
        out["gc_ms"] = sum((min(b, done_s) - max(a, sent_s)) * 1e3 for a, b in self.gc_pauses if a < done_s and b > sent_s)
        return out


def summarise_breakdown(recs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians and maxima of each part of the requests in `recs` (those with a breakdown)."""
    recs = [r for r in recs if "queued_ms" in r.get("breakdown", {})]
    if not recs:
        return {}
    parts = ("before_run_ms", "queued_ms", "engine_run_ms", "engine_cpu_ms", "engine_sleep_ms", "after_run_ms",
             "loop_lag_max_ms", "gc_ms", "agent_work_ms")
    worst = max(recs, key=lambda r: r["latency_ms"])
    def probed(r: dict[str, Any]) -> bool:
        return any(k in r["breakdown"]["agent_work_during"] for k in ("probe", "probe_rtt", "check_reachable"))

    with_probe = [r["latency_ms"] for r in recs if probed(r)]
    without = [r["latency_ms"] for r in recs if not probed(r)]
    return {
        "requests": len(recs),
        "latency_p50_ms_with_probe_or_check": statistics.median(with_probe) if with_probe else None,
        "latency_p50_ms_without": statistics.median(without) if without else None,
        "p50": {k: statistics.median(r["breakdown"][k] for r in recs) for k in parts},
        "max": {k: max(r["breakdown"][k] for r in recs) for k in parts},
        "behind_other_run": sum(r["breakdown"]["behind_other_run"] for r in recs),
        "with_probe_or_check": len(with_probe),
        "worst": {"id": worst["id"], "latency_ms": worst["latency_ms"], **worst["breakdown"]},
    }
