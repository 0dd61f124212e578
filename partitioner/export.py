"""Cut an ONNX model into segments that, run in order, equal the whole model.

Every segment keeps the source's opset and IR version, fixes the shapes and dtypes of
its inputs and outputs on both sides of each boundary, regenerates the constants its
layers need, and passes `onnx.checker`. Segments are assembled from the layer graph's
node lists and the source's node protos; their inputs and outputs are typed from the
layer graph's tensors, whose shapes were inferred once when it was built (see
[Note: shape inference chain] in partitioner/_infer.py), and the rest of the per-model
work (a topological order) happens once per `Splitter`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import onnx
from onnx import helper

from partitioner.build import _toposort, build_graph, node_names, node_reads
from partitioner.cuts import Cut, boundary, make_cut, tier_layers
from partitioner.errors import PartitionError
from partitioner._infer import per_sample_factor, shape_feeding_inputs
from partitioner.graph import BATCH, UNKNOWN_DIM, LayerGraph

__all__ = [
    "Segment",
    "Splitter",
    "with_recorded_ranks",
    "split",
    "split_tiers",
    "save_segment",
    "run_segments",
    "reference_outputs",
    "verify",
    "make_inputs",
    "make_value_info",
]

_TWO_GB = 2**31 - 1


@dataclass(frozen=True)
class Segment:
    """One piece of a cut model, with the interface it exposes."""

    index: int
    layers: frozenset[int]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    model: onnx.ModelProto

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "layers": sorted(self.layers),
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
        }


class _Source:
    """Look-ups over the source model shared by every segment export."""

    def __init__(self, model: onnx.ModelProto, graph: LayerGraph) -> None:
        self.model = model
        self.graph = graph
        g = model.graph
        names = node_names(model)
        self.node_by_name = dict(zip(names, g.node))
        self.init_by_name = {i.name: i for i in g.initializer}
        known = set(self.init_by_name) | {i.name for i in g.input}
        order = _toposort(model, known, graph.model)
        self.position = {names[i]: k for k, i in enumerate(order)}
        self._init_vi: dict[str, onnx.ValueInfoProto] = {}
        # Every segment input and output is a tensor of the layer graph, whose dtype and
        # shape were inferred once, when it was built (partitioner._infer).
        self._io_vi: dict[str, onnx.ValueInfoProto] = {}

    def segment(self, index: int, layers: frozenset[int], inputs: Sequence[str], outputs: Sequence[str]) -> Segment:
        g = self.graph
        wanted_nodes: list[str] = []
        for lid in sorted(layers):
            layer = g.layers[lid]
            wanted_nodes.extend(layer.const_nodes)
            wanted_nodes.extend(layer.nodes)
        # constants shared by several layers are emitted once, in first-use order
        seen: set[str] = set()
        for name in wanted_nodes:
            seen.add(name)
        nodes = [self.node_by_name[n] for n in sorted(seen, key=self.position.__getitem__)]
        used = {x for n in nodes for x in node_reads(n)}  # subgraphs read outer initializers by name
        inits = [self.init_by_name[x] for x in sorted(used) if x in self.init_by_name]
        graph_inputs = [self._vi(x) for x in inputs]
        if self.model.ir_version < 4:
            # IR 3 requires every initializer to be listed as a graph input too.
            graph_inputs += [self._init_value_info(i) for i in inits]
        graph = helper.make_graph(
            nodes,
            f"{self.model.graph.name or g.model}_seg{index}",
            graph_inputs,
            [self._vi(x) for x in outputs],
            initializer=inits,
        )
        model = helper.make_model(
            graph,
            opset_imports=list(self.model.opset_import),
            producer_name="splitinfer",
            ir_version=self.model.ir_version,
        )
        for f in self.model.functions:
            model.functions.append(f)
        return Segment(index, layers, tuple(inputs), tuple(outputs), model)

    def _init_value_info(self, init: onnx.TensorProto) -> onnx.ValueInfoProto:
        vi = self._init_vi.get(init.name)
        if vi is None:
            vi = self._init_vi[init.name] = helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
        return vi

    def _vi(self, name: str) -> onnx.ValueInfoProto:
        vi = self._io_vi.get(name)
        if vi is None:
            vi = self._io_vi[name] = make_value_info(self.graph, name)
        return vi


def _elem_type(dtype: str) -> int:
    try:
        return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    except (TypeError, ValueError, KeyError):
        names = onnx.TensorProto.DataType.keys()
        return onnx.TensorProto.DataType.Value(dtype.upper()) if dtype.upper() in names else 0


def make_value_info(graph: LayerGraph, name: str) -> onnx.ValueInfoProto:
    """The ONNX type of a tensor of the layer graph, as a segment declares it: the batch
    as the source's batch dim, each symbol by name, an unknown dim left open.

    Raises PartitionError naming the tensor and the fix where its dtype or rank is
    unknown: the checker requires both for a graph's inputs and outputs.
    """
    t = graph.tensor[name]
    elem = _elem_type(t.dtype)
    fix = ("pass sample inputs (--inputs FILE.npz, inputs=): one run records its shape; or fix the input "
           "shapes (--input-shape NAME=D0xD1x..., input_shapes=); or cut elsewhere")
    if not elem:
        raise PartitionError(f"tensor {name!r} of {graph.model} crosses a cut but its dtype is unknown; {fix}",
                             model=graph.model, tensor=name)
    if t.shape is None:
        raise PartitionError(
            f"tensor {name!r} of {graph.model} crosses a cut but its rank is unknown (no shape inference could "
            f"type it); {fix}",
            model=graph.model, tensor=name,
        )
    vi = helper.make_tensor_value_info(name, elem, [])
    dims = vi.type.tensor_type.shape
    for d in t.shape:
        dim = dims.dim.add()
        k = per_sample_factor(d) if isinstance(d, str) else None
        if isinstance(d, int):
            dim.dim_value = d
        elif k is not None and d != UNKNOWN_DIM:
            # the batch (N) or k rows of it folded into one dim (k*N)
            if isinstance(graph.batch, int):
                dim.dim_value = k * graph.batch
            else:
                dim.dim_param = graph.batch if k == 1 and d == BATCH else f"{k}*{graph.batch}"
        elif d != UNKNOWN_DIM:
            dim.dim_param = d
    return vi


def with_recorded_ranks(graph: LayerGraph, sized: LayerGraph) -> LayerGraph:
    """``graph`` where each tensor whose rank no inference on the symbolic model knows takes
    the rank that ``sized`` (the same model built with sample inputs or fixed input shapes)
    recorded: its batch dims (``N``, ``k*N``) as recorded, every other dim unknown (``?``),
    never the samples' size. A segment typed from it still serves any size; only the rank is
    the samples' (a Reshape to a shape input's values of another length is refused at the
    segment's input check). Other tensors are kept as they are."""
    if len(sized.tensors) != len(graph.tensors):
        return graph
    recorded = sized.tensor
    tensors = []
    for t in graph.tensors:
        r = recorded.get(t.name)
        if t.shape is None and r is not None and r.shape is not None:
            shape = tuple(d if isinstance(d, str) and d != UNKNOWN_DIM and per_sample_factor(d) is not None
                          else UNKNOWN_DIM for d in r.shape)
            t = replace(t, shape=shape, dtype=t.dtype if _elem_type(t.dtype) else r.dtype)
        tensors.append(t)
    return replace(graph, tensors=tuple(tensors))


def _segment_io(graph: LayerGraph, layers: frozenset[int], later: frozenset[int]) -> tuple[list[str], list[str]]:
    """Inputs a segment reads from outside and outputs it owes to later segments."""
    inputs, outputs = [], []
    for t in graph.tensors:
        inside = t.producer is not None and t.producer in layers
        if not inside and any(c in layers for c in t.consumers):
            inputs.append(t.name)
        if inside and (t.is_output or any(c in later for c in t.consumers)):
            outputs.append(t.name)
    return inputs, outputs


def _prepare(model: onnx.ModelProto | str | os.PathLike[str], graph: LayerGraph | None) -> tuple[onnx.ModelProto, LayerGraph]:
    if not isinstance(model, onnx.ModelProto):
        from partitioner.build import load_model

        path = os.fspath(model)
        model = load_model(path)
        if graph is None:
            graph = build_graph(model, name=os.path.splitext(os.path.basename(path))[0])
    if graph is None:
        graph = build_graph(model)
    return model, graph


class Splitter:
    """Exports segments of one model; the per-model analysis is done once, here.

    `split` and `split_tiers` build one for a single call. Code that cuts the same
    model many times (the gateway materialising tails, the benchmarks) keeps one.
    """

    def __init__(self, model: onnx.ModelProto | str | os.PathLike[str], graph: LayerGraph | None = None) -> None:
        self.model, self.graph = _prepare(model, graph)
        self._src = _Source(self.model, self.graph)

    def split(self, cut: Cut | Sequence[int], *, check: bool = True) -> tuple[Segment, Segment]:
        """Head (device) and tail (cloud) segments for a cut.

        The head reads the model inputs it uses and writes the boundary plus any model
        outputs it computes; the tail's inputs are exactly the boundary tensors.
        """
        graph = self.graph
        if not isinstance(cut, Cut):
            cut = make_cut(graph, cut)
        head_layers = cut.device
        tail_layers = frozenset(range(len(graph))) - head_layers
        bnd = boundary(graph, cut)
        head_in = [x for x in graph.inputs if any(c in head_layers for c in graph.tensor[x].consumers)]
        head_out = [t.name for t in graph.tensors if t.producer in head_layers and t.is_output]
        head_out += [x for x in bnd if x not in head_out and graph.tensor[x].producer is not None]
        tail_out = [x for x in graph.outputs if graph.tensor[x].producer in tail_layers]
        head = self._src.segment(0, head_layers, head_in, head_out)
        tail = self._src.segment(1, tail_layers, list(bnd), tail_out)
        if check:
            for s in (head, tail):
                if s.layers:
                    _check(s, graph)
        return head, tail

    def split_tiers(self, cuts: Sequence[Cut], *, check: bool = True) -> list[Segment]:
        """k segments for a chain of k-1 nested cuts (device, edge server, ..., cloud)."""
        parts = tier_layers(self.graph, cuts)
        out = []
        for i, layers in enumerate(parts):
            later = frozenset().union(*parts[i + 1 :])
            ins, outs = _segment_io(self.graph, layers, later)
            seg = self._src.segment(i, layers, ins, outs)
            if check and layers:
                _check(seg, self.graph)
            out.append(seg)
        return out


def split(
    model: onnx.ModelProto | str | os.PathLike[str],
    cut: Cut | Sequence[int],
    *,
    graph: LayerGraph | None = None,
    check: bool = True,
) -> tuple[Segment, Segment]:
    """Head and tail segments for a cut (see `Splitter.split`)."""
    return Splitter(model, graph).split(cut, check=check)


def split_tiers(
    model: onnx.ModelProto | str | os.PathLike[str],
    cuts: Sequence[Cut],
    *,
    graph: LayerGraph | None = None,
    check: bool = True,
) -> list[Segment]:
    """k segments for a chain of k-1 nested cuts (see `Splitter.split_tiers`)."""
    return Splitter(model, graph).split_tiers(cuts, check=check)


def _checkable(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with big or external weights turned into typed graph inputs.

    The checker reads external data relative to the working directory and cannot take
    a proto over 2 GB; what it verifies about the graph does not need the bytes.
    """
    heavy = [
        i for i in model.graph.initializer
        if i.data_location == onnx.TensorProto.EXTERNAL or i.ByteSize() > 2**26
    ]
    if not heavy:
        return model
    names = {i.name for i in heavy}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    kept = [i for i in g.initializer if i.name not in names]
    del g.initializer[:]
    g.initializer.extend(kept)
    listed = {i.name for i in g.input}
    for i in heavy:
        if i.name not in listed:
            g.input.append(helper.make_tensor_value_info(i.name, i.data_type, list(i.dims)))
    return out


def _check(seg: Segment, graph: LayerGraph) -> None:
    try:
        onnx.checker.check_model(_checkable(seg.model))
    except onnx.checker.ValidationError as e:
        raise PartitionError(
            f"segment {seg.index} of {graph.model} (layers {sorted(seg.layers)[:5]}...) "
            f"fails the ONNX checker: {e}",
            model=graph.model,
        ) from e


def save_segment(seg: Segment, path: str | os.PathLike[str], *, external_min_bytes: int = 1024) -> None:
    """Write a segment; models over 2 GB keep weights of ``external_min_bytes`` or more
    in a side file ``<path>.data`` (protobuf cannot hold more than 2 GB)."""
    path = os.fspath(path)
    if seg.model.ByteSize() >= _TWO_GB:
        onnx.save_model(
            seg.model,
            path,
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=os.path.basename(path) + ".data",
            size_threshold=external_min_bytes,
        )
    else:
        onnx.save_model(seg.model, path)


_ORT_STATUS_PREFIX = re.compile(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ")


def _ort_error(e: Exception, doing: str, label: str) -> PartitionError:
    """An ONNX Runtime exception as the partitioner's error: ORT's exception types are
    not public, and its message is one line worth keeping (the node and the cause)."""
    lines = str(e).strip().splitlines()
    cause = _ORT_STATUS_PREFIX.sub("", lines[0])[:300] if lines else type(e).__name__
    return PartitionError(
        f"ONNX Runtime cannot {doing} {label}: {cause}; the model itself fails on ONNX Runtime, "
        "so fix it there (onnx.checker.check_model(model, full_check=True) finds many causes)",
        model=label,
    )


def _session(model: onnx.ModelProto, base_dir: str | None, tag: str, label: str) -> Any:
    """An ORT session; models whose weights live in external files load from base_dir.

    Raises PartitionError naming ``label`` when ONNX Runtime cannot load the model.
    """
    # Imported lazily on purpose, inside this function and not at module level:
    # verification is the partitioner's one runtime door (docs/architecture.md keeps the
    # partitioner to onnx + numpy at import time; a grep for onnxruntime finds this
    # line, and the import-rule test allows it).
    import onnxruntime as ort

    opts = ort.SessionOptions()
    # fatal only: a failure reaches the caller as a PartitionError naming the model,
    # which ORT's own log line would only repeat
    opts.log_severity_level = 4
    # No graph rewrites: the whole model and its segments then run the same kernels in
    # the same order, so a difference means a wrong cut, not a fusion that one side
    # could make across the boundary and the other could not.
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        if base_dir is None:
            return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        path = os.path.join(base_dir, f"_verify_{tag}.onnx")
        onnx.save_model(model, path)
        try:
            return ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        finally:
            os.unlink(path)
    except Exception as e:  # noqa: BLE001 - ORT's error types are not public
        raise _ort_error(e, "load", label) from e


def _run(sess: Any, names: Sequence[str], feed: Mapping[str, np.ndarray], label: str) -> list[np.ndarray]:
    try:
        return sess.run(list(names), dict(feed))
    except Exception as e:  # noqa: BLE001 - ORT's error types are not public
        raise _ort_error(e, "run", label) from e


def run_segments(
    segments: Sequence[Segment],
    inputs: Mapping[str, np.ndarray],
    *,
    base_dir: str | None = None,
    name: str | None = None,
) -> dict[str, np.ndarray]:
    """Run segments in order on ONNX Runtime, passing tensors along; returns every tensor.

    ``base_dir`` is the folder of the source model's external weight files, if any;
    ``name`` names the model in errors. Raises PartitionError when ONNX Runtime cannot
    load or run a segment.
    """
    env: dict[str, np.ndarray] = dict(inputs)
    for seg in segments:
        if not seg.layers:
            continue
        label = f"segment {seg.index} of {name}" if name else seg.model.graph.name
        sess = _session(seg.model, base_dir, f"seg{seg.index}", label)
        results = _run(sess, seg.outputs, {x: env[x] for x in seg.inputs}, label)
        env.update(zip(seg.outputs, results))
    return env


def reference_outputs(
    model: onnx.ModelProto,
    names: Sequence[str],
    inputs: Mapping[str, np.ndarray],
    *,
    base_dir: str | None = None,
    name: str | None = None,
) -> dict[str, np.ndarray]:
    """Run the whole model once and return the named tensors (intermediates included).

    ``name`` names the model in errors. Raises PartitionError when ONNX Runtime cannot
    load or run it.
    """
    fed = {n: np.asarray(inputs[n]) for n in names if n in inputs}
    names = [n for n in names if n not in fed]
    full = onnx.ModelProto()
    full.CopyFrom(model)
    present = {o.name for o in full.graph.output}
    extra = [n for n in names if n not in present]
    for n in extra:
        # an output with no type: ONNX Runtime types it from the graph, whatever
        # ONNX shape inference knew of it
        full.graph.output.append(onnx.ValueInfoProto(name=n))
    label = name or model.graph.name or "the model"
    sess = _session(full, base_dir, "full", label)
    return fed | dict(zip(names, _run(sess, names, inputs, label)))


def verify(
    model: onnx.ModelProto | str | os.PathLike[str],
    segments: Sequence[Segment],
    inputs: Mapping[str, np.ndarray] | None = None,
    *,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    seed: int = 0,
    expected: Mapping[str, np.ndarray] | None = None,
    base_dir: str | None = None,
    graph: LayerGraph | None = None,
) -> dict[str, float]:
    """Run the whole model and the segments in order; compare what crosses every cut.

    Every tensor a segment hands on (each boundary, each model output) must equal the
    whole model's value of it. ``expected`` may carry those values from an earlier run
    of the whole model (`reference_outputs`) to avoid running it again. Returns the max
    absolute difference per tensor; raises PartitionError naming the tensor and the
    difference when one is beyond the tolerance.
    """
    model, graph = _prepare(model, graph)
    if inputs is None:
        inputs = make_inputs(model, graph, seed=seed)
    names = list(dict.fromkeys(n for seg in segments if seg.layers for n in seg.outputs))
    if expected is None or any(n not in expected for n in names):
        expected = reference_outputs(model, names, inputs, base_dir=base_dir, name=graph.model)
    got = run_segments(segments, inputs, base_dir=base_dir, name=graph.model)
    diffs = {}
    for name in names:
        want, have = expected[name], got[name]
        same_shape = have.shape == want.shape
        diffs[name] = float(np.max(np.abs(have.astype(np.float64) - want))) if same_shape and want.size else 0.0
        if not same_shape or not np.allclose(have, want, rtol=rtol, atol=atol):
            raise PartitionError(
                f"segments of {graph.model} disagree with the whole model on tensor "
                f"{name!r}: shape {have.shape} vs {want.shape}, max abs diff "
                f"{diffs[name]:.3g} (rtol {rtol}, atol {atol})",
                model=graph.model,
                tensor=name,
            )
    return diffs


def make_inputs(
    model: onnx.ModelProto,
    graph: LayerGraph,
    *,
    seed: int = 0,
    batch: int = 1,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
) -> dict[str, np.ndarray]:
    """Random inputs matching the model's input shapes (the batch set to ``batch``).

    ``input_shapes`` gives the whole shape of some inputs, batch included: the batch of
    an input given so is the batch of every input that leads with it. Raises
    PartitionError, naming the input and the flag that fixes it, for an input whose
    shape is not fixed, or an integer input whose values are shapes or sizes (random
    values there are no valid input: such a model runs on sample inputs).
    """
    rng = np.random.default_rng(seed)
    shapes = dict(input_shapes or {})
    given_batch = {shapes[n][0] for n in shapes
                   if n in graph.tensor and graph.tensor[n].shape and graph.tensor[n].shape[0] == BATCH and shapes[n]}
    if len(given_batch) == 1 and batch == 1:
        batch = given_batch.pop()
    feeding = set(shape_feeding_inputs(model))
    out = {}
    for name in graph.inputs:
        t = graph.tensor[name]
        if name in feeding:
            raise PartitionError(
                f"input {name!r} of {graph.model} is an integer input whose values are shapes or sizes "
                "(it feeds Reshape, Expand, Slice or the like), so random values are no valid input; pass "
                "sample inputs: --inputs FILE.npz (inputs=)",
                model=graph.model, tensor=name,
            )
        if name in shapes:
            dims: list[int | str] = list(shapes[name])
        elif t.shape is None:
            raise PartitionError(
                f"input {name!r} of {graph.model} has no known shape; give it with --input-shape "
                f"{name}=D0xD1x... (input_shapes=) or pass sample inputs with --inputs FILE.npz (inputs=)",
                model=graph.model,
                tensor=name,
            )
        else:
            dims = [batch if d == BATCH else d for d in t.shape]
        if not all(isinstance(d, int) for d in dims):
            example = "x".join(str(d) if isinstance(d, int) else str(d).upper()[:1] for d in dims)
            raise PartitionError(
                f"input {name!r} of {graph.model} has symbolic dims {t.shape}; fix them with --input-shape "
                f"{name}={example} (input_shapes=) or pass sample inputs with --inputs FILE.npz (inputs=)",
                model=graph.model,
                tensor=name,
            )
        dt = np.dtype(t.dtype)
        if np.issubdtype(dt, np.floating):
            out[name] = rng.standard_normal(dims).astype(dt)
        elif dt == np.bool_:
            out[name] = rng.random(dims) < 0.5
        else:
            out[name] = rng.integers(0, 8, size=dims).astype(dt)
    return out
