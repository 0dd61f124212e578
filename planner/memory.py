"""Device memory of a head: the one place the planner asks how much a head needs.

head bytes = sum of the head layers' parameter bytes + the peak of the live
activations while the head runs. The peak is the arena size of
`partitioner.memplan.plan_memory` for the head when that module is present; otherwise
the largest live total from a sweep in topological order where a tensor is live
from the layer that writes it (model inputs: from the start) until its last reader on
the device, and tensors that leave the device (boundary, device-computed outputs) stay
live to the end of the head, since they are sent after it runs.
"""

from __future__ import annotations

from collections.abc import Iterable

from partitioner.graph import LayerGraph

__all__ = ["head_memory_bytes"]


def _peak_live_bytes(graph: LayerGraph, device: frozenset[int]) -> int:
    if not device:
        return 0
    order = sorted(device)
    last_pos = len(order)
    pos = {v: i for i, v in enumerate(order)}
    frees: dict[int, int] = {}
    live = 0
    start: dict[int, int] = {}
    for t in graph.tensors:
        on_dev = t.producer is None or t.producer in device
        if not on_dev:
            continue
        readers = [pos[c] for c in t.consumers if c in device]
        leaves = any(c not in device for c in t.consumers) or t.is_output
        if t.producer is None and not readers and not leaves:
            continue
        b = t.bytes_per_sample or 0
        born = -1 if t.producer is None else pos[t.producer]
        end = last_pos if leaves else (max(readers) if readers else born)
        if born < 0:
            live += b
        else:
            start[born] = start.get(born, 0) + b
        frees[end] = frees.get(end, 0) + b
    peak = live
    for i in range(len(order)):
        live += start.get(i, 0)
        peak = max(peak, live)
        live -= frees.get(i, 0)
    return peak


def head_memory_bytes(graph: LayerGraph, layers: Iterable[int]) -> int:
    """Bytes the device needs to run ``layers`` (a down-closed set) at batch 1."""
    device = frozenset(layers)
    if not device:
        return 0
    params = sum(graph.layers[v].param_bytes for v in device)
    try:
        from partitioner.memplan import plan_memory  # present once the partitioner ships it
    except ImportError:
        return params + _peak_live_bytes(graph, device)
    return params + int(plan_memory(graph, sorted(device)).peak_bytes)
