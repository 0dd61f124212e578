"""Cuts: which layers run on the device, and what crosses to the cloud.

A cut is the set of layers placed on the device. It must be down-closed: every producer
of a device layer is on the device too. Its *boundary* is every tensor that crosses from
the device side to the cloud side, counted once however many cloud layers read it; a
model input that a cloud layer reads is part of it. Model outputs computed on the device
come back without a round trip.

A multi-tier plan is a chain of nested cuts (device within edge server within cloud):
tier ``i`` runs ``cuts[i] - cuts[i-1]``.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from partitioner.errors import PartitionError
from partitioner.graph import LayerGraph

__all__ = [
    "Cut",
    "make_cut",
    "is_down_closed",
    "down_closure",
    "boundary",
    "boundary_bytes",
    "device_outputs",
    "cloud_outputs",
    "chain_points",
    "prefix_cut",
    "candidate_cuts",
    "random_cut",
    "make_tiers",
    "tier_layers",
    "id_ranges",
]


def id_ranges(ids: Iterable[int]) -> list[str]:
    """Sorted layer ids as runs of consecutive ids: [0, 1, 2, 5, 7, 8] -> ['0-2', '5', '7-8']."""
    ordered = sorted(ids)
    parts, i = [], 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return parts


@dataclass(frozen=True)
class Cut:
    """The layers on the device side. Valid cuts come from `make_cut` or the generators."""

    device: frozenset[int]

    def __len__(self) -> int:
        return len(self.device)

    def __contains__(self, layer: object) -> bool:
        return layer in self.device

    def to_dict(self) -> dict[str, Any]:
        return {"edge_layers": sorted(self.device)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Cut:
        return cls(frozenset(int(x) for x in d["edge_layers"]))

    @property
    def key(self) -> str:
        """A short stable id for the cut: the wire protocol's cut id.

        Layer ranges after an ``L`` (``L0-24``, ``L0-10_12_14-20``; ``L`` alone is the
        empty cut), so any receiver holding the graph can rebuild the cut with
        `Cut.from_key`. A cut whose ranges would exceed 120 characters gets a hash
        (``H`` + 16 hex digits) instead, which only a receiver that knows the cut can map.
        """
        key = "L" + "_".join(id_ranges(self.device))
        if len(key) <= 120:
            return key
        import hashlib

        return "H" + hashlib.sha1(",".join(map(str, sorted(self.device))).encode()).hexdigest()[:16]

    @classmethod
    def from_key(cls, key: str) -> Cut | None:
        """The cut a range key names; None for a hashed key. Not validated: use make_cut."""
        if not key.startswith("L"):
            return None
        layers: set[int] = set()
        try:
            for part in filter(None, key[1:].split("_")):
                lo, _, hi = part.partition("-")
                layers.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise PartitionError(
                f"cut id {key!r} is malformed; a cut id is 'L' followed by layer ranges such as L0-24_26"
            ) from None
        return cls(frozenset(layers))


def _check_ids(graph: LayerGraph, layers: Iterable[int]) -> frozenset[int]:
    out = set()
    for x in layers:
        try:
            i = int(x)
        except (TypeError, ValueError):
            raise PartitionError(
                f"layer id {x!r} is not an integer; give layer ids as listed by "
                f"'splitinfer inspect' (0..{len(graph) - 1})",
                model=graph.model,
            ) from None
        if not 0 <= i < len(graph):
            raise PartitionError(
                f"unknown layer {i}: {graph.model} has layers 0..{len(graph) - 1}",
                model=graph.model,
                layer=i,
            )
        out.add(i)
    return frozenset(out)


def make_cut(graph: LayerGraph, layers: Iterable[int]) -> Cut:
    """Validate ``layers`` as a device set and return the cut.

    Raises PartitionError naming the first layer whose producer is missing.
    """
    device = _check_ids(graph, layers)
    for i in sorted(device):
        missing = sorted(graph.preds[i] - device)
        if missing:
            p = missing[0]
            raise PartitionError(
                f"cut is not down-closed: layer {i} ({graph.layers[i].name}) is on the "
                f"device but its producer layer {p} ({graph.layers[p].name}) is not; "
                f"add layer {p} to the edge layers or remove layer {i}",
                model=graph.model,
                layer=i,
            )
    return Cut(device)


def is_down_closed(graph: LayerGraph, layers: Iterable[int]) -> bool:
    s = set(layers)
    return all(graph.preds[i] <= s for i in s)


def down_closure(graph: LayerGraph, layers: Iterable[int]) -> frozenset[int]:
    """The smallest valid device set that contains ``layers``."""
    out: set[int] = set()
    stack = list(_check_ids(graph, layers))
    while stack:
        i = stack.pop()
        if i in out:
            continue
        out.add(i)
        stack.extend(graph.preds[i] - out)
    return frozenset(out)


def boundary(graph: LayerGraph, cut: Cut) -> tuple[str, ...]:
    """Tensors that cross from the device to the cloud, in graph order, each once."""
    out = []
    for t in graph.tensors:
        on_device = t.producer is None or t.producer in cut.device
        if on_device and any(c not in cut.device for c in t.consumers):
            out.append(t.name)
    return tuple(out)


def boundary_bytes(graph: LayerGraph, cut: Cut) -> int | None:
    """Bytes per sample that the device sends; None where a boundary tensor's size is
    unknown (``graph.bytes_total(boundary(graph, cut))`` says how much is known)."""
    return graph.bytes_total(boundary(graph, cut)).exact


def device_outputs(graph: LayerGraph, cut: Cut) -> tuple[str, ...]:
    """Model outputs computed on the device (they need no round trip)."""
    return tuple(
        n for n in graph.outputs if _producer_side(graph, n, cut.device)
    )


def cloud_outputs(graph: LayerGraph, cut: Cut) -> tuple[str, ...]:
    """Model outputs computed in the cloud (they come back on the downlink)."""
    return tuple(
        n for n in graph.outputs if not _producer_side(graph, n, cut.device)
    )


def _producer_side(graph: LayerGraph, name: str, device: frozenset[int]) -> bool:
    p = graph.tensor[name].producer
    return p is None or p in device


def _ancestor_masks(graph: LayerGraph) -> list[int]:
    """Bitmask of each layer's ancestors, itself included."""
    masks = [0] * len(graph)
    for i in range(len(graph)):
        m = 1 << i
        for p in graph.preds[i]:
            m |= masks[p]
        masks[i] = m
    return masks


def chain_points(graph: LayerGraph) -> tuple[int, ...]:
    """Layers after which the model can be cut with only that layer's outputs crossing.

    Layer v is a chain point (QDMP's articulation point) when every layer is an
    ancestor or a descendant of v, and no tensor from a strict ancestor of v, nor a
    model input, is read by a strict descendant: cutting right after v sends v's
    outputs and nothing else.
    """
    n = len(graph)
    anc = _ancestor_masks(graph)
    desc = [0] * n
    for i in range(n - 1, -1, -1):
        m = 1 << i
        for s in graph.succs[i]:
            m |= desc[s]
        desc[i] = m
    full = (1 << n) - 1
    # For every tensor: who produced it (None: model input) and the mask of readers.
    readers = [(t.producer, sum(1 << c for c in t.consumers)) for t in graph.tensors]
    out = []
    for v in range(n):
        if anc[v] | desc[v] != full:
            continue
        inside = anc[v]
        if all(
            p == v or (mask & ~inside) == 0
            for p, mask in readers
            if p is None or (inside >> p) & 1
        ):
            out.append(v)
    return tuple(out)


def prefix_cut(graph: LayerGraph, layer: int) -> Cut:
    """The cut that puts ``layer`` and everything it depends on on the device."""
    return Cut(down_closure(graph, [layer]))


def candidate_cuts(graph: LayerGraph) -> list[Cut]:
    """Valid cuts worth considering, without duplicates, smallest first.

    The empty cut (cloud only), the full cut (edge only), the ancestor closure of
    every layer, and every prefix of the topological order. Each is valid by
    construction. The exact planner does not need this list; it is for chain scans,
    tests and what-if tables.
    """
    anc = _ancestor_masks(graph)
    seen: set[int] = {0, (1 << len(graph)) - 1}
    masks = [0, (1 << len(graph)) - 1]
    for m in anc:
        if m not in seen:
            seen.add(m)
            masks.append(m)
    prefix = 0
    for i in range(len(graph)):
        prefix |= 1 << i
        if prefix not in seen:
            seen.add(prefix)
            masks.append(prefix)
    masks.sort(key=lambda m: (m.bit_count(), m))
    return [Cut(frozenset(_bits(m))) for m in masks]


def _bits(m: int) -> Iterable[int]:
    i = 0
    while m:
        if m & 1:
            yield i
        m >>= 1
        i += 1


def random_cut(graph: LayerGraph, rng: random.Random) -> Cut:
    """A random valid cut: the down-closure of a random set of layers."""
    n = len(graph)
    if n == 0:
        return Cut(frozenset())
    p = rng.random()
    picks = [i for i in range(n) if rng.random() < p * 0.3]
    return Cut(down_closure(graph, picks))


def make_tiers(graph: LayerGraph, cuts: Sequence[Iterable[int]]) -> tuple[Cut, ...]:
    """Validate a chain of nested cuts (k-1 cuts for k segments)."""
    out = tuple(make_cut(graph, c) for c in cuts)
    for i in range(1, len(out)):
        extra = sorted(out[i - 1].device - out[i].device)
        if extra:
            raise PartitionError(
                f"tier cuts must be nested: layer {extra[0]} is in tier cut {i - 1} "
                f"but not in tier cut {i}; each tier's cut must contain the previous one",
                model=graph.model,
                layer=extra[0],
            )
    return out


def tier_layers(graph: LayerGraph, cuts: Sequence[Cut]) -> list[frozenset[int]]:
    """The layer set of each of the len(cuts)+1 segments."""
    full = frozenset(range(len(graph)))
    bounds = [frozenset()] + [c.device for c in cuts] + [full]
    return [bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)]
