"""Static memory plans for a segment's activations.

Tensor lifetimes follow the segment's execution order (its layers in topological
order); offsets come from greedy-by-size placement, the idea of TFLite's arena planner:
place the largest tensor first at the lowest offset where it overlaps no tensor whose
lifetime intersects its own. The plan reports its peak (the arena size), the lower
bound (the largest total of bytes live at any one step: no plan can beat it) and the
naive sum (every tensor its own buffer). The planner uses the peak as the head's
activation memory.

The unit is the layer: tensors inside a layer are what ONNX Runtime fuses away, so
only tensors that connect layers (and the segment's inputs and outputs) are planned.

A tensor of unknown size (no shape inference knows it) cannot be placed: the plan
places the known ones and names the others in ``unknown_tensors``, so that its figures
are lower bounds there (`MemoryPlan.peak` says so), never a plan that counts them as 0.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from partitioner.graph import LayerGraph, Total

__all__ = ["Allocation", "MemoryPlan", "plan_memory", "plan_lifetimes"]


@dataclass(frozen=True)
class Allocation:
    tensor: str
    offset_bytes: int
    size_bytes: int
    first_step: int
    """Step at which the tensor is written (0 for a segment input)."""
    last_step: int
    """Last step that reads it (the final step for a segment output)."""


@dataclass(frozen=True)
class MemoryPlan:
    allocations: tuple[Allocation, ...]
    steps: int
    peak_bytes: int
    """Arena size: the highest offset + size of any allocation."""
    lower_bound_bytes: int
    """The largest total of bytes live at one step."""
    naive_bytes: int
    """The sum of all tensor sizes (one buffer each, no reuse)."""
    unknown_tensors: tuple[str, ...] = ()
    """Tensors of unknown size the segment holds: left out of the figures above, which
    are then lower bounds."""

    @property
    def peak(self) -> Total:
        """The arena size, and how many tensors of unknown size it leaves out."""
        return Total(self.peak_bytes, len(self.unknown_tensors))

    @property
    def saving(self) -> float:
        """Fraction of the naive sum that the plan saves."""
        return 1.0 - self.peak_bytes / self.naive_bytes if self.naive_bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "peak_bytes": self.peak_bytes,
            "lower_bound_bytes": self.lower_bound_bytes,
            "naive_bytes": self.naive_bytes,
            "saving": self.saving,
            "unknown_tensors": list(self.unknown_tensors),
            "allocations": [a.__dict__ for a in self.allocations],
        }


def plan_lifetimes(graph: LayerGraph, layers: Iterable[int] | None = None) -> list[tuple[str, int | None, int, int]]:
    """(tensor, bytes, first step, last step) for every activation a segment holds;
    bytes are None where the size is unknown."""
    seg = sorted(range(len(graph)) if layers is None else set(layers))
    step_of = {lid: k for k, lid in enumerate(seg)}
    last = max(len(seg) - 1, 0)
    out = []
    for t in graph.tensors:
        inside_readers = [step_of[c] for c in t.consumers if c in step_of]
        produced_here = t.producer is not None and t.producer in step_of
        if not produced_here and not inside_readers:
            continue
        first = step_of[t.producer] if produced_here else 0
        leaves = t.is_output or any(c not in step_of for c in t.consumers)
        end = last if (produced_here and leaves) else max(inside_readers, default=first)
        out.append((t.name, t.bytes_per_sample, first, end))
    return out


def plan_memory(graph: LayerGraph, layers: Iterable[int] | None = None, *, batch: int = 1) -> MemoryPlan:
    """Greedy-by-size arena plan for the segment of ``layers`` (default: whole model);
    tensors of unknown size are named in ``unknown_tensors``, not placed."""
    every = plan_lifetimes(graph, layers)
    lives = [(n, b * batch, f, e) for n, b, f, e in every if b is not None]
    steps = 1 + max((e for *_, e in every), default=-1)
    live_at = [0] * max(steps, 1)
    for _, b, f, e in lives:
        for s in range(f, e + 1):
            live_at[s] += b
    placed = min(
        (_place(lives, order, fit) for order in _ORDERS for fit in (_first_fit, _best_fit)),
        key=lambda p: max((a.offset_bytes + a.size_bytes for a in p), default=0),
    )
    placed.sort(key=lambda a: (a.first_step, a.tensor))
    return MemoryPlan(
        allocations=tuple(placed),
        steps=steps,
        peak_bytes=max((a.offset_bytes + a.size_bytes for a in placed), default=0),
        lower_bound_bytes=max(live_at, default=0),
        naive_bytes=sum(b for _, b, _, _ in lives),
        unknown_tensors=tuple(n for n, b, _, _ in every if b is None),
    )


# Greedy-by-size first; the other orders win on some graphs (DenseNet's long-lived
# concatenations), so the planner tries each and keeps the smallest arena.
_ORDERS = (
    lambda x: (-x[1], x[2], x[0]),  # size
    lambda x: (-x[1] * (x[3] - x[2] + 1), x[2], x[0]),  # size x lifetime
    lambda x: (-(x[3] - x[2]), -x[1], x[0]),  # lifetime
    lambda x: (x[2], -x[1], x[0]),  # execution order
)


def _place(lives: list[tuple[str, int, int, int]], order: Any, fit: Any) -> list[Allocation]:
    placed: list[Allocation] = []
    for name, size, first, last in sorted(lives, key=order):
        busy = sorted(
            (a.offset_bytes, a.offset_bytes + a.size_bytes)
            for a in placed
            if a.first_step <= last and first <= a.last_step
        )
        placed.append(Allocation(name, fit(busy, size), size, first, last))
    return placed


def _best_fit(busy: list[tuple[int, int]], size: int) -> int:
    """The offset of the smallest gap that holds ``size`` (or the top of the arena)."""
    best, best_gap = None, None
    offset = 0
    for lo, hi in busy:
        gap = lo - offset
        if gap >= size and (best_gap is None or gap < best_gap):
            best, best_gap = offset, gap
        offset = max(offset, hi)
    return offset if best is None else best


def _first_fit(busy: list[tuple[int, int]], size: int) -> int:
    """Lowest offset where [offset, offset+size) misses every busy interval."""
    offset = 0
    for lo, hi in busy:
        if lo - offset >= size:
            return offset
        offset = max(offset, hi)
    return offset
