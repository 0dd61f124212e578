"""The values an engine takes and gives: its config, its tensors' specs, its stats, the
dict a run that filled its bucket gives and where a run's outputs may be placed. Kept
apart from workers/engine.py so that the modules it is built of (workers/_bucket.py,
workers/_input_check.py, workers/_any_shape.py) and the PyTorch backend
(workers/_torch_engine.py) share them without importing it; ``workers.engine`` is their
public name.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from workers._ort import OPT_LEVELS
from workers.errors import EngineLoadError

__all__ = ["EngineConfig", "EngineStats", "Place", "TensorSpec"]

Place = Callable[[np.ndarray], "tuple[np.ndarray, int] | None"]
"""Where a run's output goes instead of the bucket's buffer ([Note: outputs placed]):
given that buffer, an array like it elsewhere and the address of its data, or None."""


@dataclass(frozen=True)
class EngineConfig:
    """How an engine loads and runs a segment. Every field is pinned, never guessed."""

    intra_op_threads: int = 0
    """Threads inside one operator; 0 lets ORT use one per physical core."""
    inter_op_threads: int = 1
    """Threads running independent operators in parallel; 1 runs them in order."""
    provider: Literal["auto", "cpu", "cuda", "tensorrt", "torch-cuda", "torch-cpu"] = "auto"
    """Execution provider; ``auto`` takes TensorRT, then CUDA, where ORT has them, then
    ``torch-cuda`` (the segment converted to PyTorch, workers/_torch_engine.py) where torch
    sees a GPU, else CPU. ``torch-cpu`` is that backend on the CPU, for tests."""
    device_id: int = 0
    """GPU ordinal for the CUDA and TensorRT providers."""
    graph_optimization_level: Literal["disable", "basic", "extended", "all"] = "all"
    """ORT graph optimisation applied offline to the artefact (``all`` adds NCHWc layouts)."""
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8)
    """Batch sizes with pre-allocated, pre-bound buffers; a request uses the smallest that fits."""
    warmup_runs: int = 1
    """Runs of the smallest bucket at load, so the first request pays no first-run costs."""
    warmup_all_buckets: bool = False
    """Also run every larger bucket once at load (slower load, steadier first batches)."""
    dynamic_batch: bool = True
    """Try to make the batch dimension symbolic (kept only if the batch check passes)."""
    batch_check_size: int = 2
    """N of the load-time check that a batch of N equals N runs of batch 1."""
    loop_fallback: bool = False
    """Let ``run_batch`` loop over single runs when batching is unsafe, instead of raising."""
    cache_dir: str | None = None
    """Directory of pre-optimised artefacts; ``None`` uses a per-process temporary one."""
    share_weights: bool = True
    """Map weights once per process and share them between engines (turns off pre-packing)."""
    transformer_fusion: bool = True
    """Apply ORT's BERT fusions to graphs that look like transformer blocks."""
    log_severity: int = 3
    """ORT log level (0 verbose ... 4 fatal)."""
    allow_spinning: bool = True
    """Let ORT's intra-op threads spin after a run, waiting for more work (ORT's own
    default). Measured both ways on a served tail (bench/workers.py, docs/workers.md):
    off made batch-8 runs up to 1.2x slower (DenseNet121 tail) and did not lower the
    serving overhead at concurrency 1. Turn it off where other processes need the cores
    between runs (an app beside the edge agent, say)."""

    cuda_graphs: bool | None = None
    """Provider ``torch-cuda`` only: capture each batch bucket's run as a CUDA graph at
    load, so a run is one replay instead of a launch per kernel. None: on where the
    segment's sizes besides the batch are fixed (on an H100 a batch-1 run of the
    ResNet50, DenseNet121 and transformer tails took 0.30/0.30/0.33 ms against
    0.82/0.70/0.62 eager; bench/results/gpu.json). ONNX Runtime's providers do not read it."""

    def __post_init__(self) -> None:
        def bad(field: str, value, fix: str) -> EngineLoadError:
            return EngineLoadError(f"EngineConfig.{field}={value!r} is invalid; {fix}", stage="config")

        if self.intra_op_threads < 0:
            raise bad("intra_op_threads", self.intra_op_threads, "use 0 (ORT default) or a positive count")
        if self.inter_op_threads < 1:
            raise bad("inter_op_threads", self.inter_op_threads, "use 1 or more")
        if self.provider not in ("auto", "cpu", "cuda", "tensorrt", "torch-cuda", "torch-cpu"):
            raise bad("provider", self.provider, "use auto, cpu, cuda or tensorrt (onnxruntime), or torch-cuda or torch-cpu (PyTorch)")
        if self.graph_optimization_level not in OPT_LEVELS:
            raise bad("graph_optimization_level", self.graph_optimization_level, f"use one of {', '.join(OPT_LEVELS)}")
        buckets = tuple(self.batch_buckets)
        if not buckets or any(not isinstance(b, int) or b < 1 for b in buckets):
            raise bad("batch_buckets", self.batch_buckets, "give positive integers such as (1, 2, 4, 8)")
        if tuple(sorted(set(buckets))) != buckets:
            raise bad("batch_buckets", self.batch_buckets, f"list them once each in increasing order: {tuple(sorted(set(buckets)))}")
        if self.warmup_runs < 0:
            raise bad("warmup_runs", self.warmup_runs, "use 0 or more")
        if self.batch_check_size < 2:
            raise bad("batch_check_size", self.batch_check_size, "use 2 or more: a batch of 1 proves nothing")
        if not 0 <= self.log_severity <= 4:
            raise bad("log_severity", self.log_severity, "use 0 (verbose) to 4 (fatal)")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "EngineConfig":
        raw = json.loads(text)
        raw["batch_buckets"] = tuple(raw["batch_buckets"])
        return cls(**raw)


@dataclass(frozen=True)
class TensorSpec:
    """An input or output of the segment; ``shape[0]`` is ``None`` when batching is dynamic,
    and any other dim is ``None`` where the model leaves it symbolic (any size)."""

    name: str
    dtype: str
    shape: tuple[int | None, ...]

    def describe(self, max_batch: int | None = None) -> str:
        dims = [("N" if i == 0 else "*") if d is None else str(d) for i, d in enumerate(self.shape)]
        text = f"{self.dtype}[{','.join(dims)}]"
        return text + (f" with N in 1..{max_batch}" if self.shape and self.shape[0] is None and max_batch else "")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "TensorSpec":
        raw = json.loads(text)
        return cls(name=raw["name"], dtype=raw["dtype"], shape=tuple(raw["shape"]))


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of an engine's load facts and run latencies."""

    provider: str
    """Execution provider chosen."""
    load_ms: float
    """Engine construction wall time, warm-up included."""
    build_ms: float
    """Time spent building the artefact in this load (0 when it came from the cache)."""
    warmup_ms: float
    """Of ``load_ms``, the time spent in warm-up runs."""
    from_cache: bool
    """True when a pre-optimised artefact was found."""
    batch_safe: bool
    """True when batches of more than one request run as one."""
    run_count: int
    """Runs since load (warm-up excluded)."""
    median_ms: float
    """Median run time over the last runs (0 before any run)."""
    p90_ms: float
    """90th percentile run time over the last runs (0 before any run)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "EngineStats":
        return cls(**json.loads(text))
