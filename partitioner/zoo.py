"""The ONNX model zoo architectures that ship inside the `onnx` package.

They are real topologies whose weights are regenerated at load by ConstantOfShape
nodes that fill every weight with one value (0.02). That keeps the package small, but a
network of constant weights maps every input to the same output, which would make an
equality check between a split model and the whole model nearly vacuous.
`randomize_weights` replaces those generators with seeded random initializers,
scaled per role (He-normal for Conv/Gemm weights, BatchNorm statistics near 1 and 0),
so outputs depend on inputs and a wrong wiring shows.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import numpy_helper

from partitioner.errors import PartitionError

__all__ = ["ZOO_MODELS", "zoo_dir", "zoo_path", "load_zoo", "randomize_weights"]

ZOO_MODELS = (
    "bvlc_alexnet",
    "zfnet512",
    "vgg19",
    "resnet50",
    "densenet121",
    "inception_v1",
    "inception_v2",
    "shufflenet",
    "squeezenet",
)
"""Short names of the nine architectures, as in ``light_<name>.onnx``."""

_ALIASES = {"alexnet": "bvlc_alexnet", "zfnet": "zfnet512", "inception": "inception_v1"}


def zoo_dir() -> str:
    return os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")


def zoo_path(name: str) -> str:
    """Path of a zoo model by short name (``resnet50``) or file name."""
    key = name.lower().removeprefix("light_").removesuffix(".onnx")
    key = _ALIASES.get(key, key)
    if key not in ZOO_MODELS:
        raise PartitionError(
            f"unknown zoo model {name!r}; choose one of {', '.join(ZOO_MODELS)} "
            "or give the path of an .onnx file"
        )
    return os.path.join(zoo_dir(), f"light_{key}.onnx")


def load_zoo(name: str, *, random_weights: bool = False, seed: int = 0) -> onnx.ModelProto:
    from partitioner.build import load_model

    model = load_model(zoo_path(name))
    return randomize_weights(model, seed=seed) if random_weights else model


def randomize_weights(model: onnx.ModelProto, *, seed: int = 0) -> onnx.ModelProto:
    """A copy whose ConstantOfShape weight generators become random initializers.

    Only generators whose shape input is an initializer are replaced; the rest of the
    constant sub-graphs (shape constants, Unsqueeze of scales) stay as they are.
    """
    rng = np.random.default_rng(seed)
    g = model.graph
    inits = {i.name: i for i in g.initializer}
    role: dict[str, tuple[str, int]] = {}
    for n in g.node:
        for k, x in enumerate(n.input):
            role.setdefault(x, (n.op_type, k))
    keep_nodes = []
    new_inits = []
    replaced_shapes = set()
    for n in g.node:
        if n.op_type == "ConstantOfShape" and n.input and n.input[0] in inits:
            shape = [int(d) for d in numpy_helper.to_array(inits[n.input[0]]).ravel()]
            out = n.output[0]
            op, k = role.get(out, ("", -1))
            arr = _random_for(op, k, shape, rng)
            new_inits.append(numpy_helper.from_array(arr, out))
            replaced_shapes.add(n.input[0])
        else:
            keep_nodes.append(n)
    out_model = onnx.ModelProto()
    out_model.CopyFrom(model)
    og = out_model.graph
    del og.node[:]
    og.node.extend(keep_nodes)
    still_used = {x for n in keep_nodes for x in n.input}
    kept_inits = [i for i in og.initializer if i.name not in replaced_shapes or i.name in still_used]
    del og.initializer[:]
    og.initializer.extend(kept_inits + new_inits)
    if out_model.ir_version < 4:
        names = {i.name for i in og.initializer}
        kept_inputs = [i for i in og.input if i.name in names or i.name not in replaced_shapes]
        del og.input[:]
        og.input.extend(kept_inputs)
        for t in new_inits:
            og.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return out_model


def _random_for(op: str, k: int, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    if op in ("Conv", "ConvTranspose") and k == 1 and len(shape) >= 2:
        # 0.8 x He-normal: residual sums then grow the variance slowly instead of
        # doubling it per block, so deep nets do not saturate their softmax.
        fan_in = int(np.prod(shape[1:]))
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.8 * np.sqrt(2.0 / fan_in))
    if op in ("Gemm", "MatMul") and k == 1 and len(shape) == 2:
        # Gemm weights in these models are transposed (transB=1): fan-in is the last dim
        fan_in = shape[-1]
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(np.sqrt(1.0 / fan_in))
    if op == "BatchNormalization":
        if k == 1:  # scale
            return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        if k == 4:  # variance
            return (1.0 + 0.1 * np.abs(rng.standard_normal(shape))).astype(np.float32)
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    return (0.1 * rng.standard_normal(shape)).astype(np.float32)
