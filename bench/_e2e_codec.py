"""The device profile's casts, timed on the emulated edge (bench.e2e).

[Note: casts on the device]
The emulated edge stretches each encode to the slowdown times its CPU time there
(edge_agent.device, [Note: time-scaled device]), and a cast's time depends on the values
cast (a model input's fp16 cast is about 3x cheaper per MB than a post-ReLU map's), so the
device profile's `CodecModel` comes from the edge itself: fp32, fp16 and int8 requests over
the fast link at the input cut and at one feature-map cut (the served chain cut with the
fewest device layers), round-robin over the encodings. A request's ``encode_ms`` is the
cast and the building of the request; fp32 casts nothing, so its median is the fixed ms
per tensor sent, and the casts' figures per MB are what each encoding takes beyond it.
Priced from the defaults times the slowdown instead, ZFNet-512's fp16 input was predicted
at 20.6 ms and took 43.5 ms, and the planner sent fp16 where fp32 was faster.
"""

from __future__ import annotations

from dataclasses import replace
from statistics import median
from typing import Any

__all__ = ["casts_on_edge", "timed_round_robin"]

_ENCODINGS = ("fp32", "fp16", "int8")


def _float_mb(graph: Any, names: list[str]) -> float:
    return sum(float(graph.tensor[n].bytes_per_sample or 0) for n in names
               if graph.tensor[n].dtype == "float32") / 1e6


def timed_round_robin(edge: Any, cand_id: str, encodings: list[str], reps: int) -> dict[str, list[float]]:
    """Encode ms of `reps` requests per encoding at the cut `cand_id`, one request of each
    encoding per round, as the grid sends its candidates (each after other work)."""
    ms: dict[str, list[float]] = {k: [] for k in encodings}
    for _ in range(reps):
        for k in encodings:
            r = edge.job(cand_id, k, 1)
            if "error" not in r:
                ms[k] += [x["encode_ms"] for x in r["rows"]]
    return ms


def casts_on_edge(edge: Any, graph: Any, cands: list[dict[str, Any]], known: set[str], device: Any, *,
                  reps: int = 5) -> tuple[Any, dict[str, Any]]:
    """`device` with its codec's casts timed on the edge ([Note: casts on the device]) and
    what was timed; `device` unchanged where neither cut is served or a figure is missing."""
    from partitioner import Cut, make_cut

    empty = make_cut(graph, []).key
    served = [c for c in cands if c["id"] in known and not c["local"] and c["boundary"]]
    at_input = next((c for c in served if c["id"] == empty), None)
    maps = [c for c in served if c["head_path"] and _float_mb(graph, c["boundary"]) > 0
            and not set(c["boundary"]) & set(graph.inputs)]
    at_map = min(maps, key=lambda c: len(Cut.from_key(c["cut_key"]).device)) if maps else None
    seen: dict[str, Any] = {}
    for what, cand in (("input", at_input), ("feature_map", at_map)):
        if cand is None:
            continue
        ms = timed_round_robin(edge, cand["id"], list(_ENCODINGS), reps)
        if all(ms.values()):
            seen[what] = {"cut_id": cand["id"], "tensors": len(cand["boundary"]),
                          "mb": _float_mb(graph, cand["boundary"]),
                          "encode_ms": {k: median(v) for k, v in ms.items()}, "n": len(ms["fp32"])}
    if not seen:
        return device, {"note": "no cut with a float32 boundary was served; the device keeps its codec"}
    fixed = median(v["encode_ms"]["fp32"] / v["tensors"] for v in seen.values())

    def rates(v: dict[str, Any]) -> dict[str, float]:
        beyond = {k: max(0.0, v["encode_ms"][k] - fixed * v["tensors"]) for k in ("fp16", "int8")}
        return {k: ms / v["mb"] for k, ms in beyond.items()}

    fm = rates(seen.get("feature_map") or seen["input"])
    codec = replace(device.codec, encode_ms_per_mb=dict(device.codec.encode_ms_per_mb) | fm,
                    input_encode_ms_per_mb=rates(seen["input"]) if "input" in seen else None,
                    encode_fixed_ms=fixed, source="the emulated edge: fp32/fp16/int8 requests over the fast link")
    seen |= {"encode_fixed_ms": fixed, "input_ms_per_mb": rates(seen["input"]) if "input" in seen else None,
             "feature_map_ms_per_mb": fm,
             "default_ms_per_mb": {k: device.codec.encode_ms_per_mb[k] for k in ("fp16", "int8")}}
    return replace(device, codec=codec), seen
