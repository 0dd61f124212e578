"""The registry's frontier of one version: the cuts whose tails are preloaded, and the
planner frontier edge agents get (`compute_frontier`; frontier.json is `VersionFrontier`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["FRONTIER_SCHEMA", "CutEntry", "VersionFrontier", "compute_frontier"]

FRONTIER_SCHEMA = "splitinfer.registry-frontier/1"


@dataclass(frozen=True)
class CutEntry:
    """One preloaded cut of a version."""

    cut_id: str
    """`partitioner.Cut.key`: the cut id on the wire."""
    edge_layers: tuple[int, ...]
    """Layers the device runs."""
    boundary: tuple[str, ...]
    """Tensors the device sends (the tail's inputs)."""

    def to_dict(self) -> dict[str, Any]:
        return {"cut_id": self.cut_id, "edge_layers": list(self.edge_layers), "boundary": list(self.boundary)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CutEntry:
        return cls(str(d["cut_id"]), tuple(int(x) for x in d["edge_layers"]), tuple(d["boundary"]))


@dataclass(frozen=True)
class VersionFrontier:
    """frontier.json: the cuts whose tails are preloaded, and the planner frontier if any."""

    source: str
    """'planner' (computed from profiles/) or 'default' (chain points)."""
    cuts: tuple[CutEntry, ...]
    """The cuts to preload, device-light first."""
    planner: Mapping[str, Any] | None = None
    """`planner.Frontier.to_dict()` when source is 'planner', for edge agents."""
    min_agreement: float | None = None
    """The accuracy budget the planner frontier keeps to (model.yaml's), for edge agents."""
    inputs_digest: str = ""
    """A digest of what it was computed from ([Note: frontier inputs] in cluster/_registry_disk.py)."""

    def to_json(self) -> str:
        return json.dumps({"schema": FRONTIER_SCHEMA, "source": self.source,
                           "cuts": [c.to_dict() for c in self.cuts], "planner": self.planner}
                          | ({} if self.min_agreement is None else {"min_agreement": self.min_agreement})
                          | ({"inputs_digest": self.inputs_digest} if self.inputs_digest else {}),
                          sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str) -> VersionFrontier:
        d = json.loads(text)
        if d.get("schema") != FRONTIER_SCHEMA:
            raise ValueError(f"schema {d.get('schema')!r} is not {FRONTIER_SCHEMA!r}")
        return cls(d["source"], tuple(CutEntry.from_dict(c) for c in d["cuts"]), d.get("planner"),
                   d.get("min_agreement"), str(d.get("inputs_digest", "")))

    @property
    def cut_ids(self) -> tuple[str, ...]:
        return tuple(c.cut_id for c in self.cuts)


def _entry(graph: Any, cut: Any) -> Any:
    from partitioner import boundary

    return CutEntry(cut.key, tuple(sorted(cut.device)), tuple(boundary(graph, cut)))


def compute_frontier(graph: Any, config: Any, profiles: Mapping[str, str], *,
                     min_agreement: float | None = None, accuracy: Any = None) -> VersionFrontier:
    """The cuts to preload: the planner's frontier when both profiles exist, else chain points.

    `profiles` maps file names under profiles/ to their JSON text. With `min_agreement`
    (model.yaml's) the planner frontier keeps to that budget on the `accuracy` table
    (a `planner.accuracy.AccuracyTable` or None): fp16, int8 and the table's lossy codecs
    are placed where their measured agreement meets it, so the tails their plans need
    are preloaded too. Pure: no I/O.
    """
    from partitioner import Cut, chain_points, prefix_cut

    if config.device_profile in profiles and config.cloud_profile in profiles:
        from planner import Encoding, LinkRange, Profile, frontier

        dev = Profile.from_json(profiles[config.device_profile])
        cloud = Profile.from_json(profiles[config.cloud_profile])
        rng = LinkRange(config.up_lo_bps, config.up_hi_bps, config.down_ratio, config.rtt_ms)
        if min_agreement is None:
            front = frontier(graph, [dev, cloud], rng, config.objective)
        else:
            casts = (Encoding(), Encoding("fp16"), Encoding("int8"), Encoding("int8", per_channel=True))
            front = frontier(graph, [dev, cloud], rng, config.objective, encodings=casts, accuracy=accuracy,
                             min_agreement=min_agreement)
        seen: dict[str, CutEntry] = {}
        for plan in front.plans:
            if len(plan.cut.device) < len(graph):  # an edge-only plan has no tail to preload
                seen.setdefault(plan.cut.key, _entry(graph, plan.cut))
        return VersionFrontier("planner", tuple(seen.values()), front.to_dict(), min_agreement)
    # [Note: default frontier] Without profiles nothing says which cut wins, so the
    # registry preloads cuts that are cheap to ship and spread over the model: the
    # empty cut (the device sends the input) and `default_cut_count` chain points
    # evenly spaced, where only one layer's outputs cross.
    points = [p for p in chain_points(graph) if p < len(graph) - 1]
    k = min(config.default_cut_count, len(points))
    chosen = [points[round((i + 1) * (len(points) - 1) / (k + 1))] for i in range(k)] if k else []
    cuts = [Cut(frozenset())] if config.include_cloud_only else []
    cuts += [prefix_cut(graph, p) for p in sorted(set(chosen))]
    entries: dict[str, CutEntry] = {}
    for c in cuts:
        entries.setdefault(c.key, _entry(graph, c))
    return VersionFrontier("default", tuple(entries.values()), None)
