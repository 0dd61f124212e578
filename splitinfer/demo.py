"""`splitinfer demo`: the main job on embedded defaults, no set-up.

Today it shows the foundation end to end on a zoo model: the layer graph, the chain cut
points with what each would send, a split at the cut that sends the least, and a check
with ONNX Runtime that head then tail equals the whole model.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence

from partitioner import (
    boundary,
    boundary_bytes,
    build_graph,
    chain_points,
    make_inputs,
    plan_memory,
    prefix_cut,
    save_segment,
    split,
    verify,
)
from partitioner.zoo import load_zoo
from splitinfer.partition_cmd import format_bytes

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="splitinfer demo", description=__doc__)
    p.add_argument("--model", default="resnet50", help="zoo model name (default resnet50)")
    p.add_argument("-o", "--out", default="demo-report", help="where to write the segments and report")
    p.add_argument("--quick", action="store_true", help="accepted for compatibility; the demo is already quick")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    print(f"[1/4] loading {args.model} from the onnx package's model zoo (random seeded weights)")
    model = load_zoo(args.model, random_weights=True, seed=0)
    graph = build_graph(model, name=args.model)
    mem = plan_memory(graph)
    print(
        f"      {len(graph)} layers, {graph.total_flops / 1e9:.2f} GFLOPs, "
        f"{format_bytes(graph.total_param_bytes)} of weights, activation arena "
        f"{format_bytes(mem.peak_bytes)} (naive {format_bytes(mem.naive_bytes)})"
    )

    chain = chain_points(graph)
    print(f"[2/4] {len(chain)} chain cut points; bytes per sample each would send:")
    input_bytes = graph.output_bytes(graph.inputs)
    rows = []
    for v in chain[:-1]:
        cut = prefix_cut(graph, v)
        rows.append((v, len(cut), boundary_bytes(graph, cut)))
    for v, n, b in rows:
        bar = "#" * max(1, round(30 * b / max(r[2] for r in rows)))
        print(f"      after layer {v:4d} ({n:4d} on device)  {format_bytes(b):>10}  {bar}")
    print(f"      (the raw input is {format_bytes(input_bytes)})")

    inner = [r for r in rows if 0 < r[0]] or rows
    best = min(inner, key=lambda r: (r[2], -r[0]))
    cut = prefix_cut(graph, best[0])
    print(f"[3/4] splitting after layer {best[0]}: it sends {format_bytes(best[2])} per sample")
    head, tail = split(model, cut, graph=graph)
    os.makedirs(args.out, exist_ok=True)
    save_segment(head, os.path.join(args.out, "head.onnx"))
    save_segment(tail, os.path.join(args.out, "tail.onnx"))

    print("[4/4] verifying with ONNX Runtime: head then tail against the whole model")
    diffs = verify(model, [head, tail], make_inputs(model, graph, seed=1), graph=graph)
    worst = max(diffs.values(), default=0.0)
    report = {
        "model": args.model,
        "layers": len(graph),
        "chain_points": list(chain),
        "cut_after_layer": best[0],
        "edge_layers": sorted(cut.device),
        "boundary": list(boundary(graph, cut)),
        "boundary_bytes_per_sample": best[2],
        "input_bytes_per_sample": input_bytes,
        "verify_max_abs_diff": diffs,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    with open(os.path.join(args.out, "split.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"      equal within tolerance (max abs diff {worst:.2g}); wrote {args.out}/head.onnx, tail.onnx, split.json")
    print(f"done in {report['seconds']} s")
    return 0
