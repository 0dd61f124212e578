"""Device memory of a head: the one place the planner asks how much a head needs.

head bytes = sum of the head layers' parameter bytes + the peak of the live
activations while the head runs: the arena size of `partitioner.memplan.plan_memory`
for the head. A head that holds a tensor of unknown size needs an unknown amount
(None): the planner never counts it as 0, so such a head never fits a memory limit,
and `unknown_head_tensors` names the tensors for the message.
"""

from __future__ import annotations

from collections.abc import Iterable

from partitioner.graph import LayerGraph
from partitioner.memplan import plan_memory

__all__ = ["head_memory_bytes", "unknown_head_tensors"]


def head_memory_bytes(graph: LayerGraph, layers: Iterable[int]) -> int | None:
    """Bytes the device needs to run ``layers`` (a down-closed set) at batch 1; None
    where the head holds a tensor of unknown size."""
    device = frozenset(layers)
    if not device:
        return 0
    plan = plan_memory(graph, sorted(device))
    if plan.unknown_tensors:
        return None
    return sum(graph.layers[v].param_bytes for v in device) + int(plan.peak_bytes)


def unknown_head_tensors(graph: LayerGraph, layers: Iterable[int]) -> tuple[str, ...]:
    """The tensors of unknown size that a head of ``layers`` holds."""
    device = frozenset(layers)
    return plan_memory(graph, sorted(device)).unknown_tensors if device else ()
