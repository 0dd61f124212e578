"""`splitinfer inspect` and `splitinfer split`: the partitioner on the command line.

MODEL is a path to an .onnx file or the short name of a zoo architecture shipped in the
`onnx` package (resnet50, densenet121, vgg19, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from partitioner import (
    Cut,
    LayerGraph,
    PartitionError,
    boundary,
    build_graph,
    chain_points,
    load_model,
    make_cut,
    make_inputs,
    plan_memory,
    save_segment,
    split,
    verify,
    zoo_path,
)
from splitinfer.model_inputs import add_input_args, inputs_from_args
from splitinfer.units import parse_args

__all__ = ["inspect_main", "split_main", "resolve_model", "format_bytes", "inspect_json", "layers_through",
           "parse_edge_layers"]


def layers_through(graph: LayerGraph, after: int, *, need_tail: bool = False) -> list[int]:
    """Layers ``0..after``, the device's side of ``--after LAYER_ID`` (always a valid cut:
    ids are a topological order); ``need_tail``: the cloud must be left a layer too.
    Raises PartitionError naming the layers that may be given."""
    last = len(graph) - (2 if need_tail else 1)
    if not 0 <= after <= last:
        what = "leaves no tail of" if need_tail and after == last + 1 else "is not a layer of"
        raise PartitionError(f"--after {after} {what} {graph.model}: give a layer in 0..{last}",
                             model=graph.model, layer=after)
    return list(range(after + 1))


def _model_from_args(args: argparse.Namespace) -> tuple[str, Any, Any, Any]:
    """The command's MODEL argument loaded: (name, ONNX model, the given inputs, layer graph at them)."""
    path, name = resolve_model(args.model)
    model = load_model(path)
    given = inputs_from_args(args, model)
    return name, model, given, build_graph(model, name=name, input_shapes=given.input_shapes, inputs=given.inputs)


def resolve_model(spec: str) -> tuple[str, str]:
    """(path, name) for a file path or a zoo short name."""
    if os.path.exists(spec) or spec.endswith(".onnx") or os.sep in spec:
        return spec, os.path.splitext(os.path.basename(spec))[0]
    return zoo_path(spec), spec.lower().removeprefix("light_")


def format_bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _flops(n: int | None) -> str:
    if n is None:
        return "?"
    if n >= 1e9:
        return f"{n / 1e9:.2f} G"
    if n >= 1e6:
        return f"{n / 1e6:.1f} M"
    return f"{n / 1e3:.1f} K"


def inspect_json(graph: LayerGraph) -> dict[str, Any]:
    """``totals.flops`` is null where some layer's FLOPs are unknown; ``flops_known`` and
    ``flops_unknown_layers`` then say how much is known."""
    mem = plan_memory(graph)
    flops = graph.flops_total()
    return {
        "model": graph.model,
        "opset": graph.opset,
        "inputs": [graph.tensor[x].to_dict() for x in graph.inputs],
        "outputs": [graph.tensor[x].to_dict() for x in graph.outputs],
        "layers": [
            {k: v for k, v in layer.to_dict().items() if k != "const_nodes"}
            for layer in graph.layers
        ],
        "tensors": [
            {k: v for k, v in t.to_dict().items() if k != "is_output"} for t in graph.tensors
        ],
        "chain_points": list(chain_points(graph)),
        "totals": {
            "layers": len(graph),
            "flops": flops.exact,
            "flops_known": flops.known,
            "flops_unknown_layers": flops.unknown,
            "param_bytes": graph.total_param_bytes,
        },
        "memory_plan": {
            "peak_bytes": mem.peak_bytes,
            "lower_bound_bytes": mem.lower_bound_bytes,
            "naive_bytes": mem.naive_bytes,
            "unknown_tensors": sum(t.bytes_per_sample is None for t in graph.tensors),
        },
    }


def _print_table(graph: LayerGraph, out: Any) -> None:
    chain = set(chain_points(graph))
    rows = []
    for layer in graph.layers:
        outs = [graph.tensor[t] for t in layer.outputs]
        shape = ("x".join(map(str, outs[0].shape)) or "scalar") if outs and outs[0].shape is not None else "?"
        nbytes = graph.bytes_total(layer.outputs).exact
        cut_bytes = graph.bytes_total(boundary(graph, Cut(frozenset(range(layer.id + 1))))).exact
        rows.append(
            (
                str(layer.id),
                "*" if layer.id in chain else "",
                layer.name[:28],
                "+".join(layer.ops)[:34],
                _flops(layer.flops),
                format_bytes(layer.param_bytes),
                shape[:20],
                format_bytes(nbytes),
                format_bytes(cut_bytes),
            )
        )
    head = ("id", "C", "layer", "ops", "FLOPs", "params", "out shape", "out", "cut after")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    print(line.format(*head), file=out)
    for r in rows:
        print(line.format(*r), file=out)
    mem = plan_memory(graph)
    flops = graph.flops_total()
    unknown = [t.name for t in graph.tensors if t.bytes_per_sample is None]
    print(
        f"\n{graph.model}: {len(graph)} layers, {flops.format(lambda n: _flops(n) + 'FLOPs')}, "
        f"{format_bytes(graph.total_param_bytes)} weights, {len(chain)} chain cut points (C)\n"
        f"inputs: {', '.join(graph.inputs)}   outputs: {', '.join(graph.outputs)}\n"
        f"activation memory plan: peak {'≥ ' if unknown else ''}{format_bytes(mem.peak_bytes)} "
        f"(lower bound {format_bytes(mem.lower_bound_bytes)}, naive {format_bytes(mem.naive_bytes)}"
        f"{f'; {len(unknown)} tensors of unknown size not counted' if unknown else ''})\n"
        "'cut after' = bytes per sample sent when layers 0..id run on the device"
        + (f"\n? = unknown: {len(unknown)} tensors of unknown size ({', '.join(unknown[:3])}"
           f"{', ...' if len(unknown) > 3 else ''}); fix the input shapes with --input-shape NAME=D0xD1x... "
           "or pass sample inputs with --inputs FILE.npz" if unknown else ""),
        file=out,
    )


def inspect_main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="splitinfer inspect", description=__doc__)
    p.add_argument("model", help="path to an .onnx file, or a zoo name such as resnet50")
    p.add_argument("--json", action="store_true", help="print JSON (see docs/cli.md)")
    add_input_args(p)
    args = parse_args(p, argv)
    _, _, _, graph = _model_from_args(args)
    if args.json:
        json.dump(inspect_json(graph), sys.stdout, indent=1)
        print()
    else:
        _print_table(graph, sys.stdout)
    return 0


def parse_edge_layers(text: str, graph: LayerGraph) -> list[int]:
    """The layer ids of ``--edge-layers`` (``0,1,2``, ``0-12``, ``0-3,7``), in order.

    Refuses, naming the value and the fix, what cannot be meant: a part that is not an
    id or a range, a reversed range (``5-3``), a layer given twice (``0-5,3-8``), a
    layer the model does not have, and a list naming no layer at all.
    """
    flag = f"--edge-layers {text!r}"
    last = len(graph) - 1

    def refuse(why: str, layer: int | None = None) -> PartitionError:
        return PartitionError(f"{flag}: {why}", model=graph.model, layer=layer)

    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo_text, dash, hi_text = part.partition("-")
        try:
            lo = int(lo_text)
            hi = int(hi_text) if dash else lo
        except ValueError:
            raise refuse(f"{part!r} is not a layer id or a range; write e.g. 0,1,2 or 0-12") from None
        if hi < lo:
            raise refuse(f"the range {part} is reversed; write {hi}-{lo}")
        for i in (lo, hi):
            if i > last:
                raise refuse(f"unknown layer {i}: {graph.model} has layers 0..{last}; give ids in 0..{last}", i)
        seen = set(out)
        twice = [i for i in range(lo, hi + 1) if i in seen]
        if twice:
            raise refuse(f"layer {twice[0]} is given twice; list each layer once", twice[0])
        out.extend(range(lo, hi + 1))
    if not out:
        raise refuse(f"names no layer; give the device's layers, e.g. 0-{min(3, last)} "
                     "('splitinfer inspect' lists them)")
    return out


def _write_split(out: str, head: Any, tail: Any, info: dict[str, Any]) -> None:
    """head.onnx, tail.onnx and split.json, all three or none: they are written in a
    temporary folder inside ``out`` and moved into it once all are written (a segment
    over 2 GB keeps its weights in a .data file beside it, which moves with it)."""
    os.makedirs(out, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".split-", dir=out)
    try:
        save_segment(head, os.path.join(tmp, "head.onnx"))
        save_segment(tail, os.path.join(tmp, "tail.onnx"))
        with open(os.path.join(tmp, "split.json"), "w") as f:
            json.dump(info, f, indent=1)
        for n in sorted(os.listdir(tmp)):
            os.replace(os.path.join(tmp, n), os.path.join(out, n))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def split_main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="splitinfer split", description="Cut a model into head.onnx and tail.onnx.")
    p.add_argument("model", help="path to an .onnx file, or a zoo name such as resnet50")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--edge-layers", help="layer ids on the device, e.g. 0,1,2 or 0-12")
    which.add_argument("--after", type=int, metavar="LAYER_ID", help="run layers 0..LAYER_ID on the device")
    p.add_argument("-o", "--out", required=True, help="output directory")
    p.add_argument("--verify", action="store_true",
                   help="check head then tail equals the whole model (ONNX Runtime), on --inputs where given, "
                        "else on random inputs at the fixed shapes")
    add_input_args(p)
    args = parse_args(p, argv)
    name, model, given, graph = _model_from_args(args)
    if args.after is not None:
        layers = layers_through(graph, args.after)
    else:
        layers = parse_edge_layers(args.edge_layers, graph)
    cut = make_cut(graph, layers)
    head, tail = split(model, cut, graph=graph)
    # verified before anything is written, so a split that fails leaves no files
    diffs = None
    if args.verify:
        feed = given.inputs if given.inputs is not None else make_inputs(model, graph, input_shapes=given.input_shapes)
        diffs = verify(model, [head, tail], feed, graph=graph)
    bnd = boundary(graph, cut)
    info: dict[str, Any] = {
        "model": name,
        "edge_layers": sorted(cut.device),
        "cut_id": cut.key,
        "boundary": list(bnd),
        "boundary_bytes_per_sample": graph.bytes_total(bnd).exact,
        "head_inputs": list(head.inputs),
        "head_outputs": list(head.outputs),
        "tail_inputs": list(tail.inputs),
        "tail_outputs": list(tail.outputs),
    }
    if diffs is not None:
        info["verify_max_abs_diff"] = diffs
    _write_split(args.out, head, tail, info)
    print(
        f"{name}: {len(cut.device)}/{len(graph)} layers on the device, boundary "
        f"{', '.join(info['boundary']) or '(none)'} = {graph.bytes_total(bnd).format(format_bytes)} per sample"
    )
    print(f"wrote {args.out}/head.onnx, tail.onnx, split.json")
    if args.verify:
        worst = max(info["verify_max_abs_diff"].values(), default=0.0)
        print(f"verified: head then tail equals the whole model (max abs diff {worst:.2g})")
    return 0
