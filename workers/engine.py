"""The segment engine: one ONNX model (or segment) on ONNX Runtime, served fast.

An :class:`Engine` owns one ``InferenceSession`` whose settings are all pinned by an
:class:`EngineConfig`. Loading goes through the cold-start cache (see
:mod:`workers.coldstart`): the first engine of a model builds a pre-optimised artefact,
later ones (and later processes) load it in milliseconds.

[Note: IO binding]
For every batch bucket (1, 2, 4, 8 by default) the engine allocates its input and
output arrays once and binds them to an ``IOBinding`` once. A run copies the request
into the bucket's input arrays, runs the binding and returns views of the bucket's
output arrays, so the hot path makes no new tensor buffers. The views stay valid
until the next run on this engine; pass ``copy=True`` to keep them longer. Runs are
serialised by a lock because the buffers are shared. A request that fills a bucket
exactly may be read, and answered, where its memory lies instead ([Note: inputs in
place], [Note: outputs placed]), through bindings that the bucket keeps beside its own
([Note: bindings kept]).

[Note: cancelled runs]
A run given a :class:`RunCancel` stops when another thread cancels it: ONNX Runtime's
``RunOptions.terminate`` ends a run in progress within a kernel (a ResNet50 run cancelled
20 ms in returned after 21-22 ms), and a run not yet started never starts. It raises
:class:`RunCancelledError`. The edge agent cancels a local run nobody needs (a tail whose
remote answer came first, a run started before the policy sent its request to the cloud),
so the device is free for the next request.

[Note: dynamic batching]
Batch dimension 0 is made symbolic offline and Reshape constants with a hard-coded
batch of 1 are rewritten to copy the batch (0). That is only trusted when a batch of N
random samples equals N runs of batch 1 (rtol 1e-4, atol 1e-5). Otherwise the engine
keeps the fixed batch, :meth:`Engine.run_batch` raises :class:`BatchingUnsafeError`
with the reason, and loops over batch-1 runs only if the caller allows it.

[Note: any shape]
A segment whose inputs or outputs have symbolic dims besides the batch (an image's H
and W, a sequence length) has no fixed buffers to bind: the engine checks each
request's rank, dtype and fixed dims, and runs it with ``InferenceSession.run`` at the
shape it came in. :meth:`Engine.run_batch` stacks only requests of one per-sample shape
(the batcher groups them so: ``shape_key``). Warm-up runs the segment's sample inputs,
or nothing: it never invents sizes for symbolic dims, nor values for integer inputs
that set shapes (``partitioner.shapes.shape_feeding_inputs``); it logs what it skipped.

The buckets' buffers are in workers/_bucket.py, the checks of a request's inputs in
workers/_input_check.py and [Note: weight sharing] in workers/_weights.py. The config,
the tensors' specs and the stats are in
workers/_engine_types.py, which those modules and the PyTorch backend share without
importing this one; reading a model and the default artefact directory are in
workers/_model_file.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnxruntime as ort

from partitioner.shapes import shape_feeding_inputs
from workers._any_shape import runs_by_shape, split_rows, warmup_feed, warmup_skip_reason
from workers._bucket import Bucket, address_of, pin_batch
from workers._engine_types import EngineConfig, EngineStats, Place, TensorSpec
from workers._input_check import batch_chunks, check_inputs, describe, input_checks_of
from workers._model_file import default_cache_dir, read_model
from workers._ort import make_session_options, np_dtype_of_ort, select_providers, wants_torch
from workers._weights import SharedWeights, acquire_weights
from workers.coldstart import Artefact, compute_artefact_key, digest_samples, load_or_build_artefact, random_feed
from workers.errors import BatchingUnsafeError, EngineLoadError, EngineRunError, InputError, RunCancelledError

__all__ = ["Engine", "EngineConfig", "EngineStats", "Place", "RunCancel", "TensorSpec"]

logger = logging.getLogger(__name__)

_LATENCY_WINDOW = 4096
_KEPT_BINDINGS = 8
"""Bindings to request memory that each bucket keeps ([Note: bindings kept])."""


def _one_bucket(inputs: Sequence[TensorSpec], samples: Mapping[str, np.ndarray] | None = None,
                shape_inputs: Sequence[str] = ()) -> int:
    """The one batch an engine that is not batch-safe runs at: where an input has a symbolic
    dim 0 (that symbol is the batch), 1, or the samples' rows where an integer input that
    sets shapes holds them (sizes written for that batch: a Reshape to (2, 6, 2) runs only
    at 2 rows); else the first input's fixed dim 0.

    A fixed dim 0 beside a symbolic one is not the batch: a recurrent state ``h[2,N,4]`` keeps
    its layers on axis 0 while ``x[N,4]`` carries the batch.
    """
    batched = [s for s in inputs if s.shape and s.shape[0] is None]
    if batched:
        rows = {int(np.shape(samples[s.name])[0]) for s in batched if samples and np.ndim(samples.get(s.name, 0))}
        if len(rows) == 1 and any(np.any(np.asarray(samples[k]) == min(rows)) for k in shape_inputs if k in samples):
            return rows.pop()
        return 1
    return next((s.shape[0] for s in inputs if s.shape), 1) or 1


class RunCancel:
    """Cancels one run from any thread ([Note: cancelled runs]): `cancel()` stops it if it is
    running and keeps it from starting if it is not. One per run."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._options: ort.RunOptions | None = None
        self.started = threading.Event()
        """Set as the run enters ONNX Runtime, where it no longer holds Python's interpreter lock."""

    def cancel(self) -> None:
        with self._lock:
            self._event.set()
            if self._options is not None:
                self._options.terminate = True

    def wait(self, timeout_s: float) -> bool:
        """Sleeps up to `timeout_s`, or until cancelled; True if cancelled."""
        return self._event.wait(timeout_s)

    def check(self, name: str) -> None:
        if self._event.is_set():
            raise RunCancelledError(f"the run of {name} was cancelled: its answer is no longer needed", model=name)

    def run_options(self, name: str) -> ort.RunOptions:
        """Options for the run about to start, which `cancel()` terminates."""
        with self._lock:
            self.check(name)
            self._options = ort.RunOptions()
            self.started.set()
            return self._options


class Engine:
    """One segment on ONNX Runtime with pinned settings, IO binding and shared weights.

    ``model`` is a path, serialized bytes or an ``onnx.ModelProto``. Construction
    builds or loads the pre-optimised artefact, creates the session, allocates the
    bucket buffers and warms up; it raises :class:`EngineLoadError` on failure.
    ``sample_inputs``: real inputs of the segment, by name; warm-up and the batch check
    run on them ([Note: any shape]).
    """

    def __new__(cls, model=None, config: EngineConfig | None = None, **kwargs):
        # provider torch-cuda (or auto on a GPU host without onnxruntime-gpu): the PyTorch
        # backend, behind this same interface (workers/_torch_engine.py)
        if cls is Engine and config is not None and wants_torch(config.provider):
            from workers._torch_engine import TorchEngine

            if config.provider == "auto":
                config = dataclasses.replace(config, provider="torch-cuda")
            return TorchEngine(model, config, **kwargs)
        return super().__new__(cls)

    def __init__(self, model, config: EngineConfig | None = None, *, name: str | None = None,
                 sample_inputs: Mapping[str, np.ndarray] | None = None) -> None:
        t0 = time.perf_counter()
        self.config = cfg = config or EngineConfig()
        proto, identity, base_dir, label = read_model(model)
        self.name = name or label
        samples = None if sample_inputs is None else {k: np.asarray(v) for k, v in sample_inputs.items()}
        self._shape_inputs = shape_feeding_inputs(proto)
        self._shape_input_set = frozenset(self._shape_inputs)
        cache_dir = cfg.cache_dir or default_cache_dir()
        chosen, providers = select_providers(
            cfg.provider, device_id=cfg.device_id, trt_cache_dir=os.path.join(cache_dir, "tensorrt")
        )
        self.provider = chosen
        key = compute_artefact_key(
            identity,
            provider=chosen,
            opt_level=cfg.graph_optimization_level,
            dynamic_batch=cfg.dynamic_batch,
            batch_check_size=cfg.batch_check_size,
            transformer_fusion=cfg.transformer_fusion,
            samples_digest=digest_samples(samples) if samples else "",
        )
        try:
            self.artefact, from_cache = load_or_build_artefact(
                proto,
                key=key,
                cache_dir=cache_dir,
                provider=chosen,
                providers=providers,
                opt_level=cfg.graph_optimization_level,
                dynamic_batch=cfg.dynamic_batch,
                batch_check_size=cfg.batch_check_size,
                transformer_fusion=cfg.transformer_fusion,
                intra_op_threads=cfg.intra_op_threads,
                base_dir=base_dir,
                samples=samples,
            )
        except EngineLoadError as e:
            if e.model is not None:
                raise
            # the artefact builder sees a staged copy, not the model's name: add it
            raise EngineLoadError(f"{self.name}: {e.message}", model=self.name, detail=e.detail,
                                  stage=e.stage) from e
        del proto
        build_ms = 0.0 if from_cache else self.artefact.build_ms
        self._session, self._weights = self._create_session(self.artefact, providers)
        self.inputs, self.outputs = self._specs()
        # rows are read from the first input: one that has them, never a shape vector's length
        self.inputs = tuple(sorted(self.inputs, key=lambda s: s.name in self._shape_inputs))
        self.any_shape = (any(d is None for spec in self.inputs + self.outputs for d in spec.shape[1:])
                          or any(None in s.shape for s in self.inputs if s.name in self._shape_input_set))
        """Symbolic dims besides the batch (a shape vector's length is one): no fixed buffers, runs at
        each request's shape ([Note: any shape])."""
        self.batch_safe = self.artefact.batch_safe
        self.batch_reason = self.artefact.batch_reason
        if self.batch_safe:
            self.buckets = tuple(cfg.batch_buckets)
        else:
            self.buckets = (_one_bucket([s for s in self.inputs if s.name not in self._shape_inputs], samples,
                                        self._shape_inputs),)
            # Only a symbolic dim 0 is pinned, never a shape vector's length (its values set sizes, not rows).
            self.inputs = tuple(s if s.name in self._shape_inputs else pin_batch(s, self.buckets[0])
                                for s in self.inputs)
            self.outputs = tuple(pin_batch(s, self.buckets[0]) for s in self.outputs)
        self._input_names = frozenset(s.name for s in self.inputs)
        self._input_checks = input_checks_of(self.inputs)
        device = "cuda" if chosen == "cuda" else "cpu"
        self._buckets = {} if self.any_shape else {
            b: Bucket(self._session, b, self.inputs, self.outputs, device, cfg.device_id) for b in self.buckets}
        self._output_names = [s.name for s in self.outputs]
        self._lock = threading.Lock()
        self._latency_ms = np.zeros(_LATENCY_WINDOW, dtype=np.float64)
        self._run_count = 0
        tw = time.perf_counter()
        self.warmed_up = self._warm_up(samples)
        """What warm-up ran: 'samples', 'buckets' or 'skipped: <why>' ([Note: any shape])."""
        self._warmup_ms = (time.perf_counter() - tw) * 1e3
        self._from_cache = from_cache
        self._build_ms = build_ms
        self._load_ms = (time.perf_counter() - t0) * 1e3
        logger.info(
            "engine %s: provider %s (asked %s; ORT has %s), artefact %s (%s), batch_safe=%s%s, loaded in %.0f ms",
            self.name, chosen, cfg.provider, ",".join(ort.get_available_providers()), key,
            "cached" if from_cache else "built", self.batch_safe,
            "" if self.batch_safe else f" ({self.batch_reason})", self._load_ms,
        )

    # -- loading ------------------------------------------------------------------------

    def _create_session(self, art: Artefact, providers: list) -> tuple[ort.InferenceSession, SharedWeights | None]:
        cfg = self.config
        # The artefact is already optimised, except for TensorRT which compiles itself.
        level = cfg.graph_optimization_level if self.provider == "tensorrt" else "disable"
        so = make_session_options(
            intra_op_threads=cfg.intra_op_threads,
            inter_op_threads=cfg.inter_op_threads,
            opt_level=level,
            log_severity=cfg.log_severity,
            disable_prepacking=cfg.share_weights,
            allow_spinning=cfg.allow_spinning,
        )
        weights = None
        if cfg.share_weights:
            weights = acquire_weights(art.model_path)
            weights.apply(so)
        try:
            return ort.InferenceSession(art.model_path, so, providers=providers), weights
        except Exception as e:  # noqa: BLE001 - ORT's error types are not public
            raise EngineLoadError(
                f"ONNX Runtime cannot load the artefact of {self.name} from {art.directory}: "
                f"{str(e).splitlines()[0][:300]}; delete that directory so that it is rebuilt",
                model=self.name,
                detail=str(e),
                stage="session",
            ) from e

    def _specs(self) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        def spec(arg) -> TensorSpec:
            # A symbolic dim (a name, or None) is None: any size ([Note: any shape]).
            shape = tuple(d if isinstance(d, int) and d >= 0 else None for d in arg.shape)
            return TensorSpec(arg.name, np_dtype_of_ort(arg.type).name, shape)

        ins = tuple(spec(a) for a in self._session.get_inputs())
        outs = tuple(spec(a) for a in self._session.get_outputs())
        return ins, outs

    def _warm_up(self, samples: Mapping[str, np.ndarray] | None) -> str:
        """Warm-up runs ([Note: any shape]); returns what ran."""
        runs = self.config.warmup_runs
        if not runs:
            return "skipped: warmup_runs is 0"
        if samples is not None:
            feed, take = warmup_feed(samples, self.inputs, self.max_batch, self._shape_inputs)
            try:
                self.check(feed)
            except InputError as e:
                raise EngineLoadError(f"the sample inputs of {self.name} do not fit it: {e}; give samples of "
                                      "its inputs' names, dtypes and shapes", model=self.name, stage="warmup") from e
            for _ in range(runs):
                self._warm_run(lambda: self.run(feed), take)
            return "samples"
        why = warmup_skip_reason(self._shape_inputs, self.any_shape)
        if why:
            logger.info("engine %s: warm-up skipped: %s; the first request pays the first-run costs", self.name, why)
            return f"skipped: {why}"
        sizes = self.buckets if self.config.warmup_all_buckets else self.buckets[:1]
        for k, size in enumerate(sizes):
            bucket = self._buckets[size]
            for _ in range(runs if k == 0 else 1):
                self._warm_run(lambda b=bucket: (b.push_inputs(), self._session.run_with_iobinding(b.binding)), size)
        return "buckets"

    def _warm_run(self, run: Callable[[], Any], size: int) -> None:
        try:
            run()
        except Exception as e:  # noqa: BLE001
            cause = e.detail if isinstance(e, EngineRunError) and e.detail else str(e)
            raise EngineLoadError(
                f"warm-up run of {self.name} at batch {size} failed: {cause.splitlines()[0][:300]}; "
                "check the model with onnxruntime directly",
                model=self.name,
                detail=cause,
                stage="warmup",
            ) from e

    # -- running ------------------------------------------------------------------------

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def check(self, inputs: Any, where: str = "") -> int:
        """Checks names, dtypes and shapes; returns the number of rows (batch) given.
        Raises :class:`InputError` naming the input, what was expected and what came.

        Messages are only formatted on failure, to keep the hot path lean.
        """
        return check_inputs(inputs, self._input_names, self._input_checks, name=self.name, max_batch=self.max_batch,
                            batch_safe=self.batch_safe, where=where, shape_inputs=self._shape_input_set)

    def _bucket_for(self, rows: int) -> Bucket:
        for size in self.buckets:
            if size >= rows:
                return self._buckets[size]
        raise AssertionError("rows were validated against the largest bucket")

    def _check_open(self) -> None:
        if self._session is None:
            raise EngineRunError(f"engine {self.name} is closed; create a new Engine", model=self.name)

    def _execute(self, bucket: Bucket, binding: ort.IOBinding | None = None, cancel: RunCancel | None = None) -> None:
        t = time.perf_counter()
        bucket.push_inputs()
        options = None if cancel is None else cancel.run_options(self.name)
        try:
            self._session.run_with_iobinding(bucket.binding if binding is None else binding, options)
        except Exception as e:  # noqa: BLE001
            if cancel is not None:
                cancel.check(self.name)  # terminated by its cancel: not a fault
            raise EngineRunError(
                f"ONNX Runtime failed running {self.name} at batch {bucket.size}: {str(e).splitlines()[0][:300]}; "
                "the inputs were valid, so check the device's free memory and the model",
                model=self.name, detail=str(e), batch=bucket.size,
            ) from e
        self._latency_ms[self._run_count % _LATENCY_WINDOW] = (time.perf_counter() - t) * 1e3
        self._run_count += 1

    def _binding_for(self, bucket: Bucket, inputs: Mapping[str, np.ndarray],
                     place: Place | None) -> tuple[ort.IOBinding, dict[str, np.ndarray]]:
        """The binding for a request that fills ``bucket`` exactly, and its outputs that
        lie where ``place`` put them.

        [Note: inputs in place]
        A request of exactly a bucket's rows, C-contiguous, aligned and of the input's
        dtype, is read by ONNX Runtime where it lies (a request's array in the channel's
        shared arena, say) instead of being copied into the bucket's buffer first: for a
        1 MiB input, one copy of memory that the last run has pushed out of the caches.
        Other inputs are copied into the bucket's buffer as usual.

        [Note: outputs placed]
        A lone request's answer on the direct channel lies in the worker's shared arena
        (workers/_transport/arena.py), where the caller reads it. Written to the engine's own
        buffers, it takes one more copy of each output into the arena after the run; a
        1 MiB output of the transformer tail took 0.13-0.14 ms for it at c1 (a traced
        request through Ray, p50 of about 370), in caches that the run has just used
        for other things. Placed, the answer's encoding finds its region in 0.03 ms, and
        the traced serving overhead went from 1.29-1.31 ms to 1.10-1.22 ms (three runs
        of each, alternating). ``place(buf)`` returns an array of ``buf``'s dtype and
        shape, writable, C-contiguous and aligned, somewhere else (an arena region), with
        the address of its data, or None, and then that output goes to the bucket's
        buffer as usual.

        [Note: bindings kept]
        Binding ONNX Runtime to memory by address is slow right after a run, with the
        caches cold: measured on the transformer tail (1 MiB in and out), 78 us to bind
        the input, 74 us the output, and 41 us to bind the bucket's own buffers back
        after the run (9 us in all when warm). But the addresses repeat: the arenas
        allocate first-fit, so a steady stream of lone requests lands on the same few
        regions. So each bucket keeps, besides its own binding (never changed), the
        last ``_KEPT_BINDINGS`` bindings to other memory, by their addresses; a request
        whose memory lies where an earlier one's did runs that binding as it stands;
        one that lies elsewhere takes over the oldest, which binds only what differs.
        A kept binding points at memory that may since have been unmapped, but it is
        only ever run for a request whose arrays lie at exactly those addresses now.
        Measured in one process, one binding and kept bindings alternating (six rounds
        of 50 transformer runs each, medians of the rounds' medians),
        ``engine.run``'s time outside ONNX Runtime's own run: 217-288 -> 147-153 us for
        an input in an arena answered into one; 200-231 -> 117-137 us for inputs copied
        afresh each time (glibc hands back the same few addresses); with every input at
        a new address, 112-216 against 60-213 us, no change above the noise.
        """
        key = []
        for name, buf in bucket.inputs.items():
            value = inputs[name]
            if (value.dtype == buf.dtype and value.shape == buf.shape and value.flags.c_contiguous
                    and value.flags.aligned):
                key.append(address_of(value))
            else:
                np.copyto(buf, value)
                key.append(0)
        placed: dict[str, np.ndarray] = {}
        for name, buf in bucket.outputs.items():
            spot = place(buf) if place is not None else None
            if spot is None:
                key.append(0)
            else:
                placed[name], at = spot
                key.append(at)
        if not any(key):
            return bucket.binding, placed
        addresses = tuple(key)
        binding = bucket.kept.get(addresses)
        if binding is not None:
            bucket.kept.move_to_end(addresses)
            return binding, placed
        if len(bucket.kept) < _KEPT_BINDINGS:
            was: tuple[int, ...] = (-1,) * len(addresses)  # nothing bound yet
            binding = self._session.io_binding()
        else:  # the oldest kept binding moves here: only what differs is bound again
            was, binding = bucket.kept.popitem(last=False)
        at = zip(addresses, was)
        for buffers, own, to_address, to_own in (
                (bucket.inputs, bucket.input_values, binding.bind_input, binding.bind_ortvalue_input),
                (bucket.outputs, bucket.output_values, binding.bind_output, binding.bind_ortvalue_output)):
            for name, buf in buffers.items():
                address, before = next(at)
                if address == before:
                    continue
                if address:
                    to_address(name, "cpu", 0, buf.dtype, buf.shape, address)
                else:
                    to_own(name, own[name])
        bucket.kept[addresses] = binding
        return binding, placed

    def random_inputs(self, rows: int, seed: int = 0) -> dict[str, np.ndarray]:
        """Random inputs of ``rows`` rows for this engine (timing and checks; see
        :func:`workers.coldstart.random_feed`)."""
        return random_feed(((s.name, s.dtype, s.shape) for s in self.inputs), rows, np.random.default_rng(seed))

    def run(self, inputs: Mapping[str, np.ndarray], *, copy: bool = False,
            place: Place | None = None, rows: int | None = None,
            cancel: RunCancel | None = None) -> dict[str, np.ndarray]:
        """Run one request of up to ``max_batch`` rows.

        Returns views of this engine's output buffers, valid until its next run
        (see [Note: IO binding]); ``copy=True`` returns private arrays. With ``place``,
        a request that fills its bucket gets its outputs written where ``place`` says
        ([Note: outputs placed]). Raises :class:`InputError` on bad names, dtypes or
        shapes; the engine keeps serving. ``rows``: what :meth:`check` returned for
        these very inputs, by a caller that checked them before it decided to run
        them; they are not checked again. ``cancel`` stops the run from another thread
        ([Note: cancelled runs]).
        """
        self._check_open()
        rows = self.check(inputs) if rows is None else rows
        if self.any_shape:
            return self._run_as_given(inputs, cancel)
        bucket = self._bucket_for(rows)
        with self._lock:
            if rows == bucket.size and not bucket.on_device:
                binding, placed = self._binding_for(bucket, inputs, place)
            else:
                binding, placed = bucket.binding, {}
                for name, buf in bucket.inputs.items():
                    np.copyto(buf if rows == bucket.size else buf[:rows], inputs[name])
            self._execute(bucket, binding, cancel)
            if rows == bucket.size:
                out = {**bucket.outputs, **placed}
            else:
                out = {k: v[:rows] for k, v in bucket.outputs.items()}
            if copy:
                out = {k: v.copy() for k, v in out.items()}
        return out

    def run_batch(self, requests: Sequence[Mapping[str, np.ndarray]], *, loop_fallback: bool | None = None) -> list[dict[str, np.ndarray]]:
        """Run many requests as few batches; returns one dict of private arrays per request.

        Requests are packed in order into the buckets. When batching is unsafe this
        raises :class:`BatchingUnsafeError`, unless ``loop_fallback`` (default:
        ``EngineConfig.loop_fallback``) allows running them one by one.
        """
        self._check_open()
        if not requests:
            return []
        if not self.batch_safe:
            allow = self.config.loop_fallback if loop_fallback is None else loop_fallback
            if not allow:
                raise BatchingUnsafeError(
                    f"{self.name} cannot run requests as one batch: {self.batch_reason}; pass loop_fallback=True "
                    "(or EngineConfig(loop_fallback=True)) to run them one at a time",
                    model=self.name, reason=self.batch_reason,
                )
            return [self.run(r, copy=True) for r in requests]
        rows = [self.check(r, where=f"request {i}") for i, r in enumerate(requests)]
        if self.any_shape:
            return self._run_batch_as_given(requests, rows)
        results: list[dict[str, np.ndarray]] = []
        for start, stop, total in batch_chunks(rows, self.max_batch):
            bucket = self._bucket_for(total)
            with self._lock:
                offset = 0
                for i in range(start, stop):
                    for name, buf in bucket.inputs.items():
                        buf[offset : offset + rows[i]] = requests[i][name]
                    offset += rows[i]
                self._execute(bucket)
                offset = 0
                for i in range(start, stop):
                    results.append({k: v[offset : offset + rows[i]].copy() for k, v in bucket.outputs.items()})
                    offset += rows[i]
        return results

    def _run_as_given(self, inputs: Mapping[str, np.ndarray], cancel: RunCancel | None = None) -> dict[str, np.ndarray]:
        """One checked run at the shapes the inputs have ([Note: any shape]); private arrays."""
        feed = {name: inputs[name] for name in self._input_names}
        with self._lock:
            self._check_open()
            t = time.perf_counter()
            options = None if cancel is None else cancel.run_options(self.name)
            try:
                outs = self._session.run(self._output_names, feed, options)
            except Exception as e:  # noqa: BLE001 - ORT's error types are not public
                if cancel is not None:
                    cancel.check(self.name)  # terminated by its cancel: not a fault
                shapes = ", ".join(f"{k}: {describe(np.asarray(v))}" for k, v in sorted(feed.items()))
                raise EngineRunError(
                    f"ONNX Runtime failed running {self.name} on {{{shapes}}}: {str(e).splitlines()[0][:300]}; "
                    "the inputs have the ranks, dtypes and fixed dims the model declares, so check that the model "
                    "accepts these sizes in its symbolic dims",
                    model=self.name, detail=str(e),
                ) from e
            self._latency_ms[self._run_count % _LATENCY_WINDOW] = (time.perf_counter() - t) * 1e3
            self._run_count += 1
        return dict(zip(self._output_names, outs))

    def _run_batch_as_given(self, requests: Sequence[Mapping[str, np.ndarray]],
                            rows: Sequence[int]) -> list[dict[str, np.ndarray]]:
        """Consecutive requests of one per-sample shape run stacked, up to ``max_batch``
        rows; a request of another shape starts a new run ([Note: any shape])."""
        results: list[dict[str, np.ndarray]] = []
        for start, stop, total in runs_by_shape(requests, rows, tuple(self._input_names), self.max_batch):
            if stop - start == 1:
                results.append(self._run_as_given(requests[start]))
                continue
            group = requests[start:stop]
            outs = self._run_as_given({k: np.concatenate([r[k] for r in group]) for k in self._input_names})
            if any(np.ndim(v) == 0 or v.shape[0] != total for v in outs.values()):
                raise BatchingUnsafeError(
                    f"{self.name} answered a batch of {total} rows with outputs of "
                    f"{ {k: np.shape(v) for k, v in outs.items()} }; its outputs do not carry the batch",
                    model=self.name, reason="outputs do not carry the batch")
            results.extend(split_rows(outs, rows[start:stop]))
        return results

    # -- introspection ------------------------------------------------------------------

    def output_buffer(self, name: str, batch: int = 1) -> np.ndarray:
        """The pre-allocated output array that runs of ``batch`` rows write into."""
        if self.any_shape:
            raise EngineRunError(f"{self.name} has symbolic dims besides the batch, so it has no output buffers; "
                                 "read the outputs that run() returns", model=self.name)
        return self._bucket_for(batch).outputs[name]

    @property
    def shared_weight_bytes(self) -> int:
        """Bytes of weights this engine borrows from the process-wide shared set."""
        return self._weights.nbytes if self._weights is not None else 0

    def stats(self) -> EngineStats:
        # Without the run's lock: a worker answers its stats call on its event loop, which would
        # otherwise stop for the rest of a running batch. A run finishing meanwhile may replace
        # one sample of the window; the count is read first, so it never counts more than it holds.
        count = self._run_count
        n = min(count, _LATENCY_WINDOW)
        window = self._latency_ms[:n].copy()
        med, p90 = (float(np.median(window)), float(np.percentile(window, 90))) if n else (0.0, 0.0)
        return EngineStats(
            provider=self.provider,
            load_ms=self._load_ms,
            build_ms=self._build_ms,
            warmup_ms=self._warmup_ms,
            from_cache=self._from_cache,
            batch_safe=self.batch_safe,
            run_count=count,
            median_ms=med,
            p90_ms=p90,
        )

    def close(self) -> None:
        """Release the session, buffers and the reference to shared weights."""
        with self._lock:
            self._buckets = {}
            self._session = None  # type: ignore[assignment]
            self._weights = None

    def __repr__(self) -> str:
        return f"Engine({self.name!r}, provider={self.provider!r}, buckets={self.buckets}, batch_safe={self.batch_safe})"
