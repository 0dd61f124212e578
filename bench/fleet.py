"""Fleets: the fleet planner and the fleet simulator on 10,000 devices sharing one cloud tier.

    python -m bench.fleet [--devices 10000] [--seconds 20] [--quick] [--mix all|cloud-heavy] [--out PATH]

The fleet: ResNet50 (seeded random weights; zoo topology) on 20 classes, four reference
devices (rpi4, rpi5, phone-sd8g2, jetson-orin-nano) by five lognormal link profiles,
sharing T4 workers that batch up to 8 (2 ms timeout); SLO 150 ms, target 85% (a Pi on
the weak links meets 150 ms in no placement, so 95% is out of reach for any cloud). The
devices' times and the workers' are the reference devices' roofline estimates, so the
numbers are the model's, not measurements of hardware. ``--mix cloud-heavy`` keeps the
classes that depend on the cloud most: rpi4, rpi5 and phones (no Jetson, which meets the SLO
locally) on the fibre to 4G links (no weak link, on which no placement meets it); it writes
bench/results/fleet_cloud_heavy.json and .png by default.

1. Planner: `plan_fleet` on the whole spec (resolution, frontiers, the fixed point and the
   workers-needed search), median of five runs: ``planner_s``.
2. Loads: capacity is the workers' requests/s at full batches of the whole model (the
   pool the load-blind plans use). The frame rate is set so that every device on its
   load-blind DADS plan offers 80%, 100% and 120% of it. At each load the simulator
   (splitinfer.fleetsim: the agent's policy, CloudLoad and RequestFlow against a queueing
   model of the workers with admission control) runs four strategies side by side on the
   same seed: ours (the policy with the cloud's load), DADS (each device's load-blind
   optimum), cloud-only and edge-only, and 'planned' (each device follows the fleet plan's
   choice for its class and link). ``goodput_ratio_vs_dads`` is ours over DADS in requests
   answered within the SLO per second, and likewise vs cloud-only and edge-only;
   ``planned_goodput_ratio_vs_dads`` is the fleet plan's. ``idle_cloud_within_slo`` is DADS's
   share within the SLO at 5% of capacity (a near-idle cloud: each device's best placement, which
   no strategy beats), and ``max_goodput_ratio_vs_dads`` at each load is that over DADS's
   share there: the most any load-aware strategy can gain on this fleet.
3. Workers needed: the planner's answer N at 100% load, then the simulation with N and
   N - 1 workers, with devices following the plan ('planned') and running the agent
   ('ours'): whether the SLO target holds in each.
4. Planner accuracy: at each load and at 4, 5, 6 and 8 workers, the planner's predicted share
   within the SLO against the simulation of devices that follow that plan
   (``planner_accuracy``: every point, and the mean and largest absolute error in points).
Writes bench/results/fleet.json and bench/results/fleet.png; the real load test's keys
(``sim_vs_measured_p95_rel_error``, ``sim_vs_measured_rel_error``, ``lost``, ``doubled``,
``burst_within_slo``) are copied from
bench/results/fleet_load.json (``python -m bench.fleet_load``, run first).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from typing import Any

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DEVICES = ("rpi4", "rpi5", "phone-sd8g2", "jetson-orin-nano")
LINKS = (  # (name, median uplink Mbit/s, sigma, median RTT ms)
    ("fibre", 200.0, 0.4, 10.0), ("cable", 80.0, 0.5, 20.0), ("5g", 60.0, 0.7, 30.0),
    ("4g", 25.0, 0.7, 45.0), ("weak", 8.0, 0.6, 60.0))
MIXES = {"all": (DEVICES, tuple(ln[0] for ln in LINKS)),
         "cloud-heavy": (("rpi4", "rpi5", "phone-sd8g2"), ("fibre", "cable", "5g", "4g"))}
SLO_MS, TARGET, WORKERS = 150.0, 0.85, 8
LOADS = (0.8, 1.0, 1.2)
ACCURACY_WORKERS = (4, 5, 6, WORKERS)
STRATEGIES = ("ours", "planned", "dads", "cloud-only", "edge-only")


def make_spec(devices: int, fps: float, workers: int = WORKERS, mix: str = "all") -> dict[str, Any]:
    kinds, links = MIXES[mix]
    per = devices // (len(kinds) * len(links))
    classes = [{"name": f"{d}-{ln}", "count": per, "device": d, "model": "resnet50", "fps": fps,
                "link": {"up_mbps": {"median": up, "sigma": sg}, "rtt_ms": {"median": rtt, "sigma": 0.3}}}
               for d in kinds for ln, up, sg, rtt in LINKS if ln in links]
    return {"models": {"resnet50": {"slo_ms": SLO_MS, "target": TARGET}},
            "cloud": {"device": "t4", "workers": workers, "max_batch": 8, "batch_timeout_ms": 2.0},
            "encodings": ["fp32", "fp16", "int8"], "classes": classes}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(RESULTS_DIR), check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=10_000)
    ap.add_argument("--seconds", type=float, default=20.0, help="simulated seconds per run")
    ap.add_argument("--warmup", type=float, default=5.0, help="simulated seconds not counted")
    ap.add_argument("--quick", action="store_true", help="2,000 devices, 8 s: a smoke run")
    ap.add_argument("--mix", choices=sorted(MIXES), default="all", help="device classes (see the docstring)")
    ap.add_argument("--out", default=None, help="default bench/results/fleet.json (fleet_cloud_heavy.json)")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = os.path.join(RESULTS_DIR, "fleet.json" if args.mix == "all" else "fleet_cloud_heavy.json")
    if args.quick:
        args.devices, args.seconds, args.warmup = 2000, 8.0, 2.0

    from planner.fleet import plan_fleet, plan_resolved, resolve
    from planner.fleet_spec import FleetSpec
    from splitinfer.fleetsim import SimConfig, simulate

    base = FleetSpec.from_dict(make_spec(args.devices, 1.0, mix=args.mix))
    times = []
    plan = None
    for _ in range(5):
        t0 = time.perf_counter()
        plan = plan_fleet(base)
        times.append(time.perf_counter() - t0)
    models = resolve(base)

    def sim(strategy: str, scale: float, workers: int = WORKERS) -> Any:
        return simulate(base, models, SimConfig(strategy=strategy, seconds=args.seconds, warmup_s=args.warmup,
                                                seed=1, fps_scale=scale, workers=workers))

    # The load-blind plans do not depend on the load: one short run measures their cloud share.
    probe = simulate(base, models, SimConfig(strategy="dads", seconds=2.0, warmup_s=0.5, seed=1))
    dads_rps_at_1fps = probe.offloaded * base.devices
    # full-batch capacity of WORKERS workers on the pool the plans use (ResNet50 whole: its one remote cut)
    capacity = plan_resolved(base, models, workers=WORKERS, size_workers=False).cloud.capacity_rps
    idle = sim("dads", 0.05 * capacity / dads_rps_at_1fps).within_slo
    loads: dict[str, Any] = {}
    points: list[dict[str, Any]] = []
    for load in LOADS:
        scale = load * capacity / dads_rps_at_1fps
        runs = {s: sim(s, scale) for s in STRATEGIES}
        g = {s: r.goodput_rps for s, r in runs.items()}
        spec_at = FleetSpec.from_dict(make_spec(args.devices, scale, mix=args.mix))
        models_at = resolve(spec_at)
        predicted = plan_resolved(spec_at, models_at, size_workers=False)
        for n in ACCURACY_WORKERS:  # step 4; at WORKERS the runs above
            planner_n = predicted if n == WORKERS else plan_resolved(spec_at, models_at, workers=n,
                                                                      size_workers=False)
            sim_n = runs["planned"] if n == WORKERS else sim("planned", scale, n)
            points.append({"load": f"{round(load * 100)}%", "workers": n, "planner_within_slo": planner_n.within_slo,
                           "sim_within_slo": sim_n.within_slo})
        loads[f"{round(load * 100)}%"] = {
            "fps": scale, "offered_by_dads_rps": load * capacity,
            "goodput_ratio_vs_dads": g["ours"] / g["dads"] if g["dads"] else None,
            "planned_goodput_ratio_vs_dads": g["planned"] / g["dads"] if g["dads"] else None,
            "goodput_ratio_vs_cloud_only": g["ours"] / g["cloud-only"] if g["cloud-only"] else None,
            "goodput_ratio_vs_edge_only": g["ours"] / g["edge-only"] if g["edge-only"] else None,
            "max_goodput_ratio_vs_dads": idle / runs["dads"].within_slo if runs["dads"].within_slo else None,
            "planner_within_slo": predicted.within_slo,
            "runs": {s: r.to_dict() for s, r in runs.items()},
        }
        print(f"load {load:.0%}: " + ", ".join(f"{s} {r.within_slo:.3f} in SLO ({r.goodput_rps:.0f}/s)"
                                              for s, r in runs.items()), flush=True)
    # workers needed at 100% load, checked in the simulator
    scale = capacity / dads_rps_at_1fps
    spec100 = FleetSpec.from_dict(make_spec(args.devices, scale, mix=args.mix))
    m100 = resolve(spec100)
    need = plan_resolved(spec100, m100)
    check: dict[str, Any] = {"planner_workers_needed": need.workers_needed, "note": need.workers_needed_note}
    if need.workers_needed is not None:
        for strategy in ("planned", "ours"):
            within = {}
            for n in (need.workers_needed, need.workers_needed - 1):
                if n >= 1:
                    within[n] = simulate(spec100, m100, SimConfig(strategy=strategy, seconds=args.seconds,
                                                                  warmup_s=args.warmup, seed=1, workers=n)).within_slo
            n = need.workers_needed
            check[strategy] = {"sim_within_slo_at_n": within[n], "sim_within_slo_at_n_minus_1": within.get(n - 1),
                               "slo_holds_at_n": within[n] >= TARGET,
                               "slo_fails_at_n_minus_1": n - 1 in within and within[n - 1] < TARGET}
    results = {
        "commit": _commit(), "machine": platform.machine(), "python": platform.python_version(),
        "simulated_devices": base.devices, "classes": len(base.classes), "workers": WORKERS, "mix": args.mix,
        "idle_cloud_within_slo": idle,
        "slo_ms": SLO_MS, "target": TARGET, "seconds_simulated": args.seconds, "warmup_s": args.warmup,
        "capacity_rps": capacity, "planner_s": {"median": statistics.median(times), "runs": times},
        "fixed_point": {"delay_ms": plan.fixed_point.delay_ms, "residual_ms": plan.fixed_point.residual_ms,
                        "iterations": plan.fixed_point.iterations, "trace": plan.fixed_point.trace},
        "loads": loads, "workers_needed_check": check, "planner_accuracy": _accuracy(points),
    }
    results.update(_real_load())
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2, sort_keys=True)
    _plot(results, os.path.splitext(args.out)[0] + ".png")
    print(json.dumps({k: {kk: v[kk] for kk in v if kk.startswith("goodput")} for k, v in loads.items()}, indent=2))
    print(json.dumps(check, indent=2))
    return results


def _accuracy(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Step 4's points with the planner's absolute error in points of the share within the SLO."""
    errors = [100.0 * abs(p["planner_within_slo"] - p["sim_within_slo"]) for p in points]
    return {"points": points, "mean_abs_error_points": statistics.fmean(errors) if errors else None,
            "max_abs_error_points": max(errors, default=None)}


def _real_load() -> dict[str, Any]:
    """The real load test's keys (bench/fleet_load.py writes them; run it first), or nulls."""
    path = os.path.join(RESULTS_DIR, "fleet_load.json")
    keys = ("sim_vs_measured_p95_rel_error", "sim_vs_measured_rel_error", "lost", "doubled", "burst_within_slo",
            "devices")
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return {"real_load_test": None, **{k: None for k in keys[:-1]}}
    return {"real_load_test": {"source": "bench/results/fleet_load.json", "commit": d.get("commit"),
                               "devices": d.get("devices")},
            **{k: d.get(k) for k in keys[:-1]}}


def _plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 4.5))
    loads = list(results["loads"])
    width = 0.16
    for i, s in enumerate(STRATEGIES):
        vals = [results["loads"][k]["runs"][s]["goodput_rps"] for k in loads]
        ax.bar([j + (i - 2) * width for j in range(len(loads))], vals, width, label=s)
    ax.set_xticks(range(len(loads)), [f"{k} of capacity" for k in loads])
    ax.set_ylabel(f"goodput within {results['slo_ms']:.0f} ms (req/s)")
    ax.set_title(f"{results['simulated_devices']} simulated devices, {results['workers']} T4 workers")
    ax.legend()
    trace = results["fixed_point"]["trace"]
    ax2.plot(range(len(trace)), [t[0] for t in trace], "o-", label="W (bisection point)")
    ax2.plot(range(len(trace)), [t[1] for t in trace], "s--", label="F(W)")
    ax2.set_xlabel("step")
    ax2.set_ylabel("cloud delay (ms)")
    ax2.set_title(f"fixed point: W = {results['fixed_point']['delay_ms']:.1f} ms")
    ax2.legend()
    acc = results["planner_accuracy"]
    for n in ACCURACY_WORKERS:
        pts = [p for p in acc["points"] if p["workers"] == n]
        ax3.plot([100 * p["sim_within_slo"] for p in pts], [100 * p["planner_within_slo"] for p in pts], "o",
                 label=f"{n} workers")
    ends = [100 * v for p in acc["points"] for v in (p["sim_within_slo"], p["planner_within_slo"])]
    ax3.plot([min(ends), max(ends)], [min(ends), max(ends)], "k:", lw=1)
    ax3.set_xlabel("simulated, devices following the plan (% within SLO)")
    ax3.set_ylabel("planner's prediction (% within SLO)")
    ax3.set_title(f"planner vs simulation at {', '.join(results['loads'])} load: mean error "
                  f"{acc['mean_abs_error_points']:.1f}, max {acc['max_abs_error_points']:.1f} points", fontsize=9)
    ax3.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
