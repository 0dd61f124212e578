"""Fleet load test: N virtual devices running the agent's policy against a real gateway, and the
simulator at the same N.

    python -m bench.fleet_load [--devices 200] [--seconds 30] [--burst-seconds 10] [--pools local|ray] [--out PATH]

The gateway serves ResNet50 (seeded random weights) whole-model on its in-process pool over
gRPC on 127.0.0.1, in this process, as bench/overload.py does; with `--pools ray`, on one Ray
worker of a local Ray (2 CPUs) instead, the gateway reading the pool's load from its own
requests and answers ([Note: a Ray pool's predicted wait] in cluster/_pools.py). The devices run in a second
process (its own GIL), all on one event loop. Each draws its uplink (lognormal, median
40 Mbit/s, sigma 0.5) and RTT (30 ms) once, sends Poisson frames, and for each request runs
the agent's own code: `edge_agent.policy.policy` with its `CloudLoad` (the gateway's
load keys of every answer, RESOURCE_EXHAUSTED with its retry-after) and an
`edge_agent.flow.RequestFlow`, and the real `InferenceClient`. What a device would compute
or send is emulated by sleeping the plan's times at its link (an rpi4 reference profile):
the head and encode, then the upload and half the RTT, the real call with the input tensor,
half the RTT and the download; the local model and the local tail likewise. The remote
budget is the simulator's ([Note: fleet simulator] in splitinfer/fleetsim.py), the hedge is
the runner's (`edge_agent.policy.hedge_delay_s` on the device's record of answers), both
timed from the send as the runner does (the upload is part of the remote call), and the
gRPC deadline is what is left of the SLO. Phases: ``--seconds`` steady at 60% of the measured
capacity (the first 5 s, and the last SLO before the burst, not counted), then ``--burst-seconds`` at
3x that rate (a device's gap that crosses into the burst is drawn again at its rate).

The simulator then runs the same fleet (same N, rates, links, SLO) with a cloud calibrated
to the gateway: the batch run times as the gateway's batcher timed them near the end of the
steady phase (the machine's other work moves them between phases), and the per-request
time beyond the run (the round trip at concurrency 1 less the gateway's reported queue and
compute: decoding, encoding, gRPC on loopback). ``sim_vs_measured_p95_rel_error`` compares the steady phase's p95;
``sim_vs_measured_rel_error`` the p50 and p95 of all answers and of the cloud's answers alone.

[Note: what the comparison sees]
A device answers locally in its own fixed time (the local model, or a tail after a refusal or
the budget), the same in the simulator as in the test. When more than 5 % of the answers are
local, the p95 of all answers is one of them on both sides, and agrees whatever the cloud's
model says. The quantiles of the cloud's answers alone are what test the simulator's cloud
(its batching, queue and the per-request time beyond the run); they are reported beside it.
Written to bench/results/fleet_load.json: lost and doubled answers, steady and burst
shares within the SLO (local answers counted), p50/p95, refusals, the plans offloaded to
(`plans`, and `missed_plans` for the answers past the SLO), how late this process ran the
devices' sends (`late_ms`: it shares the host's cores with the gateway), and the comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import math
import multiprocessing
import os
import statistics
import time
from typing import Any

import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
SLO_MS = 600.0
UP_MEDIAN_MBPS, UP_SIGMA, RTT_MS = 40.0, 0.5, 30.0
DEVICE = "rpi4"
LOAD = 0.6


def _fleet_spec(devices: int, fps: float, workers: int, max_batch: int, timeout_ms: float) -> dict[str, Any]:
    return {"models": {"resnet50": {"slo_ms": SLO_MS, "target": 0.9}},
            "cloud": {"device": "gateway-host", "workers": workers, "max_batch": max_batch,
                      "batch_timeout_ms": timeout_ms},
            "classes": [{"name": "devices", "count": devices, "device": DEVICE, "model": "resnet50", "fps": fps,
                         "link": {"up_mbps": {"median": UP_MEDIAN_MBPS, "sigma": UP_SIGMA}, "rtt_ms": RTT_MS}}]}


def next_arrival(t: float, fps: float, burst_s: float, rng: np.random.Generator) -> float:
    """A device's arrival after one at `t`: Poisson at `fps`, then 3x from `burst_s` on. A gap that
    crosses into the burst is drawn again from its start at the burst's rate (the process is
    memoryless). Drawn at the rate of the arrival before it, a device's first gap into the burst
    kept the steady mean (30 s at 0.033 fps), and a 10 s "3x" burst ran at 0.9-1.4x the steady rate."""
    nxt = t + rng.exponential(1.0 / (fps * (3.0 if t >= burst_s else 1.0)))
    return nxt if t >= burst_s or nxt < burst_s else burst_s + rng.exponential(1.0 / (3.0 * fps))


def _run_devices(address: str, cut_id: str, front_json: str, local_ms: float, x: dict[str, np.ndarray],
                 devices: int, fps: float, seconds: float, burst_s: float, seed: int) -> dict[str, Any]:
    from cluster.server import new_event_loop

    loop = new_event_loop()
    try:
        return loop.run_until_complete(_devices(address, cut_id, front_json, local_ms, x, devices, fps, seconds,
                                                burst_s, seed))
    finally:
        loop.close()


async def _devices(address: str, cut_id: str, front_json: str, local_ms: float, x: dict[str, np.ndarray],
                   devices: int, fps: float, seconds: float, burst_s: float, seed: int) -> dict[str, Any]:
    from cluster.errors import ClusterError, ResourceExhausted
    from cluster.protocol.client import InferenceClient, make_request
    from edge_agent.cloud_load import CloudLoad
    from edge_agent.flow import RequestFlow
    from edge_agent.hedge import urgent_priority
    from edge_agent.monitor import LinkEstimate
    from edge_agent.policy import Health, PolicyConfig, PolicyState, hedge_delay_s, policy
    from planner import Frontier
    from planner.costmodel import remote_budget_ms
    from planner.fleet import remote_ms

    front = Frontier.from_json(front_json)
    rng = np.random.default_rng(seed)
    ups = UP_MEDIAN_MBPS * 1e6 * np.exp(UP_SIGMA * rng.standard_normal(devices))
    cfg = PolicyConfig(slo_ms=SLO_MS)
    states = [PolicyState() for _ in range(devices)]
    loads = [CloudLoad() for _ in range(devices)]
    answered: list[collections.deque[float]] = [collections.deque(maxlen=32) for _ in range(devices)]
    records: list[dict[str, Any]] = []
    tasks: set[asyncio.Task[None]] = set()
    t0 = time.monotonic()
    end_steady, end_burst = t0 + seconds, t0 + seconds + burst_s

    async with InferenceClient(address) as client:
        async def request(d: int) -> None:
            start = time.monotonic()
            rec: dict[str, Any] = {"t": start - t0, "how": "", "deliveries": 0, "offload": False}
            records.append(rec)
            flow = RequestFlow(str(len(records)))

            def deliver(event: str) -> None:
                step = flow.fire(event)
                if step.delivers:
                    rec["deliveries"] += 1
                    rec["ms"] = (time.monotonic() - start) * 1e3
                    rec["answer"] = "remote" if event == "remote_ok" else "local"
                    # a remote answer that beats the local tail is a remote answer, as the simulator counts it
                    rec["how"] = event if event == "remote_ok" or not rec["how"] else rec["how"]

            est = LinkEstimate(float(ups[d]), float(ups[d]), RTT_MS, 100, start, None)
            health = Health(local_ms=local_ms, arrival_rps=fps, queue_ms=loads[d].queue_ms(start),
                            urgent_queue_ms=loads[d].queue_ms(start, urgent=True),
                            refused_until_s=loads[d].refused_until_s(start), unconfirmed=loads[d].busy_cuts(start))
            action, states[d] = policy(est, front, health, states[d], start, config=cfg)
            if action.kind != "offload":
                flow.fire("local")
                await asyncio.sleep(local_ms / 1e3)
                deliver("local_done")
                return
            rec["offload"], rec["plan"] = True, action.plan_key
            k = next(i for i, e in enumerate(front.entries) if e.plan.key == action.plan_key)
            _, b = remote_ms(front, k, float(ups[d]), RTT_MS, 0.0)
            send_s = (b.edge_ms + b.encode_ms) / 1e3
            tail_s = max(0.0, local_ms - b.edge_ms) / 1e3
            flow.fire("offload")
            await asyncio.sleep(send_s)
            # how late this process ran the device's head: it shares the host's cores with the gateway
            rec["late_ms"] = ((time.monotonic() - start) - send_s) * 1e3
            flow.fire("head_done")
            slo_s = SLO_MS / 1e3
            # The runner's timers, from the send: the upload is part of the remote call.
            budget_s = remote_budget_ms(SLO_MS, b.edge_ms, tail_s * 1e3) / 1e3
            # the runner's hedge ([Note: hedge] in edge_agent/hedge.py), on this device's record
            hedge_s = hedge_delay_s(action, elapsed_ms=(time.monotonic() - start) * 1e3, deadline_ms=SLO_MS,
                                    local_ms=tail_s * 1e3, record_ms=answered[d], config=cfg)
            priority = urgent_priority(SLO_MS, hedge_s)  # as the runner: [Note: priority under overload]
            rec["urgent"] = bool(priority)

            async def remote() -> str:
                await asyncio.sleep((b.uplink_ms + RTT_MS / 2) / 1e3)
                left = slo_s - (time.monotonic() - start)
                try:
                    resp = await client.infer(make_request("net", "1", cut_id, x, timeout_s=max(left, 0.01),
                                                           priority=priority))
                except ResourceExhausted as e:
                    rec["refused"] = True
                    await asyncio.sleep(RTT_MS / 2e3)
                    loads[d].refuse(cut_id, e.retry_after_ms, time.monotonic())
                    return "refused"
                except ClusterError:
                    return "error"
                await asyncio.sleep((RTT_MS / 2 + b.downlink_ms) / 1e3)
                loads[d].observe_timings(cut_id, resp.timings_ms, time.monotonic())
                answered[d].append((time.monotonic() - start) * 1e3)
                return "ok"

            call = asyncio.create_task(remote())
            done, _ = await asyncio.wait({call}, timeout=min(budget_s, hedge_s))
            if call in done and call.result() == "ok":
                deliver("remote_ok")
                return
            if call in done:
                rec["how"] = call.result()
                flow.fire("remote_error")
                await asyncio.sleep(tail_s)
                deliver("local_done")
                return
            flow.fire("remote_timeout")
            rec["how"], rec["hedged"] = "fallback", hedge_s < budget_s
            local = asyncio.create_task(asyncio.sleep(tail_s))
            done, _ = await asyncio.wait({call, local}, return_when=asyncio.FIRST_COMPLETED)
            if call in done and call.result() == "ok" and not local.done():
                deliver("remote_ok")
                await local
            else:
                await local
                deliver("local_done")
                await call
                if call.result() == "ok":
                    deliver("remote_ok")  # late: dropped, counted by the flow

        async def device(d: int) -> None:
            t = next_arrival(t0, fps, end_steady, rng)
            while t < end_burst:
                await asyncio.sleep(max(0.0, t - time.monotonic()))
                task = asyncio.create_task(request(d))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                t = next_arrival(t, fps, end_steady, rng)

        await asyncio.gather(*(device(d) for d in range(devices)))
        while tasks:
            await asyncio.gather(*list(tasks))
    return {"records": records}


def _gateway_profile(graph: Any, run_s: dict[int, float]) -> Any:
    """A cloud profile whose whole-model run is the gateway's timed batch 1, with its timed batch curve."""
    from planner.synthetic import make_flops_profile

    flops = sum(ly.flops or 0 for ly in graph.layers)
    p = make_flops_profile(graph, device="gateway-host", gflops=flops / 1e9 / run_s[1])  # layer sum = run_s[1]
    return dataclasses.replace(p, batch_ms={b: sec * 1e3 for b, sec in run_s.items()})


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def _summary(recs: list[dict[str, Any]]) -> dict[str, Any]:
    ms = [r["ms"] for r in recs if "ms" in r]
    remote = [r["ms"] for r in recs if r.get("answer") == "remote"]
    late = [r["late_ms"] for r in recs if "late_ms" in r]
    missed = [r for r in recs if r.get("ms", 0.0) > SLO_MS]
    return {"requests": len(recs), "within_slo": statistics.fmean(x <= SLO_MS for x in ms) if ms else None,
            "p50_ms": _pct(ms, 50), "p95_ms": _pct(ms, 95),
            "remote_p50_ms": _pct(remote, 50), "remote_p95_ms": _pct(remote, 95),
            # [Note: what the comparison sees] the emulation's own delay, at the send of offloaded requests
            "late_ms": {"p50": _pct(late, 50), "p95": _pct(late, 95), "max": max(late, default=None),
                        "of_misses": sorted(r["late_ms"] for r in missed if "late_ms" in r)},
            "offloaded": statistics.fmean([r["offload"] for r in recs]) if recs else None,
            "refused": sum(bool(r.get("refused")) for r in recs),
            # the local tail started at the budget, or beside the call by the hedge
            "fallbacks": sum(r["how"] == "fallback" and not r.get("hedged") for r in recs),
            "hedged": sum(bool(r.get("hedged")) for r in recs),
            "answered_by": dict(collections.Counter(r["answer"] for r in recs if "answer" in r)),
            "plans": dict(collections.Counter(r["plan"] for r in recs if "plan" in r)),
            "urgent": sum(bool(r.get("urgent")) for r in recs),
            "missed_plans": dict(collections.Counter(r["plan"] for r in missed if "plan" in r)),
            "missed_by": dict(collections.Counter(f"{'hedged' if r.get('hedged') else r['how'] or 'local'}/"
                                                  f"{r['answer']}" for r in missed))}


def _rel_errors(sim: Any, measured: dict[str, Any]) -> dict[str, float | None]:
    """|simulated - measured| / measured of the steady phase's quantiles, all answers and the
    cloud's alone: see [Note: what the comparison sees]."""
    out: dict[str, float | None] = {}
    for key in ("p50_ms", "p95_ms", "remote_p50_ms", "remote_p95_ms"):
        s, m = getattr(sim, key), measured.get(key)
        out[key] = abs(s - m) / m if s is not None and m else None
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=30.0, help="steady phase (its first 5 s not counted)")
    ap.add_argument("--burst-seconds", type=float, default=10.0, help="3x burst after the steady phase")
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--pools", choices=("local", "ray"), default="local",
                    help="the gateway's pools: in its process (default), or one Ray worker on a local Ray")
    ap.add_argument("--out", help="default bench/results/fleet_load.json (fleet_load_ray.json with --pools ray)")
    a = ap.parse_args(argv)
    a.out = a.out or os.path.join(RESULTS, "fleet_load.json" if a.pools == "local" else "fleet_load_ray.json")

    from bench.overload import _clients_in_process, _commit, _round_trips, _served_whole
    from cluster.gateway import PoolKey
    from cluster.server import new_event_loop
    from partitioner import Cut
    from planner import LinkRange, evaluate, frontier
    from planner.fleet import resolve
    from planner.fleet_spec import FleetSpec
    from planner.whatif import Workspace
    from splitinfer.fleetsim import SimConfig, simulate

    ray = None
    if a.pools == "ray":
        from cluster import ray_cluster as ray

        ray.connect("local", num_cpus=2)
    gateway, server, cut, x = _served_whole("resnet50", a.max_batch_size, "bench-fleet-load-",
                                            pools=None if ray is None else ray.RayPoolFactory(provider="cpu"))
    try:
        # Round trips at concurrency 1 less the gateway's queue and compute: the per-request rest.
        loop = new_event_loop()
        try:
            loop.run_until_complete(_round_trips(server.address, cut.cut_id, x, 5))
            overhead_ms = max(0.0, statistics.median(
                s * 1e3 - ms for s, ms in loop.run_until_complete(_round_trips(server.address, cut.cut_id, x, 25))))
        finally:
            loop.close()
        pool = gateway._pools[PoolKey("net", "1", cut.cut_id)]
        capacity = _clients_in_process(server.address, cut.cut_id, x, 16, 10.0, None)
        capacity_rps = capacity["goodput_rps"]
        # The batch times and batching as the pool knows them: its batcher's here, its answers' on Ray.
        if ray is None:
            times = pool.batcher.run_times
            bcfg = pool.batcher.config
            max_batch, timeout_ms, workers = bcfg.max_batch_size, bcfg.max_queue_delay_ms, bcfg.max_concurrent_batches
        else:
            times = pool.answers.run_times
            max_batch, timeout_ms = pool.answers.max_batch_size, pool.answers.timeout_s * 1e3
            workers = pool.answers.replicas * pool.answers.instances
        run_s = times.as_dict()
        # The devices' frontier: an rpi4 against a cloud calibrated to this gateway.
        ws = Workspace()
        graph = ws.graph("resnet50")
        cloud = _gateway_profile(graph, run_s)
        ws.put_profile("gateway-host", cloud)
        dev = ws.profile(graph, DEVICE, "device")
        lo, hi = UP_MEDIAN_MBPS * 1e6 * math.exp(-3 * UP_SIGMA), UP_MEDIAN_MBPS * 1e6 * math.exp(3 * UP_SIGMA)
        front = frontier(graph, [dev, cloud], LinkRange(lo, hi, 1.0, RTT_MS))
        local_ms = evaluate(graph, Cut(frozenset(range(len(graph)))), [dev, cloud], front.link_range.at(lo)).total_ms
        fps = LOAD * capacity_rps / a.devices
        with multiprocessing.get_context("spawn").Pool(1) as procs:
            job = procs.apply_async(_run_devices, (server.address, cut.cut_id, front.to_json(), local_ms, x,
                                                   a.devices, fps, a.seconds, a.burst_seconds, 1))
            # The batch times as timed while the steady phase runs (the devices start a few seconds
            # after this, so this is before the burst): the simulator's cloud for that phase.
            time.sleep(a.seconds)
            steady_run_s = {**run_s, **times.as_dict()}
            out = job.get()
    finally:
        asyncio.run_coroutine_threadsafe(gateway.close(), server._loop).result()
        server.stop()
        if ray is not None:
            ray.shutdown()

    recs = out["records"]
    # A request sent within an SLO of the burst may be answered in it, behind the burst's queue,
    # which the simulator of the steady phase does not run: the steady phase ends an SLO early.
    steady = [r for r in recs if 5.0 <= r["t"] < a.seconds - SLO_MS / 1e3]
    burst = [r for r in recs if r["t"] >= a.seconds]
    measured = {"steady": _summary(steady), "burst": _summary(burst),
                "lost": sum(r["deliveries"] == 0 for r in recs), "doubled": sum(r["deliveries"] > 1 for r in recs)}
    ws.put_profile("gateway-host", _gateway_profile(graph, steady_run_s))
    spec = FleetSpec.from_dict(_fleet_spec(a.devices, fps, workers, max_batch, timeout_ms))
    sim = simulate(spec, resolve(spec, ws), SimConfig(seconds=a.seconds, warmup_s=5.0, seed=1,
                                                      request_overhead_ms=overhead_ms))
    m95 = measured["steady"]["p95_ms"]
    result = {
        "commit": _commit(), "pools": a.pools, "devices": a.devices, "slo_ms": SLO_MS, "fps": fps,
        "load_of_capacity": LOAD,
        "capacity_rps": capacity_rps,
        "gateway_run_ms": {str(b): s * 1e3 for b, s in sorted(run_s.items())}, "workers": workers,
        "gateway_run_ms_steady": {str(b): s * 1e3 for b, s in sorted(steady_run_s.items())},
        "gateway_request_overhead_ms": overhead_ms,
        "measured": measured, "lost": measured["lost"], "doubled": measured["doubled"],
        "burst_within_slo": measured["burst"]["within_slo"],
        "simulated": sim.to_dict(),
        "sim_vs_measured_p95_rel_error": abs(sim.p95_ms - m95) / m95 if m95 else None,
        "sim_vs_measured_rel_error": _rel_errors(sim, measured["steady"]),
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2, sort_keys=True)
    print(json.dumps({k: v for k, v in result.items() if k != "simulated"}, indent=2, sort_keys=True))
    return result


if __name__ == "__main__":
    main()
