"""Offline optimisation of segments into artefacts that load in milliseconds.

An *artefact* is a directory ``<cache_dir>/<key>/`` holding

* ``model.onnx``: the graph after our rewrites and ONNX Runtime's optimiser, with
  every large initializer stored externally;
* ``weights.bin``: those initializers, 64-byte aligned, mapped (not read) at load;
* ``meta.json``: an :class:`Artefact`, including whether batching proved safe.

The key hashes the model bytes, the ORT version, the execution provider, the
optimisation level, the batching settings and the host's CPU features, so a stale or
foreign artefact is never picked up.

Building one (:func:`load_or_build_artefact`) runs these steps, each a small function
(the pure graph rewrites of steps 1-3 live in :mod:`workers.rewrite`):

1. ``strip_initializer_inputs``: IR 3 models list every initializer as a graph
   input, which tells ORT they may be overridden and so forbids folding them;
2. ``fuse_transformer`` for graphs that look like transformer blocks, kept only if
   the fused graph computes the same outputs;
3. ``make_batch_dynamic`` when dynamic batching is asked for; when ONNX Runtime
   rejects the result (a fixed 1 that is not the batch, which the rewrite cannot
   tell apart), the model is built as given and the artefact records why;
4. :func:`externalise_weights`: ConstantOfShape weight generators (the zoo models
   build all their weights that way at every load) become real initializers, and all
   large initializers move to a weights file;
5. ONNX Runtime optimises the graph (fusions, constant folding and, at level ``all``,
   NCHWc weight layouts) and saves it; the weights are re-laid out aligned;
6. the batch check: a batch of N must equal N runs of batch 1, on the segment's sample
   inputs where it has some (real data: a classifier's 0/1 dummy masks differed by
   more than the tolerance where its real bytes agreed to 1.2e-7). If it does not,
   the artefact is rebuilt without step 3 and records why.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import uses_external_data

from partitioner.graph import BATCH, LayerGraph
from partitioner.subgraphs import node_reads
from workers._ort import host_fingerprint, make_session_options, np_dtype_of_ort
from workers._weights import acquire_weights
from workers.errors import BatchingUnsafeError, EngineLoadError
from workers.rewrite import (
    BATCH_DIM,
    fuse_transformer,
    looks_like_transformer,
    make_batch_dynamic,
    shape_feeding_inputs,
    strip_initializer_inputs,
)

__all__ = [
    "Artefact",
    "BATCH_DIM",
    "batch_axes",
    "check_batching",
    "compute_artefact_key",
    "digest_samples",
    "externalise_weights",
    "fuse_transformer",
    "inline_subgraph_weights",
    "load_or_build_artefact",
    "looks_like_transformer",
    "make_batch_dynamic",
    "make_batch_feed",
    "random_feed",
    "strip_initializer_inputs",
]

logger = logging.getLogger(__name__)

_ALIGN_BYTES = 64
_EXTERNAL_MIN_BYTES = 1024
_FORMAT_VERSION = 1


@dataclass(frozen=True)
class Artefact:
    """A pre-optimised segment on disk and what was learnt while building it."""

    key: str
    """Hash of model bytes, ORT version, provider, optimisation level, batching, host."""
    directory: str
    """Directory holding ``model.onnx``, ``weights.bin`` and ``meta.json``."""
    provider: str
    """Execution provider the graph was optimised for (``cpu``, ``cuda``, ``tensorrt``)."""
    opt_level: str
    """ORT optimisation level applied offline."""
    ort_version: str
    """ONNX Runtime version that built it."""
    batch_safe: bool
    """True when the batch dimension is symbolic and passed the batch check."""
    batch_reason: str
    """Why batching is unsafe (empty when it is safe)."""
    batch_rewrites: tuple[str, ...] = ()
    """The Reshape shape constants rewritten to carry the batch dimension."""
    fused_ops: tuple[tuple[str, int], ...] = ()
    """Transformer fusions applied, as (operator, count) pairs."""
    folded_constants: int = 0
    """ConstantOfShape weight generators turned into initializers."""
    weights_bytes: int = 0
    """Bytes in ``weights.bin``."""
    build_ms: float = 0.0
    """Wall time of the build."""

    @property
    def model_path(self) -> str:
        return os.path.join(self.directory, "model.onnx")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Artefact":
        raw = json.loads(text)
        raw["batch_rewrites"] = tuple(raw.get("batch_rewrites", ()))
        raw["fused_ops"] = tuple((str(k), int(v)) for k, v in raw.get("fused_ops", ()))
        return cls(**raw)


def compute_artefact_key(
    model_bytes: bytes,
    *,
    provider: str,
    opt_level: str,
    dynamic_batch: bool,
    batch_check_size: int,
    transformer_fusion: bool,
    samples_digest: str = "",
) -> str:
    """Cache key of an artefact (hex, 32 characters). ``samples_digest``: of the sample
    inputs the batch check runs on (:func:`digest_samples`); empty for random ones."""
    h = hashlib.sha256()
    h.update(model_bytes)
    facts = (
        f"v{_FORMAT_VERSION}|ort={ort.__version__}|onnx={onnx.__version__}|ep={provider}|opt={opt_level}"
        f"|dyn={dynamic_batch}|check={batch_check_size}|tf={transformer_fusion}|host={host_fingerprint()}"
        + (f"|samples={samples_digest}" if samples_digest else "")
    )
    h.update(facts.encode())
    return h.hexdigest()[:32]


def digest_samples(samples: Mapping[str, np.ndarray]) -> str:
    """A hash of sample inputs: names, dtypes, shapes and bytes (hex, 16 characters)."""
    h = hashlib.sha256()
    for name in sorted(samples):
        v = np.ascontiguousarray(samples[name])
        h.update(f"{name}|{v.dtype.str}|{v.shape}|".encode())
        h.update(v.tobytes())
    return h.hexdigest()[:16]


# -- graph rewrites (pure: ModelProto in, new ModelProto out) --------------------------


class _WeightsWriter:
    """Appends tensors to one file at aligned offsets and returns external refs."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._f = open(path, "wb")  # noqa: SIM115 - closed by close()
        self.nbytes = 0

    def add(self, name: str, elem_type: int, dims: Sequence[int], data) -> TensorProto:
        pad = (-self._f.tell()) % _ALIGN_BYTES
        if pad:
            self._f.write(b"\0" * pad)
        offset = self._f.tell()
        view = memoryview(data).cast("B")
        self._f.write(view)
        t = TensorProto(name=name, data_type=elem_type, dims=list(dims))
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", os.path.basename(self.path)), ("offset", str(offset)), ("length", str(view.nbytes))):
            e = t.external_data.add()
            e.key, e.value = k, v
        self.nbytes += view.nbytes
        return t

    def close(self) -> None:
        self._f.close()


def _tensor_payload(t: TensorProto, base_dir: str | None):
    if uses_external_data(t):
        info = {e.key: e.value for e in t.external_data}
        arr = np.memmap(
            os.path.join(base_dir or ".", info["location"]),
            dtype=np.uint8,
            mode="r",
            offset=int(info.get("offset", 0)),
            shape=(int(info["length"]),),
        )
        return arr
    if t.raw_data:
        return t.raw_data
    return np.ascontiguousarray(numpy_helper.to_array(t))


def externalise_weights(model: onnx.ModelProto, weights_path: str, *, base_dir: str | None = None) -> tuple[onnx.ModelProto, int]:
    """Fold ConstantOfShape generators of constant shape and move large tensors out.

    Returns the rewritten model (its large initializers now refer to ``weights_path``,
    by base name) and how many generators were folded. ``base_dir`` resolves the
    input model's own external data.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    inits = {t.name: t for t in g.initializer}
    writer = _WeightsWriter(weights_path)
    try:
        kept_nodes, new_inits, folded = [], [], 0
        for node in g.node:
            if node.op_type == "ConstantOfShape" and node.input and node.input[0] in inits:
                shape = numpy_helper.to_array(inits[node.input[0]]).astype(np.int64)
                value = np.zeros(1, np.float32)
                for a in node.attribute:
                    if a.name == "value":
                        value = numpy_helper.to_array(a.t)
                arr = np.full(tuple(shape.tolist()), value.reshape(-1)[0], dtype=value.dtype)
                elem = helper.np_dtype_to_tensor_dtype(arr.dtype)
                if arr.nbytes >= _EXTERNAL_MIN_BYTES:
                    new_inits.append(writer.add(node.output[0], elem, arr.shape, np.ascontiguousarray(arr)))
                else:
                    new_inits.append(numpy_helper.from_array(arr, node.output[0]))
                folded += 1
            else:
                kept_nodes.append(node)
        used = {x for n in kept_nodes for x in node_reads(n)} | {o.name for o in g.output}  # bodies read weights too
        final_inits = []
        for t in g.initializer:
            if t.name not in used:
                continue  # shape tensors of folded generators, and dead weights
            size = int(np.prod(t.dims, dtype=np.int64)) * _itemsize(t.data_type)
            if size >= _EXTERNAL_MIN_BYTES:
                final_inits.append(writer.add(t.name, t.data_type, t.dims, _tensor_payload(t, base_dir)))
            else:
                if uses_external_data(t):
                    arr = np.frombuffer(_tensor_payload(t, base_dir), dtype=helper.tensor_dtype_to_np_dtype(t.data_type))
                    t = numpy_helper.from_array(arr.reshape(tuple(t.dims)), t.name)
                final_inits.append(t)
        del g.node[:]
        g.node.extend(kept_nodes)
        del g.initializer[:]
        g.initializer.extend(final_inits + new_inits)
        inline_subgraph_weights(out, base_dir)
    finally:
        writer.close()
    return out, folded


def _itemsize(elem_type: int) -> int:
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).itemsize


def _subgraphs(graph: onnx.GraphProto) -> Iterable[onnx.GraphProto]:
    """Every graph nested in ``graph``'s nodes (If branches, Loop/Scan bodies), at any depth."""
    for node in graph.node:
        for a in node.attribute:
            nested = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
            for sub in nested:
                yield sub
                yield from _subgraphs(sub)


def inline_subgraph_weights(model: onnx.ModelProto, base_dir: str | None) -> int:
    """Make the initializers inside subgraphs inline, in place; returns how many moved.

    Only top-level initializers can be handed to a session as shared buffers
    (``SessionOptions.add_initializer``), and ONNX Runtime saves a subgraph's weights
    into its own external file: kept inline, they travel with ``model.onnx`` and the
    artefact never refers to a file that the build deleted.
    """
    moved = 0
    for sub in _subgraphs(model.graph):
        for i, t in enumerate(sub.initializer):
            if uses_external_data(t):
                arr = np.frombuffer(_tensor_payload(t, base_dir), dtype=helper.tensor_dtype_to_np_dtype(t.data_type))
                sub.initializer[i].CopyFrom(numpy_helper.from_array(arr.reshape(tuple(t.dims)), t.name))
                moved += 1
    return moved


def _realign(src_model_path: str, dst_dir: str) -> int:
    """Rewrite an ORT-saved model so its external weights sit aligned in weights.bin."""
    model = onnx.load(src_model_path, load_external_data=False)
    base = os.path.dirname(src_model_path)
    writer = _WeightsWriter(os.path.join(dst_dir, "weights.bin"))
    try:
        for t in model.graph.initializer:
            size = int(np.prod(t.dims, dtype=np.int64)) * _itemsize(t.data_type)
            if uses_external_data(t) or size >= _EXTERNAL_MIN_BYTES:
                payload = _tensor_payload(t, base)
                t.CopyFrom(writer.add(t.name, t.data_type, t.dims, payload))
        inline_subgraph_weights(model, base)
    finally:
        writer.close()
    onnx.save(model, os.path.join(dst_dir, "model.onnx"))
    return writer.nbytes


# -- the batch check ---------------------------------------------------------------------


def random_feed(inputs: Iterable[tuple[str, np.dtype | str, Sequence]], batch: int,
                rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random inputs of ``batch`` rows for ``(name, dtype, shape)`` triples (the first
    dimension is the batch; other dimensions that are not numbers become 1)."""
    feed = {}
    for name, dtype, dims in inputs:
        shape = [batch] + [d if isinstance(d, int) else 1 for d in dims[1:]]
        dtype = np.dtype(dtype)
        if dtype.kind == "f":
            feed[name] = rng.standard_normal(shape).astype(dtype)
        elif shape:
            # Integer inputs of segments are masks, ids or indices: right-padded 0/1
            # rows are valid for all three, and are what fused attention assumes.
            lengths = rng.integers(1, shape[-1] + 1, size=shape[:-1])
            feed[name] = (np.arange(shape[-1]) < lengths[..., None]).astype(dtype)
        else:
            feed[name] = np.ones(shape, dtype)
    return feed


def _random_feed(session: ort.InferenceSession, batch: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return random_feed(((i.name, np_dtype_of_ort(i.type), i.shape) for i in session.get_inputs()), batch, rng)


def batch_axes(name: str, value: np.ndarray, graph: LayerGraph | None = None,
               unbatched: Collection[str] = ()) -> tuple[int, ...]:
    """The axes of input ``name`` that hold the batch: where the layer graph's per-sample
    shape has ``N`` (a recurrent state [layers, N, hidden] has it on axis 1), none for
    an input without it (a shape vector); without the graph's shape, axis 0 unless the
    input is one of ``unbatched`` (integer inputs that set shapes) or a scalar."""
    t = graph.tensor.get(name) if graph is not None else None
    if t is not None and t.shape is not None:
        return tuple(ax for ax, d in enumerate(t.shape) if d == BATCH and ax < np.ndim(value))
    return () if name in unbatched or not np.ndim(value) else (0,)


def make_batch_feed(samples: Mapping[str, np.ndarray], batch: int, rng: np.random.Generator, *,
                    graph: LayerGraph | None = None, unbatched: Collection[str] = ()) -> dict[str, np.ndarray]:
    """``batch`` rows made from real sample inputs: their own rows first, then copies of
    them; a copy's floating-point inputs get noise of 1 % of their spread, so that no two
    rows are equal, while integer inputs (ids, masks, lengths) keep their real values.
    Rows are taken along each input's batch axes (`batch_axes`); an input without a batch
    dim (a shape vector, a sample rate) is passed unchanged."""
    axes = {name: batch_axes(name, v, graph, unbatched) for name, v in samples.items()}
    rows = min((np.shape(v)[ax] for name, v in samples.items() for ax in axes[name]), default=1)
    feed = {}
    for name, value in samples.items():
        value = np.asarray(value)
        if not axes[name]:
            feed[name] = value
            continue
        picked = value
        for ax in axes[name]:
            picked = np.take(picked, [j % rows for j in range(batch)], axis=ax)
        if picked.dtype.kind == "f" and batch > rows:
            copies = np.zeros(picked.shape, dtype=bool)
            index: list = [slice(None)] * picked.ndim
            for ax in axes[name]:
                index[ax] = slice(rows, None)
                copies[tuple(index)] = True
                index[ax] = slice(None)
            spread = float(np.std(value)) or 1.0
            noise = rng.standard_normal(picked.shape) * (0.01 * spread)
            picked = np.where(copies, picked + noise, picked).astype(picked.dtype)
        feed[name] = picked
    return feed


def _row(value: np.ndarray, axes: tuple[int, ...], j: int) -> np.ndarray:
    """Row ``j`` of ``value`` along its batch axes (all of it where it has none)."""
    for ax in axes:
        value = np.take(value, [j], axis=ax)
    return value


def check_batching(session: ort.InferenceSession, batch: int, *, rtol: float = 1e-4, atol: float = 1e-5,
                   samples: Mapping[str, np.ndarray] | None = None, shape_inputs: Sequence[str] = (),
                   graph: LayerGraph | None = None) -> str:
    """Run one batch of ``batch`` samples against ``batch`` runs of one each.

    The samples are ``samples`` (real inputs, see :func:`make_batch_feed`) when given,
    else random ones. Random values are never made for ``shape_inputs`` (integer inputs
    that set shapes, :func:`partitioner.shapes.shape_feeding_inputs`): without samples
    such a segment is reported unsafe without running. Rows are split and joined along
    each tensor's batch axes (`batch_axes`, from ``graph``'s shapes where given); inputs
    without a batch dim go whole into every run. Returns an empty string when they agree
    (``np.allclose``), else the reason.
    """
    rng = np.random.default_rng(1234)
    if samples is not None:
        feed = make_batch_feed(samples, batch, rng, graph=graph, unbatched=shape_inputs)
    elif shape_inputs:
        return (f"its integer inputs {', '.join(shape_inputs)} set shapes, and there are no sample inputs to "
                "check a batch on; give the model sample inputs (model.yaml sample_inputs, or --inputs)")
    else:
        feed = _random_feed(session, batch, rng)
    try:
        together = session.run(None, feed)
        axes = {k: batch_axes(k, v, graph, shape_inputs) for k, v in feed.items()}
        apart = [session.run(None, {k: _row(v, axes[k], j) for k, v in feed.items()}) for j in range(batch)]
    except Exception as e:  # noqa: BLE001 - ORT raises its own error types; we report them
        return f"a batch of {batch} does not run: {str(e).splitlines()[0][:300]}"
    names = [o.name for o in session.get_outputs()]
    for k, name in enumerate(names):
        out_axes = batch_axes(name, together[k], graph) or (0,)
        joined = np.concatenate([a[k] for a in apart], axis=out_axes[0])
        if together[k].shape != joined.shape:
            return f"output {name!r} has shape {together[k].shape} for a batch of {batch}, expected {joined.shape}"
        if not np.allclose(together[k], joined, rtol=rtol, atol=atol):
            diff = float(np.max(np.abs(together[k].astype(np.float64) - joined.astype(np.float64))))
            return f"output {name!r} of a batch of {batch} differs from {batch} runs of batch 1 (max abs diff {diff:.3g})"
    return ""


def _fusion_mismatch(before: onnx.ModelProto, after: onnx.ModelProto) -> str:
    """Empty when the fused graph computes what the original did on random inputs."""
    try:
        a = ort.InferenceSession(before.SerializeToString(), providers=["CPUExecutionProvider"])
        b = ort.InferenceSession(after.SerializeToString(), providers=["CPUExecutionProvider"])
        feed = _random_feed(a, 1, np.random.default_rng(7))
        for x, y in zip(a.run(None, feed), b.run(None, feed)):
            if x.shape != y.shape or not np.allclose(x, y, rtol=1e-3, atol=1e-4):
                return "the fused graph's outputs differ from the original's"
    except Exception as e:  # noqa: BLE001 - any failure means: keep the plain graph
        return f"the fused graph does not run: {str(e).splitlines()[0][:200]}"
    return ""


# -- build and cache -------------------------------------------------------------------


def _build_once(
    model: onnx.ModelProto,
    out_dir: str,
    *,
    base_dir: str | None,
    providers: list,
    opt_level: str,
    intra_op_threads: int,
) -> tuple[int, int]:
    stage = tempfile.mkdtemp(prefix="stage-", dir=out_dir)
    try:
        staged, folded = externalise_weights(model, os.path.join(stage, "stage.bin"), base_dir=base_dir)
        stage_model = os.path.join(stage, "stage.onnx")
        onnx.save(staged, stage_model)
        ep = providers[0] if isinstance(providers[0], str) else providers[0][0]
        if ep == "TensorrtExecutionProvider":
            # TensorRT compiles at session creation and keeps its own engine cache;
            # a graph saved by ORT would hold nodes only this session could run.
            nbytes = _realign(stage_model, out_dir)
            return folded, nbytes
        so = make_session_options(
            intra_op_threads=intra_op_threads, inter_op_threads=1, opt_level=opt_level, log_severity=3
        )
        ort_model = os.path.join(stage, "ort.onnx")
        so.optimized_model_filepath = ort_model
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", "ort.bin")
        so.add_session_config_entry(
            "session.optimized_model_external_initializers_min_size_in_bytes", str(_EXTERNAL_MIN_BYTES)
        )
        try:
            ort.InferenceSession(stage_model, so, providers=providers)
        except Exception as e:  # noqa: BLE001 - ORT's error types are not public
            raise EngineLoadError(
                f"ONNX Runtime cannot optimise the model: {str(e).splitlines()[0][:300]}; check that it passes "
                "onnx.checker.check_model and that its opset is supported by onnxruntime " + ort.__version__,
                detail=str(e),
                stage="optimise",
            ) from e
        nbytes = _realign(ort_model, out_dir)
        return folded, nbytes
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _checked_reason(model_path: str, providers: list, intra_op_threads: int, batch: int,
                    samples: Mapping[str, np.ndarray] | None, shape_inputs: Sequence[str]) -> str:
    weights = acquire_weights(model_path)  # must outlive the session that borrows it
    # fatal only: a batch that does not run is returned as the reason, not logged
    so = make_session_options(
        intra_op_threads=intra_op_threads, inter_op_threads=1, opt_level="disable", log_severity=4, disable_prepacking=True
    )
    weights.apply(so)
    session = ort.InferenceSession(model_path, so, providers=providers)
    if samples is not None and shape_inputs:  # an engine stacks requests along dim 0 of every input
        return (f"its integer inputs {', '.join(shape_inputs)} set shapes and hold no rows, and requests are "
                "stacked along dim 0 of every input")
    try:
        return check_batching(session, batch, samples=samples, shape_inputs=shape_inputs)
    finally:
        del session
        del weights


def load_or_build_artefact(
    model: onnx.ModelProto,
    *,
    key: str,
    cache_dir: str,
    provider: str,
    providers: list,
    opt_level: str,
    dynamic_batch: bool,
    batch_check_size: int,
    transformer_fusion: bool,
    intra_op_threads: int = 0,
    base_dir: str | None = None,
    samples: Mapping[str, np.ndarray] | None = None,
) -> tuple[Artefact, bool]:
    """The artefact for ``key``, built when absent. Returns it and whether it was cached.

    ``samples``: real inputs of the segment that the batch check runs on (the key must
    then cover them: ``compute_artefact_key(samples_digest=...)``).

    Concurrent builders of one key are safe: each builds in a private directory and
    the first to rename it into place wins.
    """
    final_dir = os.path.join(cache_dir, key)
    meta_path = os.path.join(final_dir, "meta.json")
    if os.path.exists(meta_path):
        with open(meta_path, encoding="utf-8") as f:
            art = Artefact.from_json(f.read())
        return dataclasses.replace(art, directory=final_dir), True

    os.makedirs(cache_dir, exist_ok=True)
    t0 = time.perf_counter()
    work = tempfile.mkdtemp(prefix=f"{key}.build-", dir=cache_dir)
    try:
        base = strip_initializer_inputs(model)
        fused: dict[str, int] = {}
        if transformer_fusion and looks_like_transformer(base):
            candidate, fused = fuse_transformer(base)
            mismatch = _fusion_mismatch(base, candidate) if fused else ""
            if mismatch:
                logger.warning("transformer fusions for %s dropped: %s", key, mismatch)
                fused = {}
            else:
                base = candidate
            logger.info("transformer fusions for %s: %s", key, fused or "none")
        batch_safe, reason, rewrites = False, "dynamic batching is off in the engine config", ()
        chosen = None
        if dynamic_batch:
            try:
                dyn, rewrites = make_batch_dynamic(base)
            except BatchingUnsafeError as e:
                reason = e.reason or str(e)
            else:
                chosen = os.path.join(work, "dynamic")
                os.mkdir(chosen)
                try:
                    folded, nbytes = _build_once(
                        dyn, chosen, base_dir=base_dir, providers=providers, opt_level=opt_level,
                        intra_op_threads=intra_op_threads,
                    )
                    reason = _checked_reason(os.path.join(chosen, "model.onnx"), providers, intra_op_threads,
                                             batch_check_size, samples, shape_feeding_inputs(base))
                except (EngineLoadError, ort.capi.onnxruntime_pybind11_state.Fail,
                        ort.capi.onnxruntime_pybind11_state.InvalidGraph) as e:
                    # A fixed batch the rewrite cannot free (a leading 1 that is not the
                    # batch): the model as given still serves, one request a run.
                    cause = str(getattr(e, "detail", "") or e).splitlines()[0]
                    cause = cause.split(" failed:", 1)[-1][:300]  # past "Load model from <temp path>"
                    reason = f"ONNX Runtime rejects the model with a symbolic batch: {cause}"
                batch_safe = not reason
                if reason:
                    chosen, rewrites = None, ()
                    logger.info("batching is unsafe for %s: %s", key, reason)
        if chosen is None:
            chosen = os.path.join(work, "static")
            os.mkdir(chosen)
            folded, nbytes = _build_once(
                base, chosen, base_dir=base_dir, providers=providers, opt_level=opt_level, intra_op_threads=intra_op_threads
            )
        art = Artefact(
            key=key,
            directory=final_dir,
            provider=provider,
            opt_level=opt_level,
            ort_version=ort.__version__,
            batch_safe=batch_safe,
            batch_reason=reason,
            batch_rewrites=tuple(rewrites),
            fused_ops=tuple(sorted(fused.items())),
            folded_constants=folded,
            weights_bytes=nbytes,
            build_ms=(time.perf_counter() - t0) * 1e3,
        )
        with open(os.path.join(chosen, "meta.json"), "w", encoding="utf-8") as f:
            f.write(art.to_json())
        try:
            os.rename(chosen, final_dir)
        except OSError:
            logger.debug("artefact %s was built concurrently; using the one in place", key)
            with open(meta_path, encoding="utf-8") as f:
                return dataclasses.replace(Artefact.from_json(f.read()), directory=final_dir), True
        logger.info(
            "built artefact %s in %.0f ms: batch_safe=%s (%s), %d folded generators, %d weight bytes",
            key, art.build_ms, batch_safe, reason or "checked", folded, nbytes,
        )
        return art, False
    finally:
        shutil.rmtree(work, ignore_errors=True)
