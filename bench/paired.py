"""A whole benchmark at two revisions, paired: did a change keep the performance?

    python -m bench.paired --bench workers --old REV [--new REV] [--pairs 5] [--full] [--out PATH]

Checks out ``--old`` and ``--new`` (default HEAD) as git worktrees made for the run and
removed after it, and runs ``python -m bench.BENCH`` in each, one after the other, pair
after pair; the side that goes first alternates from pair to pair, so the load of other
processes on a shared machine falls on both alike. Each run imports only its own
checkout's code (it runs there, with that checkout first on ``PYTHONPATH``) and writes
its JSON to a directory of its own. Runs are ``--quick`` unless ``--full``.

The metrics compared are the ones a change must not regress (`METRICS`):

* ``workers``, per model: ours at concurrency 32 against raw batched ONNX Runtime and
  against Ray Serve (throughput ratios, higher is better) and the latency ours adds at
  concurrency 1 (p50 ms, lower is better);
* ``transport``: our gateway's round trip per payload size (p50 ms) and its ratio to the
  best plain gRPC + msgpack server of the same run (lower is better).

Per metric the verdict is bench.transport_layers's: a difference is beyond the pairs'
spread when the interquartile range of the per-pair differences (new minus old) lies
wholly on one side of zero. Writes bench/results/paired_BENCH.json, with every run's
values, so the new side's runs are the "after" numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from bench.transport_layers import _verdict

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

Extract = Callable[[dict[str, Any]], dict[str, float]]


def _workers(doc: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for model, m in sorted(doc["models"].items()):
        r = m.get("ratios", {})
        for key, name in (("ours_c32_over_raw_batched_throughput", "c32_over_raw_batched"),
                          ("ours_c32_over_serve_c32_throughput", "c32_over_serve"),
                          ("ours_c1_added_p50_ms", "c1_added_p50_ms")):
            if key in r:
                out[f"{model}.{name}"] = float(r[key])
    return out


def _transport(doc: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for rt in doc.get("round_trip", []):
        size = f"{rt['size_bytes'] // 1024}KiB"
        out[f"round_trip_{size}.ours_p50_ms"] = float(rt["median_ms"]["ours_infer"])
        out[f"round_trip_{size}.ours_over_best_grpc_msgpack"] = float(rt["ours_vs_best_grpc_msgpack"])
    return out


METRICS: dict[str, tuple[str, Extract, Callable[[str], bool]]] = {
    # bench -> (its JSON's file name, the metrics, whether a metric is better lower)
    "workers": ("workers.json", _workers, lambda name: name.endswith("_ms")),
    "transport": ("transport.json", _transport, lambda name: True),
}


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", REPO, *args], check=True, capture_output=True, text=True).stdout.strip()


def _run(tree: str, bench: str, quick: bool, out_dir: str, log: Any) -> dict[str, Any]:
    """One run of bench.BENCH in the checkout `tree`; its JSON."""
    env = dict(os.environ, PYTHONPATH=tree)
    cmd = [sys.executable, "-m", f"bench.{bench}", "--out", out_dir] + (["--quick"] if quick else [])
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"bench.{bench} in {tree} exited with {proc.returncode}; its output is in {log.name}")
    with open(os.path.join(out_dir, METRICS[bench][0])) as f:
        doc = json.load(f)
    doc["_wall_s"] = time.monotonic() - t0
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.paired", description=__doc__.split("\n\n")[0])
    ap.add_argument("--bench", choices=sorted(METRICS), required=True)
    ap.add_argument("--old", required=True, help="the revision before the change")
    ap.add_argument("--new", default="HEAD", help="the revision after it (default HEAD)")
    ap.add_argument("--pairs", type=int, default=5, help="old/new pairs (default 5)")
    ap.add_argument("--full", action="store_true", help="full runs instead of --quick ones")
    ap.add_argument("--out", default=None, help="the JSON to write (default bench/results/paired_BENCH.json)")
    a = ap.parse_args(argv)
    if a.pairs < 4:
        raise SystemExit(f"--pairs is {a.pairs}; give at least 4, so that the pairs' spread has quartiles")
    name, extract, lower_better = METRICS[a.bench]
    revs = {"old": _git("rev-parse", a.old), "new": _git("rev-parse", a.new)}
    work = tempfile.mkdtemp(prefix=f"splitinfer-paired-{a.bench}-")
    trees = {side: os.path.join(work, side) for side in revs}
    for side, rev in revs.items():
        _git("worktree", "add", "--detach", trees[side], rev)
    runs: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    walls: dict[str, list[float]] = {"old": [], "new": []}
    loads: list[float] = []
    log_path = os.path.join(work, "runs.log")
    try:
        with open(log_path, "w") as log:
            for i in range(a.pairs):
                order = ("old", "new") if i % 2 == 0 else ("new", "old")
                for side in order:
                    out_dir = os.path.join(work, f"{side}-{i}")
                    os.makedirs(out_dir)
                    print(f"pair {i + 1}/{a.pairs}: {side} ({revs[side][:10]}) ...", end=" ", flush=True)
                    doc = _run(trees[side], a.bench, not a.full, out_dir, log)
                    runs[side].append(extract(doc))
                    walls[side].append(doc["_wall_s"])
                    loads.append(os.getloadavg()[0])
                    print(f"{doc['_wall_s']:.0f} s", flush=True)
    finally:
        for tree in trees.values():
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", tree], capture_output=True)
    common = sorted(set.intersection(*(set(r) for r in runs["old"] + runs["new"])))
    metrics = {m: _verdict([r[m] for r in runs["old"]], [r[m] for r in runs["new"]], lower_better(m))
               for m in common}
    doc = {
        "benchmark": f"paired {a.bench}", "old": revs["old"], "new": revs["new"], "pairs": a.pairs,
        "mode": "full" if a.full else "quick",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_1min_after_each_run": [round(x, 2) for x in loads]},
        "wall_s": walls, "metrics": metrics,
        "runs": runs,
    }
    out = a.out or os.path.join(RESULTS_DIR, f"paired_{a.bench}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    width = max(map(len, metrics), default=10)
    print(f"\n{'metric':<{width}}  {'old':>9}  {'new':>9}  {'new-old':>9}  interquartile        verdict")
    for m, v in metrics.items():
        q1, q3 = v["new_minus_old_interquartile"]
        print(f"{m:<{width}}  {v['old_median']:9.3f}  {v['new_median']:9.3f}  {v['new_minus_old_median']:+9.3f}  "
              f"[{q1:+.3f}, {q3:+.3f}]  {v['verdict']}")
    print(f"\nwrote {out}; the runs' output is in {log_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
