"""The shapes and sample inputs a user gives for a model whose inputs have symbolic dims.

Every command and API that reads a model takes the same two things:

- ``--input-shape NAME=D0xD1x...`` (``input_shapes=``): fixes an input's dims. NAME may
  be left out for a model with one input.
- ``--inputs FILE.npz`` (``inputs=``): arrays by input name. They fix the shapes too, and
  they are what verification, profiling and warm-up run on.
"""

from __future__ import annotations

import os
import re
import zipfile
from collections.abc import Mapping, Sequence

import numpy as np

from partitioner._infer import shape_feeding_inputs
from partitioner.errors import PartitionError
from partitioner.graph import BATCH, LayerGraph

__all__ = ["parse_input_shape", "parse_input_shapes", "load_sample_inputs", "shapes_of", "sample_rows",
           "samples_batch", "shape_feeding_inputs"]

_DIMS = re.compile(r"^\d+(x\d+)*$")


def parse_input_shape(text: str) -> tuple[str | None, tuple[int, ...]]:
    """``"images=1x3x640x640"`` -> ``("images", (1, 3, 640, 640))``; ``"1x16000"`` -> ``(None, (1, 16000))``."""
    name, sep, dims = text.rpartition("=")
    dims = dims.strip().lower().replace("×", "x")
    if not _DIMS.match(dims):
        raise PartitionError(
            f"input shape {text!r} is not NAME=D0xD1x... with positive integer dims "
            "(e.g. images=1x3x640x640, or 1x3x640x640 for a model with one input)"
        )
    shape = tuple(int(d) for d in dims.split("x"))
    if any(d <= 0 for d in shape):
        raise PartitionError(f"input shape {text!r} has a zero dim; every dim must be at least 1")
    return (name.strip() or None) if sep else None, shape


def parse_input_shapes(specs: Sequence[str], input_names: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """Parse repeated ``--input-shape`` values against the model's input names."""
    out: dict[str, tuple[int, ...]] = {}
    for text in specs:
        name, shape = parse_input_shape(text)
        if name is None:
            if len(input_names) != 1:
                raise PartitionError(
                    f"input shape {text!r} names no input, but the model has {len(input_names)} "
                    f"inputs ({', '.join(input_names)}); write NAME=D0xD1x..."
                )
            name = input_names[0]
        if name not in input_names:
            raise PartitionError(
                f"input shape {text!r} names {name!r}, which is not a model input; "
                f"the inputs are {', '.join(input_names)}"
            )
        if name in out and out[name] != shape:
            raise PartitionError(f"input {name!r} is given two shapes, {out[name]} and {shape}; give one")
        out[name] = shape
    return out


def load_sample_inputs(path: str | os.PathLike[str], input_names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Arrays by input name from an ``.npz`` file (``numpy.savez``).

    With ``input_names``, every model input must be present and no other name may be.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise PartitionError(f"sample inputs file {path!r} does not exist; write one with numpy.savez(path, NAME=array, ...)")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: np.asarray(z[k]) for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise PartitionError(
            f"sample inputs file {path!r} is not a readable .npz of arrays ({e}); "
            "write one with numpy.savez(path, NAME=array, ...)"
        ) from e
    if not arrays:
        raise PartitionError(f"sample inputs file {path!r} holds no arrays; write one array per model input")
    if input_names is not None:
        missing = [n for n in input_names if n not in arrays]
        extra = [n for n in arrays if n not in input_names]
        if missing or extra:
            raise PartitionError(
                f"sample inputs file {path!r} has arrays {sorted(arrays)}, but the model's inputs are "
                f"{list(input_names)}"
                + (f"; missing {missing}" if missing else "")
                + (f"; not inputs {extra}" if extra else "")
            )
    return arrays


def shapes_of(inputs: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    """The shapes that sample inputs fix."""
    return {k: tuple(int(d) for d in np.shape(v)) for k, v in inputs.items()}


def sample_rows(inputs: Mapping[str, np.ndarray], graph: LayerGraph, rows: int) -> dict[str, np.ndarray]:
    """Sample inputs with ``rows`` rows: along each axis where a tensor's per-sample shape
    has the batch (a recurrent state [layers, N, hidden] too), its own rows come first,
    then repeats of them; a tensor without the batch is kept whole (an integer input
    that holds sizes is no batch of rows)."""
    out = {}
    for k, v in inputs.items():
        t = graph.tensor.get(k)
        v = np.asarray(v)
        for ax, d in enumerate(t.shape if t is not None and t.shape is not None else ()):
            if d == BATCH and ax < v.ndim and v.shape[ax] not in (0, rows):
                v = np.take(v, np.arange(rows) % v.shape[ax], axis=ax)
        out[k] = v
    return out


def samples_batch(inputs: Mapping[str, np.ndarray], graph: LayerGraph) -> int | None:
    """The rows sample inputs hold along the first axis where an input's per-sample shape
    has the batch; None where no input has one."""
    for k, v in inputs.items():
        t = graph.tensor.get(k)
        for ax, d in enumerate(t.shape if t is not None and t.shape is not None else ()):
            if d == BATCH and ax < np.ndim(v):
                return int(np.shape(v)[ax])
    return None
