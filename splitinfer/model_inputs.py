"""``--input-shape`` and ``--inputs``: one spelling, and one set of errors, for every
command that reads a model (inspect, split, profile, plan, sweep, instances).

    --input-shape NAME=D0xD1x...   fixes an input's dims (repeatable; NAME may be left
                                   out for a model with one input)
    --inputs FILE.npz              sample inputs, arrays by input name (numpy.savez):
                                   they fix the shapes, and verify and profile run on them
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx

from partitioner.shapes import load_sample_inputs, parse_input_shapes

__all__ = ["ModelInputs", "add_input_args", "inputs_from_args", "model_input_names"]


@dataclass(frozen=True)
class ModelInputs:
    """What the user said about a model's inputs."""

    input_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Fixed dims by input name (``--input-shape``)."""
    inputs: Mapping[str, np.ndarray] | None = None
    """Sample inputs by input name (``--inputs``), or None."""

    @property
    def given(self) -> bool:
        return bool(self.input_shapes) or self.inputs is not None


def add_input_args(p: argparse.ArgumentParser) -> None:
    """Add ``--input-shape`` and ``--inputs`` to a command's parser."""
    p.add_argument("--input-shape", action="append", default=[], metavar="NAME=D0xD1x...",
                   help="fix an input's dims, e.g. images=1x3x640x640 (repeatable; NAME may be left out for a "
                        "model with one input)")
    p.add_argument("--inputs", metavar="FILE.npz",
                   help="sample inputs, arrays by input name (numpy.savez): they fix the input shapes, and "
                        "verification and profiling run on them")


def model_input_names(model: onnx.ModelProto) -> list[str]:
    """The model's inputs, initializers listed as inputs left out."""
    inits = {i.name for i in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in inits]


def inputs_from_args(args: argparse.Namespace, model: onnx.ModelProto) -> ModelInputs:
    """The parsed ``--input-shape`` and ``--inputs`` of ``args`` for ``model``; raises
    PartitionError naming the value and the fix."""
    names = model_input_names(model)
    shapes = parse_input_shapes(getattr(args, "input_shape", None) or [], names)
    path = getattr(args, "inputs", None)
    samples = load_sample_inputs(path, names) if path else None
    return ModelInputs(shapes, samples)
