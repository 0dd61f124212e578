"""What the what-if service costs on top of the planner, side by side in one run.

Run: ``python -m bench.planner_service`` (about a minute; ``--quick`` for a smoke run).
Writes ``bench/results/planner_service.json`` and ``.png``.

Per zoo model, with the reference devices rpi4 (edge) and t4 (cloud) (roofline
estimates), RTT 20 ms:
- a warm ``POST /v1/plan`` over real HTTP on 127.0.0.1 (one keep-alive connection)
  against the same request to `PlannerService.plan` in process (the HTTP + JSON cost),
  and that against a bare ``solve`` on the same inputs (validation, the edge-only and
  cloud-only baselines and the answer's dict), as ratios of medians;
- the first request for a model (graph built) against a warm one (graph cached): what
  the graph cache saves;
- a 200-point ``POST /v1/sweep`` (DAG optimum from the frontier) against 200 separate
  ``solve`` calls for the DAG series alone, with the answers checked equal.
Timings are medians on a shared 2-core machine; read the ratios, not the absolutes.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from planner.devices import reference_profile
from planner.solvers import solve
from planner.types import Link
from splitinfer.planner_http import make_server

RESULTS = Path(__file__).resolve().parent / "results"


def _post(conn: http.client.HTTPConnection, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    raw = json.dumps(body).encode()
    t0 = time.perf_counter()
    conn.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = resp.read()
    dt = time.perf_counter() - t0
    if resp.status != 200:
        raise RuntimeError(f"{path} answered {resp.status}: {data[:300]!r}")
    return json.loads(data), dt


def _median_ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def run(models: list[str], reps: int, points: int) -> dict[str, Any]:
    out: dict[str, Any] = {"models": {}}
    for model in models:
        srv = make_server("127.0.0.1", 0)
        srv.start()
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=300)
        try:
            base = {"model": model, "edge": "rpi4", "cloud": "t4", "rtt": "20ms"}
            _, cold_s = _post(conn, "/v1/plan", {**base, "uplink": "18.88mbit"})
            http_s, direct_s, inproc_s = [], [], []
            g = srv.service.graph(model)
            profs = [reference_profile("rpi4", g), reference_profile("t4", g)]
            rates = np.geomspace(1e6, 1e9, reps)
            for r in rates:
                ans, dt = _post(conn, "/v1/plan", {**base, "uplink": float(r)})
                http_s.append(dt)
                t0 = time.perf_counter()
                plan = solve(g, profs, Link(float(r), float(r), 20.0))
                direct_s.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                srv.service.plan({**base, "uplink": float(r)})
                inproc_s.append(time.perf_counter() - t0)
                assert ans["edge_layers"] == list(plan.edge_layers)
            sweep, sweep_s = _post(conn, "/v1/sweep", {**base, "uplink_lo": "0.1mbit", "uplink_hi": "1gbit",
                                                       "points": points})
            t0 = time.perf_counter()
            per_point = [solve(g, profs, Link(u, u, 20.0)).breakdown.total_ms for u in sweep["uplink_bps"]]
            per_point_s = time.perf_counter() - t0
            worst = max(abs(a - b) / b for a, b in zip(sweep["series"]["dag"], per_point))
            out["models"][model] = {
                "layers": len(g),
                "plan_http_ms_p50": _median_ms(http_s),
                "plan_direct_ms_p50": _median_ms(direct_s),
                "plan_service_inprocess_ms_p50": _median_ms(inproc_s),
                "http_over_direct": _median_ms(http_s) / _median_ms(direct_s),
                "http_over_inprocess": _median_ms(http_s) / _median_ms(inproc_s),
                "inprocess_over_direct": _median_ms(inproc_s) / _median_ms(direct_s),
                "plan_cold_ms": cold_s * 1e3,
                "cold_over_warm": cold_s / statistics.median(http_s),
                "sweep_http_ms": sweep_s * 1e3,
                "sweep_points": points,
                "sweep_method": sweep["method"],
                "sweep_solves": sweep["solves"],
                "per_point_solve_dag_ms": per_point_s * 1e3,
                "per_point_over_sweep": per_point_s / sweep_s,
                "sweep_dag_max_rel_diff": worst,
                "graph_builds": srv.service.graph_builds,
            }
            print(model, json.dumps(out["models"][model]))
        finally:
            conn.close()
            srv.shutdown()
            srv.server_close()
    out["platform"] = {"python": platform.python_version(), "machine": platform.machine(),
                       "cpus": os.cpu_count()}
    return out


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(res["models"])
    keys = [("http_over_inprocess", "warm plan: HTTP / in-process service"),
            ("inprocess_over_direct", "in-process service / bare solve"),
            ("cold_over_warm", "first request (graph built) / warm"),
            ("per_point_over_sweep", "200 solves / one frontier sweep (whole request)")]
    fig, ax = plt.subplots(figsize=(9, 4.8), dpi=120)
    w = 0.2
    x = np.arange(len(models))
    for i, (k, label) in enumerate(keys):
        vals = [res["models"][m][k] for m in models]
        bars = ax.bar(x + (i - 1.5) * w, vals, w, label=label)
        ax.bar_label(bars, fmt="%.1fx", fontsize=7.5)
    ax.axhline(1.0, color="0.4", lw=0.8)
    ax.set_xticks(x, [f"{m}\n({res['models'][m]['layers']} layers)" for m in models])
    ax.set_yscale("log")
    from matplotlib.ticker import FuncFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax.set_ylabel("ratio of median times (log scale)")
    ax.set_title("planner service: HTTP overhead, graph cache, frontier sweep (rpi4 -> t4 estimates)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one small model, few repetitions")
    args = ap.parse_args()
    models = ["squeezenet"] if args.quick else ["squeezenet", "resnet50", "inception_v1", "densenet121"]
    res = run(models, reps=5 if args.quick else 30, points=200)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "planner_service.json").write_text(json.dumps(res, indent=1))
    plot(res, RESULTS / "planner_service.png")
    print(f"wrote {RESULTS / 'planner_service.json'} and .png")


if __name__ == "__main__":
    main()
