"""How fast the partitioner builds layer graphs and exports splits, and how good its
memory plans are.

Run: ``python -m bench.partitioner``. Writes ``bench/results/partitioner.json`` and
``.png``. Per zoo model, side by side in one run:
- graph build time (median of 5, from a loaded ModelProto: the time `build_graph` takes);
- one split export (head and tail, with the ONNX checker on), median over the model's
  chain cut points: warm (a kept `Splitter`, the way the gateway cuts a loaded model)
  and cold (one `split` call, per-model shape inference included), against
  `onnx.utils.Extractor` extracting the same head and tail from a shape-inferred model
  (the peer a user would reach for), as a ratio;
- the memory plan's peak against its lower bound (the limit) and the naive sum.
Targets on this machine: DenseNet121 builds in under 1 s and exports a split in under
100 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any

import onnx

from partitioner import ZOO_MODELS, Splitter, boundary, build_graph, chain_points, load_model, plan_memory, prefix_cut, split, zoo_path

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _median_s(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_model(name: str, *, cuts: int, extractor_cuts: int) -> dict[str, Any]:
    model = load_model(zoo_path(name))
    build_s = _median_s(lambda: build_graph(model, name=name), 5)
    g = build_graph(model, name=name)
    pts = chain_points(g)
    step = max(1, len(pts) // cuts)
    chosen = [prefix_cut(g, v) for v in pts[::step][:cuts]]
    # cold: one `split` call does the per-model analysis too; warm: a kept Splitter
    cold_times = [_median_s(lambda c=c: split(model, c, graph=g), 3) for c in chosen]
    splitter = Splitter(model, g)
    split_times = [_median_s(lambda c=c: splitter.split(c), 3) for c in chosen]

    extractor_times = []
    for c in chosen[:extractor_cuts]:
        bnd = list(boundary(g, c))
        head_out = [x for x in bnd if g.tensor[x].producer is not None] or list(g.outputs)
        t = time.perf_counter()
        # the Extractor's own inference cannot see ConstantOfShape weight shapes
        ex = onnx.utils.Extractor(onnx.shape_inference.infer_shapes(model, data_prop=True))
        ex.extract_model(list(g.inputs), head_out)
        ex.extract_model(bnd, list(g.outputs))
        extractor_times.append(time.perf_counter() - t)
    ours_same = statistics.median(split_times[: len(extractor_times)])
    mem = plan_memory(g)
    return {
        "layers": len(g),
        "nodes": len(model.graph.node),
        "chain_points": len(pts),
        "build_ms": build_s * 1e3,
        "split_export_ms_median": statistics.median(split_times) * 1e3,
        "split_export_cold_ms_median": statistics.median(cold_times) * 1e3,
        "split_export_ms_max": max(split_times) * 1e3,
        "extractor_ms_median": statistics.median(extractor_times) * 1e3,
        "extractor_over_ours": statistics.median(extractor_times) / ours_same,
        "memory": {
            "peak_bytes": mem.peak_bytes,
            "lower_bound_bytes": mem.lower_bound_bytes,
            "naive_bytes": mem.naive_bytes,
            "peak_over_lower_bound": mem.peak_bytes / mem.lower_bound_bytes,
            "saving_vs_naive": mem.saving,
        },
    }


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["models"])
    m = results["models"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    ax.bar(names, [m[n]["build_ms"] for n in names], color="#4c72b0")
    ax.axhline(1000, color="red", ls="--", lw=1, label="target for DenseNet121 (1 s)")
    ax.set_ylabel("ms")
    ax.set_title("layer-graph build time")
    ax.legend()
    ax = axes[1]
    x = range(len(names))
    ax.bar([i - 0.27 for i in x], [m[n]["split_export_ms_median"] for n in names], 0.27, label="ours (kept Splitter)", color="#4c72b0")
    ax.bar(list(x), [m[n]["split_export_cold_ms_median"] for n in names], 0.27, label="ours (cold split call)", color="#8fb0d9")
    ax.bar([i + 0.27 for i in x], [m[n]["extractor_ms_median"] for n in names], 0.27, label="onnx Extractor", color="#dd8452")
    ax.axhline(100, color="red", ls="--", lw=1, label="target for DenseNet121 (100 ms)")
    ax.set_yscale("log")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("ms per head+tail export (log)")
    ax.set_title("one split export")
    ax.set_ylim(top=ax.get_ylim()[1] * 8)
    ax.legend(fontsize=8, loc="upper left", ncol=2)
    ax = axes[2]
    ax.bar([i - 0.2 for i in x], [m[n]["memory"]["peak_over_lower_bound"] for n in names], 0.4, label="plan peak / lower bound")
    ax.bar([i + 0.2 for i in x], [m[n]["memory"]["naive_bytes"] / m[n]["memory"]["lower_bound_bytes"] for n in names], 0.4, label="naive sum / lower bound")
    ax.axhline(1.1, color="red", ls="--", lw=1, label="10% over the bound")
    ax.set_xticks(list(x), names)
    ax.set_title("activation memory plan")
    ax.legend(fontsize=8, loc="upper left")
    for a in axes:
        a.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cuts", type=int, default=8, help="chain cut points per model to export")
    ap.add_argument("--extractor-cuts", type=int, default=2, help="of those, how many to extract with onnx's Extractor too")
    ap.add_argument("--out", default=RESULTS_DIR)
    args = ap.parse_args(argv)
    results: dict[str, Any] = {
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(), "onnx": onnx.__version__},
        "models": {},
    }
    for name in ZOO_MODELS:
        r = bench_model(name, cuts=args.cuts, extractor_cuts=args.extractor_cuts)
        results["models"][name] = r
        print(
            f"{name:14s} build {r['build_ms']:7.1f} ms  split {r['split_export_ms_median']:7.1f} ms "
            f"(cold {r['split_export_cold_ms_median']:7.1f} ms) "
            f"(Extractor {r['extractor_ms_median']:8.1f} ms, x{r['extractor_over_ours']:.1f})  "
            f"memory peak/bound {r['memory']['peak_over_lower_bound']:.3f} saving {r['memory']['saving_vs_naive']:.0%}"
        )
    d = results["models"]["densenet121"]
    results["targets"] = {
        "densenet121_build_under_1s": d["build_ms"] < 1000,
        "densenet121_split_under_100ms": d["split_export_ms_median"] < 100,
        "memory_peak_within_10pct_all": all(m["memory"]["peak_over_lower_bound"] <= 1.10 for m in results["models"].values()),
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "partitioner.json"), "w") as f:
        json.dump(results, f, indent=1)
    plot(results, os.path.join(args.out, "partitioner.png"))
    print(json.dumps(results["targets"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
