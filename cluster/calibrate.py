"""Measures the accuracy of every encoding at every candidate cut: the `AccuracyTable`.

For each cut the head runs once per sample (ONNX Runtime, through `workers.engine`);
its boundary tensors then go through each encoding (encode, then decode, as the wire
would carry them) and the tail runs on the result. The outputs are compared with the
fp32 whole model's on the same samples by `workers.agreement.compare_runs`, which picks
the metric that fits each output and names the worst. Cost: one whole-model run and one
head run per sample, plus one tail run per sample and encoding.

Which encodings apply where:

* the boundary encodings (``fp16``, ``int8``, ``int8+pc``) and ``bits@B`` take any float
  tensor, at every cut;
* ``tiled-jpeg@Q`` / ``tiled-webp@Q`` take float feature maps ``[N, C, H, W]``: a cut
  whose float boundary holds another rank records them as not applicable;
* ``jpeg@Q`` / ``webp@Q`` (``input_encodings``) are measured only where what crosses is
  the model input itself (the empty cut, and any cut whose boundary is model inputs),
  and apply only to an image tensor; float inputs are turned back into pixels with the declared
  `ImageNorm` or, without one, each sample's per-channel range. The table records which
  (`AccuracyTable.image_norm`), and the edge agent encodes the frame with the same one.

Integer and bool tensors cross as they are under every encoding. An encoding that
cannot take a boundary (not an image, fp16 overflow) is recorded with its reason and
agreement None, so the next run does not try it again.

[Note: accuracy cache]
A table is tied to a fingerprint of the model file, the sample inputs and the image
normalisation. Given the previous table of the same fingerprint, only the (cut,
encoding) pairs it lacks are measured; when it lacks none, nothing runs at all.
"""

from __future__ import annotations

import hashlib
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import onnx

from cluster.protocol.encoding import decode, encode
from cluster.protocol.errors import EncodingError
from cluster.protocol.lossy import ImageNorm, decode_lossy, encode_lossy
from partitioner import Cut, LayerGraph, Splitter, boundary, build_graph, chain_points, load_model, prefix_cut
from planner.accuracy import AccuracyEntry, AccuracyTable, parse_encoding_key
from workers.agreement import compare_runs
from workers.engine import Engine, EngineConfig
from workers.progress import Progress, progress

__all__ = [
    "DEFAULT_ENCODINGS",
    "DEFAULT_INPUT_ENCODINGS",
    "CalibrationResult",
    "fingerprint",
    "measure_accuracy",
    "select_cuts",
    "split_samples",
]

logger = logging.getLogger(__name__)

#: Boundary encodings measured at every cut by default.
DEFAULT_ENCODINGS: tuple[str, ...] = ("fp16", "int8", "int8+pc", "bits@6", "bits@4",
                                      "tiled-jpeg@90", "tiled-jpeg@50", "tiled-webp@90")
#: Codecs of the model input (image tensors) measured where the model input crosses.
DEFAULT_INPUT_ENCODINGS: tuple[str, ...] = ("jpeg@95", "jpeg@75", "jpeg@50", "jpeg@10", "webp@90", "webp@50")
_INPUT_CODECS = ("jpeg", "webp")
_ENGINE = EngineConfig(provider="cpu", graph_optimization_level="basic", batch_buckets=(1,), warmup_runs=0,
                       dynamic_batch=False, share_weights=False)


@dataclass(frozen=True)
class CalibrationResult:
    """A measured table and what measuring it took."""

    table: AccuracyTable
    """Every entry: the reused ones and the new ones."""
    measured: int
    """(cut, encoding) pairs measured by this call; 0 when the cache held them all."""
    reused: int
    """Pairs taken from the previous table."""


def fingerprint(model_bytes: bytes, samples: Mapping[str, np.ndarray], norm: ImageNorm | None) -> str:
    """sha256 of the model, the samples (names, dtypes, shapes, values) and the norm."""
    h = hashlib.sha256()
    h.update(hashlib.sha256(model_bytes).digest())
    for name in sorted(samples):
        a = np.ascontiguousarray(samples[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    h.update(repr(None if norm is None else norm.to_dict()).encode())
    return h.hexdigest()[:32]


def select_cuts(graph: LayerGraph, *, extra: Sequence[Cut] = (), max_chain_points: int = 8) -> list[Cut]:
    """The empty cut (the model input crosses), up to ``max_chain_points`` chain points
    evenly spaced, and ``extra`` (the frontier's cuts); no duplicates, no edge-only cut."""
    points = [p for p in chain_points(graph) if p < len(graph) - 1]
    k = min(max(0, max_chain_points), len(points))
    chosen = sorted({points[round(i * (len(points) - 1) / max(1, k - 1))] for i in range(k)}) if k else []
    cuts: dict[str, Cut] = {}
    for c in [Cut(frozenset())] + [prefix_cut(graph, p) for p in chosen] + list(extra):
        if len(c.device) < len(graph):
            cuts.setdefault(c.key, c)
    return list(cuts.values())


def split_samples(model: onnx.ModelProto, samples: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """One feed of batch 1 per sample. The rows are those of the model's first input; an
    input is batched when its array has that many rows and the model does not fix its
    first dim at another size. The others (sizes, recurrent state) go whole to every
    sample."""
    declared = {i.name: i.type.tensor_type.shape.dim for i in model.graph.input}
    names = [n for n in declared if n in samples] or list(samples)
    first = np.asarray(samples[names[0]])
    rows = int(first.shape[0]) if first.ndim else 1

    def batched(name: str, v: np.ndarray) -> bool:
        if v.ndim == 0 or v.shape[0] != rows:
            return False
        dims = declared.get(name)
        if not dims:
            return True
        d0 = dims[0]
        return not d0.HasField("dim_value") or d0.dim_value in (-1, 0, 1, rows)

    keep = {k: batched(k, np.asarray(v)) for k, v in samples.items()}
    return [{k: (np.ascontiguousarray(np.asarray(v)[i:i + 1]) if keep[k] else np.asarray(v))
             for k, v in samples.items()} for i in range(rows if any(keep.values()) else 1)]


def _encode_all(key: str, tensors: Mapping[str, np.ndarray], norm: ImageNorm | None) -> tuple[dict, int, float]:
    """The tensors as the receiver decodes them, the bytes sent, and encode + decode ms."""
    kind, level = parse_encoding_key(key)
    out: dict[str, np.ndarray] = {}
    sent = 0
    t0 = time.perf_counter()
    for name, x in tensors.items():
        is_image = kind in _INPUT_CODECS and x.dtype == np.uint8
        if x.dtype.kind != "f" and not is_image:
            out[name], sent = x, sent + x.nbytes
        elif level is None:
            precision = kind.split("+")[0]
            per_channel = kind.endswith("+pc") and x.ndim >= 2
            t = encode(x, precision=precision, per_channel=per_channel)  # type: ignore[arg-type]
            out[name], sent = decode(t).astype(x.dtype, copy=False), sent + t.wire_bytes
        else:
            lt = encode_lossy(x, kind, level, norm=norm if kind in _INPUT_CODECS else None)
            out[name], sent = decode_lossy(lt).astype(x.dtype, copy=False), sent + lt.wire_bytes
    return out, sent, (time.perf_counter() - t0) * 1e3


def _engine(seg_model: onnx.ModelProto, name: str, cache_dir: str) -> Engine:
    return Engine(seg_model, replace(_ENGINE, cache_dir=cache_dir), name=name)


def _one_thread_cpu_ms(model: onnx.ModelProto, feed: Mapping[str, np.ndarray], cache_dir: str,
                       runs: int = 3) -> float:
    """The whole model's median CPU ms with one thread here: the speed the codecs were timed at
    (`AccuracyTable.host_model_ms`, [Note: codec time on the sender] in planner.accuracy)."""
    engine = Engine(model, replace(_ENGINE, cache_dir=cache_dir, intra_op_threads=1), name="host speed")
    try:
        engine.run(feed, copy=True)
        times = []
        for _ in range(runs):
            t = time.thread_time()
            engine.run(feed, copy=True)
            times.append((time.thread_time() - t) * 1e3)
        return max(float(statistics.median(times)), 1e-3)
    finally:
        engine.close()


def _measure_cut(splitter: Splitter, cut: Cut, encodings: Sequence[str], feeds: list[dict[str, np.ndarray]],
                 reference: list[dict[str, np.ndarray]], norm: ImageNorm | None, cache_dir: str,
                 bar: Progress) -> list[AccuracyEntry]:
    graph = splitter.graph
    head, tail = splitter.split(cut, check=False)
    crossing = boundary(graph, cut)
    head_engine = _engine(head.model, f"head {cut.key}", cache_dir) if head.layers else None
    tail_engine = _engine(tail.model, f"tail {cut.key}", cache_dir)
    heads = []
    for feed in feeds:
        env = dict(feed)
        if head_engine is not None:
            env.update(head_engine.run({k: feed[k] for k in head.inputs}, copy=True))
        heads.append(env)
    entries = []
    for key in encodings:
        kind, _ = parse_encoding_key(key)
        cand, sizes, times = [], [], []
        reason = ""
        if kind in _INPUT_CODECS and not all(n in graph.inputs for n in crossing):
            reason = "the image codecs apply where the model input crosses, and this cut sends feature maps"
        else:
            try:
                _encode_all(key, {n: heads[0][n] for n in tail.inputs}, norm)  # untimed: loads the codec
                for env in heads:
                    sent, nbytes, ms = _encode_all(key, {n: env[n] for n in tail.inputs}, norm)
                    outs = tail_engine.run(sent, copy=True)
                    cand.append({n: (outs[n] if n in outs else env[n]) for n in graph.outputs})
                    sizes.append(nbytes)
                    times.append(ms)
            except EncodingError as e:
                reason = e.reason
        if reason:
            entries.append(AccuracyEntry(cut.key, key, None, reason=reason))
        else:
            stats = compare_runs(reference, cand)
            worst = stats.output(stats.worst_output) if stats.worst_output else None
            entries.append(AccuracyEntry(
                cut.key, key, None if stats.agreement is None else min(1.0, max(0.0, stats.agreement)),
                stats.worst_output, None if worst is None else worst.metric, len(cand),
                float(np.mean(sizes)), float(statistics.median(times))))
        bar.update(1)
    for e in (head_engine, tail_engine):
        if e is not None:
            e.close()
    return entries


def measure_accuracy(
    model: str | os.PathLike[str] | onnx.ModelProto,
    samples: Mapping[str, np.ndarray],
    *,
    cuts: Sequence[Cut] | None = None,
    encodings: Sequence[str] = DEFAULT_ENCODINGS,
    input_encodings: Sequence[str] = DEFAULT_INPUT_ENCODINGS,
    norm: ImageNorm | None = None,
    previous: AccuracyTable | None = None,
    model_name: str | None = None,
    sample_source: str = "generated",
    show_progress: bool = True,
    splitter: Splitter | None = None,
) -> CalibrationResult:
    """The accuracy table of ``model`` (a path or a ModelProto) on ``samples`` ([Note: accuracy cache]).

    ``cuts`` defaults to `select_cuts`; ``previous`` is the table measured before (kept
    only when its fingerprint matches). ``splitter`` is the model's, built with the
    samples as inputs where shape inference cannot type every tensor (`build_graph`);
    without one it is built so here."""
    for key in (*encodings, *input_encodings):
        parse_encoding_key(key)
    if isinstance(model, onnx.ModelProto):
        model_bytes = model.SerializeToString()
    else:
        with open(model, "rb") as fh:
            model_bytes = fh.read()
    fp = fingerprint(model_bytes, samples, norm)
    if splitter is None:
        # the samples type every tensor that shape inference leaves unknown, so any cut can be exported
        proto = model if isinstance(model, onnx.ModelProto) else load_model(os.fspath(model))
        stem = None if isinstance(model, onnx.ModelProto) else os.path.splitext(os.path.basename(model))[0]
        splitter = Splitter(proto, build_graph(proto, name=model_name or stem,
                                               inputs=split_samples(proto, samples)[0]))
    graph = splitter.graph
    name = model_name or graph.model
    cuts = select_cuts(graph) if cuts is None else [c for c in cuts if len(c.device) < len(graph)]
    feeds = split_samples(splitter.model, samples)
    image_norm = None if norm is None else norm.to_dict()
    table = AccuracyTable(name, fp, len(feeds), (), sample_source, image_norm)
    if previous is not None and previous.fingerprint == fp and previous.num_samples == len(feeds):
        table = replace(previous, image_norm=image_norm)  # the fingerprint holds the norm: this states it
    elif previous is not None:
        logger.info("%s: the model, samples or norm changed since the stored accuracy table; measuring again", name)
    inputs = set(graph.inputs)
    wanted = {c.key: list(dict.fromkeys((*encodings, *(input_encodings if set(boundary(graph, c)) <= inputs
                                                      else ())))) for c in cuts}
    todo = [(c, [k for k in wanted[c.key] if table.entry(c, k) is None]) for c in cuts]
    todo = [(c, ks) for c, ks in todo if ks]
    total = sum(len(ks) for _, ks in todo)
    reused = sum(len(ks) for ks in wanted.values()) - total
    if not total and table.host_model_ms is not None:
        return CalibrationResult(table, 0, reused)
    new: list[AccuracyEntry] = []
    with tempfile.TemporaryDirectory(prefix="splitinfer-calibrate-") as cache_dir:
        if table.host_model_ms is None or total:
            table = replace(table, host_model_ms=_one_thread_cpu_ms(splitter.model, feeds[0], cache_dir))
        if not total:
            return CalibrationResult(table, 0, reused)
        whole = _engine(splitter.model, f"{name} fp32", cache_dir)
        reference = [whole.run(f, copy=True) for f in feeds]
        whole.close()
        reference = [{n: r[n] for n in graph.outputs} for r in reference]
        with progress(total=total, desc=f"calibrate {name}", enabled=show_progress) as bar:
            for cut, keys in todo:
                new += _measure_cut(splitter, cut, keys, feeds, reference, norm, cache_dir, bar)
    return CalibrationResult(table.with_entries(new), total, reused)
