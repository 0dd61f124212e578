"""Adaptation benchmark: the edge agent on the demo trace, against the trace itself.

    python -m bench.adaptation [--only main|fast] [--quick]

One process on 127.0.0.1: the real gateway (cluster.gateway, in-process ONNX Runtime
pools: the unthrottled "cloud"), the link emulator replaying splitinfer/traces/demo.csv
(18.88 Mbit/s -> 1.1 -> outage 10 s -> 5.85), and the edge agent, fed by an open-loop
app. Two runs, written together to bench/results/adaptation.json, each with a PNG
timeline (adaptation.png, adaptation_fast.png):

* main: ResNet50 on the emulated slow device at 80 % of the frame rate it sustains
  locally (measured at start: about 1.8 fps on a quiet machine; `--fps`, `--slowdown`);
* fast: a 10 fps run (`--fast-model`, `--fast-slowdown`) where local execution takes
  less than the 100 ms between frames, so 10 fps is sustainable through the outage.

The device is emulated as the demo does (see [Note: device emulation]); its profile is the
FLOPs estimate calibrated to it. The cloud profile (profiles/cloud.json) is calibrated to
the gateway's own measured time.

[Note: why not ResNet50 at 10 fps]
Offloading ResNet50 only beats running it on the device when the device is slow: its
input alone is 150 kB in int8 (602 kB in fp32), 64 ms at 18.88 Mbit/s before any RTT or
cloud time, so a device that runs it in under ~100 ms never offloads and there is
nothing to adapt. The emulated device (one thread, 4x) takes ~450 ms per local run,
so while the link is slow or out (22 s of the trace) it can answer about 2 requests/s:
at 10 fps the app would queue 8 more every second, and the latencies would measure that
queue, not the agent. So the main run streams at 80 % of the rate this device sustains
locally, and the fast run shows 10 fps with a model and device where it is sustainable.

[Note: device emulation]
The device is `edge_agent.device.SlowDevice` ([Note: time-scaled device] there): its
engines run on one thread, and each piece of its work (an engine run, an encode of the
boundary) takes `slowdown` times the CPU time it took here (`time.thread_time`: ONNX
Runtime with one intra-op thread runs on the calling thread), one piece at a time, as on
a device with one core: a hedge's local run and a local request wait for each other. CPU
time, not wall time, is stretched: a run the shared host descheduled (other jobs, or the
in-process gateway and emulator, which stand for the cloud and the network, not the
device) counts that delay once, as its own wall time, not `slowdown` times.

[Note: local baseline]
"Local latency" is measured in the same run: after the trace, the same app stream (same
fps, same agent and emulated device) runs for as long as the outage did with the agent's
offloading off (`Runner.offload_enabled`: no probes, no checks, every request on the
whole local model). The outage answers are compared with it (`outage_readings`); the
target "local latency + 100 ms at the worst" reads as outage max - baseline max. Each
request also records where its time went (`breakdown`: waiting for an engine thread,
the engine's CPU time, wall time and the rest of it (the device's stretch and its queue), the time from the run's end to
the answer, the agent's link work and policy evaluations overlapping it, event-loop lag
and collector pauses), summarised per phase in `where_outage_time_goes` and
`where_baseline_time_goes`.

Measured per step: the time from the step until the plan the agent settles on for the
new link is in use by requests (`adaptation_s`: the first request from which every
request uses it) and until the agent switched to it (`decision_s`: its switch log,
from a request or a re-evaluation without one; in a held drop requests may use it before
the switch); the requests served meanwhile on
another plan (`stale_requests`); the latency during the outage (p50 and max) against
the local baseline's and the local engine's (`outage_readings`, see [Note: local
baseline]); lost and doubled answers (must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
import onnx

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _setup_registry(root: str, model_name: str, slowdown: float) -> tuple[str, str, float, float]:
    from edge_agent.engines import estimate_profile, time_engine_ms
    from partitioner import Splitter, load_zoo
    from workers.engine import Engine, EngineConfig

    vdir = os.path.join(root, "registry", model_name, "1")
    os.makedirs(os.path.join(vdir, "profiles"))
    path = os.path.join(vdir, "model.onnx")
    onnx.save_model(load_zoo(model_name, random_weights=True), path)
    graph = Splitter(path).graph
    cache = os.path.join(root, "ort")
    cloud = Engine(path, EngineConfig(batch_buckets=(1,), dynamic_batch=False, cache_dir=cache))
    cloud_ms = time_engine_ms(cloud, 5)
    cloud.close()
    one = Engine(path, EngineConfig(intra_op_threads=1, batch_buckets=(1,), dynamic_batch=False, cache_dir=cache))
    one_ms = time_engine_ms(one, 5)
    one.close()
    with open(os.path.join(vdir, "profiles", "cloud.json"), "w") as fh:
        fh.write(estimate_profile(graph, cloud_ms).to_json())
    dev_path = os.path.join(root, "device.json")
    with open(dev_path, "w") as fh:
        fh.write(estimate_profile(graph, one_ms * slowdown).to_json())
    return path, dev_path, cloud_ms, one_ms


def _outage_readings(outage: dict[str, Any] | None, base_lat: list[float], engine_ms: float) -> dict[str, Any]:
    """The outage latency against "local latency", three ways; the target is the first."""
    if outage is None or not base_lat:
        return {}
    base_p50, base_max = statistics.median(base_lat), max(base_lat)
    return {
        "max_minus_local_max_ms": outage["latency_max_ms"] - base_max,
        "p50_minus_local_p50_ms": outage["latency_p50_ms"] - base_p50,
        "max_minus_engine_ms": outage["latency_max_ms"] - engine_ms,
        "target_reading": "max_minus_local_max_ms",
        "target_ms": 100.0,
        "met": outage["latency_max_ms"] - base_max <= 100.0,
        "what": {
            "max_minus_local_max_ms": "the slowest outage answer minus the slowest answer of the local baseline "
                                      "(same stream served with offloading off, same run): the target reading, "
                                      "'local latency + 100 ms at the worst'",
            "p50_minus_local_p50_ms": "outage median minus the local baseline's median: the typical cost of "
                                      "running through an outage",
            "max_minus_engine_ms": "the slowest outage answer minus one local engine run timed at start (the "
                                   "reading used before the baseline existed; it counts queueing at this fps and "
                                   "host contention as outage cost)",
        },
    }


def _plan_of(rec: dict[str, Any]) -> str:
    return "local" if rec["served_by"] == "local" else rec["cut_id"]


def _analyse(records: list[dict[str, Any]], steps: list[tuple[float, str]], end_s: float,
             switches: list[tuple[float, str]]) -> list[dict[str, Any]]:
    out = []
    bounds = [s for s, _ in steps] + [end_s]
    for i, (t0, label) in enumerate(steps):
        t1 = bounds[i + 1]
        seg = sorted((r for r in records if t0 <= r["sent_s"] < t1), key=lambda r: r["sent_s"])
        if not seg:
            continue
        tail = seg[len(seg) // 2:]
        settled = collections.Counter(_plan_of(r) for r in tail).most_common(1)[0][0]
        first = None
        for j in range(len(seg)):
            if all(_plan_of(r) == settled for r in seg[j:]):
                first = j
                break
        if first is None:  # never fully settled: first request on the settled plan
            first = next(j for j, r in enumerate(seg) if _plan_of(r) == settled)
        # The agent's own switch to the settled plan: the last one into it at or before the first
        # settled request (a re-evaluation may switch before any request uses it), else the first
        # after it (in a held drop requests run locally before the plan is left: [Note: risk] in
        # edge_agent/policy.py).
        into_step = [t for t, key in switches if _key_plan(key) == settled and t0 <= t < t1]
        before = [t for t in into_step if t <= seg[first]["sent_s"] + 1e-3]
        decided = before[-1] if before else into_step[0] if into_step else None
        lat = [r["latency_ms"] for r in seg]
        # Already on the plan the new link wants (e.g. local from the slow link into the outage),
        # with every request after the step on it: nothing to adapt.
        kept = bool(i) and not into_step and first == 0
        out.append({
            "step_s": t0, "link": label, "settled_plan": settled, "requests": len(seg),
            "adaptation_s": seg[first]["sent_s"] - t0 if i and not kept else 0.0,
            "decision_s": (decided - t0 if decided is not None else 0.0) if i else 0.0,
            "already_on_plan": kept,
            "stale_requests": first if i else 0,
            "served_by": dict(collections.Counter(r["served_by"] for r in seg)),
            "latency_p50_ms": statistics.median(lat), "latency_p90_ms": float(np.percentile(lat, 90)),
            "latency_max_ms": max(lat),
        })
    return out


def _key_plan(plan_key: str) -> str:
    """A policy plan_key ('local' or 'cut:encoding') as _plan_of names it."""
    return "local" if plan_key == "local" else plan_key.split(":", 1)[0]


async def _run(args: argparse.Namespace, root: str, model: str, fps: float, slowdown: float) -> dict[str, Any]:
    from cluster.gateway import Gateway, LocalPoolFactory
    from cluster.registry import Registry
    from cluster.server import serve
    from edge_agent.config import config_from_dict
    from edge_agent.daemon import EdgeAgent
    from edge_agent.engines import time_engine_ms
    from bench._adaptation_trace import RID, Tracer, summarise_breakdown
    from splitinfer.netem import LinkEmulator, load_trace, shipped_trace_path

    model_path, dev_path, cloud_ms, one_ms = await asyncio.to_thread(_setup_registry, root, model, slowdown)
    trace = load_trace(shipped_trace_path("demo"))
    if args.quick:  # 4 s per phase instead of 10-12 s
        trace = [type(s)(t_s=s.t_s / 3.0, setting=s.setting) for s in trace]
    end_s = trace[-1].t_s
    dark = next((k for k, st in enumerate(trace[:-1]) if not st.setting.up), None)
    baseline_s = trace[dark + 1].t_s - trace[dark].t_s if dark is not None else end_s / 4
    registry = Registry(os.path.join(root, "registry"), cache_dir=os.path.join(root, "gw-cache"))
    gateway = Gateway(registry, LocalPoolFactory(cache_dir=os.path.join(root, "ort")))
    await gateway.start()
    server = await serve(gateway)
    # Start-up downloads the model (~100 MB for ResNet50): a fast link until the trace begins.
    emu = LinkEmulator(upstream=("127.0.0.1", server.port), setting=type(trace[0].setting).from_mbps(2000, 2000, 1))
    await emu.start()
    agent = EdgeAgent(config_from_dict({
        "gateway": f"127.0.0.1:{emu.port}", "model": f"{model}@1", "apiPort": 0, "deviceProfile": dev_path,
        "cacheDir": os.path.join(root, "edge-cache"), "intraOpThreads": 1, "remoteTimeoutMs": args.remote_timeout_ms,
        "breakerOpenS": 1.0, "startupTimeoutS": 120, "encodings": args.encodings.split(",")}))
    await agent.start()
    runner = agent.runner
    assert runner is not None and agent.models is not None
    # One core, each piece of work `slowdown` x its CPU time ([Note: time-scaled device] in edge_agent.device).
    agent.models.device.set_factor(slowdown)
    names = {id(agent.models.full): "full"}
    for c in agent.models.cuts.values():
        names.setdefault(id(c.head), f"head:{c.cut_id}")
        names.setdefault(id(c.tail), f"tail:{c.cut_id}")  # the empty cut's tail is the whole model's engine
    tracer = Tracer(runner, names)
    # The median of 6 runs, not 3: right after start-up one or two runs are slow (caches cold
    # after the other engines loaded), and with 3 they set the frame rate 25 % low in a test run.
    agent.models.local_ms = time_engine_ms(agent.models.full, 6)
    if fps <= 0:  # the most the device sustains locally, with a 20 % margin; see [Note: why not ResNet50 at 10 fps]
        fps = math.floor(0.8 * 1e3 / agent.models.local_ms * 10) / 10
    x = np.random.default_rng(0).standard_normal(tuple(agent.models.full.inputs[0].shape)).astype(np.float32)
    name = agent.models.input_names[0]
    records: list[dict[str, Any]] = []
    answers: collections.Counter[str] = collections.Counter()
    errors: list[str] = []
    est_trace: list[tuple[float, float | None, str]] = []
    inflight = [0, 0]  # now, most

    async def one(rid: str, t0: float, out: list[dict[str, Any]]) -> None:
        RID.set(rid)
        sent_abs = time.monotonic()
        sent = sent_abs - t0
        inflight[0] += 1
        inflight[1] = max(inflight)
        try:
            a = await agent.infer({name: x}, rid)
        except Exception as e:  # noqa: BLE001 - counted: an error is still an answer, not a lost request
            errors.append(f"{type(e).__name__}: {e}")
            answers[rid] += 1
            return
        finally:
            inflight[0] -= 1
        answers[a["id"]] += 1
        out.append({"id": a["id"], "sent_s": sent, "latency_ms": a["latency_ms"], "served_by": a["served_by"],
                    "cut_id": a["cut_id"], "breakdown": tracer.breakdown(a["id"], sent_abs, time.monotonic(), t0)})

    async def stream(prefix: str, duration_s: float, out: list[dict[str, Any]]) -> tuple[float, int]:
        """The app: one request every 1/fps s for `duration_s`, open loop. Returns (start, requests)."""
        t0 = time.monotonic()
        tasks, n = [], 0
        while time.monotonic() - t0 < duration_s:
            tasks.append(asyncio.ensure_future(one(f"{prefix}{n}", t0, out)))
            n += 1
            await asyncio.sleep(max(0.0, n / fps - (time.monotonic() - t0)))
        await asyncio.gather(*tasks)
        return t0, n

    async def sample(t0: float) -> None:
        while True:
            est = runner.monitor.estimate()
            a = runner.last_action
            est_trace.append((time.monotonic() - t0, est.up_bps, "" if a is None else a.plan_key))
            await asyncio.sleep(0.05)

    emu.replay(trace)
    t0 = time.monotonic()
    sampler = asyncio.ensure_future(sample(t0))
    lag_sampler = asyncio.ensure_future(tracer.sample_lag())
    _, i = await stream("req", end_s, records)
    await asyncio.sleep(args.remote_timeout_ms / 1e3 * 2 + 1.0)  # let late remote answers arrive and be dropped
    sampler.cancel()
    # The trace's counters and switches, before the baseline's own switch to local.
    counters = runner.counters.to_dict()
    switches = [(t - t0, key) for t, key, _ in runner.switch_events if t >= t0]
    switch_log = [{"t_s": t - t0, "plan": key, "reason": why} for t, key, why in runner.switch_events if t >= t0]
    # [Note: local baseline] The same stream, same fps, same agent and emulated device, with
    # offloading off (no probes, no checks): what "local latency" is in this run.
    runner.offload_enabled = False
    await asyncio.sleep(1.0)  # a check already on the wire ends before the baseline starts
    baseline: list[dict[str, Any]] = []
    base_t0, n_base = await stream("base", baseline_s, baseline)
    base_end = time.monotonic()
    runner.offload_enabled = True
    lag_sampler.cancel()
    tracer.close()
    local_engine_ms = runner.models.local_ms
    await agent.stop()
    await emu.stop()
    await server.stop(None)
    await gateway.close()

    steps = [(s.t_s, s.setting.describe()) for s in trace[:-1]]
    per_step = _analyse(records, steps, end_s, switches)
    outage = next((s for s in per_step if s["link"] == "outage"), None)
    local_lat = [r["latency_ms"] for r in records if r["served_by"] == "local"]
    out_end_s = next((b for a, b in zip(steps, steps[1:] + [(end_s, "")]) if a[1] == "outage"), (end_s, ""))[0]
    out_start_s = outage["step_s"] if outage else 0.0
    in_outage = [r for r in records if outage and out_start_s <= r["sent_s"] < out_end_s]
    base_lat = [r["latency_ms"] for r in baseline]
    readings = _outage_readings(outage, base_lat, local_engine_ms)
    return {
        "model": model, "encodings": args.encodings, "fps": fps,
        "fps_sustainable": local_engine_ms < 1e3 / fps,
        "trace": "demo.csv" + (" (1/3 time)" if args.quick else ""),
        "emulated_device": {"slowdown": slowdown, "single_thread_model_ms": one_ms,
                            "profile_model_ms": one_ms * slowdown,
                            "note": "edge_agent.device.SlowDevice: one core, each engine run and encode takes "
                                    "slowdown x its CPU time, one at a time; see [Note: device emulation]"},
        "cloud_model_ms": cloud_ms,
        "requests": i, "answered": sum(n for k, n in answers.items() if k.startswith("req")),
        "errors": len(errors), "error_samples": errors[:5],
        "lost": i + n_base - len(answers), "doubled": sum(n - 1 for n in answers.values() if n > 1),
        "max_inflight": inflight[1],
        "late_dropped": counters["late_dropped"], "local_dropped": counters["local_dropped"],
        "switches": counters["switches"], "trials": counters["trials"], "probes": counters["probes"],
        "held_local": counters["held_local"],
        "reachability_failures": counters["reachability_failures"], "remote_errors": counters["remote_errors"],
        "per_step": per_step,
        "max_adaptation_s": max(s["adaptation_s"] for s in per_step),
        "max_decision_s": max(s["decision_s"] for s in per_step),
        "stale_requests": sum(s["stale_requests"] for s in per_step),
        "outage_p50_ms": outage["latency_p50_ms"] if outage else None,
        "outage_max_ms": outage["latency_max_ms"] if outage else None,
        "local_p50_ms": statistics.median(local_lat) if local_lat else None,
        "local_engine_ms": local_engine_ms,
        "outage_max_minus_local_ms": (outage["latency_max_ms"] - local_engine_ms) if outage else None,
        "outage_vs_local_ratio": (outage["latency_p50_ms"] / local_engine_ms) if outage else None,
        "local_baseline": {"requests": n_base, "seconds": baseline_s, "fps": fps,
                           "served_by": dict(collections.Counter(r["served_by"] for r in baseline)),
                           "p50_ms": statistics.median(base_lat) if base_lat else None,
                           "p90_ms": float(np.percentile(base_lat, 90)) if base_lat else None,
                           "max_ms": max(base_lat, default=None),
                           "what": "the same stream (same fps, same agent, same emulated device) right after the "
                                   "trace, with offloading off: no probes or checks, every request on the whole "
                                   "local model; see [Note: local baseline]"},
        "outage_readings": readings,
        "where_outage_time_goes": summarise_breakdown(in_outage),
        "where_baseline_time_goes": summarise_breakdown(baseline),
        "cpu_ms_per_s": {"outage": tracer.cpu_ms_per_s(t0 + out_start_s, t0 + out_end_s),
                         "baseline": tracer.cpu_ms_per_s(base_t0, base_end),
                         "what": "CPU ms per second of the event loop's thread (the agent, and the in-process "
                                 "emulator and gateway), of the whole process, and of the device's engine runs"},
        "switch_log": switch_log,
        "timeline": records, "estimates": est_trace,
        "trace_steps": [{"t_s": s.t_s, **s.setting.to_json()} for s in trace],
    }


def _plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(11, 8.5), sharex=True,
                                        gridspec_kw={"height_ratios": [3, 3, 1.4]})
    colors = {"remote": "tab:blue", "local": "tab:green", "local_tail": "tab:red"}
    for by, c in colors.items():
        pts = [(r["sent_s"], r["latency_ms"]) for r in result["timeline"] if r["served_by"] == by]
        if pts:
            ax1.scatter(*zip(*pts), s=8, c=c, label=by)
    ax1.axhline(result["local_engine_ms"], color="tab:green", lw=0.6, ls="--", label="local engine")
    if result["local_baseline"]["max_ms"]:
        ax1.axhline(result["local_baseline"]["max_ms"], color="tab:olive", lw=0.6, ls=":",
                    label="local baseline max (offload off)")
    ax1.set_ylabel("latency per request (ms)")
    ax1.set_yscale("log")
    ax1.legend(loc="upper left", fontsize=8)
    steps = result["trace_steps"]
    xs, ys = [], []
    for a, b in zip(steps, steps[1:] + [steps[-1]]):
        xs += [a["t_s"], b["t_s"]]
        ys += [a["up_bps"] / 1e6 if a["up"] else 0.0] * 2
    ax2.plot(xs, ys, "k-", label="link (trace)")
    est = [(t, u / 1e6) for t, u, _ in result["estimates"] if u]
    if est:
        ax2.plot(*zip(*est), "tab:orange", label="agent's estimate")
    ax2.set_ylabel("uplink (Mbit/s)")
    ax2.set_yscale("log")
    ax2.legend(loc="upper right", fontsize=8)
    plans = sorted({k for _, _, k in result["estimates"] if k}, key=lambda k: (k != "local", k))
    if plans:
        pts = [(t, plans.index(k)) for t, _, k in result["estimates"] if k]
        ax3.step(*zip(*pts), where="post", color="tab:purple")
        ax3.set_yticks(range(len(plans)), plans, fontsize=8)
    ax3.set_ylabel("plan")
    ax3.set_xlabel("time (s)")
    for s in steps[1:-1]:
        for ax in (ax1, ax2, ax3):
            ax.axvline(s["t_s"], color="grey", lw=0.5)
    fig.suptitle(f"edge agent on demo.csv: {result['model']} at {result['fps']:g} fps "
                 f"(device {result['emulated_device']['slowdown']:g}x slowed); lost {result['lost']}, "
                 f"doubled {result['doubled']}, stale {result['stale_requests']}, "
                 f"slowest switch {result['max_adaptation_s']:.2f} s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _print(name: str, result: dict[str, Any]) -> None:
    keys = ("model", "fps", "requests", "answered", "lost", "doubled", "max_inflight", "late_dropped", "switches",
            "trials", "stale_requests", "max_adaptation_s", "max_decision_s", "outage_p50_ms", "outage_max_ms",
            "local_engine_ms", "outage_max_minus_local_ms")
    print(name, json.dumps({k: result[k] for k in keys}, indent=1))
    print("local baseline:", json.dumps({k: v for k, v in result["local_baseline"].items() if k != "what"}))
    print("cpu ms per s:", json.dumps({k: v for k, v in result["cpu_ms_per_s"].items() if k != "what"}))
    print("outage readings:", json.dumps({k: v for k, v in result["outage_readings"].items() if k != "what"}))
    for what in ("outage", "baseline"):
        summary = result[f"where_{what}_time_goes"]
        print(f"where the {what} time goes (p50 / max ms):", json.dumps(
            {k: [round(summary["p50"][k], 1), round(summary["max"][k], 1)] for k in summary.get("p50", {})}),
            "behind another run:", summary.get("behind_other_run"), "with a probe or check:",
            summary.get("with_probe_or_check"), "of", summary.get("requests"))
    for s in result["per_step"]:
        print(f"{s['step_s']:5.1f} s {s['link']:<40} settled {s['settled_plan']:<8} in use after "
              f"{s['adaptation_s']:.2f} s (switch {s['decision_s']:.2f} s), {s['stale_requests']} stale; "
              f"{s['served_by']}; p50 {s['latency_p50_ms']:.0f} ms, max {s['latency_max_ms']:.0f} ms")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("main", "fast"), help="run one of the two configurations")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--fps", type=float, default=0.0,
                   help="0: 80%% of what the device sustains locally; see [Note: why not ResNet50 at 10 fps]")
    p.add_argument("--slowdown", type=float, default=4.0)
    p.add_argument("--fast-model", default="squeezenet")
    p.add_argument("--fast-fps", type=float, default=10.0)
    p.add_argument("--fast-slowdown", type=float, default=2.0)
    p.add_argument("--remote-timeout-ms", type=float, default=1500.0)
    p.add_argument("--encodings", default="fp32,fp16,int8", help="boundary encodings the agent may plan with")
    p.add_argument("--quick", action="store_true", help="replay the trace 3x faster")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("edge_agent").setLevel(logging.INFO)
    configs = {"main": (args.model, args.fps, args.slowdown),
               "fast": (args.fast_model, args.fast_fps, args.fast_slowdown)}
    runs: dict[str, Any] = {}
    for name, (model, fps, slowdown) in configs.items():
        if args.only and name != args.only:
            continue
        with tempfile.TemporaryDirectory(prefix="splitinfer-adapt-") as root:
            runs[name] = asyncio.run(_run(args, root, model, fps, slowdown))
    os.makedirs(args.out, exist_ok=True)
    result = {"benchmark": "adaptation", "targets": {"adaptation_s": 1.0, "outage_max_minus_local_max_ms": 100.0,
                                                     "lost": 0, "doubled": 0},
              "why_not_resnet50_at_10fps": __doc__.split("[Note: why not ResNet50 at 10 fps]")[1].split("\n\n")[0]
              .strip().replace("\n", " "),
              "runs": runs}
    with open(os.path.join(args.out, "adaptation.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    for name, r in runs.items():
        _plot(r, os.path.join(args.out, "adaptation.png" if name == "main" else f"adaptation_{name}.png"))
        _print(name, r)
    return 0 if all(r["lost"] == 0 and r["doubled"] == 0 for r in runs.values()) else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
