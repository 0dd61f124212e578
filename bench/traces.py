"""Real links: the edge agent on recorded cellular traces, against static plans and a bound.

    python -m bench.traces [--trace-dir DIR] [--out FILE] [--model M] [--slo-ms S] [--seconds N] [--rounds R]
                           [--rate-scale K] [--only NAME]

Every `NAME.up`/`NAME.down` pair in `--trace-dir` (default the recorded traces in
`../shared/traces` next to the checkout, GPL-3.0 data that stays there) is replayed by
the link emulator (Mahimahi delivery opportunities, `--rtt-ms` added) between an edge
agent and the real gateway on 127.0.0.1, with an emulated device (a reference device's
time per run, see [Note: emulated device]). An open-loop app sends one frame every
1/fps s, fps being 80 % of what the emulated device sustains locally (`--fps` sets it).
Strategies take turns on the same trace window (the traces restart at time 0 for each,
and each turn begins as the daemon does, with one link probe, on a fresh runner), so they
see the same link; `--rounds R` repeats the turns R times, the order rotating by one
strategy each round, so that a slow spell of the shared host falls on a different
strategy each time. Before the first turn, an uncounted 10 s cloud-only turn pays the
fresh gateway's first runs, which would otherwise fall on whichever strategy goes first:

* `ours`: the adaptive agent, on its default policy and monitor;
* `edge_only`: every request on the whole local model (offloading off);
* `cloud_only`: the frontier's plan with the fewest layers on the device, always;
* `static`: the plan the frontier picks once for the trace's mean uplink, as Neurosurgeon
  would;
* `hindsight`: per request, the best of the latencies measured around that request's
  send time by the strategies above (each one a cut or local, on the same link moment;
  each strategy's figure the median of its own requests within 0.5 s, so that the host's
  noise does not pass for a better cut): a bound computed offline, not a strategy.

Per trace and strategy, over the requests of every round pooled: `p50_ms`, `p95_ms`,
`p99_ms`, `slo_miss_rate` (answers later than `--slo-ms`, which defaults to twice the
device's local time), `lost`, `doubled`, `switches_per_min` (a pinned plan has none),
`bytes_up` (what crossed the emulated uplink) and `served_by`; `rounds` holds the same
figures per round, and `spread` each figure's least and greatest round. The JSON is
`{"traces": {NAME: {"strategies": {STRATEGY: {...}}}}}`; one timeline PNG per trace
(`traces_NAME.png` next to the JSON): the trace's 1-second uplink rate, the plan `ours`
used in each round, and each request's latency per strategy; `timeline.ours_requests` holds
each of ours' requests with its decision (plan, predicted and pessimistic ms, predicted
chance of a miss), to read its tail against what was predicted. `--seconds N` cuts each
trace to its first N seconds (default 60, times 3 rounds: a default run over the three
shared traces takes about 45 minutes; 0: whole traces). `--rate-scale K` replays every trace
at K times its rate, its dips and outages in place ([Note: scaled traces] in
splitinfer/netem/mahimahi.py), under the name `NAME-xK`: the same recording as a faster (or
slower) network, where the shared traces leave offloading a near thing. Every trace file is
read before the first turn, so a malformed one stops the run at once. `p95_gaps` holds ours'
p95 less each other strategy's, with a 95 % interval ([Note: p95 gap]); `--gaps-of FILE` adds
them to an earlier result from its timelines.

[Note: p95 gap]
A p95 over a few hundred requests is a noisy figure, and between two strategies that both
answer their slowest requests locally it compares the device's jitter (a few tenths of a ms
on a 494 ms run). `p95_gaps` says how large a gap the run can tell from that: it resamples
the trace's `_GAP_BLOCK_S` blocks of time (every round's requests sent in the same block
together) with replacement, the same blocks for both strategies, as both saw the same link
there, and takes the 2.5 and 97.5 percentiles of the gap over `_GAP_RESAMPLES` resamples (a
paired block bootstrap; blocks, not requests, because a dip's requests fare alike). An
interval that holds 0 is no evidence either way. On the shared traces (60 s, 3 rounds) ours
against edge-only read +0.3 ms (-0.1 to +3.7) on LTE and +0.0 (-0.0 to +0.1) on EVDO; at 3x
their rate, on LTE, ours against static read +73.2 ms (-25.6 to +166.8).

[Note: the cloud's process]
The gateway and the link emulator run in a process of their own (bench/_trace_cloud.py), as
the cloud and the network are not the device's work: in the agent's process they shared its
event loop and its interpreter lock, so every remote call's packets (one callback per
delivery opportunity) and the gateway's handling of it ran between the agent's own steps.
That was not what made ours' local answers slower than edge-only's (0.27 ms at the median
on LTE, the same with the cloud moved out: the decision ran before the local run; see
[Note: local runs cancelled] in edge_agent/runner.py), but no strategy now pays for the
cloud's work in the device's time. Nor in the device's CPU time: the process runs at a lower
priority than the agent's (`nice` 10), as the cloud and the device are different machines. The
emulated device sleeps out each run's time, and on this 2-core host a sleeping thread woke 3.6 ms
late at the 95th percentile while another process at the same priority ran ORT on both cores
(0.16 ms with that process at nice 10); so every probe, trial or hedge whose tail the cloud ran
could delay a local answer, and edge-only, which sends nothing, was never delayed. The agent
reaches the emulator over loopback TCP as it would a network; between turns the bench drives the
link through the emulator's control API.

[Note: emulated device]
The device is a reference device of `planner.devices` (`--device`, default `rpi4`): its
whole-model time is that device's roofline time for the model (ResNet50 on an rpi4: 493 ms,
5.6x the 88 ms of CPU time one core of this shared host took on one day, 14x the 35 ms on
another; real phones and Raspberry Pis are 10-30x slower than a server core at ResNet50),
and the device profile the agent plans with
says so. At that speed offloading beats local on good stretches of an LTE trace (a 150 kB
int8 input at 8 Mbit/s is 150 ms on the link) and not on a 1 Mbit/s UMTS one. The device is
`edge_agent.device.SlowDevice`, as in the demo: one core, on which each piece of the device's
work (a run of the whole model, a cut's head or its tail, an encode of the boundary) takes
the slowdown (device time / one run's CPU time here) times that piece's reference CPU time
(the median of its first runs), one piece at a time; a hedge's local run and a local request
wait for each other as they would on the device. CPU time, not wall time, is stretched, and
a reference rather than each run's own, so neither the load of the shared host (2 cores,
other jobs) nor its neighbours' passes for the device's slowness; only a run slower than its
share on a very busy host takes longer. `--slowdown S` sets the device's time to S times one single-thread run's CPU time here instead. The frame
rate and the SLO derive from the device's time, not from a timing on the shared host: fps is
80 % of 1 / device time, the SLO twice the device time (local meets it; the question is
whether the link beats it). The cloud profile is the least of seven timings of the cloud's
engine: its speed, not the load of the moment (the agent corrects its predictions by the
answers it measures).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import contextvars
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
STRATEGIES = ("ours", "edge_only", "cloud_only", "static")
_SPREAD_KEYS = ("p50_ms", "p95_ms", "p99_ms", "slo_miss_rate", "switches_per_min")
_WARM_S = 10.0
"""Seconds of the uncounted turn that warms the gateway before the strategies' turns."""



logger = logging.getLogger("bench.traces")

_DECISION: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("decision", default=None)
"""The record of the request whose task is running: the runner's decision for it goes there."""


def _record_decisions(runner: Any) -> None:
    """Each request's record gets its decision: the plan, the predicted and pessimistic times and
    the predicted chance of a miss (what the tail's requests were expected to take)."""
    decide = runner.decide

    def recorded(now_s: float) -> Any:
        action = decide(now_s)
        rec = _DECISION.get()
        if rec is not None and "plan" not in rec:
            rec.update(plan=action.plan_key, predicted_ms=action.predicted_ms, hi_ms=action.hi_ms,
                       miss=action.miss, trial=action.trial)
        return action

    runner.decide = recorded


def default_trace_dir() -> Path:
    """`../shared/traces` next to the checkout (relative to this file, not to the working directory)."""
    return Path(__file__).resolve().parents[1].parent / "shared" / "traces"


def find_pairs(trace_dir: Path) -> list[tuple[str, Path, Path]]:
    """(name, up, down) for every NAME.up with a NAME.down beside it, by name."""
    if not trace_dir.is_dir():
        raise SystemExit(f"bench.traces: --trace-dir {str(trace_dir)!r} is not a folder; pass a folder of "
                         "Mahimahi NAME.up/NAME.down pairs")
    pairs = [(p.stem, p, p.with_suffix(".down")) for p in sorted(trace_dir.glob("*.up"))
             if p.with_suffix(".down").is_file()]
    if not pairs:
        raise SystemExit(f"bench.traces: no NAME.up/NAME.down pair in {str(trace_dir)!r}; Mahimahi traces come "
                         "in pairs, one file per direction")
    return pairs


def rate_per_second(trace: Any, seconds: float) -> list[float]:
    """The trace's uplink rate in each 1-second window from 0 (Mbit/s)."""
    return [trace.count_between(i * 1e3, (i + 1) * 1e3) * 1500 * 8 / 1e6 for i in range(int(seconds))]


def summarise(records: list[dict[str, Any]], sent: int, answers: collections.Counter[str], slo_ms: float,
              switches: int, seconds: float, bytes_up: int) -> dict[str, Any]:
    lat = [r["latency_ms"] for r in records]
    pct = (lambda q: float(np.percentile(lat, q))) if lat else (lambda q: None)
    return {
        "requests": sent, "answered": len(records),
        "p50_ms": pct(50), "p95_ms": pct(95), "p99_ms": pct(99),
        "slo_miss_rate": (sum(x > slo_ms for x in lat) + (sent - len(records))) / sent if sent else None,
        "lost": sent - len(answers), "doubled": sum(n - 1 for n in answers.values() if n > 1),
        "switches_per_min": switches / (seconds / 60.0), "bytes_up": bytes_up,
        "served_by": dict(collections.Counter(r["served_by"] for r in records)),
    }


def hindsight(runs: dict[str, list[dict[str, Any]]], sent: int, slo_ms: float, *,
              half_width: int = 0) -> dict[str, Any]:
    """Per request index (the same send time in every turn), the best of the strategies' latencies
    there. Each strategy's latency at a request is the median of its own within `half_width`
    requests either side: the min of single samples would be biased low by the host's noise
    (four identical strategies would "beat" each other), not by the link."""
    by = {name: {r["index"]: r["latency_ms"] for r in recs} for name, recs in runs.items()}

    def level(b: dict[int, float], i: int) -> float:
        near = [b[j] for j in range(i - half_width, i + half_width + 1) if j in b]
        return statistics.median(near) if near else math.inf

    best = [min((level(b, i) for b in by.values() if i in b), default=math.inf) for i in range(sent)]
    lat = [x for x in best if math.isfinite(x)]
    return {"requests": sent, "p50_ms": float(np.percentile(lat, 50)), "p95_ms": float(np.percentile(lat, 95)),
            "p99_ms": float(np.percentile(lat, 99)), "slo_miss_rate": sum(x > slo_ms for x in best) / sent,
            "lost": 0, "doubled": 0, "switches_per_min": None, "bytes_up": None,
            "what": "per request, the least of the strategies' latencies at that send time (each the median of "
                    "its own within +-0.5 s): a bound", "latencies_ms": best}


def pooled(rounds: list[dict[str, Any]], slo_ms: float, seconds: float) -> dict[str, Any]:
    """One strategy's figures over every round's requests together, each round's figures
    (`rounds`), and each figure's least and greatest round (`spread`)."""
    per = [summarise(r["records"], r["sent"], r["answers"], slo_ms, r["switches"], seconds, r["bytes_up"])
           for r in rounds]
    answers: collections.Counter[str] = collections.Counter()
    for r in rounds:
        answers.update(r["answers"])
    out = summarise([x for r in rounds for x in r["records"]], sum(r["sent"] for r in rounds), answers, slo_ms,
                    sum(r["switches"] for r in rounds), seconds * len(rounds), sum(r["bytes_up"] for r in rounds))
    counters: dict[str, Any] = {}
    for r in rounds:
        for k, v in r["counters"].items():
            if isinstance(v, dict):
                d = counters.setdefault(k, {})
                for kk, vv in v.items():
                    d[kk] = d.get(kk, 0) + vv
            else:
                counters[k] = counters.get(k, 0) + v
    out["counters"] = counters
    out["rounds"] = [{k: v[k] for k in _SPREAD_KEYS} for v in per]
    out["spread"] = {k: [min(v[k] for v in per), max(v[k] for v in per)] for k in _SPREAD_KEYS
                     if all(v[k] is not None for v in per)}
    return out


def pooled_hindsight(rounds: list[dict[str, list[dict[str, Any]]]], sent: list[int], slo_ms: float,
                     half_width: int) -> dict[str, Any]:
    """The hindsight bound of each round (its strategies on the same link moments), pooled over
    the rounds' requests; `spread` as in `pooled`."""
    per = [hindsight(runs, n, slo_ms, half_width=half_width) for runs, n in zip(rounds, sent)]
    best = [x for h in per for x in h.pop("latencies_ms")]
    lat = [x for x in best if math.isfinite(x)]
    out = {"requests": len(best), "p50_ms": float(np.percentile(lat, 50)), "p95_ms": float(np.percentile(lat, 95)),
           "p99_ms": float(np.percentile(lat, 99)), "slo_miss_rate": sum(x > slo_ms for x in best) / len(best),
           "lost": 0, "doubled": 0, "switches_per_min": None, "bytes_up": None, "what": per[0]["what"],
           "rounds": [{k: h[k] for k in _SPREAD_KEYS} for h in per]}
    out["spread"] = {k: [min(h[k] for h in per), max(h[k] for h in per)] for k in _SPREAD_KEYS[:4]}
    return out


_GAP_BLOCK_S = 5.0
"""Seconds of trace time a resampled block of `p95_gaps` spans: longer than a dip, so that a
block keeps a dip's requests together."""
_GAP_RESAMPLES = 2000


def p95_gaps(latency_ms: dict[str, list[Any]], *, block_s: float = _GAP_BLOCK_S, resamples: int = _GAP_RESAMPLES,
             seed: int = 0) -> dict[str, dict[str, Any]]:
    """Ours' p95 less each other strategy's, with a 95 % interval: see [Note: p95 gap].

    `latency_ms` is a result's `timeline.latency_ms`: per strategy, (sent_s, ms, served_by) of
    every request, all rounds pooled."""
    blocks = {s: collections.defaultdict(list) for s in latency_ms}
    for s, recs in latency_ms.items():
        for sent_s, ms, _ in recs:
            blocks[s][int(sent_s // block_s)].append(ms)
    ours = blocks.get("ours")
    if not ours:
        return {}
    rng = np.random.default_rng(seed)
    out: dict[str, dict[str, Any]] = {}
    for s, other in blocks.items():
        if s == "ours" or not other:
            continue
        keys = sorted(set(ours) & set(other))
        draws = rng.integers(0, len(keys), size=(resamples, len(keys)))
        gaps = np.empty(resamples)
        for i, row in enumerate(draws):
            picked = [keys[j] for j in row]
            gaps[i] = (np.percentile([x for k in picked for x in ours[k]], 95)
                       - np.percentile([x for k in picked for x in other[k]], 95))
        gap = float(np.percentile([x for k in keys for x in ours[k]], 95)
                    - np.percentile([x for k in keys for x in other[k]], 95))
        lo, hi = (float(x) for x in np.percentile(gaps, [2.5, 97.5]))
        out[s] = {"gap_ms": gap, "interval_ms": [lo, hi], "blocks": len(keys), "block_s": block_s,
                  "resamples": resamples}
    return out


def cpu_ms(engine: Any, runs: int = 3) -> float:
    """Median CPU ms of one run of `engine` on zeros, on this thread (a busy host stretches its
    wall time, much less its CPU time), after one untimed run."""
    from edge_agent.engines import time_engine_ms

    time_engine_ms(engine, 1)
    return time_engine_ms(engine, runs, clock="thread")


async def _turn(agent: Any, cloud: Any, strategy: str, *, fps: float, seconds: float, pin: str | None,
                local_ms: float, executor: concurrent.futures.Executor, grace_s: float,
                tag: str = "") -> dict[str, Any]:
    """One strategy on the trace from time 0: a fresh runner (its estimate, policy state, corrections)."""
    from edge_agent.runner import Runner

    runner = Runner(agent.models, agent.frontier, agent.remote, agent.config, executor=executor, local_ms=local_ms)
    if strategy == "edge_only":
        runner.offload_enabled = False
    elif pin is not None:  # one cut, always: the other cuts out, and no local option to choose
        runner.unusable_cuts = {k for k in agent.models.cuts if k != pin}
        runner.local_ms = math.inf
    agent.runner = runner
    _record_decisions(runner)
    name = agent.models.input_names[0]
    x = np.random.default_rng(0).standard_normal(tuple(agent.models.full.inputs[0].shape)).astype(np.float32)
    records: list[dict[str, Any]] = []
    answers: collections.Counter[str] = collections.Counter()
    plans: list[tuple[float, str]] = []
    cloud.replay()
    # What the daemon does at start: an RTT check and one boundary, so the first plan sees this link
    # (every strategy pays it, so each turn starts its stream at about the same trace time).
    await runner.probe()
    bytes_before = cloud.bytes_up()
    t0 = time.monotonic()

    async def one(i: int) -> None:
        rid = f"{strategy}{tag}-{i}"
        decision: dict[str, Any] = {}
        _DECISION.set(decision)
        try:
            a = await agent.infer({name: x}, rid)
        except Exception as e:  # noqa: BLE001 - an error is an answer (counted), not a lost request
            answers[rid] += 1
            records.append({"index": i, "sent_s": i / fps, "latency_ms": (time.monotonic() - t0 - i / fps) * 1e3,
                            "served_by": f"error: {type(e).__name__}", "cut_id": ""} | decision)
            return
        answers[a["id"]] += 1
        records.append({"index": i, "sent_s": i / fps, "latency_ms": a["latency_ms"], "served_by": a["served_by"],
                        "cut_id": a["cut_id"]} | decision)

    async def sample() -> None:
        while True:
            act = runner.last_action
            plans.append((time.monotonic() - t0, "" if act is None else act.plan_key))
            await asyncio.sleep(0.1)

    sampler = asyncio.ensure_future(sample())
    tasks, n = [], 0
    while n / fps < seconds:
        await asyncio.sleep(max(0.0, n / fps - (time.monotonic() - t0)))
        tasks.append(asyncio.ensure_future(one(n)))
        n += 1
    await asyncio.gather(*tasks)
    sampler.cancel()
    cloud.fast()
    await asyncio.sleep(grace_s)  # late remote answers arrive, are dropped and counted, before the next turn
    counters_after = runner.counters.to_dict()
    # A pinned plan never switches; the runner's count there is the breaker's moves to local and back.
    # The policy's own count leaves out the first plan, which is no switch.
    switches = runner.state.switches if strategy == "ours" else 0
    return {"records": records, "sent": n, "answers": answers, "switches": switches,
            "bytes_up": cloud.bytes_up() - bytes_before, "plans": plans,
            "counters": {k: counters_after[k] for k in ("late_dropped", "local_dropped", "local_cancelled", "hedges",
                                                        "trials", "held_local", "remote_errors", "switches")}}


def turn_order(rounds: int) -> list[tuple[int, str]]:
    """(round, strategy) in the order they run: every strategy once per round, the first one
    rotating, so that no strategy always follows the same one or runs at the same point of a round."""
    k = len(STRATEGIES)
    return [(r, STRATEGIES[(r + i) % k]) for r in range(rounds) for i in range(k)]


async def run_trace(args: argparse.Namespace, root: str, setup: dict[str, Any], name: str, up: Path,
                    down: Path, traces: tuple[Any, Any]) -> dict[str, Any]:
    from bench._trace_cloud import CloudProcess
    from edge_agent.config import config_from_dict
    from edge_agent.daemon import EdgeAgent
    from edge_agent.engines import time_engine_ms

    trace_up, trace_down = traces  # scaled by --rate-scale
    seconds = args.seconds or trace_up.period_ms / 1e3
    # [Note: the cloud's process]; the model installs fast
    cloud = CloudProcess(root, up, down, args.rtt_ms, args.rate_scale)
    cfg = {"gateway": f"127.0.0.1:{cloud.port}", "model": f"{args.model}@1", "apiPort": 0,
           "deviceProfile": setup["device_profile"], "cacheDir": os.path.join(root, "edge-cache"),
           "intraOpThreads": 1, "startupTimeoutS": 120, "encodings": args.encodings.split(","),
           "remoteTimeoutMs": args.remote_timeout_ms}
    agent = EdgeAgent(config_from_dict(cfg))
    executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="edge-engine")
    device_ms = setup["device_ms"]
    try:
        await agent.start()
        assert agent.models is not None and agent.runner is not None
        policy_local_ms = agent.runner.local_ms  # the device profile's whole-model time, as the policy sees it
        agent.runner.close()  # each turn gets a fresh runner on the shared executor
        # Every engine run (the whole model, a cut's head or tail) takes the device's time: one core,
        # slowdown x its reference CPU time here ([Note: time-scaled device] in edge_agent.device).
        agent.models.settle_device()
        agent.models.device.set_factor(max(1.0, device_ms / agent.models.full.reference_cpu_ms()))
        local_ms = time_engine_ms(agent.models.full, 3)
        agent.models.local_ms = local_ms
        fps = args.fps or math.floor(0.8 * 1e3 / device_ms * 10) / 10
        slo_ms = args.slo_ms or 2.0 * device_ms
        if agent.config.policy.slo_ms != slo_ms:
            import dataclasses

            agent.config = dataclasses.replace(agent.config, policy=dataclasses.replace(agent.config.policy,
                                                                                         slo_ms=slo_ms))
        front = agent.frontier
        cloud_only = min(front.entries, key=lambda e: len(e.plan.cut.device)).plan if front else None
        static = front.plan_at(trace_up.mean_bps) if front else None
        pins = {"cloud_only": cloud_only.cut.key if cloud_only and cloud_only.boundary else None,
                "static": static.cut.key if static and static.boundary else None}
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in STRATEGIES}
        loads: list[dict[str, Any]] = []  # the shared host's 1-minute load average as each turn starts
        grace_s = 2 * args.remote_timeout_ms / 1e3 + 1.0
        if pins["cloud_only"] is not None:
            # The first turn on a fresh gateway would pay for its first runs (the cloud's engines at each
            # batch size, the agent's first calls): a short cloud-only turn, not counted, pays them.
            logger.info("%s: a %.0f s cloud-only turn to warm the gateway (not counted)", name, _WARM_S)
            await _turn(agent, cloud, "cloud_only", fps=fps, seconds=min(seconds, _WARM_S), pin=pins["cloud_only"],
                        local_ms=policy_local_ms, executor=executor, grace_s=grace_s, tag="-warm")
        for rnd, strategy in turn_order(args.rounds):
            pin = pins.get(strategy)
            strategy_kind = "edge_only" if strategy in pins and pin is None else strategy  # that plan is local here
            logger.info("%s round %d: %s for %.0f s at %.2g fps", name, rnd + 1, strategy, seconds, fps)
            loads.append({"round": rnd, "strategy": strategy, "load_1min": os.getloadavg()[0]})
            runs[strategy].append(await _turn(agent, cloud, strategy_kind, fps=fps, seconds=seconds, pin=pin,
                                              local_ms=policy_local_ms, executor=executor, grace_s=grace_s,
                                              tag=f"-r{rnd}"))
    finally:
        await agent.stop()
        executor.shutdown(wait=True)
        cloud.close()
    out = {s: pooled(r, slo_ms, seconds) for s, r in runs.items()}
    out["hindsight"] = pooled_hindsight([{s: runs[s][i]["records"] for s in runs} for i in range(args.rounds)],
                                        [runs["ours"][i]["sent"] for i in range(args.rounds)], slo_ms,
                                        half_width=max(0, round(fps / 2)))
    timeline = {"rate_mbps": rate_per_second(trace_up, seconds),
                "ours_plans": [r["plans"] for r in runs["ours"]],
                "latency_ms": {s: [(x["sent_s"], x["latency_ms"], x["served_by"])
                                   for r in runs[s] for x in r["records"]] for s in runs},
                "ours_requests": [[{k: x.get(k) for k in ("index", "latency_ms", "served_by", "plan", "predicted_ms",
                                                        "hi_ms", "miss", "trial")} for x in r["records"]]
                                  for r in runs["ours"]]}
    return {
        "strategies": out,
        "p95_gaps": p95_gaps(timeline["latency_ms"]),
        "trace": {"up": up.name, "down": down.name, "seconds": seconds, "mean_up_bps": trace_up.mean_bps,
                  "mean_down_bps": trace_down.mean_bps, "rtt_ms": args.rtt_ms, "rate_scale": args.rate_scale},
        "fps": fps, "slo_ms": slo_ms, "rounds": args.rounds, "local_engine_ms": local_ms, "host_load": loads,
        "plans": {"cloud_only": cloud_only.key if cloud_only else None, "static": static.key if static else None},
        "timeline": timeline,
    }


def plot(name: str, result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = result["timeline"]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(11, 8), sharex=True, gridspec_kw={"height_ratios": [2, 1, 3]})
    rate = tl["rate_mbps"]
    ax1.step(range(len(rate)), rate, where="post", color="k")
    ax1.set_ylabel("uplink, 1 s (Mbit/s)")
    names = sorted({p for rnd in tl["ours_plans"] for _, p in rnd if p}, key=lambda k: (k != "local", k))
    for i, rnd in enumerate(tl["ours_plans"]):
        pts = [(t, names.index(p) + 0.08 * i) for t, p in rnd if p]
        if pts:
            ax2.step(*zip(*pts), where="post", lw=1, label=f"round {i + 1}")
    if names:
        ax2.set_yticks(range(len(names)), names, fontsize=7)
        ax2.legend(fontsize=7, loc="upper right")
    ax2.set_ylabel("ours: plan")
    colors = {"ours": "tab:blue", "edge_only": "tab:green", "cloud_only": "tab:red", "static": "tab:orange"}
    for s, pts in tl["latency_ms"].items():
        if pts:
            ax3.scatter([p[0] for p in pts], [p[1] for p in pts], s=5, c=colors.get(s, "grey"), label=s, alpha=0.7)
    ax3.axhline(result["slo_ms"], color="grey", ls="--", lw=0.7, label="SLO")
    ax3.set_yscale("log")
    ax3.set_ylabel("latency per request (ms)")
    ax3.set_xlabel("time in the trace (s)")
    ax3.legend(fontsize=8, loc="upper right")
    st = result["strategies"]
    fig.suptitle(f"{name} ({result.get('rounds', 1)} rounds pooled): p95 ours {st['ours']['p95_ms']:.0f} ms, edge {st['edge_only']['p95_ms']:.0f}, "
                 f"cloud {st['cloud_only']['p95_ms']:.0f}, static {st['static']['p95_ms']:.0f}, "
                 f"hindsight {st['hindsight']['p95_ms']:.0f}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def emulated_device(model_path: str, profile_path: str, cloud_path: str, device: str, slowdown: float,
                    cache_dir: str) -> dict[str, float]:
    """The emulated device's whole-model time (the reference `device`'s roofline time, or
    `slowdown` > 0 times the CPU time of one single-thread run here), the device profile at
    `profile_path` rewritten to it, and the cloud profile at `cloud_path` rewritten to the least
    of seven timings of the cloud's engine (its speed, not the shared host's load of the moment);
    see [Note: emulated device]."""
    from edge_agent.engines import estimate_profile
    from partitioner import Splitter
    from planner.devices import reference_profile
    from workers.engine import Engine, EngineConfig

    graph = Splitter(model_path).graph
    one = Engine(model_path, EngineConfig(intra_op_threads=1, batch_buckets=(1,), dynamic_batch=False,
                                          cache_dir=cache_dir))
    try:
        one_cpu_ms = cpu_ms(one, 5)
    finally:
        one.close()
    if slowdown:
        device_ms = one_cpu_ms * slowdown
    else:
        ref = reference_profile(device, graph)
        device_ms = sum(t.ms for t in ref.layers.values()) + ref.fixed_ms
    cloud = Engine(model_path, EngineConfig(batch_buckets=(1,), dynamic_batch=False, cache_dir=cache_dir))
    try:
        x = {t.name: np.zeros(t.shape, np.float32) for t in cloud.inputs}
        cloud.run(x)
        times = []
        for _ in range(7):
            t = time.perf_counter()
            cloud.run(x)
            times.append((time.perf_counter() - t) * 1e3)
    finally:
        cloud.close()
    cloud_ms = min(times)
    with open(profile_path, "w") as fh:
        fh.write(estimate_profile(graph, device_ms).to_json())
    with open(cloud_path, "w") as fh:
        fh.write(estimate_profile(graph, cloud_ms).to_json())
    return {"device_ms": device_ms, "cpu_ms": one_cpu_ms, "slowdown": device_ms / one_cpu_ms, "cloud_ms": cloud_ms}


def _print_gaps(name: str, gaps: dict[str, dict[str, Any]]) -> None:
    for s, g in gaps.items():
        lo, hi = g["interval_ms"]
        print(f"{name:<24} ours p95 - {s:<10} {g['gap_ms']:+7.1f} ms (95% interval {lo:+.1f} to {hi:+.1f})",
              flush=True)


def _add_gaps(path: Path) -> int:
    try:
        with open(path, encoding="utf-8") as fh:
            results = json.load(fh)
        traces = results["traces"]
        for name, r in traces.items():
            r["p95_gaps"] = p95_gaps(r["timeline"]["latency_ms"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"bench.traces: --gaps-of {str(path)!r}: {type(e).__name__}: {e}; give a result this "
                         f"bench wrote (with its timelines)") from None
    for name, r in traces.items():
        _print_gaps(name, r["p95_gaps"])
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1, default=str)
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace-dir", type=Path, default=default_trace_dir(),
                   help="folder of Mahimahi NAME.up/NAME.down pairs (default ../shared/traces)")
    p.add_argument("--out", default=os.path.join(RESULTS, "traces.json"), help="the JSON (PNGs go beside it)")
    p.add_argument("--model", default="resnet50", help="zoo model (default resnet50)")
    p.add_argument("--slo-ms", type=float, default=0.0, help="latency target; 0: twice the device's local time")
    p.add_argument("--seconds", type=float, default=60.0, help="first N seconds of each trace; 0: whole traces")
    p.add_argument("--rounds", type=int, default=3, help="turns of every strategy on each trace window (default 3)")
    p.add_argument("--fps", type=float, default=0.0, help="0: 80%% of what the emulated device sustains locally")
    p.add_argument("--device", default="rpi4", help="reference device (planner.devices) the device emulates")
    p.add_argument("--slowdown", type=float, default=0.0,
                   help="the emulated device is this much slower than one core here; 0: as --device")
    p.add_argument("--rtt-ms", type=float, default=40.0, help="RTT added on the traces (default 40)")
    p.add_argument("--remote-timeout-ms", type=float, default=1500.0)
    p.add_argument("--encodings", default="fp32,fp16,int8", help="boundary encodings the agent may plan with")
    p.add_argument("--only", action="append", help="run only this trace NAME (repeatable)")
    p.add_argument("--rate-scale", type=float, default=1.0,
                   help="replay every trace at this many times its rate (its dips in place; results and PNGs "
                        "named NAME-xK); default 1")
    p.add_argument("--gaps-of", metavar="FILE", type=Path,
                   help="run nothing: add the p95 gaps ([Note: p95 gap]) to a result FILE, from its timelines")
    args = p.parse_args(argv)
    if args.gaps_of is not None:
        return _add_gaps(args.gaps_of)
    for flag, v, ok in (("--seconds", args.seconds, args.seconds >= 0), ("--slo-ms", args.slo_ms, args.slo_ms >= 0),
                        ("--fps", args.fps, args.fps >= 0), ("--rate-scale", args.rate_scale, args.rate_scale > 0),
                        ("--slowdown", args.slowdown, args.slowdown == 0 or args.slowdown >= 1)):
        if not (math.isfinite(v) and ok):
            least = {"--slowdown": ">= 1, or 0", "--rate-scale": "> 0"}.get(flag, ">= 0")
            p.error(f"{flag} is {v!r}; it must be a number {least}")
    if args.rounds < 1:
        p.error(f"--rounds is {args.rounds!r}; it must be an integer >= 1")
    from planner.devices import DEVICES

    if args.device not in DEVICES:
        p.error(f"--device is {args.device!r}; it must be one of {sorted(DEVICES)}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)
    found = find_pairs(args.trace_dir)
    pairs = [pr for pr in found if not args.only or pr[0] in args.only]
    missing = sorted(set(args.only or ()) - {name for name, _, _ in found})
    if missing:
        p.error(f"--only {', '.join(missing)}: no such pair in {str(args.trace_dir)!r}; it has "
                f"{', '.join(name for name, _, _ in found)}")
    from splitinfer.netem import NetemError, load_mahimahi_trace

    try:  # every file read before the first turn: a bad one fails now, not after an hour of others
        traces = {name: (load_mahimahi_trace(up).scaled(args.rate_scale),
                         load_mahimahi_trace(down).scaled(args.rate_scale)) for name, up, down in pairs}
    except NetemError as e:
        raise SystemExit(f"bench.traces: {e}") from None
    suffix = "" if args.rate_scale == 1 else f"-x{args.rate_scale:g}"
    from bench.adaptation import _setup_registry

    results: dict[str, Any] = {"traces": {}}
    with tempfile.TemporaryDirectory(prefix="splitinfer-traces-") as root:
        model_path, dev_path, _, one_ms = _setup_registry(root, args.model, 1.0)
        setup = {"device_profile": dev_path} | emulated_device(
            model_path, dev_path, os.path.join(os.path.dirname(model_path), "profiles", "cloud.json"), args.device,
            args.slowdown, os.path.join(root, "ort"))
        results["setup"] = {"model": args.model, "cloud_model_ms": setup["cloud_ms"], "single_thread_model_ms": one_ms,
                            "device": args.device if not args.slowdown else None, "device_ms": setup["device_ms"],
                            "single_thread_cpu_ms": setup["cpu_ms"], "slowdown": setup["slowdown"],
                            "rounds": args.rounds, "rtt_ms": args.rtt_ms, "seconds": args.seconds,
                            "encodings": args.encodings, "remote_timeout_ms": args.remote_timeout_ms,
                            "rate_scale": args.rate_scale,
                            "trace_dir": args.trace_dir.name}
        for stem, up, down in pairs:
            t = time.monotonic()
            name = stem + suffix
            results["traces"][name] = r = asyncio.run(run_trace(args, root, setup, name, up, down, traces[stem]))
            logger.info("%s done in %.0f s", name, time.monotonic() - t)
            out_dir = os.path.dirname(os.path.abspath(args.out))
            os.makedirs(out_dir, exist_ok=True)
            plot(name, r, os.path.join(out_dir, f"traces_{name}.png"))
            for s, v in r["strategies"].items():
                per_min = v["switches_per_min"]
                print(f"{name:<24} {s:<10} p50 {v['p50_ms']:7.0f} p95 {v['p95_ms']:7.0f} p99 {v['p99_ms']:7.0f} ms  "
                      f"miss {v['slo_miss_rate']:.3f}  lost {v['lost']} doubled {v['doubled']}  switches/min "
                      f"{'-' if per_min is None else round(per_min, 1)}  bytes up {v['bytes_up']}", flush=True)
            _print_gaps(name, r["p95_gaps"])
            with open(args.out, "w", encoding="utf-8") as fh:  # after each trace: a stopped run keeps those done
                json.dump(results, fh, indent=1, default=str)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
