"""Synthetic profiles: per-layer times drawn from FLOPs, for tests and benchmarks.

They are not measurements; `workers.profile` writes real ones.
"""

from __future__ import annotations

import random

from partitioner.graph import LayerGraph
from planner.devices import unknown_work_error
from planner.profile import Corrections, Profile

__all__ = ["make_random_profile", "make_flops_profile"]


def make_flops_profile(
    graph: LayerGraph,
    *,
    device: str,
    gflops: float,
    fixed_ms: float = 0.0,
    compute_w: float = 0.0,
    radio_tx_w: float = 0.0,
    idle_w: float = 0.0,
    batch_ms: dict[int, float] | None = None,
    unknown_flops_ms: float | None = None,
) -> Profile:
    """Roofline-free times: layer ms = flops / (gflops * 1e9) * 1000. A layer of unknown
    FLOPs has no such time: a PlannerError names it (never priced as free), unless the
    caller says what it takes with ``unknown_flops_ms``."""
    if unknown_flops_ms is None:
        _require_flops(graph, f"a {gflops:g} GFLOP/s roofline")
    layers = {layer.id: {"ms": unknown_flops_ms if layer.flops is None else layer.flops / (gflops * 1e9) * 1e3}
              for layer in graph.layers}
    d = {
        "schema": "splitinfer.profile/1", "model": graph.model, "device": device, "layers": layers,
        "fixed_ms": fixed_ms, "compute_w": compute_w, "radio_tx_w": radio_tx_w, "idle_w": idle_w,
        "batch_ms": None if batch_ms is None else {str(k): v for k, v in batch_ms.items()},
    }
    return Profile.from_dict(d)


def make_random_profile(
    graph: LayerGraph,
    seed: int,
    *,
    device: str = "synthetic",
    gflops: float | None = None,
    jitter: float = 0.5,
    fixed_ms: float | None = None,
    corrections: bool = False,
    batching: bool = False,
) -> Profile:
    """Layer ms from FLOPs at a random speed (``gflops``), times a log-normal jitter
    (fused and memory-bound layers do not follow FLOPs), plus random power figures.
    """
    _require_flops(graph, "a random profile")
    rng = random.Random(seed)
    speed = gflops if gflops is not None else 10 ** rng.uniform(0.5, 3.5)
    layers = {
        layer.id: {"ms": layer.flops / (speed * 1e9) * 1e3 * rng.lognormvariate(0.0, jitter)}
        for layer in graph.layers
    }
    total = sum(v["ms"] for v in layers.values())
    batch_ms = None
    if batching:
        batch_ms = {str(b): total * b * (1.0 / (1.0 + 0.6 * (1.0 - 1.0 / b))) for b in (2, 4, 8)}
    corr = None
    if corrections:
        corr = Corrections(scale=rng.uniform(0.6, 1.0), offset_ms=rng.uniform(0.0, 2.0), segments=4).to_dict()
    return Profile.from_dict({
        "schema": "splitinfer.profile/1", "model": graph.model, "device": device, "layers": layers,
        "fixed_ms": rng.uniform(0.0, 3.0) if fixed_ms is None else fixed_ms,
        "batch_ms": batch_ms, "corrections": corr,
        "compute_w": rng.uniform(1.0, 8.0), "radio_tx_w": rng.uniform(0.5, 3.0), "idle_w": rng.uniform(0.0, 1.0),
    })


def _require_flops(graph: LayerGraph, what: str) -> None:
    unknown = [ly for ly in graph.layers if ly.flops is None]
    if unknown:
        raise unknown_work_error(graph, unknown, what)
