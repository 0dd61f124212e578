"""model.yaml's model inputs: `input_shapes` parsed, `sample_inputs` read and checked
against the model, and random inputs at the declared shapes where those are valid
([Note: warm-up inputs] in cluster/_registry_disk.py)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["make_shaped_inputs", "parse_input_shapes", "read_sample_inputs"]


def parse_input_shapes(raw: Any) -> dict[str, tuple[int, ...]]:
    """model.yaml's input_shapes: {NAME: [d0, d1, ...] or "D0xD1x..."} -> {NAME: dims}."""
    if not isinstance(raw, Mapping):
        raise ValueError(f"input_shapes={raw!r} must map input names to shapes, such as "
                         "{images: [1, 3, 640, 640]} or {images: 1x3x640x640}")
    out = {}
    for name, dims in raw.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"input_shapes names {name!r}; name a model input")
        if isinstance(dims, str):
            from partitioner import PartitionError
            from partitioner.shapes import parse_input_shape

            try:
                named, shape = parse_input_shape(dims)
            except PartitionError as e:
                raise ValueError(f"input_shapes[{name!r}]: {e}") from None
            if named is not None:
                raise ValueError(f"input_shapes[{name!r}]={dims!r} names an input inside the shape; write "
                                 f"{name}: {dims.rpartition('=')[2]}")
        elif (isinstance(dims, (list, tuple)) and dims
              and all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims)):
            shape = tuple(dims)
        else:
            raise ValueError(f"input_shapes[{name!r}]={dims!r} is not a shape; give positive integer dims such as "
                             "[1, 3, 640, 640] or 1x3x640x640")
        out[name] = shape
    return out


def read_sample_inputs(version_dir: str, config: Any, names: list[str]) -> dict[str, np.ndarray] | None:
    """The sample inputs of a version whose model.yaml is ``config`` and whose model takes
    ``names``, checked: input_shapes name inputs, every input has an array, the arrays
    agree with input_shapes. None without sample_inputs. Raises RegistryError naming the
    field and the fix."""
    from cluster._registry_disk import RegistryError

    yml = os.path.join(version_dir, "model.yaml")
    unknown = sorted(set(config.input_shapes) - set(names))
    if unknown:
        raise RegistryError(path=yml, reason=f"input_shapes names {unknown}, which are not inputs of the model",
                            fix=f"name its inputs: {', '.join(names)}")
    if not config.sample_inputs:
        return None
    from partitioner import PartitionError
    from partitioner.shapes import load_sample_inputs

    try:
        samples = load_sample_inputs(os.path.join(version_dir, config.sample_inputs), names)
    except PartitionError as e:
        raise RegistryError(path=yml, reason=f"sample_inputs: {e}",
                            fix="write the file with numpy.savez(path, NAME=array, ...) for every input") from e
    for name, shape in config.input_shapes.items():
        if tuple(samples[name].shape) != shape:
            raise RegistryError(path=yml, reason=f"input_shapes gives {name!r} the shape {list(shape)}, but "
                                                 f"sample_inputs has {list(samples[name].shape)}",
                                fix="make them agree, or leave input_shapes out (the samples fix the shapes)")
    return samples


def make_shaped_inputs(graph: Any, input_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, np.ndarray] | None:
    """Random inputs of the ONNX ``graph`` at ``input_shapes`` (the graph's own shapes for
    the other inputs, with batch 1 where it is symbolic); None where that would invent a
    size or a shape: a symbolic dim besides the batch that input_shapes leave open, or an
    integer input that sets a shape (partitioner.shapes.shape_feeding_inputs)."""
    import onnx
    from onnx import helper

    from workers.coldstart import random_feed
    from partitioner.shapes import shape_feeding_inputs

    model = onnx.ModelProto()
    model.graph.CopyFrom(graph)
    if shape_feeding_inputs(model):
        return None
    weights = {t.name for t in graph.initializer}
    specs = []
    for vi in graph.input:
        if vi.name in weights:
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
        shape = input_shapes.get(vi.name) or tuple([dims[0] or 1] + dims[1:] if dims else [])
        if None in shape:
            return None
        specs.append((vi.name, helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type), tuple(shape)))
    rng = np.random.default_rng(0)
    return {name: random_feed([(name, dtype, shape)], shape[0], rng)[name] if shape else np.ones(shape, dtype)
            for name, dtype, shape in specs}
