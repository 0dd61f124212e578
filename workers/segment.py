"""One hosted segment: its engines, its dynamic batcher, its counters and its load.

The one segment host of the project. A Ray worker (:class:`workers._worker.SegmentHost`,
the actor ``workers.actors.SegmentWorker``) holds one per segment it serves; the
gateway's in-process pool (``cluster.gateway.LocalPool``) holds one per tail. Both
load engines, batch, warm up, check shapes, time batches and count discarded results
through this code; they differ only in the choices made at :func:`load_segment`.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from workers._pool import RequestTiming, SegmentStats, new_timing
from workers.batcher import Batcher, BatcherConfig, BatcherLoad, ExpectedLoad
from workers.engine import Engine, EngineConfig

__all__ = ["HostedSegment", "TimedInputs", "load_segment"]


class TimedInputs(dict):
    """One request's inputs, carrying when it reached the segment (``arrival_s``,
    ``time.monotonic``) and, once its batch ran, its RequestTiming (``timing``).

    [Note: request timing]
    The batcher knows when a batch starts and how big it is, but hands each request only
    its outputs. A request whose inputs come wrapped in this dict gets stamped by its
    batch's run with its queue time, the batch's run time and size, and whether it came
    first in the batch (so a caller counts every batch once). The in-process pool reads
    them for its answers' timings; a Ray worker sends them back with the outputs, and the
    gateway's Prometheus metrics record both alike.
    """

    __slots__ = ("arrival_s", "timing")
    arrival_s: float
    timing: RequestTiming | None

    @classmethod
    def now(cls, inputs: Mapping[str, np.ndarray]) -> TimedInputs:
        """``inputs`` arriving now. (Made without an ``__init__`` of its own: one per
        request, 0.17 us against 0.28 us with one.)"""
        timed = cls(inputs)
        timed.arrival_s, timed.timing = time.monotonic(), None
        return timed


def _shape_key(inputs: Mapping[str, np.ndarray]) -> tuple:
    """A batcher ``shape_key`` from names, per-sample shapes and dtypes: requests that
    differ in any of them never share a batch ([Note: any shape] in workers/engine.py)."""
    return tuple(sorted((k, v.shape[1:], v.dtype.str) for k, v in inputs.items()))


class HostedSegment:
    """One segment's engines, batcher and counters.

    ``engine`` runs lone requests and gives the specs and loading facts; ``instances``
    (empty for one engine) run batches side by side, one each. Where ``engine`` is not
    one of the instances it is the engine with all the segment's threads, and it runs a
    batch of one whenever it is free ([Note: engine instances]).

    ``batcher_config`` is the batcher's, with ``max_concurrent_batches`` set to the
    number of engines that run batches. ``on_batch(size)`` is called after each batch
    that ran (on the thread that ran it). A batch stamps each of its requests that came
    as :class:`TimedInputs` ([Note: request timing]).

    [Note: engine instances]
    With ``instances`` = N > 1 (SegmentHost's, PoolConfig's) a segment has N engines
    (as Triton's instance groups), each with N-th of the segment's intra-op threads,
    sharing one set of weights where ``share_weights`` is on ([Note: weight sharing] in
    workers/_weights.py); up to N batches run at once, one on each (the batcher's
    ``max_concurrent_batches`` is N). Beside them stays the engine with all the
    threads, which runs a batch of one whenever it is free: a lone request is as fast
    as with one instance, and a busy worker runs its batches on narrow instances side
    by side. An engine runs one batch at a time (its lock), so N batches on one engine
    would only wait for each other. The in-process pool's N ``replicas`` are N engines
    of the same threads and no lone engine: its operator splits the threads in
    model.yaml.

    It pays where operators are too small to keep several threads busy: on 2 cores,
    two one-thread sessions ran the DenseNet121 tail's batch 8 at 1.3-1.5x the rate of
    one two-thread session, the transformer block's at 1.0x (bench/workers.py). So N
    is the operator's choice, not timed at load: timing both ways for a fraction of a
    second reads anywhere from 0.6x to 1.3x for the DenseNet121 tail on this shared
    machine, against 1.3-1.5x over seconds.
    """

    def __init__(self, key: str, engine: Engine, batcher_config: BatcherConfig, instances: Sequence[Engine] = (),
                 *, on_batch: Callable[[int], None] | None = None) -> None:
        self.key = key
        self.engine = engine
        self.instances = tuple(instances)
        self._lone = not any(engine is i for i in self.instances)
        self._free: queue.SimpleQueue[Engine] = queue.SimpleQueue()
        for instance in self.instances:
            self._free.put(instance)
        self._engine_idle = threading.Lock()
        self._on_batch = on_batch
        self.batcher = Batcher(self._run_batch, dataclasses.replace(
            batcher_config, max_concurrent_batches=max(1, len(self.instances))))
        self.requests = 0
        self.completed = 0
        self.input_errors = 0
        self.failed = 0
        self._expected_rps, self._expected_at_s, self._expected_s = -1.0, -float("inf"), (0.0, 0.0)

    @property
    def engines(self) -> tuple[Engine, ...]:
        """Every engine of the segment, ``engine`` first."""
        return (self.engine, *(i for i in self.instances if i is not self.engine))

    def _run_on_engines(self, payloads: list) -> list[dict[str, np.ndarray]]:
        if not self.instances:
            return self.engine.run_batch(payloads, loop_fallback=True)
        if len(payloads) == 1 and self._lone and self._engine_idle.acquire(blocking=False):
            try:
                return self.engine.run_batch(payloads, loop_fallback=True)
            finally:
                self._engine_idle.release()
        instance = self._free.get()  # never waits: the batcher runs at most len(instances) batches at once
        try:
            return instance.run_batch(payloads, loop_fallback=True)
        finally:
            self._free.put(instance)

    def _run_batch(self, payloads: list) -> list[dict[str, np.ndarray]]:
        start = time.monotonic()
        outs = self._run_on_engines(payloads)
        compute_s = time.monotonic() - start
        if self._on_batch is not None:
            self._on_batch(len(payloads))
        for i, p in enumerate(payloads):
            if type(p) is TimedInputs:
                p.timing = new_timing((start - p.arrival_s, compute_s, len(payloads), i == 0))
        return outs

    def shape_key(self, inputs: Mapping[str, np.ndarray]) -> tuple | None:
        """The batcher's ``shape_key`` for inputs checked against the specs: one key (None)
        unless the engine has symbolic dims besides the batch."""
        return _shape_key(inputs) if self.engine.any_shape else None

    shape_key_unchecked = staticmethod(_shape_key)
    """The ``shape_key`` for inputs not checked (the in-process pool's): by names,
    per-sample shapes and dtypes, so that one that does not fit batches apart and fails
    alone (InputError from its engine run), with no check of its own on the way."""

    def expected_load(self, load: BatcherLoad | None = None) -> ExpectedLoad | None:
        """The load keys now, from the batcher's arrival rates and batch times ([Note: expected wait]
        in workers/_batch_policy.py), or from `load`, its reading taken now; None before any batch
        was timed."""
        load = self.batcher.load() if load is None else load
        if load.utilisation is None:
            return None
        now_s = time.monotonic()
        # The formula iterates (about 40 us); the arrival rate it reads changes once a second.
        if load.arrival_rps != self._expected_rps or now_s - self._expected_at_s >= 1.0:
            cfg = self.batcher.config
            urgent = load.urgent_arrival_rps / load.arrival_rps if load.arrival_rps > 0 else 0.0
            wait_s, urgent_s = (load.expected_wait_at(
                load.arrival_rps, self.batcher.run_times.estimate_s, max_batch_size=cfg.max_batch_size,
                instances=cfg.max_concurrent_batches, timeout_s=cfg.max_queue_delay_ms / 1e3, ahead_share=share)
                or 0.0 for share in (1.0, urgent))
            self._expected_rps, self._expected_at_s, self._expected_s = load.arrival_rps, now_s, (wait_s, urgent_s)
        # At least what a request arriving now waits: the rate read lags a burst.
        return ExpectedLoad(load.utilisation, max(self._expected_s[0], load.predicted_wait_s or 0.0),
                            max(self._expected_s[1], load.urgent_predicted_wait_s or 0.0))

    def stats(self) -> SegmentStats:
        b = self.batcher.stats()
        engines = [e.stats() for e in self.engines]
        busiest = max(engines, key=lambda e: e.run_count)
        return SegmentStats(
            key=self.key, provider=engines[0].provider, batch_safe=engines[0].batch_safe,
            max_batch=self.engine.max_batch, instances=max(1, len(self.instances)),
            requests=self.requests, completed=self.completed, input_errors=self.input_errors,
            failed=self.failed, engine_median_ms=busiest.median_ms,
            batches_formed=b.batches_formed, batch_size_histogram=dict(sorted(b.batch_size_histogram.items())),
            discarded=b.discarded,
        )

    async def close(self) -> None:
        """Runs what is queued, then closes the engines."""
        await self.batcher.close(drain=True)
        for engine in self.engines:
            engine.close()


def _instance_threads(config: EngineConfig, instances: int) -> int:
    """Intra-op threads of each of ``instances`` engines sharing ``config``'s budget."""
    budget = config.intra_op_threads or len(os.sched_getaffinity(0))
    return max(1, budget // instances)


def _fit_batcher(config: BatcherConfig, engine: Engine) -> BatcherConfig:
    """``config`` for batches that ``engine`` runs as one: up to its largest bucket, and
    one request at a time where its batching is unsafe (it would run them in a loop)."""
    size = min(config.max_batch_size, engine.max_batch) if engine.batch_safe else 1
    sizes = tuple(s for s in config.preferred_batch_sizes if s <= size)
    return dataclasses.replace(config, max_batch_size=size, preferred_batch_sizes=sizes)


def load_segment(key: str, model: bytes | str, engine_config: EngineConfig, batcher_config: BatcherConfig, *,
                 sample_inputs: Mapping[str, np.ndarray] | None = None, instances: int = 1,
                 lone_engine: bool = True, on_batch: Callable[[int], None] | None = None) -> HostedSegment:
    """Loads segment ``key`` from ONNX bytes or a path; blocks (call it off an event loop).

    ``instances`` engines run its batches side by side. With ``lone_engine`` (a Ray
    worker) and ``instances`` > 1, they split ``engine_config``'s intra-op threads and
    one more engine with all of them runs lone requests ([Note: engine instances]);
    without it (the in-process pool's replicas) each has ``engine_config`` as it is.
    The batcher takes batches up to what the engine runs as one. Every engine warms
    up, on ``sample_inputs`` where given. Raises EngineLoadError; what loaded is
    closed again.
    """
    split = lone_engine and instances > 1
    configs = [engine_config] * instances
    if split:
        narrow = dataclasses.replace(engine_config, intra_op_threads=_instance_threads(engine_config, instances))
        configs = [engine_config] + [narrow] * instances
    engines: list[Engine] = []
    try:
        for config in configs:
            engines.append(Engine(model, config, name=key, sample_inputs=sample_inputs))
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    batch_engines = engines[1:] if split else engines if instances > 1 else []
    return HostedSegment(key, engines[0], _fit_batcher(batcher_config, engines[0]), batch_engines, on_batch=on_batch)
