"""The boundary casts' cost on this host, timed on the model's own tensors: the
`planner.CodecModel` that ``splitinfer profile`` writes into a measured profile.

A cast's time depends on the values it casts (numpy's fp16 cast is about 3x slower per MB
on post-ReLU maps, half exact zeros, than on images), so the figures come from the
tensors the planner will send: the model's float32 inputs and the boundary tensors at a
few chain cuts, computed from the sample inputs (random ones at the input shapes where
none are given). The inputs get figures of their own (`CodecModel.input_encode_ms_per_mb`);
the feature maps' figures are per MB over all the maps timed, so a small tensor's fixed
cost does not inflate them. Times are the calling thread's CPU time (`time.thread_time`),
median over ``repeats``: on a shared host, wall time counts other processes' turns.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import onnx

from cluster.protocol.encoding import decode, encode
from partitioner import LayerGraph, boundary, chain_points, prefix_cut
from partitioner.export import make_inputs, reference_outputs
from planner import CodecModel

__all__ = ["CastTiming", "codec_from_timings", "measure_codec_model", "time_casts"]

_CASTS = ("fp16", "int8")


@dataclass(frozen=True)
class CastTiming:
    """One tensor's cast times on this host."""

    name: str
    """The tensor."""
    model_input: bool
    """True for a model input, False for a feature map."""
    mb: float
    """Its size as float32, in MB (1e6 bytes)."""
    encode_ms: Mapping[str, float]
    """Median encode ms per encoding: fp32 (framing only), fp16, int8."""
    decode_ms: Mapping[str, float]
    """Median decode ms per cast: fp16, int8."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "model_input": self.model_input, "mb": self.mb,
                "encode_ms": dict(self.encode_ms), "decode_ms": dict(self.decode_ms)}


def _cpu_ms(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    out, times = None, []
    for _ in range(repeats):
        c = time.thread_time()
        out = fn()
        times.append((time.thread_time() - c) * 1e3)
    return statistics.median(times), out


def time_casts(name: str, arr: np.ndarray, *, model_input: bool, repeats: int) -> CastTiming:
    """`arr`'s encode (fp32, fp16, int8) and decode (fp16, int8) CPU ms on this thread."""
    enc: dict[str, float] = {}
    dec: dict[str, float] = {}
    for p in ("fp32", *_CASTS):
        enc[p], t = _cpu_ms(lambda p=p: encode(arr, precision=p), repeats)
        if p != "fp32":
            dec[p], _ = _cpu_ms(lambda t=t: decode(t), repeats)
    return CastTiming(name=name, model_input=model_input, mb=arr.nbytes / 1e6, encode_ms=enc, decode_ms=dec)


def _per_mb(rows: list[CastTiming], key: str, which: str) -> float:
    mb = sum(r.mb for r in rows)
    return sum(getattr(r, which)[key] for r in rows) / mb


def codec_from_timings(base: CodecModel, rows: list[CastTiming], source: str) -> CodecModel:
    """`base` with its casts' figures from `rows`: per MB over the feature maps (over the
    inputs where no map was timed), the inputs' own, decode over all, and the median fp32
    encode (framing a tensor) as the fixed ms per tensor sent. ValueError without rows."""
    if not rows:
        raise ValueError("no tensor was timed; time at least one float32 input or boundary tensor")
    maps = [r for r in rows if not r.model_input] or rows
    ins = [r for r in rows if r.model_input]
    enc = dict(base.encode_ms_per_mb) | {k: _per_mb(maps, k, "encode_ms") for k in _CASTS}
    dec = dict(base.decode_ms_per_mb) | {k: _per_mb(rows, k, "decode_ms") for k in _CASTS}
    return replace(base, encode_ms_per_mb=enc, decode_ms_per_mb=dec,
                   input_encode_ms_per_mb={k: _per_mb(ins, k, "encode_ms") for k in _CASTS} if ins else None,
                   encode_fixed_ms=statistics.median(r.encode_ms["fp32"] for r in rows), source=source)


def _cuts(graph: LayerGraph, n: int) -> list[int]:
    """Up to `n` chain points, evenly spaced, whose boundary is not a model output."""
    outs = set(graph.outputs)
    chain = [v for v in chain_points(graph) if not set(boundary(graph, prefix_cut(graph, v))) <= outs]
    if n <= 0 or not chain:
        return []
    step = len(chain) / min(n, len(chain))
    return sorted({chain[int(i * step)] for i in range(min(n, len(chain)))})


def measure_codec_model(model: onnx.ModelProto, graph: LayerGraph, *, inputs: Mapping[str, np.ndarray] | None = None,
                        cuts: int = 3, repeats: int = 9, base: CodecModel | None = None,
                        source: str = "this host") -> tuple[CodecModel, list[CastTiming]]:
    """The CodecModel of this host for `model`: the casts of its float32 inputs and of the
    boundary tensors at `cuts` chain points (on ``inputs``, or random inputs), and
    every tensor's timing. ``base`` gives the compressions' figures (defaults)."""
    if repeats < 1:
        raise ValueError(f"repeats is {repeats!r}; time each cast at least once (repeats >= 1)")
    # the samples as given: a model whose integer input holds their batch runs only at it
    feed = dict(inputs) if inputs else make_inputs(model, graph, batch=1)
    names = sorted({t for v in _cuts(graph, cuts) for t in boundary(graph, prefix_cut(graph, v))}
                   - set(feed) - set(graph.outputs))
    values = reference_outputs(model, names, feed, name=graph.model) if names else {}
    rows = []
    for name, arr in [(k, np.asarray(v)) for k, v in feed.items()] + [(k, values[k]) for k in names]:
        if arr.dtype == np.float32 and arr.size:
            rows.append(time_casts(name, arr, model_input=name in feed, repeats=repeats))
    return codec_from_timings(base or CodecModel(), rows, f"{source}: {graph.model}'s tensors"), rows
