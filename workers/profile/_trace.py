"""ONNX Runtime profiler traces -> per-layer kernel time. Pure: no sessions, no files.

[Note: attributing kernels to layers]
ONNX Runtime rewrites the graph before it runs it, so the names in a trace are not
always the model's node names:

* a node it keeps keeps its name (``r45``);
* a node it rewrites in place gets a suffix (the NCHWc layout pass turns ``r45`` into
  ``r45_nchwc``) or a prefix (the Gemm+activation fusion makes ``fused n38``);
* a fusion keeps only its anchor: Conv+BatchNorm+Relu runs as one Conv under the
  Conv's name, and the BatchNorm and Relu vanish from the trace;
* new nodes appear (``ReorderInput``, ``ReorderOutput_token_15``, memory copies).

`map_nodes` therefore resolves each name in three steps: the exact name; the name
with ORT's prefixes and ``_suffix`` parts removed; and, for nodes that are still
unknown, the graph ORT actually ran (its saved optimised model, when given): a node
that writes a tensor of the original model belongs to that tensor's layer, and a
layout or copy node ORT added belongs to the layer of the node that reads its output
(input reorders, copies to the device) or of the node that wrote its input (output
reorders, copies back). Some passes name a rewritten node after the tensor it writes
(the NCHWc pass turns the Conv writing ``r1`` into ``r1_nchwc``), so a stripped name
is also looked up as a tensor name. Time of a fused
node goes to its anchor's layer, which is the layer the partitioner put the fused
nodes in anyway (see [Note: layer grouping] in partitioner/build.py). Whatever stays
unresolved is reported as unattributed time, never guessed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from partitioner.build import node_names
from partitioner.graph import LayerGraph
from partitioner.subgraphs import subgraphs
from workers.errors import WorkerError

__all__ = [
    "ProfilingError",
    "KernelEvent",
    "RunTrace",
    "Attribution",
    "parse_trace",
    "map_nodes",
    "resolve_name",
    "attribute_runs",
]

_KERNEL_SUFFIX = "_kernel_time"
_PREFIXES = ("fused ",)
# Nodes ORT adds around kernels to change layout or device. They belong to the layer
# on the side given: an input reorder to the kernel that reads it, an output reorder
# to the kernel that wrote its input. Other unknown nodes are never placed by position.
_GLUE_OPS = {"ReorderInput": "down", "ReorderOutput": "up", "MemcpyFromHost": "down", "MemcpyToHost": "up"}


class ProfilingError(WorkerError):
    """A profile cannot be measured: a bad trace, a bad setting or a failed run.

    ``setting`` names the argument or input at fault (``runs``, ``batch``, ``trace``).
    """

    def __init__(self, message: str, *, model: str | None = None, detail: str | None = None,
                 setting: str | None = None) -> None:
        super().__init__(message, model=model, detail=detail)
        self.setting = setting


@dataclass(frozen=True)
class KernelEvent:
    """One kernel execution in a trace."""

    node: str
    """ORT's node name (after its rewrites)."""
    op: str
    """Op type as ORT ran it (``Conv``, ``FusedGemm``, ``ReorderInput``)."""
    dur_us: float
    """Kernel time in microseconds."""


@dataclass(frozen=True)
class RunTrace:
    """The kernels of one ``InferenceSession.run``."""

    run_us: float
    """ORT's own duration of the run (``model_run``), microseconds."""
    kernels: tuple[KernelEvent, ...]

    @property
    def kernel_us(self) -> float:
        return float(sum(k.dur_us for k in self.kernels))


def parse_trace(events: Any) -> list[RunTrace]:
    """Split a Chrome-trace list from ``end_profiling()`` into runs, in order.

    A kernel belongs to the ``model_run`` event whose interval holds its start.
    Raises ProfilingError when the trace is not a list of events or has no run.
    """
    if not isinstance(events, list):
        raise ProfilingError(
            f"an ONNX Runtime trace is a JSON list of events, got {type(events).__name__}; "
            "pass the parsed file that InferenceSession.end_profiling() wrote",
            setting="trace",
        )
    runs: list[tuple[float, float]] = []
    kernels: list[tuple[float, KernelEvent]] = []
    for i, e in enumerate(events):
        if not isinstance(e, Mapping) or "name" not in e:
            raise ProfilingError(
                f"trace event {i} is {e!r:.120}; every event must be an object with a 'name'",
                setting="trace",
            )
        cat, name = e.get("cat"), str(e["name"])
        try:
            ts, dur = float(e.get("ts", 0.0)), float(e.get("dur", 0.0))
        except (TypeError, ValueError):
            raise ProfilingError(
                f"trace event {i} ({name}) has a non-numeric ts/dur; the trace is corrupt, re-run the profiler",
                setting="trace",
            ) from None
        if cat == "Session" and name == "model_run":
            runs.append((ts, dur))
        elif cat == "Node" and name.endswith(_KERNEL_SUFFIX):
            args = e.get("args") or {}
            op = str(args.get("op_name", "")) if isinstance(args, Mapping) else ""
            kernels.append((ts, KernelEvent(name[: -len(_KERNEL_SUFFIX)], op, dur)))
    if not runs:
        raise ProfilingError(
            "the trace has no 'model_run' event: no run was profiled; run the session at "
            "least once between enabling profiling and end_profiling()",
            setting="trace",
        )
    runs.sort()
    kernels.sort(key=lambda x: x[0])
    out: list[list[KernelEvent]] = [[] for _ in runs]
    starts = np.array([r[0] for r in runs])
    for ts, k in kernels:
        j = int(np.searchsorted(starts, ts, side="right")) - 1
        if j >= 0 and ts <= runs[j][0] + runs[j][1]:
            out[j].append(k)
    return [RunTrace(run_us=r[1], kernels=tuple(ks)) for r, ks in zip(runs, out)]


def _original_maps(graph: LayerGraph, model: onnx.ModelProto | None) -> tuple[dict[str, int], dict[str, int]]:
    """(node name -> layer, tensor name -> layer of its producer) for the original model."""
    layer_of: dict[str, int] = {}
    for layer in graph.layers:
        for n in layer.nodes:
            layer_of[n] = layer.id
        for n in layer.const_nodes:
            layer_of.setdefault(n, layer.id)
    tensor_layer: dict[str, int] = {}
    for t in graph.tensors:
        if t.producer is not None:
            tensor_layer[t.name] = t.producer
    if model is not None:
        for name, node in zip(node_names(model), model.graph.node):
            if name in layer_of:
                for o in node.output:
                    if o:
                        tensor_layer.setdefault(o, layer_of[name])
                # An If, Loop or Scan is one layer: ORT runs and times the nodes of its
                # branches and body under their own names.
                stack = list(subgraphs(node))
                while stack:
                    sub = stack.pop()
                    for inner in sub.node:
                        if inner.name:
                            layer_of.setdefault(inner.name, layer_of[name])
                        stack.extend(subgraphs(inner))
    return layer_of, tensor_layer


def resolve_name(ort_name: str, layer_of: Mapping[str, int], tensor_layer: Mapping[str, int] | None = None) -> int | None:
    """Layer of an ORT node by name alone: the exact node name, then the name without
    ORT's prefixes and ``_suffix`` parts as a node name or, since some passes name the
    new node after the tensor it writes (``r1`` -> ``r1_nchwc``), as a tensor name."""
    if ort_name in layer_of:
        return layer_of[ort_name]
    name = ort_name
    for p in _PREFIXES:
        if name.startswith(p):
            name = name[len(p):]
    stems = [name]
    while "_" in name:
        name = name.rsplit("_", 1)[0]
        stems.append(name)
    for stem in stems:
        if stem in layer_of:
            return layer_of[stem]
    if tensor_layer:
        for stem in stems:
            if stem in tensor_layer:
                return tensor_layer[stem]
    return None


def map_nodes(graph: LayerGraph, model: onnx.ModelProto | None = None,
              optimized: onnx.ModelProto | None = None, *,
              names: Iterable[str] = ()) -> dict[str, int]:
    """Layer of every ORT node that can be placed; see [Note: attributing kernels to layers].

    ``model`` is the model as profiled (node names as in ``graph``), ``optimized`` the
    graph ORT ran (``SessionOptions.optimized_model_filepath``, weights not needed),
    ``names`` extra ORT node names (from a trace) to resolve by name only.
    """
    layer_of, tensor_layer = _original_maps(graph, model)
    out: dict[str, int] = {}
    if optimized is not None:
        nodes = list(optimized.graph.node)
        onames = node_names(optimized)
        placed: dict[int, int] = {}
        for i, (nm, node) in enumerate(zip(onames, nodes)):
            lid = resolve_name(nm, layer_of, tensor_layer)
            if lid is None:
                lid = next((tensor_layer[o] for o in node.output if o in tensor_layer), None)
            if lid is not None:
                placed[i] = lid
        producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
        readers: dict[str, list[int]] = {}
        for i, n in enumerate(nodes):
            for x in n.input:
                readers.setdefault(x, []).append(i)
        changed = True
        while changed:
            changed = False
            for i, node in enumerate(nodes):
                if i in placed or node.op_type not in _GLUE_OPS:
                    continue
                down = [placed[j] for o in node.output for j in readers.get(o, ()) if j in placed]
                up = [placed[producer[x]] for x in node.input if x in producer and producer[x] in placed]
                first, second = (up, down) if _GLUE_OPS[node.op_type] == "up" else (down, up)
                if first or second:
                    placed[i] = (max(first) if first is up else min(first)) if first else (
                        max(second) if second is up else min(second))
                    changed = True
        out.update({onames[i]: lid for i, lid in placed.items()})
    for nm in names:
        if nm not in out:
            lid = resolve_name(nm, layer_of, tensor_layer)
            if lid is not None:
                out[nm] = lid
    return out


@dataclass(frozen=True)
class Attribution:
    """Per-layer kernel time over the timed runs."""

    layer_us: Mapping[int, tuple[float, ...]]
    """Kernel microseconds of each layer in each run (every layer present, zeros allowed)."""
    kernel_us: tuple[float, ...]
    """All kernel microseconds of each run, attributed or not."""
    attributed_fraction: float
    """Share of all kernel time that was placed on a layer (1.0 when every kernel was)."""
    unattributed_us: Mapping[str, float] = field(default_factory=dict)
    """Mean microseconds per run of each node that could not be placed, by ORT name."""

    def median_ms(self, layer: int) -> float:
        return float(np.median(self.layer_us[layer])) / 1e3

    def min_ms(self, layer: int) -> float:
        return float(np.min(self.layer_us[layer])) / 1e3

    def p90_ms(self, layer: int) -> float:
        return float(np.percentile(self.layer_us[layer], 90)) / 1e3


def attribute_runs(runs: Sequence[RunTrace], graph: LayerGraph, layer_of: Mapping[str, int]) -> Attribution:
    """Sum each run's kernels per layer with the name map from `map_nodes` (give it the
    trace's names so that every name it can place is in the map)."""
    if not runs:
        raise ProfilingError("no runs to attribute; profile at least one run", setting="runs")
    per = np.zeros((len(runs), len(graph)))
    total = np.zeros(len(runs))
    lost: dict[str, float] = {}
    for r, run in enumerate(runs):
        for k in run.kernels:
            total[r] += k.dur_us
            lid = layer_of.get(k.node)
            if lid is None:
                lost[k.node] = lost.get(k.node, 0.0) + k.dur_us / len(runs)
            else:
                per[r, lid] += k.dur_us
    all_us = float(total.sum())
    frac = 1.0 if all_us <= 0 else float(per.sum()) / all_us
    if not math.isfinite(frac):
        frac = 0.0
    return Attribution(
        layer_us={v: tuple(float(x) for x in per[:, v]) for v in range(len(graph))},
        kernel_us=tuple(float(x) for x in total),
        attributed_fraction=frac,
        unattributed_us=dict(sorted(lost.items(), key=lambda kv: -kv[1])),
    )
