"""Pipelined multi-stage tails: where to cut a tail into stages, and proof of overlap.

A tail too slow for one worker is cut at chain points (only one layer's outputs cross)
into stages of about equal FLOPs; each stage runs on its own actor and frames flow
through them like a production line, so stage 1 works on frame k+1 while stage 2 works
on frame k. The actors themselves live in :mod:`workers.actors`; this module is pure
(ONNX and the partitioner only) so the stage choice is testable without Ray.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import onnx

import partitioner
from workers.errors import ActorConfigError

__all__ = ["StageSpan", "count_overlaps", "make_stage_cuts", "make_stages"]

logger = logging.getLogger(__name__)


def make_stage_cuts(graph: partitioner.LayerGraph, num_stages: int) -> tuple[int, ...]:
    """Chain-point layers after which to cut ``graph`` into ``num_stages`` stages of
    about equal FLOPs (each cut point is the chain point whose prefix FLOPs come
    nearest to k/num_stages of the total). Pure.

    Raises :class:`ActorConfigError` when the graph has fewer usable chain points than
    ``num_stages - 1``.
    """
    if num_stages < 1:
        raise ActorConfigError(f"num_stages={num_stages} must be >= 1", field_name="num_stages", value=num_stages)
    if num_stages == 1:
        return ()
    last = len(graph) - 1
    points = [v for v in partitioner.chain_points(graph) if v != last]
    total = sum(layer.flops for layer in graph.layers) or 1
    prefix = {v: sum(graph.layers[u].flops for u in partitioner.prefix_cut(graph, v).device) for v in points}
    chosen: list[int] = []
    for k in range(1, num_stages):
        target = total * k / num_stages
        later = [v for v in points if not chosen or v > chosen[-1]]
        if len(later) < num_stages - k:
            break
        # Leave enough chain points for the cuts still to place.
        usable = later[: len(later) - (num_stages - 1 - k)]
        chosen.append(min(usable, key=lambda v: abs(prefix[v] - target)))
    if len(chosen) != num_stages - 1:
        raise ActorConfigError(
            f"{graph.model} has {len(points)} chain points before its last layer, too few to cut it into "
            f"{num_stages} stages; use at most {len(points) + 1} stages",
            field_name="num_stages", value=num_stages, model=graph.model,
        )
    return tuple(chosen)


def make_stages(model: onnx.ModelProto, num_stages: int = 2) -> list[onnx.ModelProto]:
    """Cuts a tail (or any model) into ``num_stages`` segments at chain points.

    Stage i's outputs are exactly stage i+1's inputs, so the stages chain without
    renaming, and the last stage's outputs are the model's. Each segment passes the
    partitioner's checks; :func:`partitioner.verify` style equality is the caller's
    test (tests/integration/test_actors.py runs it on real Ray actors).
    """
    graph = partitioner.build_graph(model)
    points = make_stage_cuts(graph, num_stages)
    if not points:
        return [model]
    cuts = [partitioner.prefix_cut(graph, v) for v in points]
    segments = partitioner.split_tiers(model, cuts, graph=graph)
    for a, b in zip(segments, segments[1:]):
        if set(a.outputs) != set(b.inputs):
            raise ActorConfigError(
                f"stage {a.index} of {graph.model} writes {sorted(a.outputs)} but stage {b.index} reads "
                f"{sorted(b.inputs)}; a pipeline needs cuts where one stage feeds only the next, "
                "so use fewer stages",
                field_name="num_stages", value=num_stages, model=graph.model,
            )
    logger.info("pipeline of %s: %d stages cut after layers %s", graph.model, num_stages, list(points))
    return [s.model for s in segments]


@dataclass(frozen=True)
class StageSpan:
    """When one stage ran one frame, on the host's monotonic clock."""

    frame: int
    stage: int
    start_s: float
    end_s: float


def count_overlaps(spans: Sequence[StageSpan]) -> int:
    """Frames k for which some stage s+1 was still running frame k while stage s had
    already started frame k+1: the proof that the stages worked at the same time.
    Pure; compares the order of events, not their durations."""
    by = {(s.frame, s.stage): s for s in spans}
    stages = sorted({s.stage for s in spans})
    n = 0
    for (frame, stage), span in by.items():
        if stage == stages[-1]:
            continue
        nxt = by.get((frame + 1, stage))
        down = by.get((frame, stage + 1))
        if nxt is not None and down is not None and nxt.start_s < down.end_s:
            n += 1
    return n
