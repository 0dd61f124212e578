"""Dtypes and shapes of every tensor of a model, by the methods that know them.

[Note: shape inference chain]
A model a user brings often has symbolic dims, ops from other domains, or shapes that
depend on values. Each tensor's dtype and shape come from the first method that knows
them; later methods run only for the tensors the earlier ones left unknown:

1. ONNX shape inference, strict and with data propagation; non-strict where strict
   fails (an unknown op, a shape the spec cannot express).
2. ONNX Runtime's symbolic shape inference, where every input dim is fixed or ONNX lost
   a dtype or a rank: it knows the com.microsoft ops and computes through Reshape,
   Slice and Resize where ONNX gives up.
3. One run of the model in ONNX Runtime, with each tensor still unknown added as an
   output: on the sample inputs (``inputs=``), or on random ones when every input dim
   is fixed and no integer input feeds a shape (random values there are no shape).

Inside If, Loop and Scan subgraphs, where ONNX inference leaves values without a shape
(it carries none into a Loop body, nor through a Pad or Reshape of computed sizes in a
branch), ORT's symbolic inference of the whole model is used for the subgraphs' shapes
when it leaves fewer unknown (`_with_subgraph_shapes`): their FLOPs come from them.

Input dims the user fixes (``input_shapes=``, or the shapes of ``inputs=``) are written
into the model's graph inputs first; a symbol fixed in one input is fixed wherever it
appears. Methods 2 and 3 import onnxruntime, inside the functions that use it: the
partitioner imports only onnx and numpy when it is imported.

[Note: the batch through Resize, Expand and Reshape]
A model's batch is the leading dim of its first input. When that dim is symbolic, ONNX
inference carries the symbol through most ops but loses it through Resize, Expand and
Reshape with computed shapes, and then every later shape, byte count and FLOP count is
unknown. When one inference with the symbolic batch leaves any tensor unknown, the
chain runs twice instead, with the batch fixed at b and at 2b (b is the batch the user
gave, else 1; sample inputs are repeated along the batch for the second run), and the
two answers are compared dim by dim: a dim equal in both is that size; a dim that is b
in one and 2b in the other is the batch (written ``N``); a dim that is k*b and 2k*b is
``k*N`` (a batch folded into rows, as transformers reshape to (N*seq, hidden)); any
other dim is unknown. This holds for any op and any method that found the shapes,
because it only asks how the shape moves with the batch. Where only the run at b knows
a shape (sample inputs that hold sizes for batch b make the run at 2b fail), its
leading dim equal to b is taken as the batch, the rule for a model with a fixed batch. Bytes per sample count ``N``
as 1 and ``k*N`` as k.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, shape_inference

from partitioner.errors import PartitionError
from partitioner.graph import BATCH
from partitioner.subgraphs import node_reads, subgraphs

__all__ = ["Dim", "Shape", "Inferred", "infer_types", "shape_feeding_inputs", "per_sample_factor"]

log = logging.getLogger(__name__)

Dim = int | str | None
"""A size, a symbol (``N`` is the batch, ``k*N`` k times it), or None where unknown."""
Shape = tuple[Dim, ...] | None
"""None where even the rank is unknown."""

_LIGHT_MIN_BYTES = 1 << 16
"""Initializers this big keep only dtype and dims for inference (shape constants are
far smaller, and their values are what data propagation reads)."""
_TWO_GB = 2**31 - 1
_INVENTED = re.compile(r"^unk__\d+$")
"""The symbols ONNX and ORT inference make up for a dim they do not know."""
_CONFLICT = re.compile(r"Incompatible dimensions|\[TypeInferenceError\]")
_FOLDED = re.compile(r"^(\d+)\*" + re.escape(BATCH) + "$")

# Input slots whose values are shapes, sizes, indices of axes or counts: a random
# integer there is no valid model input.
_SHAPE_SLOTS: dict[str, tuple[int, ...]] = {
    "Reshape": (1,), "Expand": (1,), "Tile": (1,), "Slice": (1, 2, 3, 4), "ConstantOfShape": (0,),
    "Range": (0, 1, 2), "Resize": (1, 2, 3), "Upsample": (1,), "Pad": (1, 3), "CenterCropPad": (1,), "TopK": (1,),
    "OneHot": (1,),
    "Squeeze": (1,), "Unsqueeze": (1,), "Split": (1,), "ReduceSum": (1,), "ReduceMean": (1,), "ReduceMax": (1,),
    "ReduceMin": (1,), "ReduceProd": (1,), "CumSum": (1,), "Loop": (0,), "Trilu": (1,),
    "NonMaxSuppression": (2,),
}
# Ops whose outputs do not depend on their inputs' values.
_SHAPE_ONLY = frozenset({"Shape", "Size"})
_INT_TYPES = frozenset({
    onnx.TensorProto.INT8, onnx.TensorProto.INT16, onnx.TensorProto.INT32, onnx.TensorProto.INT64,
    onnx.TensorProto.UINT8, onnx.TensorProto.UINT16, onnx.TensorProto.UINT32, onnx.TensorProto.UINT64,
})


@dataclass(frozen=True, eq=False)
class Inferred:
    """What the chain knows about each tensor of the main graph."""

    elem_type: Mapping[str, int]
    """ONNX element type by tensor name; 0 where unknown."""
    shape: Mapping[str, Shape]
    """Shape by tensor name, in the terms of `Dim` (the batch as ``N`` when symbolic)."""
    batch: int | str
    """The model's batch: the leading dim of its first input, a size or a symbol."""
    typed: onnx.ModelProto
    """ONNX inference's copy of the model with the given input sizes (the batch left
    symbolic): the shapes inside subgraphs are there. Big initializers carry no bytes."""
    unknown: tuple[str, ...] = ()
    """Tensors whose shape is still not fully known after every method."""


def per_sample_factor(d: Dim) -> int | None:
    """What a dim contributes to bytes per sample: its size, 1 for ``N``, k for ``k*N``."""
    if isinstance(d, int):
        return d
    if d == BATCH:
        return 1
    m = _FOLDED.match(d) if isinstance(d, str) else None
    return int(m.group(1)) if m else None


def _dims(vi: onnx.ValueInfoProto, keep: frozenset[str] | None = None) -> tuple[int, Shape]:
    """Element type and dims. With ``keep``, a symbol named as inference names those it
    makes up is None unless in ``keep`` (the model inputs' own symbols: an exporter may
    have named a dim so); without it every symbol is kept, as for a model input."""
    tt = vi.type.tensor_type
    if not vi.type.HasField("tensor_type"):
        return 0, None
    if not tt.HasField("shape"):
        return tt.elem_type, None
    out: list[Dim] = []
    for d in tt.shape.dim:
        if d.HasField("dim_value"):
            out.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param and (keep is None or d.dim_param in keep
                                                             or not _INVENTED.match(d.dim_param)):
            out.append(d.dim_param)
        else:
            out.append(None)
    return tt.elem_type, tuple(out)


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_FUNCTIONS = frozenset({"floor", "ceiling", "ceil", "Max", "Min", "Mod", "Abs", "sqrt", "Floor", "Ceil"})


def _full(t: tuple[int, Shape] | None, symbols: frozenset[str] = frozenset()) -> bool:
    """Dtype and every dim known: a size, or an expression over the input symbols
    (``floor(2.0*H)``); a symbol inference made up for a value it could not see is not."""
    if t is None or not t[0] or t[1] is None:
        return False
    for d in t[1]:
        if d is None:
            return False
        if isinstance(d, str) and d not in symbols and not set(_NAME.findall(d)) <= symbols | _FUNCTIONS:
            return False
    return True


def _read(model: onnx.ModelProto) -> dict[str, tuple[int, Shape]]:
    g = model.graph
    keep = frozenset(d.dim_param for vi in g.input for d in vi.type.tensor_type.shape.dim if d.dim_param)
    return {vi.name: _dims(vi, keep) for vi in [*g.value_info, *g.input, *g.output]}


def _copy_fields(src: Any, dst: Any, skip: str) -> None:
    """Every set field of message ``src`` into ``dst``, but the one named ``skip``."""
    for desc, value in src.ListFields():
        if desc.name == skip:
            continue
        repeated = desc.is_repeated if hasattr(desc, "is_repeated") else desc.label == desc.LABEL_REPEATED
        if repeated:
            getattr(dst, desc.name).extend(value)
        elif desc.message_type is not None:
            getattr(dst, desc.name).CopyFrom(value)
        else:
            setattr(dst, desc.name, value)


def _light(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose big initializers keep dtype and dims but no bytes (cheap, and never
    over protobuf's 2 GB): the weights' bytes are not even copied."""
    light = onnx.ModelProto()
    _copy_fields(model, light, skip="graph")
    _copy_fields(model.graph, light.graph, skip="initializer")
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL or init.ByteSize() >= _LIGHT_MIN_BYTES:
            light.graph.initializer.append(
                onnx.TensorProto(name=init.name, data_type=init.data_type, dims=list(init.dims)))
        else:
            light.graph.initializer.append(init)
    return light


def _name_open_dims(model: onnx.ModelProto) -> None:
    """Give each input dim that has no size a symbol of its own, ``<input>:<axis>``: a dim
    with neither size nor name, a negative size (exporters write -1 for "any"), or a
    name without a letter (PaddlePaddle names every such dim "?": they are not one size).
    It can then be fixed and, at axis 0 of the first input, be the batch."""
    for vi in _model_inputs(model):
        for i, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.HasField("dim_value"):
                open_ = d.dim_value < 0
            else:
                open_ = not re.search(r"[A-Za-z_]", d.dim_param)
            if open_:
                d.dim_param = f"{vi.name}:{i}"


def _model_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    inits = {i.name for i in model.graph.initializer}
    return [vi for vi in model.graph.input if vi.name not in inits]


def _symbols(model: onnx.ModelProto, fixed: Mapping[str, tuple[int, ...]], name: str) -> dict[str, int]:
    """The size of each input symbol the fixed shapes settle; checks them against the model."""
    sizes: dict[str, int] = {}
    for vi in _model_inputs(model):
        if vi.name not in fixed:
            continue
        want = tuple(fixed[vi.name])
        _, dims = _dims(vi)
        if dims is None:
            continue
        if len(dims) != len(want):
            raise PartitionError(
                f"input {vi.name!r} of {name} has rank {len(dims)} ({'x'.join(str(d) for d in dims) or 'scalar'}), "
                f"but the shape given for it is {'x'.join(map(str, want))}; give {len(dims)} dims",
                model=name, tensor=vi.name,
            )
        for i, (d, w) in enumerate(zip(dims, want)):
            if isinstance(d, int) and d != w:
                raise PartitionError(
                    f"input {vi.name!r} of {name} has dim {i} fixed at {d} in the model, but the shape given "
                    f"for it is {'x'.join(map(str, want))}; give {d} there",
                    model=name, tensor=vi.name,
                )
            if isinstance(d, str):
                if sizes.get(d, w) != w:
                    raise PartitionError(
                        f"dim {d!r} of {name} is given two sizes, {sizes[d]} and {w} (it names one size in "
                        "every input where it appears); give the same size",
                        model=name, tensor=vi.name,
                    )
                sizes[d] = w
    return sizes


def _with_inputs(light: onnx.ModelProto, sizes: Mapping[str, int],
                 fixed: Mapping[str, tuple[int, ...]]) -> onnx.ModelProto:
    """A copy of ``light`` whose graph inputs carry the fixed sizes."""
    out = onnx.ModelProto()
    out.CopyFrom(light)
    for vi in _model_inputs(out):
        tt = vi.type.tensor_type
        if not tt.HasField("shape"):
            if vi.name in fixed:
                for w in fixed[vi.name]:
                    tt.shape.dim.add().dim_value = w
            continue
        for d in tt.shape.dim:
            if d.HasField("dim_param") and d.dim_param in sizes:
                d.dim_value = sizes[d.dim_param]
        if vi.name in fixed:
            for d, w in zip(tt.shape.dim, fixed[vi.name]):
                if w and not d.HasField("dim_value"):
                    d.dim_value = w
    # what inference found before the sizes were fixed would contradict them
    del out.graph.value_info[:]
    return out


def _onnx_infer(model: onnx.ModelProto, name: str, *, refuse_conflicts: bool = False) -> onnx.ModelProto:
    """ONNX shape inference's copy of ``model`` (``model`` itself where it fails).

    ``refuse_conflicts``: a node whose inputs contradict its op's rules (shapes that do
    not broadcast, a wrong input type) is a malformed model, refused with PartitionError;
    any other failure of strict inference falls back to non-strict.
    """
    for strict in (True, False):
        try:
            return shape_inference.infer_shapes(model, strict_mode=strict, data_prop=True)
        except Exception as e:  # noqa: BLE001 - InferenceError, ValueError, and checker errors alike
            if refuse_conflicts and strict and _CONFLICT.search(str(e)):
                raise PartitionError(
                    f"shapes of {name} cannot be inferred: {str(e).strip()[:300]}; fix the model so that ONNX "
                    "shape inference succeeds (onnx.shape_inference.infer_shapes(model, strict_mode=True))",
                    model=name,
                ) from e
            log.debug("ONNX shape inference of %s (strict=%s) failed: %s", name, strict, e)
    return model


def _onnx_types(model: onnx.ModelProto, name: str) -> dict[str, tuple[int, Shape]]:
    return _read(_onnx_infer(model, name))


def _symbolic_types(model: onnx.ModelProto, name: str) -> dict[str, tuple[int, Shape]]:
    sym = _symbolic_model(model, name)
    return {} if sym is None else _read(sym)


def _symbolic_model(model: onnx.ModelProto, name: str) -> onnx.ModelProto | None:
    """ORT's symbolic shape inference's copy of ``model``, with what it found even where it
    stopped early; None where it found nothing.

    Its public ``infer_shapes`` writes a model file into the working directory when it
    stops early, so its loop is run here; a version without these methods adds nothing.
    """
    try:
        # Lazy on purpose, inside this function: the partitioner imports only onnx and numpy
        # at import time (docs/architecture.md); a grep for onnxruntime finds this line.
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference  # noqa: PLC0415 - the door

        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
        if opset < 7:
            return None
        sym = SymbolicShapeInference(2**31 - 1, True, False, 0)
        sym._preprocess(model)
        try:
            while sym.run_:
                sym._infer_impl()
        except Exception as e:  # noqa: BLE001 - it raises plain Exceptions and asserts on ops it does not know
            log.debug("symbolic shape inference of %s stopped: %s", name, e)
        sym._update_output_from_vi()
        return sym.out_mp_
    except Exception as e:  # noqa: BLE001 - as above, before it has a model to give
        log.debug("symbolic shape inference of %s failed: %s", name, e)
        return None


def _unshaped(graph: onnx.GraphProto, symbols: frozenset[str]) -> int:
    """Values made inside ``graph``'s subgraphs (at any depth) with no full shape there
    (sizes, or expressions over the model's input ``symbols``)."""
    count = 0
    for node in graph.node:
        for g in subgraphs(node):
            shaped = {vi.name for vi in [*g.value_info, *g.output] if _full(_dims(vi), symbols)}
            count += sum(1 for n in g.node for o in n.output if o and o not in shaped) + _unshaped(g, symbols)
    return count


def _with_subgraph_shapes(typed: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """``typed``, or ORT symbolic inference's copy of it where that leaves fewer values inside
    subgraphs without a shape: FLOPs of If, Loop and Scan come from the shapes their
    subgraphs carry ([Note: control-flow FLOPs] in partitioner/flops.py), and ONNX
    inference does not carry a shape through a Reshape or Pad of computed sizes there
    (Silero VAD: every Conv of both branches of its top-level If)."""
    syms = _input_symbols(typed)
    before = _unshaped(typed.graph, syms)
    if not before:
        return typed
    sym = _symbolic_model(typed, name)
    return sym if sym is not None and _unshaped(sym.graph, syms) < before else typed


def _recorded_types(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], names: Sequence[str],
                    name: str) -> dict[str, tuple[int, Shape]]:
    """Dtypes and shapes of ``names`` from one run of the model on ``feeds``."""
    if not names or model.ByteSize() >= _TWO_GB:
        return {}
    # Lazy on purpose, inside this function: the partitioner imports only onnx and numpy
    # at import time (docs/architecture.md); a grep for onnxruntime finds this line.
    import onnxruntime as ort  # noqa: PLC0415 - the door

    run = onnx.ModelProto()
    run.CopyFrom(model)
    present = {o.name for o in run.graph.output}
    for n in names:
        if n not in present:
            run.graph.output.append(onnx.ValueInfoProto(name=n))
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        sess = ort.InferenceSession(run.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        values = sess.run(names, dict(feeds))
    except Exception as e:  # noqa: BLE001 - ORT's error types are not public
        log.info("a run of %s to record %d unknown shapes failed: %s", name, len(names),
                 str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__)
        return {}
    out: dict[str, tuple[int, Shape]] = {}
    for n, v in zip(names, values):
        v = np.asarray(v)
        try:
            elem = helper.np_dtype_to_tensor_dtype(v.dtype)
        except Exception:  # noqa: BLE001 - object arrays (strings) and the like
            elem = onnx.TensorProto.STRING if v.dtype.kind in "OUS" else 0
        out[n] = (elem, tuple(int(d) for d in v.shape))
    return out


def shape_feeding_inputs(model: onnx.ModelProto) -> tuple[str, ...]:
    """The integer inputs whose values reach an argument that sets a shape, a count or a
    range (Reshape's shape, Expand, Slice, Tile, ConstantOfShape, Range, ...), through any
    chain of operators, inside If, Loop and Scan bodies too; a path through Shape or Size
    does not count.

    Random values for them are no valid input: verification and profiling run such a
    model on sample inputs, and warm-up and the batch check never invent values for them.
    """
    ints = [vi.name for vi in _model_inputs(model) if vi.type.tensor_type.elem_type in _INT_TYPES]
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
        if node.op_type in _SHAPE_ONLY:
            continue
        if not any(x in reach for x in node_reads(node)):
            continue
        hit = {i for i, x in enumerate(node.input) if x and x in reach}
        if hit & set(_SHAPE_SLOTS.get(node.op_type, ())):
            return True
        for body in subgraphs(node):
            if _reaches_shape_arg(body.node, reach | {i.name for i in body.input}):
                return True
        reach.update(o for o in node.output if o)
    return False


def _random_feeds(model: onnx.ModelProto, sizes: Mapping[str, int], fixed: Mapping[str, tuple[int, ...]],
                  seed: int = 0) -> dict[str, np.ndarray] | None:
    """Random inputs at the fixed shapes, or None where one is not fixed or feeds a shape."""
    if shape_feeding_inputs(model):
        return None
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in _model_inputs(model):
        elem, dims = _dims(vi)
        if vi.name in fixed:
            dims = tuple(fixed[vi.name])
        if dims is None:
            return None
        dims = tuple(sizes.get(d, d) if isinstance(d, str) else d for d in dims)
        if not all(isinstance(d, int) for d in dims):
            return None
        try:
            dt = np.dtype(helper.tensor_dtype_to_np_dtype(elem))
        except Exception:  # noqa: BLE001 - strings and unknown types
            return None
        if np.issubdtype(dt, np.floating):
            feeds[vi.name] = rng.standard_normal(dims).astype(dt)
        elif dt == np.bool_:
            feeds[vi.name] = rng.random(dims) < 0.5
        else:
            feeds[vi.name] = rng.integers(0, 8, size=dims).astype(dt)
    return feeds


def _input_symbols(model: onnx.ModelProto) -> frozenset[str]:
    return frozenset(d for vi in _model_inputs(model) for d in (_dims(vi)[1] or ()) if isinstance(d, str))


def _chain(light_fixed: onnx.ModelProto, model: onnx.ModelProto, feeds: Mapping[str, np.ndarray] | None,
           wanted: Sequence[str], name: str,
           types: dict[str, tuple[int, Shape]] | None = None) -> dict[str, tuple[int, Shape]]:
    """The three methods in turn, each for what the ones before left unknown
    (``types``: what ONNX inference found, where it already ran)."""
    syms = _input_symbols(light_fixed)
    types = _onnx_types(light_fixed, name) if types is None else types
    missing = [n for n in wanted if not _full(types.get(n), syms)]
    lost = [n for n in missing if n not in types or not types[n][0] or types[n][1] is None]
    if missing and (not syms or lost):
        # With every input dim fixed, or for a dtype or rank that ONNX lost (a segment's
        # inputs and outputs need both). Over free symbols it builds sympy expressions for
        # sizes that stay unknown anyway, at seconds a model (8 s for PP-OCRv4's detector
        # over N, H and W, where ONNX loses no rank; 0.07 s with them fixed).
        sym = _symbolic_types(light_fixed, name)
        for n in missing:
            if n in sym:
                types[n] = _better(types.get(n), sym[n])
        missing = [n for n in wanted if not _full(types.get(n), syms)]
    if missing and feeds is not None:
        types.update(_recorded_types(model, feeds, missing, name))
    return types


def _merge(t1: Mapping[str, tuple[int, Shape]], t2: Mapping[str, tuple[int, Shape]], b1: int,
           b2: int) -> dict[str, tuple[int, Shape]]:
    """Shapes at batch b1 and b2 as one shape in terms of the batch
    (see [Note: the batch through Resize, Expand and Reshape])."""
    out: dict[str, tuple[int, Shape]] = {}
    for n in set(t1) | set(t2):
        e1, s1 = t1.get(n, (0, None))
        e2, s2 = t2.get(n, (0, None))
        elem = e1 or e2
        if s1 is not None and s2 is None:
            # the run at 2b failed (a sample input holds sizes for batch b): the leading
            # dim equal to b is taken as the batch, as for a model whose batch is fixed
            out[n] = (elem, tuple(BATCH if i == 0 and d == b1 else d for i, d in enumerate(s1)))
            continue
        if s1 is None or s2 is None or len(s1) != len(s2):
            out[n] = (elem, None)
            continue
        dims: list[Dim] = []
        for i, (a, b) in enumerate(zip(s1, s2)):
            if a == b and a is not None:
                dims.append(a)
            elif isinstance(a, int) and isinstance(b, int) and a > 0 and a % b1 == 0 and a * b2 == b * b1:
                k = a // b1
                dims.append(BATCH if k == 1 else f"{k}*{BATCH}")
            elif isinstance(a, int) and not isinstance(b, int):
                dims.append(BATCH if i == 0 and a == b1 else a)  # as where the run at 2b failed
            else:
                dims.append(None)
        out[n] = (elem, tuple(dims))
    return out


def _batch_terms(types: Mapping[str, tuple[int, Shape]], batch: str) -> dict[str, tuple[int, Shape]]:
    """Shapes from an inference with the batch symbolic, with the batch written ``N``."""
    out = {}
    for n, (elem, s) in types.items():
        if s is not None:
            s = tuple(BATCH if d == batch else (f"{d}'" if d == BATCH else d) for d in s)
        out[n] = (elem, s)
    return out


def _tile(feeds: Mapping[str, np.ndarray], batch_axes: Mapping[str, list[int]]) -> dict[str, np.ndarray]:
    """The feeds at twice the batch: each repeated along every axis where its input has
    the batch symbol (a recurrent state [layers, N, hidden] too)."""
    out = {}
    for k, v in feeds.items():
        for ax in batch_axes.get(k, ()):
            if ax < np.ndim(v):
                v = np.concatenate([v, v], axis=ax)
        out[k] = v
    return out


def infer_types(
    model: onnx.ModelProto,
    *,
    name: str,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    inputs: Mapping[str, np.ndarray] | None = None,
) -> Inferred:
    """Dtype and shape of every tensor of the main graph (see [Note: shape inference chain]).

    ``input_shapes`` fixes input dims; ``inputs`` are sample inputs (their shapes are
    fixed too). Raises PartitionError when a given shape contradicts the model.
    """
    fixed: dict[str, tuple[int, ...]] = {k: tuple(int(d) for d in v) for k, v in (input_shapes or {}).items()}
    for k, v in (inputs or {}).items():
        shp = tuple(int(d) for d in np.shape(v))
        if k in fixed and fixed[k] != shp:
            raise PartitionError(
                f"input {k!r} of {name} is given shape {'x'.join(map(str, fixed[k]))} but its sample input "
                f"is {'x'.join(map(str, shp))}; give one of them",
                model=name, tensor=k,
            )
        fixed[k] = shp
    light = _light(model)
    _name_open_dims(light)
    ins = _model_inputs(light)
    known_inputs = {vi.name for vi in ins}
    for k in fixed:
        if k not in known_inputs:
            raise PartitionError(f"{k!r} is not an input of {name}; the inputs are {', '.join(sorted(known_inputs))}",
                                 model=name, tensor=k)
    _check_dtypes(inputs or {}, ins, name)
    _, first = _dims(ins[0]) if ins else (0, None)
    batch: int | str = first[0] if first and first[0] is not None else 1
    sizes = _symbols(light, fixed, name)
    # what a node (its subgraphs too) or the graph reads; an output nothing reads (Dropout's
    # mask) is not wanted
    read = {x for n in model.graph.node for x in node_reads(n)} | {o.name for o in model.graph.output}
    wanted = [vi.name for vi in ins] + [o for n in model.graph.node for o in n.output if o and o in read]

    if not isinstance(batch, str):
        feeds = dict(inputs) if inputs is not None else _random_feeds(light, sizes, fixed)
        fixed_model = _with_inputs(light, sizes, fixed)
        syms = _input_symbols(fixed_model)
        typed = _onnx_infer(fixed_model, name, refuse_conflicts=True)
        types = _chain(fixed_model, model, feeds, wanted, name, _read(typed))
    else:
        # First with the batch symbolic; twice at fixed batches where that leaves any unknown.
        user_b = sizes.pop(batch, None)
        first_pass = _with_inputs(light, sizes, _unfix_batch(ins, fixed, batch))
        syms = _input_symbols(first_pass) - {batch} | {BATCH}
        typed = _onnx_infer(first_pass, name, refuse_conflicts=True)
        types = _batch_terms(_read(typed), batch)
        if any(not _full(types.get(n), syms) for n in wanted):
            b1 = user_b or 1
            b2 = 2 * b1
            batch_axes = {vi.name: [i for i, d in enumerate(_dims(vi)[1] or ()) if d == batch] for vi in ins}
            feeds1 = dict(inputs) if inputs is not None else _random_feeds(light, {**sizes, batch: b1}, fixed)
            feeds2 = _tile(feeds1, batch_axes) if feeds1 is not None else None
            probes = []
            for b, feeds in ((b1, feeds1), (b2, feeds2)):
                at = {**sizes, batch: b}
                fixed_b = {k: _with_batch(ins, k, v, batch, b) for k, v in fixed.items()}
                probes.append(_chain(_with_inputs(light, at, fixed_b), model, feeds, wanted, name))
            merged = _merge(probes[0], probes[1], b1, b2)
            for n, t in merged.items():
                if _full(t, syms) or not _full(types.get(n), syms):
                    types[n] = _better(types.get(n), t)
    typed = _with_subgraph_shapes(typed, name)
    unknown = tuple(n for n in wanted if not _full(types.get(n), syms))
    if unknown:
        log.info("%s: %d tensors of unknown shape after inference (first: %s); --input-shape or --inputs "
                 "may settle them", name, len(unknown), ", ".join(unknown[:3]))
    return Inferred(elem_type={n: t[0] for n, t in types.items()}, shape={n: t[1] for n, t in types.items()},
                    batch=batch, typed=typed, unknown=unknown)


def _check_dtypes(inputs: Mapping[str, np.ndarray], ins: Sequence[onnx.ValueInfoProto], name: str) -> None:
    """Sample inputs of the dtypes the model takes: ONNX Runtime refuses any other."""
    for vi in ins:
        if vi.name not in inputs:
            continue
        try:
            want = np.dtype(helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type))
        except Exception:  # noqa: BLE001 - strings and types numpy does not name
            continue
        got = np.asarray(inputs[vi.name]).dtype
        if got != want:
            raise PartitionError(
                f"sample input {vi.name!r} of {name} is {got}, but the model takes {want}; save it as "
                f"{want} (array.astype(numpy.{want}))",
                model=name, tensor=vi.name,
            )


def _better(old: tuple[int, Shape] | None, new: tuple[int, Shape]) -> tuple[int, Shape]:
    """``new``, keeping what ``old`` knew where ``new`` does not."""
    if old is None:
        return new
    elem = new[0] or old[0]
    if new[1] is None:
        return elem, old[1]
    if old[1] is None or len(old[1]) != len(new[1]):
        return elem, new[1]
    return elem, tuple(b if b is not None else a for a, b in zip(old[1], new[1]))


def _unfix_batch(ins: Sequence[onnx.ValueInfoProto], fixed: Mapping[str, tuple[int, ...]],
                 batch: str) -> dict[str, tuple[int, ...]]:
    """The fixed shapes without the dims where the model has its batch symbol."""
    out = {}
    for vi in ins:
        if vi.name not in fixed:
            continue
        _, dims = _dims(vi)
        if dims is None:
            out[vi.name] = fixed[vi.name]
            continue
        # a dim left 0 stays symbolic (_with_inputs sets only what it is given)
        out[vi.name] = tuple(0 if d == batch else w for d, w in zip(dims, fixed[vi.name]))
    return out


def _with_batch(ins: Sequence[onnx.ValueInfoProto], name: str, shape: tuple[int, ...], batch: str,
                b: int) -> tuple[int, ...]:
    """A fixed shape with the batch dims set to ``b``."""
    vi = next(v for v in ins if v.name == name)
    _, dims = _dims(vi)
    if dims is None:
        return shape
    return tuple(b if d == batch else w for d, w in zip(dims, shape))
