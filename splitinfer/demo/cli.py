"""`splitinfer demo`: the whole system on one machine, on embedded defaults, in one command.

It loads a zoo model, profiles the emulated edge device and the cloud side, writes a
model repository, plans the cut frontier, starts a local Ray, the gateway, the link
emulator and an edge agent, streams requests while the link steps down, drops out and
recovers, and writes demo-report/index.html and report.json. Everything it starts is
stopped, and its temporary directory removed, before it returns: on success, on error, on
Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["main", "make_parser"]

logger = logging.getLogger(__name__)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitinfer demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="squeezenet",
                   help="zoo model name (default squeezenet: a mid-network cut is its best plan on part of the trace)")
    p.add_argument("-o", "--out", default="demo-report", help="report directory (default demo-report)")
    p.add_argument("--quick", action="store_true",
                   help="halve the trace's phases and profile with fewer runs (~1-2 min)")
    p.add_argument("--no-ray", action="store_true", help="serve tails in the gateway's process instead of Ray actors")
    p.add_argument("--fps", type=float, default=5.0, help="frames per second the app sends (default 5)")
    p.add_argument("--window", type=int, default=2,
                   help="most requests in flight; later frames are skipped (default 2)")
    p.add_argument("--trace-scale", type=float, default=None,
                   help="multiply the trace's times (default 1, or 0.5 with --quick)")
    p.add_argument("--slowdown", type=float, default=None,
                   help="the emulated device's work takes this many times its CPU time on one thread here (>= 1; "
                        "default: the factor that makes the device as many times slower than the cloud as an rpi4 "
                        "against a t4)")
    p.add_argument("--log-level", default="WARNING", help="log level of the parts (default WARNING)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="also show Ray's and gRPC's own log lines (hidden by default)")
    return p


def _say(msg: str) -> None:
    print(msg, flush=True)


_INTERRUPTED = threading.Event()
_SIGNAL = {"number": signal.SIGINT}
"""The signal that interrupted the run: the exit code is 128 + its number."""


def _catch_ctrl_c() -> None:
    """Ctrl-C (or SIGTERM) sets `_INTERRUPTED` and cancels the demo's main task.

    asyncio.run's own handler cancels the task and nothing more; a cancellation that lands
    while a library call swallows it (it happened once in CI: the demo ran to the end and
    exited 0) would be lost. The flag is also checked by the stream loop, and `main` turns
    it into exit code 130 however the task ended. The task is cancelled once only, so its
    clean-up (`finally`) is never cut short.
    """
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None

    def on_signal(signum: int) -> None:
        if not _INTERRUPTED.is_set():
            _SIGNAL["number"] = signum
            _INTERRUPTED.set()
            task.cancel()

    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, on_signal, signum)


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM outside the event loop: unwinds like Ctrl-C, so every `finally` runs."""
    _SIGNAL["number"] = signum
    _INTERRUPTED.set()
    raise KeyboardInterrupt


async def _run(a: argparse.Namespace, work: str) -> int:
    from splitinfer.demo import stack as demo_stack
    from splitinfer.demo.setup import prepare
    from partitioner import Cut
    from splitinfer.demo.edge import ENCODINGS
    from splitinfer.demo.stream import make_tolerances, make_trace, measure_encoding_errors, reference_outputs, stream
    from splitinfer.demo.summary import make_cut_labeler, summarize
    from splitinfer.report import write_report

    _catch_ctrl_c()
    t0 = time.monotonic()
    out = os.path.abspath(a.out)
    scale = a.trace_scale if a.trace_scale is not None else (0.5 if a.quick else 1.0)
    trace = make_trace(scale)
    ray_job: concurrent.futures.Future[float] | None = None
    ray_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="demo-ray-start")
    stack = None
    try:
        if not a.no_ray:
            # Ray takes tens of seconds to start on a small machine: it starts while the model
            # loads and the device is profiled, and the cloud side is profiled once it is up.
            _say("[0/6] starting a local Ray in the background (use --no-ray to serve tails in-process)")
            ray_job = ray_pool.submit(demo_stack.start_ray, quiet=not a.verbose)
        job = ray_job
        def wait_ray() -> None:
            if job is not None:
                _say(f"      (local Ray up after {job.result():.0f} s)")

        dm = await asyncio.to_thread(prepare, a.model, work, runs=4 if a.quick else 8,
                                     slowdown=a.slowdown, say=_say, before_cloud=wait_ray)
        label = make_cut_labeler(dm)
        _say(f"[4/6] plan frontier ({dm.front.objective.value}, uplink {dm.front.link_range.up_lo_bps / 1e6:g}-"
             f"{dm.front.link_range.up_hi_bps / 1e6:g} Mbit/s, downlink 4x, RTT {dm.front.link_range.rtt_ms:g} ms); "
             "breakpoints at "
             + (", ".join(f"{b / 1e6:.3g}" for b in dm.front.breakpoints_bps) or "none") + " Mbit/s")
        from splitinfer.demo.setup import describe_frontier

        for r in describe_frontier(dm):
            _say(f"      {r['up_lo_bps'] / 1e6:8.3g}-{r['up_hi_bps'] / 1e6:<8.3g} Mbit/s  {label(r['cut_id']):<20} "
                 f"sends {r['sends']:<28} predicted {r['predicted_ms_mid']:6.0f} ms "
                 f"at {r['mid_up_bps'] / 1e6:.3g} Mbit/s")
        ray_s = None if ray_job is None else await asyncio.wrap_future(ray_job)
        _say("[5/6] starting the gateway, the link emulator and the edge agent on 127.0.0.1")
        stack = demo_stack.Stack(registry_dir=dm.registry_dir, work_dir=work, model=dm.name,
                                 device_profile_path=dm.device_profile_path, trace=trace, use_ray=ray_job is not None,
                                 remote_timeout_ms=max(800.0, dm.edge_model_ms), slowdown=dm.device_slowdown)
        await stack.start(say=_say)
        from partitioner import make_inputs

        inputs = [make_inputs(dm.model, dm.graph, seed=100 + k) for k in range(4)]
        refs = await asyncio.to_thread(reference_outputs, dm.model_path, inputs)
        n = len(dm.graph)
        cuts = [e.plan.cut for e in dm.front.entries if len(e.plan.cut.device) < n] + [Cut(frozenset())]
        encoding_errors = await asyncio.to_thread(measure_encoding_errors, dm.model, dm.graph, cuts, ENCODINGS,
                                                  inputs, refs)
        tolerances = make_tolerances(encoding_errors)
        _say("      tolerance per encoding of what crosses the link: " + ", ".join(
            f"{e} {t:.2g}" + (f" (measured {encoding_errors[e]:.2g} at the frontier's cuts + fp32's)"
                              if e in encoding_errors else "") for e, t in tolerances.items()))
        dur = trace[-1].t_s
        _say(f"[6/6] streaming {a.fps:g} frames/s for {dur:.0f} s while the link replays the demo trace "
             f"(steps at {', '.join(f'{s.t_s:g}' for s in trace[1:-1])} s)")
        res = await stream(socket_path=stack.edge.socket_path, inputs=inputs, refs=refs, duration_s=dur, fps=a.fps,
                           window=a.window,
                           start_trace=stack.start_trace, link_now=stack.link_now, status=stack.status,
                           label_cut=label, n_layers=len(dm.graph), say=_say, stop=_INTERRUPTED.is_set)
        agent_status = await stack.status()
        calls = stack.gateway.backend_calls
    finally:
        # Each step runs even when one before it fails (a Ray that never started raises
        # again here); the last failure propagates, with the earlier ones as its context.
        try:
            if stack is not None:
                await stack.stop()
        finally:
            try:
                if ray_job is not None:
                    try:
                        await asyncio.wrap_future(ray_job)
                    finally:
                        await asyncio.to_thread(demo_stack.stop_ray)
            finally:
                ray_pool.shutdown(wait=False)
                _keep_agent_log(work, out)
                shutil.rmtree(work, ignore_errors=True)

    setup = {"model": dm.name, "layers": len(dm.graph), "gflops": round(dm.graph.total_flops / 1e9, 3),
             "profiles": dm.profile_source, "edge_model_ms": round(dm.edge_model_ms, 1),
             "cloud_model_ms": round(dm.cloud_model_ms, 1), "edge_over_cloud": round(dm.slowdown, 2),
             "edge_emulation": f"1 ORT thread, its work stretched {dm.device_slowdown:.3g}x in time",
             "reference_devices": (f"{dm.emulation['reference']['edge_device']} against "
                                   f"{dm.emulation['reference']['cloud_device']}: {dm.emulation['reference']['ratio']:g}x "
                                   "(the planner's roofline profiles of this model)"),
             "cloud": "Ray actors (local Ray)" if ray_job is not None else "gateway in-process pool (--no-ray)",
             "ray_start_s": None if ray_s is None else round(ray_s, 1), "fps": a.fps, "window": a.window,
             "trace": "splitinfer/traces/demo.csv", "trace_scale": scale, "cpus": os.cpu_count()}
    data = _clean(summarize(dm, trace, res, agent_status=agent_status, gateway_calls=calls, setup=setup,
                            tolerances=tolerances))
    data["verification"]["measured_encoding_errors"] = _clean(encoding_errors)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "report.json"), "w", encoding="utf-8") as fh:
        json.dump(_clean(data), fh, indent=1, default=str, allow_nan=False)
    page = write_report(out, data)
    c, v = data["counts"], data["verification"]
    _say(f"sent {c['sent']}, answered {c['answered']}, lost {c['lost']}, doubled {c['doubled']}; served split "
         f"{c['served_split']}, remote {c['served_remote']}, local {c['served_local']}, fallback {c['served_fallback']}; "
         f"{c['frames_skipped']} frames skipped; {v['checked']} answers checked against the whole model, "
         f"{v['mismatched']} outside their encoding's tolerance ("
         + ", ".join(f"{e}: max relative error {m['max_rel_err']:.1e}, tolerance {m['tolerance']:g}"
                     for e, m in v["per_encoding"].items()) + ")")
    _say(f"report: {page} (done in {time.monotonic() - t0:.0f} s)")
    ok = c["lost"] == 0 and c["doubled"] == 0 and c["answered"] == c["sent"] and v["mismatched"] == 0
    return 0 if ok else 1


def _keep_agent_log(work: str, out: str) -> None:
    """The agent's log outlives the run's temporary directory, next to the report."""
    src = os.path.join(work, "edge-agent.log")
    if os.path.exists(src):
        try:
            os.makedirs(out, exist_ok=True)
            shutil.copyfile(src, os.path.join(out, "edge-agent.log"))
        except OSError as e:
            logger.warning("could not keep the edge agent's log: %s", e)


def _clean(x: Any) -> Any:
    """JSON has no NaN or infinity: they become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _bad_args(a: argparse.Namespace) -> str | None:
    if a.fps <= 0 or a.window < 1:
        return f"--fps must be > 0 and --window >= 1 (got {a.fps}, {a.window})"
    if a.trace_scale is not None and not (math.isfinite(a.trace_scale) and a.trace_scale > 0):
        return f"--trace-scale must be a number > 0 (got {a.trace_scale}); 0.5 replays the trace twice as fast"
    if a.slowdown is not None and not (math.isfinite(a.slowdown) and a.slowdown >= 1):
        return f"--slowdown must be a number >= 1 (got {a.slowdown}); 1 runs the device at one thread's speed here"
    return None


def _quiet_parts() -> None:
    """Keeps the console to the demo's own lines: Ray's Python notices and gRPC's fork
    notice (the edge agent starts while gRPC threads run) are not the user's concern;
    --verbose shows them. The C++ log lines of Ray's workers and raylet (E ... core_worker.cc)
    reach the console only when forwarded to the driver, which `start_ray(quiet=True)` turns
    off; they stay in Ray's log files. RAY_BACKEND_LOG_LEVEL is left alone: setting it
    makes the driver print a line of its own saying so."""
    logging.getLogger("ray").setLevel(logging.ERROR)
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


def main(argv: Sequence[str] | None = None) -> int:
    from splitinfer.cli import check_extras

    a = make_parser().parse_args(argv)
    bad = _bad_args(a)
    if bad is not None:
        print(f"splitinfer demo: {bad}", file=sys.stderr)
        return 2
    # The gateway needs the cloud extra and the report the plots extra: say so before minutes of work.
    missing = check_extras(["prometheus_client", "matplotlib"] + ([] if a.no_ray else ["ray"]))
    if missing is not None:
        print(f"splitinfer demo: {missing}", file=sys.stderr)
        return 2
    logging.basicConfig(level=a.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if not a.verbose:
        _quiet_parts()
    _INTERRUPTED.clear()
    _SIGNAL["number"] = signal.SIGINT
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if on_main_thread else None
    work = tempfile.mkdtemp(prefix="splitinfer-demo-")
    try:
        try:
            rc = asyncio.run(_run(a, work))
            if not _INTERRUPTED.is_set():
                return rc
        except (KeyboardInterrupt, asyncio.CancelledError):
            pass
        print("interrupted: everything the demo started has been stopped", file=sys.stderr, flush=True)
        return 128 + int(_SIGNAL["number"])
    finally:
        if on_main_thread:  # asyncio.run's loop put SIGTERM back to its default on closing
            signal.signal(signal.SIGTERM, _interrupt)
        # Again after asyncio.run: a Ctrl-C during profiling returns only once the profiling
        # thread has finished, and that thread may have written into the work directory
        # after `_run` removed it.
        shutil.rmtree(work, ignore_errors=True)
        if on_main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
