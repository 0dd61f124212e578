"""Adaptation benchmark: the edge agent on the demo trace, against the trace itself.

    python -m bench.adaptation [--fps 10] [--model resnet50] [--slowdown 4] [--quick]

One process on 127.0.0.1: the real gateway (cluster.gateway, in-process ONNX Runtime
pools: the unthrottled "cloud"), the link emulator replaying splitinfer/traces/demo.csv
(18.88 Mbit/s -> 1.1 -> outage 10 s -> 5.85), and the edge agent, fed by an open-loop
app at `--fps`. Writes bench/results/adaptation.json and .png.

The device is emulated as DESIGN.md ("Measuring") allows: its engines run on one
thread and every local engine run is followed by a sleep of (slowdown - 1) times its
own duration, so the device is `--slowdown` times slower than one core of this machine;
its profile is the FLOPs estimate calibrated to that. The cloud profile
(profiles/cloud.json) is calibrated to the gateway's own measured time. The default
rate is 0.5 fps, not 10: on this 2-core machine, shared by the gateway, the emulated
device cannot run ResNet50 locally at 10 fps (that would measure an overloaded queue,
not the agent); pass --fps 10 to see it. Measured per step: time from the step until the plan the agent settles
on for the new link is in use, requests served on the stale plan meanwhile, latency
during the outage against local latency, and lost / doubled answers (must be 0).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
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


def _slow_down(engine: Any, factor: float) -> None:
    """Emulates a slower device: each run is followed by (factor - 1) times its duration of sleep."""
    run = engine.run

    def slowed(inputs: Any, *, copy: bool = False) -> Any:
        t = time.perf_counter()
        out = run(inputs, copy=copy)
        time.sleep((factor - 1.0) * (time.perf_counter() - t))
        return out

    engine.run = slowed


def _plan_of(rec: dict[str, Any]) -> str:
    return "local" if rec["served_by"] == "local" else rec["cut_id"]


def _analyse(records: list[dict[str, Any]], steps: list[tuple[float, str]], end_s: float) -> list[dict[str, Any]]:
    out = []
    bounds = [s for s, _ in steps] + [end_s]
    for i, (t0, label) in enumerate(steps):
        t1 = bounds[i + 1]
        seg = [r for r in records if t0 <= r["sent_s"] < t1]
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
        lat = [r["latency_ms"] for r in seg]
        out.append({
            "step_s": t0, "link": label, "settled_plan": settled, "requests": len(seg),
            "adaptation_s": seg[first]["sent_s"] - t0 if i else 0.0,
            "stale_requests": first if i else 0,
            "served_by": dict(collections.Counter(r["served_by"] for r in seg)),
            "latency_p50_ms": statistics.median(lat), "latency_p90_ms": float(np.percentile(lat, 90)),
        })
    return out


async def _run(args: argparse.Namespace, root: str) -> dict[str, Any]:
    from cluster.gateway import Gateway, LocalPoolFactory
    from cluster.registry import Registry
    from cluster.server import serve
    from edge_agent.config import config_from_dict
    from edge_agent.daemon import EdgeAgent
    from edge_agent.engines import time_engine_ms
    from splitinfer.netem import LinkEmulator, load_trace, shipped_trace_path

    model_path, dev_path, cloud_ms, one_ms = await asyncio.to_thread(_setup_registry, root, args.model, args.slowdown)
    trace = load_trace(shipped_trace_path("demo"))
    if args.quick:  # 4 s per phase instead of 10-12 s
        trace = [type(s)(t_s=s.t_s / 3.0, setting=s.setting) for s in trace]
    end_s = trace[-1].t_s
    registry = Registry(os.path.join(root, "registry"), cache_dir=os.path.join(root, "gw-cache"))
    gateway = Gateway(registry, LocalPoolFactory(cache_dir=os.path.join(root, "ort")))
    await gateway.start()
    server = await serve(gateway)
    # Start-up downloads the model (~100 MB for ResNet50): a fast link until the trace begins.
    emu = LinkEmulator(upstream=("127.0.0.1", server.port), setting=type(trace[0].setting).from_mbps(2000, 2000, 1))
    await emu.start()
    agent = EdgeAgent(config_from_dict({
        "gateway": f"127.0.0.1:{emu.port}", "model": f"{args.model}@1", "apiPort": 0, "deviceProfile": dev_path,
        "cacheDir": os.path.join(root, "edge-cache"), "intraOpThreads": 1, "remoteTimeoutMs": args.remote_timeout_ms,
        "breakerOpenS": 1.0, "startupTimeoutS": 120, "encodings": args.encodings.split(",")}))
    await agent.start()
    runner = agent.runner
    assert runner is not None and agent.models is not None
    engines = [agent.models.full] + [e for c in agent.models.cuts.values() for e in (c.head, c.tail) if e is not None]
    for e in engines:
        _slow_down(e, args.slowdown)
    agent.models.local_ms = time_engine_ms(agent.models.full, 3)
    x = np.random.default_rng(0).standard_normal(tuple(agent.models.full.inputs[0].shape)).astype(np.float32)
    name = agent.models.input_names[0]
    records: list[dict[str, Any]] = []
    answers: collections.Counter[str] = collections.Counter()
    errors: list[str] = []
    est_trace: list[tuple[float, float | None, str]] = []

    async def one(i: int, t0: float) -> None:
        sent = time.monotonic() - t0
        try:
            a = await agent.infer({name: x}, f"req{i}")
        except Exception as e:  # noqa: BLE001 - counted: an error is still an answer, not a lost request
            errors.append(f"{type(e).__name__}: {e}")
            answers[f"req{i}"] += 1
            return
        answers[a["id"]] += 1
        records.append({"id": a["id"], "sent_s": sent, "latency_ms": a["latency_ms"], "served_by": a["served_by"],
                        "cut_id": a["cut_id"]})

    async def sample(t0: float) -> None:
        while True:
            est = runner.monitor.estimate()
            a = runner.last_action
            est_trace.append((time.monotonic() - t0, est.up_bps, "" if a is None else a.plan_key))
            await asyncio.sleep(0.1)

    emu.replay(trace)
    t0 = time.monotonic()
    sampler = asyncio.ensure_future(sample(t0))
    tasks, i = [], 0
    while time.monotonic() - t0 < end_s:
        tasks.append(asyncio.ensure_future(one(i, t0)))
        i += 1
        await asyncio.sleep(max(0.0, i / args.fps - (time.monotonic() - t0)))
    await asyncio.gather(*tasks)
    await asyncio.sleep(args.remote_timeout_ms / 1e3 * 2 + 1.0)  # let late remote answers arrive and be dropped
    sampler.cancel()
    counters = runner.counters.to_dict()
    local_engine_ms = runner.models.local_ms
    await agent.stop()
    await emu.stop()
    await server.stop(None)
    await gateway.close()

    steps = [(s.t_s, s.setting.describe()) for s in trace[:-1]]
    per_step = _analyse(records, steps, end_s)
    outage = next((s for s in per_step if s["link"] == "outage"), None)
    local_lat = [r["latency_ms"] for r in records if r["served_by"] == "local"]
    return {
        "benchmark": "adaptation", "model": args.model, "encodings": args.encodings, "fps": args.fps, "trace": "demo.csv" + (" (1/3 time)" if args.quick else ""),
        "emulated_device": {"slowdown": args.slowdown, "single_thread_model_ms": one_ms,
                            "profile_model_ms": one_ms * args.slowdown,
                            "note": "local engines run on one thread, each run followed by (slowdown - 1) x its duration "
                                    "of sleep"},
        "cloud_model_ms": cloud_ms,
        "requests": i, "answered": sum(answers.values()), "errors": len(errors), "error_samples": errors[:5],
        "lost": i - len(answers), "doubled": sum(n - 1 for n in answers.values() if n > 1),
        "late_dropped": counters["late_dropped"], "local_dropped": counters["local_dropped"],
        "switches": counters["switches"], "remote_errors": counters["remote_errors"],
        "per_step": per_step,
        "outage_p50_ms": outage["latency_p50_ms"] if outage else None,
        "local_p50_ms": statistics.median(local_lat) if local_lat else None,
        "local_engine_ms": local_engine_ms,
        "outage_vs_local_ratio": (outage["latency_p50_ms"] / local_engine_ms) if outage else None,
        "timeline": records, "estimates": est_trace,
        "trace_steps": [{"t_s": s.t_s, **s.setting.to_json()} for s in trace],
    }


def _plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    colors = {"remote": "tab:blue", "local": "tab:green", "local_tail": "tab:red"}
    for by, c in colors.items():
        pts = [(r["sent_s"], r["latency_ms"]) for r in result["timeline"] if r["served_by"] == by]
        if pts:
            ax1.scatter(*zip(*pts), s=8, c=c, label=by)
    ax1.set_ylabel("latency (ms)")
    ax1.set_yscale("log")
    ax1.legend(loc="upper left")
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
    ax2.set_xlabel("time (s)")
    ax2.legend(loc="upper right")
    for s in steps[1:-1]:
        for ax in (ax1, ax2):
            ax.axvline(s["t_s"], color="grey", lw=0.5)
    fig.suptitle(f"edge agent on demo.csv: {result['model']} at {result['fps']} fps; "
                 f"lost {result['lost']}, doubled {result['doubled']}, late dropped {result['late_dropped']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--fps", type=float, default=0.5)
    p.add_argument("--slowdown", type=float, default=4.0)
    p.add_argument("--remote-timeout-ms", type=float, default=1500.0)
    p.add_argument("--encodings", default="fp32,fp16,int8", help="boundary encodings the agent may plan with")
    p.add_argument("--quick", action="store_true", help="replay the trace 3x faster")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("edge_agent").setLevel(logging.INFO)
    with tempfile.TemporaryDirectory(prefix="splitinfer-adapt-") as root:
        result = asyncio.run(_run(args, root))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "adaptation.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    _plot(result, os.path.join(args.out, "adaptation.png"))
    summary = {k: result[k] for k in ("requests", "answered", "lost", "doubled", "late_dropped", "switches",
                                      "outage_p50_ms", "local_engine_ms", "outage_vs_local_ratio")}
    print(json.dumps(summary, indent=1))
    for s in result["per_step"]:
        print(f"{s['step_s']:5.1f} s {s['link']:<40} settled {s['settled_plan']:<14} after {s['adaptation_s']:.2f} s, "
              f"{s['stale_requests']} stale; {s['served_by']}; p50 {s['latency_p50_ms']:.0f} ms")
    return 0 if result["lost"] == 0 and result["doubled"] == 0 else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
