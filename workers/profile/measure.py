"""Measuring a profile on this host with ONNX Runtime's profiler.

`measure` runs the whole model with ``SessionOptions.enable_profiling``, reads the
kernel times from the trace, places them on layers (see [Note: attributing kernels
to layers] in workers/profile/_trace.py), and reports per-layer median and p90 over
the timed runs after a warm-up. Optionally it times real head and tail segments to
fit the profile's corrections ([Note: fitting corrections] in _calibrate.py) and the
whole model at several batch sizes.

Every session here comes from `open_session`, the one place that pins the settings
(threads, optimisation level, provider), so that switching the timing runner (to the
serving `workers.engine.Engine`, say) is one change.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from partitioner.build import node_names
from partitioner.cuts import Cut, boundary
from partitioner.export import Splitter, make_inputs, reference_outputs
from partitioner.graph import LayerGraph
from partitioner.shapes import sample_rows, samples_batch, shape_feeding_inputs
from planner.profile import LayerTime, Profile
from workers._ort import PROVIDER_NAMES, make_session_options, select_providers
from workers.coldstart import check_batching, make_batch_dynamic, strip_initializer_inputs
from workers.errors import BatchingUnsafeError
from workers.profile._calibrate import SegmentTiming, calibration_cuts, fit_corrections
from workers.profile._trace import ProfilingError, attribute_runs, map_nodes, parse_trace
from workers.progress import progress as show_progress  # "progress" is the flag of the functions below

__all__ = ["Measurement", "SegmentJob", "load_profile", "measure", "measure_profile", "open_session", "prepare_model",
           "segment_jobs", "time_interleaved", "time_segments"]

logger = logging.getLogger(__name__)

_EPS = ("cpu", "cuda")


@dataclass(frozen=True)
class Measurement:
    """A measured profile and the facts about how well it was measured."""

    profile: Profile
    """The measured profile (with corrections when calibrated)."""
    attributed_fraction: float
    """Share of the profiler's kernel time that was placed on a layer."""
    unattributed_us: Mapping[str, float] = field(default_factory=dict)
    """Mean microseconds per run of ORT nodes that could not be placed, by name."""
    run_ms: tuple[float, ...] = ()
    """Wall ms of each profiled run (profiler overhead included)."""
    segments: tuple[SegmentTiming, ...] = ()
    """The segment timings the corrections were fitted to (empty without calibration)."""
    batch_note: str = ""
    """Why ``batch_ms`` is missing or partial (empty when every batch asked was timed)."""
    alongside_ms: tuple[tuple[float, ...], ...] = ()
    """Wall ms of each ``alongside`` job of `measure`, run by run."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile.to_dict(),
            "attributed_fraction": self.attributed_fraction,
            "unattributed_us": dict(self.unattributed_us),
            "run_ms": list(self.run_ms),
            "segments": [s.to_dict() for s in self.segments],
            "batch_note": self.batch_note,
            "alongside_ms": [list(t) for t in self.alongside_ms],
        }

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)


def _check_settings(threads: int, batch: int, ep: str, warmup: int, runs: int) -> None:
    def bad(name: str, value: Any, fix: str) -> ProfilingError:
        return ProfilingError(f"{name}={value!r} is invalid; {fix}", setting=name)

    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise bad("threads", threads, "give the intra-op thread count the tier will run with (>= 1)")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise bad("batch", batch, "use a batch size >= 1")
    if ep not in _EPS:
        raise bad("ep", ep, f"use one of {list(_EPS)}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise bad("warmup", warmup, "use 0 or more warm-up runs")
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise bad("runs", runs, "use at least 1 timed run (10 or more for a stable p90)")


def prepare_model(model: onnx.ModelProto, *, batch: int = 1) -> onnx.ModelProto:
    """The model as it is profiled: initializers not listed as inputs (so ORT may fold
    them, as the serving engine lets it), every node named as in the layer graph, and
    for ``batch`` > 1 a symbolic batch dimension (BatchingUnsafeError if impossible)."""
    out = strip_initializer_inputs(model)
    for node, name in zip(out.graph.node, node_names(model)):
        node.name = name
    if batch != 1:
        out, _ = make_batch_dynamic(out)
    return out


def open_session(model: onnx.ModelProto | str, *, threads: int, ep: str = "cpu", profile_prefix: str | None = None,
                 optimized_path: str | None = None, prepacking: bool = True,
                 name: str = "the model") -> ort.InferenceSession:
    """An InferenceSession with every speed setting pinned (optimisation level all,
    ``threads`` intra-op threads, sequential execution). ``prepacking=False`` is how
    the serving engine runs when it shares weights (`workers.engine`), and keeps one
    copy of the weights per session instead of two. ``name`` names the model in errors."""
    # Severity 4 (fatal only): a load or run failure reaches the caller as a
    # ProfilingError naming the model, which ORT's own log line would only repeat.
    so = make_session_options(intra_op_threads=threads, inter_op_threads=1, opt_level="all", log_severity=4,
                              disable_prepacking=not prepacking)
    if profile_prefix is not None:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    if optimized_path is not None:
        so.optimized_model_filepath = optimized_path
        # The graph is all we read back; keep the weights out of the saved proto.
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                    os.path.basename(optimized_path) + ".weights")
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "64")
    _, providers = select_providers(ep)
    source = model if isinstance(model, str) else model.SerializeToString()
    try:
        return ort.InferenceSession(source, so, providers=providers)
    except Exception as e:  # noqa: BLE001 - ORT's error types are not public
        raise ProfilingError(
            f"ONNX Runtime cannot load {name} to profile: {str(e).splitlines()[0][:300]}; "
            "check it with 'splitinfer inspect' and onnx.checker",
            model=name, detail=str(e), setting="model",
        ) from e


def _run(session: ort.InferenceSession, feed: Mapping[str, np.ndarray], name: str) -> list[np.ndarray]:
    try:
        return session.run(None, dict(feed))
    except Exception as e:  # noqa: BLE001
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise ProfilingError(
            f"ONNX Runtime failed running {name} to profile it: {first}; the inputs are the sample inputs where "
            "given (--inputs, inputs=), else random values at the model's input shapes (partitioner.make_inputs): "
            "check that the model runs on ONNX Runtime, or pass sample inputs",
            model=name, detail=str(e), setting="model",
        ) from e


_CLOCKS = {"wall": time.perf_counter_ns, "thread": time.thread_time_ns}


def time_interleaved(jobs: Sequence[tuple[ort.InferenceSession, Mapping[str, np.ndarray]]], *, warmup: int,
                     runs: int, progress: bool = False, desc: str = "", clock: str = "wall",
                     name: str = "the model") -> list[np.ndarray]:
    """Ms of ``runs`` runs of each (session, feed), taken round-robin after ``warmup``
    runs of each, so that a slow spell on a shared host hits all alike.

    ``clock`` is ``wall`` (elapsed time) or ``thread`` (CPU time of the calling
    thread: with one intra-op thread ORT runs every kernel on the caller, so this is
    the run's time without the time other processes held the core; see
    [Note: clocks on a shared host] in docs/profiles.md). ``name`` names the model in
    the ProfilingError a failed run raises.
    """
    if clock not in _CLOCKS:
        raise ProfilingError(f"clock={clock!r} is invalid; use 'wall' or 'thread'", setting="clock")
    now = _CLOCKS[clock]

    for s, f in jobs:
        for _ in range(warmup):
            _run(s, f, name)
    out = np.zeros((len(jobs), runs))
    with show_progress(runs * len(jobs), desc, enabled=progress) as bar:
        for r in range(runs):
            for j, (s, f) in enumerate(jobs):
                t = now()
                _run(s, f, name)
                out[j, r] = (now() - t) / 1e6
                bar.update(1)
    return [out[j] for j in range(len(jobs))]


@dataclass(frozen=True, eq=False)
class SegmentJob:
    """A real segment ready to time: its session and a feed for it."""

    cut: str
    """Key of the cut (``whole`` for the whole model)."""
    side: str
    """``head`` or ``tail``."""
    layers: frozenset[int]
    session: ort.InferenceSession
    feed: Mapping[str, np.ndarray]

    def timing(self, profile: Profile, times_ms: np.ndarray) -> SegmentTiming:
        add = float(sum(profile.layers[v].ms for v in self.layers))
        return SegmentTiming(cut=self.cut, side=self.side, layers=len(self.layers), additive_ms=add,
                             measured_ms=float(np.median(times_ms)), p90_ms=float(np.percentile(times_ms, 90)))


def segment_jobs(model: onnx.ModelProto, graph: LayerGraph, cuts: Sequence[Cut], *, threads: int, ep: str = "cpu",
                 whole: bool = False, sides: Sequence[str] = ("head", "tail"),
                 prepacking: bool = True, inputs: Mapping[str, np.ndarray] | None = None) -> list[SegmentJob]:
    """Sessions for the real head and tail segments of ``cuts`` (and the whole model
    when ``whole``), each with inputs: a tail is fed the real values of its boundary,
    computed once by one run of the whole model on ``inputs`` (sample inputs of one
    row), or on random ones at the model's input shapes."""
    feed0 = _feed(model, graph, 1, inputs)
    jobs: list[SegmentJob] = []
    if whole:
        jobs.append(SegmentJob("whole", "tail", frozenset(range(len(graph))),
                               open_session(prepare_model(model), threads=threads, ep=ep, prepacking=prepacking,
                                            name=graph.model),
                               feed0))
    need = sorted({x for cut in cuts for x in boundary(graph, cut)} - set(feed0)) if "tail" in sides else []
    env = dict(feed0)
    if need:
        env.update(reference_outputs(model, need, feed0, name=graph.model))
    splitter = Splitter(model, graph)  # the per-model analysis once, not per cut
    for cut in cuts:
        head, tail = splitter.split(cut, check=False)
        for seg, side in ((head, "head"), (tail, "tail")):
            if seg.layers and side in sides:
                sess = open_session(prepare_model(seg.model), threads=threads, ep=ep, prepacking=prepacking,
                                    name=f"the {side} of {graph.model} cut {cut.key}")
                jobs.append(SegmentJob(cut.key, side, seg.layers, sess, {x: env[x] for x in seg.inputs}))
    return jobs


def time_segments(model: onnx.ModelProto, graph: LayerGraph, profile: Profile, cuts: Sequence[Cut], *,
                  threads: int, ep: str = "cpu", warmup: int = 2, runs: int = 10, progress: bool = False,
                  whole: bool = True, sides: Sequence[str] = ("head", "tail"),
                  clock: str = "wall") -> list[SegmentTiming]:
    """Time the real head and tail segments of ``cuts`` (and the whole model when
    ``whole``), in-process, each in its own session, against ``profile``'s per-layer sum."""
    jobs = segment_jobs(model, graph, cuts, threads=threads, ep=ep, whole=whole, sides=sides)
    times = time_interleaved([(j.session, j.feed) for j in jobs], warmup=warmup, runs=runs, progress=progress,
                             desc=f"segments {graph.model}", clock=clock, name=graph.model)
    return [j.timing(profile, t) for j, t in zip(jobs, times)]


def _feed(model: onnx.ModelProto, graph: LayerGraph, batch: int,
          inputs: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
    """Sample inputs at ``batch`` rows where given (at their own rows where an integer input
    sets shapes: see :func:`_own_batch`), else random ones at the input shapes."""
    if inputs is None:
        return make_inputs(model, graph, batch=batch)
    return dict(inputs) if _own_batch(model, graph, inputs) else sample_rows(inputs, graph, batch)


def _own_batch(model: onnx.ModelProto, graph: LayerGraph,
               inputs: Mapping[str, np.ndarray] | None) -> tuple[int, tuple[str, ...]] | None:
    """(the samples' batch, the integer inputs that set shapes) where such an input's values
    hold that batch (a Reshape to (2, 6, 2) for 2 rows): sizes written for the samples'
    rows, which run only at their own rows; None where the rows can be repeated or cut
    (no such input, or values such as (-1, 3, 4) that leave the batch to the data).
    A size equal to the batch by chance counts as the batch: the samples then run as given."""
    if inputs is None:
        return None
    feeding = tuple(k for k in shape_feeding_inputs(model) if k in inputs)
    rows = samples_batch(inputs, graph) if feeding else None
    if rows is None:
        return None
    holding = tuple(k for k in feeding if np.any(np.asarray(inputs[k]) == rows))
    return (rows, holding) if holding else None


def _batch_ms(model: onnx.ModelProto, graph: LayerGraph, sizes: Sequence[int], *, threads: int, ep: str,
              warmup: int, runs: int, inputs: Mapping[str, np.ndarray] | None = None
              ) -> tuple[dict[int, float] | None, str]:
    """Whole-model ms per batch size, or None and the reason batching is impossible."""
    sizes = sorted(set(sizes) | {1})
    if sizes == [1]:
        return None, ""
    try:
        dyn = prepare_model(model, batch=2)
    except BatchingUnsafeError as e:
        return None, f"batch kept at 1: {e}"
    own = _own_batch(model, graph, inputs)
    if own is not None:
        return None, (f"batch kept at the sample inputs' {own[0]}: integer input(s) {', '.join(own[1])} "
                      "set shapes for it")
    sess = open_session(dyn, threads=threads, ep=ep, name=graph.model)
    reason = check_batching(sess, 2, samples=sample_rows(inputs, graph, 1) if inputs is not None else None,
                            shape_inputs=shape_feeding_inputs(model), graph=graph)
    if reason:
        return None, f"batch kept at 1: the batch dimension cannot be made dynamic ({reason})"
    jobs = [(sess, _feed(model, graph, b, inputs)) for b in sizes]
    times = time_interleaved(jobs, warmup=max(1, warmup), runs=runs, name=graph.model)
    return {b: float(np.median(t)) for b, t in zip(sizes, times)}, ""


def measure(
    model: onnx.ModelProto,
    graph: LayerGraph,
    *,
    threads: int,
    batch: int = 1,
    ep: str = "cpu",
    warmup: int = 3,
    runs: int = 10,
    progress: bool = True,
    device: str = "this-host",
    batch_sizes: Sequence[int] = (),
    calibrate: int = 0,
    cuts: Sequence[Cut] | None = None,
    alongside: Sequence[tuple[ort.InferenceSession, Mapping[str, np.ndarray]]] = (),
    clock: str = "wall",
    layer_stat: str = "median",
    prepacking: bool = True,
    inputs: Mapping[str, np.ndarray] | None = None,
) -> Measurement:
    """Measure ``model`` (whose layer graph is ``graph``) on this host.

    ``batch`` is the batch the per-layer times are taken at (1 for the planner's
    additive model); ``batch_sizes`` adds whole-model ``batch_ms`` where the batch can
    be made dynamic; ``calibrate`` > 0 fits corrections on that many cuts (or on
    ``cuts``) from timed real segments. ``alongside`` are (session, feed) pairs to time
    in the same interleaved loop (their ms come back in ``alongside_ms``). ``clock``
    is the `time_interleaved` clock of every timed run; ``thread`` needs ``threads=1``.
    ``layer_stat`` is how a layer's ``ms`` summarises its runs: ``median``, or ``min``
    on a shared host, where a long kernel is preempted in most runs (kernel times in
    the trace are wall times) and only the fastest run shows its own cost.
    ``prepacking`` is passed to every `open_session`. ``inputs`` are sample inputs
    by input name (`partitioner.shapes.load_sample_inputs`): every run is on them, their
    rows repeated or cut to the batch; without them the runs are on random inputs at
    the model's input shapes, which `graph` fixes (build it with ``input_shapes=``).
    """
    _check_settings(threads, batch, ep, warmup, runs)
    if layer_stat not in ("median", "min"):
        raise ProfilingError(f"layer_stat={layer_stat!r} is invalid; use 'median' or 'min'", setting="layer_stat")
    if clock not in _CLOCKS:
        raise ProfilingError(f"clock={clock!r} is invalid; use 'wall' or 'thread'", setting="clock")
    if clock == "thread" and (threads != 1 or ep != "cpu"):
        raise ProfilingError(
            f"clock='thread' counts only the calling thread's CPU time, which is the run's time only "
            f"with one CPU thread; got threads={threads}, ep={ep!r}: use clock='wall'", setting="clock")
    for b in batch_sizes:
        _check_settings(threads, b, ep, warmup, runs)
    try:
        prepared = prepare_model(model, batch=batch)
    except BatchingUnsafeError as e:
        raise ProfilingError(f"cannot profile {graph.model} at batch {batch}: {e}; profile at batch 1",
                             model=graph.model, setting="batch") from e
    feed = _feed(model, graph, batch, inputs)
    if (calibrate or cuts) and batch != 1:
        raise ProfilingError("corrections are fitted at batch 1; profile at batch 1 to calibrate",
                             model=graph.model, setting="batch")
    own = _own_batch(model, graph, inputs)
    if own is not None and own[0] != batch:
        rows, feeding = own
        if batch != 1:
            raise ProfilingError(
                f"cannot profile {graph.model} at batch {batch}: its integer input(s) {', '.join(feeding)} set "
                f"shapes, and the sample inputs' values are for batch {rows}; pass sample inputs at batch {batch}, "
                f"or profile at batch 1 (it then runs at the samples' batch {rows})", model=graph.model,
                setting="batch")
        logger.warning("profile of %s: layers timed at the sample inputs' batch %d, not 1: integer input(s) %s "
                       "set shapes for that batch; pass sample inputs at batch 1 for batch-1 times",
                       graph.model, rows, ", ".join(feeding))
        batch = rows
    cal_jobs: list[SegmentJob] = []
    if calibrate or cuts:
        chosen_cuts = list(cuts) if cuts else calibration_cuts(graph, calibrate)
        cal_jobs = segment_jobs(model, graph, chosen_cuts, threads=threads, ep=ep, whole=True,
                                prepacking=prepacking, inputs=inputs)
    others = [(j.session, j.feed) for j in cal_jobs] + list(alongside)

    with tempfile.TemporaryDirectory(prefix="splitinfer-profile-") as tmp:
        opt_path = os.path.join(tmp, "optimized.onnx")
        sess = open_session(prepared, threads=threads, ep=ep, profile_prefix=os.path.join(tmp, "trace"),
                            optimized_path=opt_path, prepacking=prepacking, name=graph.model)
        # The profiled runs take turns with the segments they are compared with, so a
        # slow spell on a shared host hits the profile and the segments alike.
        times = time_interleaved([(sess, feed)] + others, warmup=warmup, runs=runs, progress=progress,
                                 desc=f"profile {graph.model}", clock=clock, name=graph.model)
        wall = [float(x) for x in times[0]]
        trace_path = sess.end_profiling()
        with open(trace_path, encoding="utf-8") as f:
            events = json.load(f)
        optimized = onnx.load(opt_path, load_external_data=False) if os.path.exists(opt_path) else None
        del sess
    traces = parse_trace(events)
    if len(traces) != warmup + runs:
        raise ProfilingError(
            f"the trace holds {len(traces)} runs but {warmup + runs} were made; ORT may have dropped "
            "events (a trace over its size limit): use fewer runs",
            model=graph.model, setting="runs",
        )
    timed = traces[warmup:]
    names = {k.node for r in timed for k in r.kernels}
    attr = attribute_runs(timed, graph, map_nodes(graph, prepared, optimized, names=names))
    if attr.attributed_fraction < 0.95:
        logger.warning("profile of %s: only %.1f%% of kernel time placed on layers; unplaced: %s",
                       graph.model, 100 * attr.attributed_fraction, list(attr.unattributed_us)[:5])
    stat = attr.median_ms if layer_stat == "median" else attr.min_ms
    layers = {v: LayerTime(ms=stat(v), p90_ms=attr.p90_ms(v), samples=runs) for v in range(len(graph))}
    overhead = [max(0.0, w - k / 1e3) for w, k in zip(wall, attr.kernel_us)]
    fixed_ms = float(np.median(overhead))
    batch_ms, note = _batch_ms(model, graph, batch_sizes, threads=threads, ep=ep, warmup=warmup,
                               runs=max(3, runs // 2), inputs=inputs) if batch_sizes else (None, "")
    if note:
        logger.info("profile of %s: %s", graph.model, note)
    chosen, _ = select_providers(ep)
    profile = Profile(
        device=device, layers=layers, ep=PROVIDER_NAMES[chosen], ort_version=ort.__version__, threads=threads,
        batch=batch, fixed_ms=fixed_ms, batch_ms=batch_ms, model=graph.model,
    )
    segments = [j.timing(profile, t) for j, t in zip(cal_jobs, times[1:])]
    if segments:
        corr = fit_corrections([(s.additive_ms, s.measured_ms) for s in segments], fixed_ms)
        profile = dataclasses.replace(profile, corrections=corr)
        logger.info("profile of %s: corrections scale %.3f offset %.3f ms from %d segments", graph.model,
                    corr.scale, corr.offset_ms, corr.segments)
    return Measurement(profile=profile, attributed_fraction=attr.attributed_fraction,
                       unattributed_us=attr.unattributed_us, run_ms=tuple(wall), segments=tuple(segments),
                       batch_note=note, alongside_ms=tuple(tuple(float(x) for x in t) for t in times[1 + len(cal_jobs):]))


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Read a profile file; ProfilingError if it cannot be read, ProfileError (from the
    planner, naming the field and the fix) if it is malformed."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ProfilingError(f"profile file {os.fspath(path)!r} cannot be read ({e.strerror}); "
                             "write one with 'splitinfer profile MODEL -o FILE'", setting="profile") from e
    return Profile.from_json(text)


def measure_profile(model: onnx.ModelProto, graph: LayerGraph, *, threads: int, batch: int = 1, ep: str = "cpu",
                    warmup: int = 3, runs: int = 10, progress: bool = True, **kw: Any) -> Profile:
    """`measure`, returning only the profile."""
    return measure(model, graph, threads=threads, batch=batch, ep=ep, warmup=warmup, runs=runs,
                   progress=progress, **kw).profile
