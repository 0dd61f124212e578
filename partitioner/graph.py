"""The layer graph: the unit of placement for every cut and plan.

A *layer* is one compute node, plus the constant sub-graph that only it uses, plus the
BatchNorm, activation, elementwise and shape-only nodes that ONNX Runtime runs with it
anyway (see `partitioner.build` for the grouping rules). Tensors listed here are the
ones that connect layers, or that are model inputs or outputs: only they can cross a cut.

Everything here is a frozen value with an exact JSON round trip.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

__all__ = ["BATCH", "UNKNOWN_DIM", "Total", "TensorInfo", "Layer", "LayerGraph"]

BATCH = "N"
"""The symbolic batch dimension that leads every per-sample shape."""

UNKNOWN_DIM = "?"
"""A dim that no shape inference knows (its tensor's bytes are then unknown)."""


@dataclass(frozen=True)
class Total:
    """A sum over items of which some may be unknown: never counts an unknown as 0."""

    known: int
    """The sum of the items that are known."""
    unknown: int = 0
    """How many items are unknown."""

    @property
    def exact(self) -> int | None:
        """The sum, or None where any item is unknown."""
        return None if self.unknown else self.known

    def format(self, fmt: Callable[[int], str] = str) -> str:
        """``fmt(known)``, or ``>= fmt(known) (k unknown)`` where k items are unknown."""
        return fmt(self.known) if not self.unknown else f"≥ {fmt(self.known)} ({self.unknown} unknown)"


@dataclass(frozen=True)
class TensorInfo:
    """A tensor that connects layers, or a model input or output."""

    name: str
    dtype: str
    """NumPy dtype name, e.g. ``float32``."""
    shape: tuple[int | str, ...] | None
    """Per-sample shape: the batch written ``"N"`` (``"k*N"`` where k rows per sample
    are folded into one dim), other symbols by name, ``"?"`` for a dim no inference
    knows; None where even the rank is unknown."""
    bytes_per_sample: int | None
    """Bytes for one sample (batch 1); None where the size is unknown, never 0 for it."""
    producer: int | None
    """Id of the producing layer; None for a model input."""
    consumers: tuple[int, ...] = ()
    """Ids of the layers that read it, ascending, each once."""
    is_output: bool = False
    """True if it is a model output."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": None if self.shape is None else list(self.shape),
            "bytes_per_sample": self.bytes_per_sample,
            "producer": self.producer,
            "consumers": list(self.consumers),
            "is_output": self.is_output,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TensorInfo:
        shape = d.get("shape")
        return cls(
            name=d["name"],
            dtype=d["dtype"],
            shape=None if shape is None else tuple(shape),
            bytes_per_sample=d.get("bytes_per_sample"),
            producer=d.get("producer"),
            consumers=tuple(d.get("consumers", ())),
            is_output=bool(d.get("is_output", False)),
        )


@dataclass(frozen=True)
class Layer:
    """One unit of placement."""

    id: int
    """Position in the graph's topological order (0-based)."""
    name: str
    """Name of the layer's anchor (first compute) node."""
    nodes: tuple[str, ...]
    """Names of the ONNX nodes the layer runs, in execution order."""
    ops: tuple[str, ...]
    """Op type of each node in ``nodes``."""
    flops: int | None
    """Floating-point operations for one sample; None where an op is not known."""
    param_bytes: int
    """Bytes of the constant tensors (weights) its nodes read."""
    inputs: tuple[str, ...]
    """Tensors it reads from other layers or from the model inputs."""
    outputs: tuple[str, ...]
    """Tensors it writes that other layers read or that are model outputs."""
    const_nodes: tuple[str, ...] = ()
    """The constant sub-graph (weight generators, shape constants) it needs."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "nodes": list(self.nodes),
            "ops": list(self.ops),
            "flops": self.flops,
            "param_bytes": self.param_bytes,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "const_nodes": list(self.const_nodes),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Layer:
        return cls(
            id=int(d["id"]),
            name=d["name"],
            nodes=tuple(d["nodes"]),
            ops=tuple(d["ops"]),
            flops=d.get("flops"),
            param_bytes=int(d.get("param_bytes", 0)),
            inputs=tuple(d.get("inputs", ())),
            outputs=tuple(d.get("outputs", ())),
            const_nodes=tuple(d.get("const_nodes", ())),
        )


@dataclass(frozen=True)
class LayerGraph:
    """A model as a DAG of layers, in topological order."""

    model: str
    """The model's name (file stem or graph name)."""
    inputs: tuple[str, ...]
    """The model inputs (initializers excluded)."""
    outputs: tuple[str, ...]
    """The model outputs."""
    layers: tuple[Layer, ...]
    tensors: tuple[TensorInfo, ...]
    opset: int = 0
    """The default-domain opset version of the source model."""
    ir_version: int = 0
    batch: int | str = 1
    """The source model's batch dimension: a fixed size, or a symbolic name."""
    meta: Mapping[str, Any] = field(default_factory=dict)
    """Free-form facts about the source (file, node counts); not used in decisions."""

    def __post_init__(self) -> None:
        for i, layer in enumerate(self.layers):
            assert layer.id == i, f"layer ids must be positions, got {layer.id} at {i}"

    # -- lookups ---------------------------------------------------------------
    @cached_property
    def tensor(self) -> dict[str, TensorInfo]:
        """Tensor by name."""
        return {t.name: t for t in self.tensors}

    @cached_property
    def preds(self) -> tuple[frozenset[int], ...]:
        """For each layer, the layers whose outputs it reads."""
        out: list[set[int]] = [set() for _ in self.layers]
        for t in self.tensors:
            if t.producer is not None:
                for c in t.consumers:
                    out[c].add(t.producer)
        return tuple(frozenset(s) for s in out)

    @cached_property
    def succs(self) -> tuple[frozenset[int], ...]:
        """For each layer, the layers that read its outputs."""
        out: list[set[int]] = [set() for _ in self.layers]
        for t in self.tensors:
            if t.producer is not None:
                out[t.producer].update(t.consumers)
        return tuple(frozenset(s) for s in out)

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def total_flops(self) -> int:
        """FLOPs of the layers whose count is known: a lower bound where
        `flops_total` says some are unknown."""
        return self.flops_total().known

    def flops_total(self) -> Total:
        """FLOPs per sample of all layers, and how many layers' FLOPs are unknown."""
        return Total(sum(layer.flops or 0 for layer in self.layers),
                     sum(layer.flops is None for layer in self.layers))

    def bytes_total(self, names: Iterable[str]) -> Total:
        """Bytes per sample of the given tensors, and how many are of unknown size."""
        sizes = [self.tensor[n].bytes_per_sample for n in names]
        return Total(sum(b for b in sizes if b is not None), sum(b is None for b in sizes))

    @property
    def total_param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    def output_bytes(self, names: Iterable[str] | None = None) -> int | None:
        """Bytes per sample of the given tensors (default: the model outputs); None
        where any of them is of unknown size (`bytes_total` says how many)."""
        return self.bytes_total(self.outputs if names is None else names).exact

    def unknown_size(self, names: Iterable[str]) -> list[str]:
        """Those of ``names`` whose bytes per sample are unknown."""
        return [n for n in names if self.tensor[n].bytes_per_sample is None]

    # -- JSON ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "splitinfer.layergraph/1",
            "model": self.model,
            "opset": self.opset,
            "ir_version": self.ir_version,
            "batch": self.batch,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "layers": [layer.to_dict() for layer in self.layers],
            "tensors": [t.to_dict() for t in self.tensors],
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayerGraph:
        return cls(
            model=d["model"],
            inputs=tuple(d["inputs"]),
            outputs=tuple(d["outputs"]),
            layers=tuple(Layer.from_dict(x) for x in d["layers"]),
            tensors=tuple(TensorInfo.from_dict(x) for x in d["tensors"]),
            opset=int(d.get("opset", 0)),
            ir_version=int(d.get("ir_version", 0)),
            batch=d.get("batch", 1),
            meta=dict(d.get("meta", {})),
        )

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_json(cls, text: str) -> LayerGraph:
        return cls.from_dict(json.loads(text))

    def replace(self, **changes: Any) -> LayerGraph:
        return dataclasses.replace(self, **changes)
