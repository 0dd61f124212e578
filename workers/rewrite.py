"""Pure graph rewrites applied before a segment is optimised: ModelProto in, new one out.

* :func:`strip_initializer_inputs` lets ORT treat IR 3 initializers as constants;
* :func:`make_batch_dynamic` makes the batch dimension symbolic (see [Note: dynamic
  batching] in workers/engine.py; only the batch check in workers/coldstart.py trusts it);
* :func:`fuse_transformer` applies ONNX Runtime's BERT fusions;
* :func:`shape_feeding_inputs` (from `partitioner.shapes`) finds the integer inputs
  whose values set shapes (no warm-up or batch check may invent values for them).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import numpy_helper

from partitioner.shapes import shape_feeding_inputs
from partitioner.subgraphs import node_reads
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
