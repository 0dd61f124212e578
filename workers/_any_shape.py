"""The pure parts of serving segments of any shape ([Note: any shape] in workers/engine.py):
which requests run stacked, which sample rows warm an engine up, and why a warm-up is
skipped. No ONNX Runtime here: the engine runs what these decide."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from workers._engine_types import TensorSpec

__all__ = ["runs_by_shape", "split_rows", "warmup_feed", "warmup_skip_reason"]


def per_sample_shape(request: Mapping[str, np.ndarray], names: Sequence[str]) -> tuple:
    """The shape of one sample of each input: what requests that may share a batch have in common."""
    return tuple((k, request[k].shape[1:]) for k in names)


def runs_by_shape(requests: Sequence[Mapping[str, np.ndarray]], rows: Sequence[int], names: Sequence[str],
                  max_batch: int) -> Iterator[tuple[int, int, int]]:
    """(start, stop, rows) of each run: consecutive requests of one per-sample shape, up to
    ``max_batch`` rows; a request of another shape starts a new run."""
    names = sorted(names)
    start = 0
    while start < len(requests):
        key, stop, total = per_sample_shape(requests[start], names), start, 0
        while (stop < len(requests) and total + rows[stop] <= max_batch
               and (stop == start or per_sample_shape(requests[stop], names) == key)):
            total += rows[stop]
            stop += 1
        yield start, stop, total
        start = stop


def split_rows(outputs: Mapping[str, np.ndarray], rows: Sequence[int]) -> list[dict[str, np.ndarray]]:
    """The outputs of a stacked run, cut back into one dict per request of ``rows`` rows each."""
    out, offset = [], 0
    for n in rows:
        out.append({k: v[offset:offset + n] for k, v in outputs.items()})
        offset += n
    return out


def warmup_feed(samples: Mapping[str, np.ndarray], specs: Sequence[TensorSpec], max_batch: int,
                shape_inputs: Sequence[str] = ()) -> tuple[dict[str, np.ndarray], int]:
    """(the sample rows one warm-up run takes, its rows): up to ``max_batch`` rows of the
    inputs with a symbolic batch; an input with a fixed dim 0 takes that many; an integer
    input that sets shapes (``shape_inputs``) is whole: its dim 0 is a length, not rows.

    Beside such an input every sample is whole: its values hold the other inputs' sizes
    (a head's outputs carry the batch it ran at), so rows cut from them would no longer fit."""
    rows = max(1, min((v.shape[0] for k, v in samples.items() if v.ndim and k not in shape_inputs), default=1))
    if any(k in shape_inputs for k in samples):
        return dict(samples), rows
    take = min(rows, max_batch)
    by_name = {spec.name: spec for spec in specs}

    def fit(name: str, v: np.ndarray) -> np.ndarray:
        spec = by_name.get(name)
        if not v.ndim or spec is None or not spec.shape or name in shape_inputs:
            return v
        return v[:take] if spec.shape[0] is None else v[:spec.shape[0]]

    return {k: fit(k, v) for k, v in samples.items()}, take


def warmup_skip_reason(shape_inputs: Sequence[str], any_shape: bool) -> str:
    """Why an engine without sample inputs must not warm up on values it makes up; empty
    when it may (its buckets' zeros are valid inputs)."""
    whys = []
    if shape_inputs:
        whys.append(f"its integer inputs {', '.join(shape_inputs)} set shapes")
    if any_shape:
        whys.append("its inputs or outputs have symbolic dims besides the batch")
    return f"{' and '.join(whys)}, and it has no sample inputs to warm up on" if whys else ""
