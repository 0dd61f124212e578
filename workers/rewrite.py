"""Pure graph rewrites applied before a segment is optimised: ModelProto in, new one out.

* :func:`strip_initializer_inputs` lets ORT treat IR 3 initializers as constants;
* :func:`make_batch_dynamic` makes the batch dimension symbolic (see [Note: dynamic
  batching] in workers/engine.py; only the batch check in workers/coldstart.py trusts it);
* :func:`fuse_transformer` applies ONNX Runtime's BERT fusions;
* :func:`shape_feeding_inputs` finds the integer inputs whose values set shapes (no
  warm-up or batch check may invent values for them).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
import onnx
from onnx import numpy_helper

from partitioner.subgraphs import node_reads, subgraphs
from workers.errors import BatchingUnsafeError

__all__ = [
    "BATCH_DIM",
    "fuse_transformer",
    "looks_like_transformer",
    "make_batch_dynamic",
    "shape_feeding_inputs",
    "strip_initializer_inputs",
]

logger = logging.getLogger(__name__)

BATCH_DIM = "batch"
"""Name given to the symbolic batch dimension."""

def strip_initializer_inputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """Drop initializers from ``graph.input`` so ORT may treat them as constants."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    names = {i.name for i in out.graph.initializer}
    keep = [i for i in out.graph.input if i.name not in names]
    del out.graph.input[:]
    out.graph.input.extend(keep)
    out.ir_version = max(out.ir_version, 4)  # IR >= 4 lets initializers not be inputs
    return out


def _real_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    names = {i.name for i in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in names]


def _input_dependent(model: onnx.ModelProto) -> set[str]:
    """Names of tensors whose value depends on a real graph input (read directly, or
    inside an If, Loop or Scan body: ``partitioner.subgraphs.node_reads``)."""
    live = {i.name for i in _real_inputs(model)}
    for node in model.graph.node:  # nodes are topologically sorted in valid models
        if any(x in live for x in node_reads(node)):
            live.update(o for o in node.output if o)
    return live


_SHAPE_ARGS = {
    "Reshape": (1,), "Expand": (1,), "Tile": (1,), "ConstantOfShape": (0,), "Range": (0, 1, 2),
    "Slice": (1, 2, 3, 4), "Pad": (1,), "Resize": (2, 3), "Upsample": (1,), "Split": (1,), "Squeeze": (1,),
    "Unsqueeze": (1,), "TopK": (1,), "OneHot": (1,), "ReduceSum": (1,), "ReduceMean": (1,), "ReduceMax": (1,),
    "ReduceMin": (1,), "ReduceProd": (1,), "CenterCropPad": (1,), "Loop": (0,),
}
"""Operator -> the input positions whose values set a shape, a count or a range: an
invented value there gives an error or a tensor of the wrong size, not a wrong number."""

_SHAPE_ONLY_OPS = frozenset({"Shape", "Size"})
"""Operators whose output depends on their input's shape only, never on its values."""


def shape_feeding_inputs(model: onnx.ModelProto) -> tuple[str, ...]:
    """The real integer inputs whose values reach an argument that sets a shape, a count
    or a range (Reshape's shape, Expand, Slice, Tile, ConstantOfShape, Range, ...),
    through any chain of operators, inside If, Loop and Scan bodies too; a path through
    Shape or Size does not count.

    Warm-up and the batch check never invent values for these: zeros or 0/1 masks make
    ONNX Runtime fail, or build a tensor of the wrong size."""
    ints = [vi.name for vi in _real_inputs(model)
            if vi.type.tensor_type.elem_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32,
                                                 onnx.TensorProto.INT16, onnx.TensorProto.INT8,
                                                 onnx.TensorProto.UINT8, onnx.TensorProto.UINT64,
                                                 onnx.TensorProto.UINT32, onnx.TensorProto.UINT16)]
    if not ints:
        return ()
    return tuple(name for name in ints if _reaches_shape_arg(model.graph.node, {name}))


def _reaches_shape_arg(nodes: Iterable[onnx.NodeProto], reach: set[str]) -> bool:
    """Whether a value in ``reach`` reaches a shape argument of one of ``nodes``
    (topologically sorted, as in a valid model) or of a node inside their If, Loop and
    Scan bodies; adds to ``reach`` every value it reaches on the way.

    A node that reads a reached value, directly or inside a body (``node_reads``),
    passes it to all its outputs; inside the body, to all the body's inputs too (a
    Loop's carried values, a Scan's slices): a value marked shape-setting that is not
    only costs a warm-up, a value missed costs a failed one."""
    for node in nodes:
        if node.op_type in _SHAPE_ONLY_OPS:
            continue
        if not any(x in reach for x in node_reads(node)):
            continue
        hit = {i for i, x in enumerate(node.input) if x and x in reach}
        if hit & set(_SHAPE_ARGS.get(node.op_type, ())):
            return True
        for body in subgraphs(node):
            inner = reach | {i.name for i in body.input}
            if _reaches_shape_arg(body.node, inner):
                return True
        reach.update(o for o in node.output if o)
    return False


def _set_batch(vi: onnx.ValueInfoProto) -> None:
    dims = vi.type.tensor_type.shape.dim
    if dims:
        dims[0].Clear()
        dims[0].dim_param = BATCH_DIM


def make_batch_dynamic(model: onnx.ModelProto) -> tuple[onnx.ModelProto, tuple[str, ...]]:
    """Make dimension 0 of every real input and output symbolic.

    Reshape shape constants on the data path whose first entry is a hard-coded 1 are
    rewritten to 0 ("copy the input's dimension 0"), which equals the old constant at
    batch 1 and carries the batch otherwise. Only the batch check proves the result
    right; this function only makes it possible. Raises :class:`BatchingUnsafeError`
    when an input has no dimension 0 or a fixed one other than 1.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    for vi in _real_inputs(out):
        dims = vi.type.tensor_type.shape.dim
        if not dims:
            raise BatchingUnsafeError(
                f"input {vi.name!r} is a scalar, so it has no batch dimension to make symbolic",
                reason="scalar input",
            )
        if dims[0].HasField("dim_value") and dims[0].dim_value not in (0, 1):
            raise BatchingUnsafeError(
                f"input {vi.name!r} has a fixed dimension 0 of {dims[0].dim_value}, not 1; "
                "export the segment with batch 1 or a symbolic batch",
                reason=f"input {vi.name} dimension 0 is {dims[0].dim_value}",
            )
        _set_batch(vi)
    for vi in g.output:
        _set_batch(vi)
    # Intermediate shapes were inferred for batch 1; stale ones would mislead ORT.
    del g.value_info[:]

    live = _input_dependent(out)
    inits = {t.name: t for t in g.initializer}
    consts = {n.output[0]: n for n in g.node if n.op_type == "Constant" and n.output}
    uses: dict[str, int] = {}
    for node in g.node:
        for x in node_reads(node):  # a read inside an If, Loop or Scan body keeps the constant as it is
            uses[x] = uses.get(x, 0) + 1
    rewrites: list[str] = []
    for node in g.node:
        if node.op_type != "Reshape" or len(node.input) < 2 or node.input[0] not in live:
            continue
        if any(a.name == "allowzero" and a.i == 1 for a in node.attribute):
            continue  # 0 would mean a zero-sized dimension, not "copy"
        shape_name = node.input[1]
        if shape_name in inits:
            shape = numpy_helper.to_array(inits[shape_name])
        elif shape_name in consts:
            shape = numpy_helper.to_array(consts[shape_name].attribute[0].t)
        else:
            continue
        if shape.ndim != 1 or shape.size == 0 or shape[0] != 1:
            continue
        new_shape = shape.copy()
        new_shape[0] = 0
        new_name = shape_name if uses.get(shape_name, 0) == 1 and shape_name in inits else f"{shape_name}__batch"
        tensor = numpy_helper.from_array(new_shape.astype(np.int64), new_name)
        if new_name == shape_name:
            inits[shape_name].CopyFrom(tensor)
        else:
            if new_name not in inits:  # shared by several Reshapes: add it once
                g.initializer.append(tensor)
                inits[new_name] = g.initializer[-1]
            node.input[1] = new_name
        rewrites.append(f"{node.name or node.output[0]}: {shape.tolist()} -> {new_shape.tolist()}")
    return out, tuple(rewrites)


def looks_like_transformer(model: onnx.ModelProto) -> bool:
    """True for convolution-free graphs with attention or normalisation patterns."""
    ops = {n.op_type for n in model.graph.node}
    if ops & {"Conv", "ConvTranspose"}:
        return False
    return "MatMul" in ops and bool(ops & {"Softmax", "ReduceMean", "Erf", "LayerNormalization"})


def fuse_transformer(model: onnx.ModelProto, *, num_heads: int = 0, hidden_size: int = 0) -> tuple[onnx.ModelProto, dict[str, int]]:
    """Apply ONNX Runtime's BERT fusions (attention, LayerNorm, GELU, SkipLayerNorm).

    ``num_heads``/``hidden_size`` of 0 let the fuser detect them from the graph.
    Returns the fused model and the count of each fused operator; when the fuser is
    unavailable or fails, returns the model unchanged and an empty dict, and logs why.
    """
    try:
        from onnxruntime.transformers.optimizer import optimize_model
    except ImportError as e:
        logger.warning("transformer fusion skipped: onnxruntime.transformers is unavailable (%s)", e)
        return model, {}
    fused_in = onnx.ModelProto()
    fused_in.CopyFrom(model)
    try:
        opt = optimize_model(
            fused_in, model_type="bert", num_heads=num_heads, hidden_size=hidden_size, opt_level=0, use_gpu=False
        )
        stats = {k: int(v) for k, v in opt.get_fused_operator_statistics().items() if v}
        return opt.model, stats
    except Exception as e:  # noqa: BLE001 - the fuser raises anything; the plain model still runs
        logger.warning("transformer fusion failed, keeping the unfused graph: %s", e)
        return model, {}
