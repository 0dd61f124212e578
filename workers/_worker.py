"""The segment worker itself, without Ray: the segments it hosts (a
:class:`workers.segment.HostedSegment` each) and the ways a request reaches them.

:mod:`workers.actors` turns :class:`SegmentHost` into the Ray actor ``SegmentWorker``
(only that module imports Ray). Kept apart so the serving logic stays small and
importable without Ray.
"""

from __future__ import annotations

import asyncio
import copyreg
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from workers._malloc import keep_freed_memory
from workers._pool import WorkerStats, check_inputs, to_monotonic_deadline
from workers.batcher import NOT_NOW, BatcherConfig
from workers.engine import EngineConfig, Place
from workers.errors import ActorConfigError, InputError, SegmentNotLoadedError, WorkerError
from workers.pipeline import StageSpan
from workers.segment import HostedSegment, load_segment

__all__ = ["DEFAULT_BATCHER_CONFIG", "ModelSource", "SegmentHost", "SegmentSource", "register_error_pickling"]

logger = logging.getLogger(__name__)

DEFAULT_BATCHER_CONFIG = BatcherConfig(max_batch_size=8, max_queue_delay_ms=0.0, num_priority_levels=4,
                                       inline_max_ms=20.0)
"""No waiting for company: a lone request runs at once, and requests that arrive while
a batch runs form the next batch (up to 8). That batches under load without adding
latency at concurrency 1. A lone request whose runs take up to 20 ms runs on the
worker's event loop thread (see [Note: inline runs] in workers/batcher.py): a worker
serves nothing but its segments, so the loop can wait that long."""

@dataclasses.dataclass(frozen=True)
class SegmentSource:
    """A segment with the sample inputs its engines warm up and check batching on
    ([Note: any shape] in workers/engine.py)."""

    model: bytes | str
    """Serialized ONNX bytes, or a path (relative to the worker's registry directory)."""
    sample_inputs: Mapping[str, np.ndarray]
    """Real inputs of the segment, by name."""


ModelSource = bytes | str | SegmentSource
"""Serialized ONNX bytes, a path (relative to the worker's registry directory), or either
with sample inputs (:class:`SegmentSource`)."""


def _rebuild_error(cls: type, message: str, state: dict) -> BaseException:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err


def _reduce_error(err: BaseException) -> tuple:
    return _rebuild_error, (type(err), str(err.args[0]) if err.args else "", dict(err.__dict__))


def register_error_pickling() -> None:
    """Makes every WorkerError survive pickling with its fields.

    Ray ships an actor's exception to the caller by pickling it, and the default
    exception pickling calls ``cls(*args)``, which drops keyword-only fields or fails
    on required ones (QueueFullError) so the caller would get UnserializableException.
    """
    stack: list[type] = [WorkerError]
    while stack:
        cls = stack.pop()
        copyreg.pickle(cls, _reduce_error)
        stack.extend(cls.__subclasses__())


register_error_pickling()


class SegmentHost:
    """Hosts segments and serves them; Ray runs it as the actor ``workers.actors.SegmentWorker``.

    ``segments`` maps ``model@version@cut`` keys to model bytes or registry paths; they
    load in the constructor, so a replica that Ray restarts comes back with them.
    ``engine_config`` and ``batcher_config`` are the defaults for every segment.
    ``instances`` engines run each segment's batches side by side, splitting its
    intra-op threads; the batcher's ``max_concurrent_batches`` follows it (see
    [Note: engine instances] in workers/segment.py).
    """

    def __init__(
        self,
        segments: Mapping[str, ModelSource] | None = None,
        *,
        engine_config: EngineConfig | None = None,
        batcher_config: BatcherConfig | None = None,
        registry_dir: str | None = None,
        instances: int = 1,
    ) -> None:
        register_error_pickling()
        if not (type(instances) is int and instances >= 1):
            raise ActorConfigError(f"instances={instances!r} is invalid; use 1 or more engines per segment",
                                   field_name="instances", value=instances)
        self._instances = instances
        keep_freed_memory()  # [Note: fresh pages] (workers/_malloc.py)
        self._engine_config = engine_config or EngineConfig()
        self._batcher_config = batcher_config or DEFAULT_BATCHER_CONFIG
        self._registry_dir = registry_dir
        self._hosted: dict[str, HostedSegment] = {}
        self._started_unix_s = time.time()
        self._spans: list[StageSpan] = []
        for key, source in (segments or {}).items():
            self._hosted[key] = self._make(key, source, self._engine_config)
        logger.info("segment worker pid %d up with %s", os.getpid(), sorted(self._hosted))

    # -- loading --------------------------------------------------------------------

    def _resolve(self, source: bytes | str) -> bytes | str:
        if isinstance(source, (bytes, bytearray, memoryview)):
            return bytes(source)
        if self._registry_dir is None:
            if not os.path.isabs(source):
                raise ActorConfigError(
                    f"model path {source!r} is relative but the worker has no registry_dir; "
                    "pass an absolute path or create the worker with registry_dir=",
                    field_name="model", value=source,
                )
            return source
        root = os.path.realpath(self._registry_dir)
        path = os.path.realpath(os.path.join(root, source))
        if os.path.commonpath([root, path]) != root:
            raise ActorConfigError(
                f"model path {source!r} resolves to {path}, outside the registry {root}; "
                "name a file inside the registry",
                field_name="model", value=source,
            )
        return path

    def _make(self, key: str, source: ModelSource, config: EngineConfig) -> HostedSegment:
        samples = None
        if isinstance(source, SegmentSource):
            source, samples = source.model, source.sample_inputs
        return load_segment(key, self._resolve(source), config, self._batcher_config, sample_inputs=samples,
                            instances=self._instances)

    async def load(self, key: str, model: ModelSource, engine_config: EngineConfig | None = None) -> dict:
        """Loads (or replaces) segment ``key``; returns its input and output specs.

        The engine is built off the event loop, so requests for other segments keep
        being served meanwhile. Raises EngineLoadError when the model is bad.
        """
        loop = asyncio.get_running_loop()
        hosted = await loop.run_in_executor(None, self._make, key, model, engine_config or self._engine_config)
        old = self._hosted.pop(key, None)
        self._hosted[key] = hosted
        if old is not None:
            await old.close()
        logger.info("worker pid %d loaded %s (batch_safe=%s)", os.getpid(), key, hosted.engine.batch_safe)
        return self._describe(hosted)

    async def unload(self, key: str) -> bool:
        """Drops segment ``key`` after its queued requests ran; False if it was not loaded."""
        hosted = self._hosted.pop(key, None)
        if hosted is None:
            return False
        await hosted.close()
        return True

    @staticmethod
    def _describe(h: HostedSegment) -> dict:
        return {
            "inputs": [s.to_json() for s in h.engine.inputs],
            "outputs": [s.to_json() for s in h.engine.outputs],
            "batch_safe": h.engine.batch_safe,
            "max_batch": h.engine.max_batch,
        }

    def _get(self, key: str) -> HostedSegment:
        hosted = self._hosted.get(key)
        if hosted is None:
            raise SegmentNotLoadedError(
                f"segment {key!r} is not loaded on worker pid {os.getpid()} (loaded: {sorted(self._hosted)}); "
                "load it first with load(key, model)",
                key=key, loaded=tuple(sorted(self._hosted)),
            )
        return hosted

    # -- serving --------------------------------------------------------------------

    def _admit(self, hosted: HostedSegment, inputs: Mapping[str, np.ndarray], deadline_unix_ms: float | None,
               budget_ms: float | None, check: Callable[[Mapping[str, np.ndarray]], int] | None = None,
               ) -> tuple[int, float | None]:
        """Counts and checks one request for ``hosted``; returns its rows and monotonic
        deadline. ``check`` (default: the segment's specs, before batching) checks it."""
        hosted.requests += 1
        try:
            if check is None:
                rows = check_inputs(hosted.engine.inputs, inputs, max_batch=hosted.engine.max_batch, name=hosted.key)
            else:
                rows = check(inputs)
        except InputError:
            hosted.input_errors += 1
            raise
        if deadline_unix_ms is None and budget_ms is None:
            return rows, None
        return rows, to_monotonic_deadline(
            deadline_unix_ms=deadline_unix_ms, budget_ms=budget_ms,
            now_unix_s=time.time(), now_monotonic_s=time.monotonic(),
        )

    async def infer(
        self,
        key: str,
        inputs: Mapping[str, np.ndarray],
        *,
        deadline_unix_ms: float | None = None,
        budget_ms: float | None = None,
        priority: int = 0,
    ) -> dict[str, np.ndarray]:
        """Runs one request through segment ``key``'s batcher and engine.

        Raises InputError (bad names, dtypes, shapes), DeadlineExceededError,
        QueueFullError (retry-able), SegmentNotLoadedError or EngineRunError. The
        worker keeps serving after any of them.
        """
        hosted = self._get(key)
        _, deadline_s = self._admit(hosted, inputs, deadline_unix_ms, budget_ms)
        try:
            out = await hosted.batcher.submit(inputs, deadline_s=deadline_s, priority=priority,
                                              shape_key=hosted.shape_key(inputs))
        except Exception:
            hosted.failed += 1
            raise
        hosted.completed += 1
        return out

    def infer_now(
        self, key: str, inputs: Mapping[str, np.ndarray], deadline_unix_ms: float | None, priority: int,
        *, views: bool = False, place: Place | None = None,
        stamps: list[float] | None = None,
    ) -> Any:
        """Runs one request at once when its batcher is idle and would run it on the event
        loop anyway (see [Note: run now] in workers/batcher.py); returns ``NOT_NOW``
        (nothing counted, nothing run) otherwise. Raises what :meth:`infer` raises.
        ``views=True`` runs it on the engine with all the segment's threads (free: the
        batcher is idle) and returns views of its output buffers, valid until its next
        run: send them on before returning to the loop. With ``place``, outputs lie
        where it put them ([Note: outputs placed]). ``stamps``, if given, gets the run's
        start and end (``time.monotonic``).

        For a caller that knows the request came alone (a frame of one on the direct
        channel, with nothing behind it); :meth:`infer` leaves the batching decision to
        the batcher's scheduling loop, so that requests arriving together still batch.

        [Note: lean lone path]
        This runs between a request's frame and its engine run at concurrency 1, right
        after the previous run has pushed the interpreter out of the caches, where each
        step costs about ten times what it costs warm. So it takes the fewest steps that
        keep :meth:`infer`'s behaviour: one input check, the engine's own (which the run
        then trusts), where ``infer`` checks in ``_admit`` and the engine again; no copy
        of the inputs to carry the timing (``stamps`` instead of [Note: request
        timing]'s wrapper); no per-request partials. Measured through Ray on the
        transformer tail (1 MiB in and out), the worker's time from the request's
        arrival to the run's start went from 72 to 12 us, and the c1 serving overhead
        from 0.90-1.08 ms (median 0.98) to 0.72-0.98 ms (median 0.85), old and new code
        alternating, three runs of three 3 s rounds each.
        """
        hosted = self._get(key)
        batcher = hosted.batcher
        if not batcher.can_run_now():
            return NOT_NOW
        engine = hosted.engine
        rows, deadline_s = self._admit(hosted, inputs, deadline_unix_ms, None, check=engine.check)

        def run(payloads: list) -> Sequence[dict[str, np.ndarray]]:
            start_s = time.monotonic()
            outs = (engine.run(inputs, place=place, rows=rows),) if views else hosted._run_batch(payloads)
            if stamps is not None:
                stamps.extend((start_s, time.monotonic()))
            return outs

        try:
            out = batcher.run_now(inputs, deadline_s=deadline_s, priority=priority, run=run)
        except Exception:
            hosted.failed += 1
            raise
        hosted.completed += 1
        return out

    async def infer_batch(
        self,
        key: str,
        requests: list[Mapping[str, np.ndarray]],
        deadlines_unix_ms: list[float | None],
        priorities: list[int],
    ) -> list[dict[str, np.ndarray] | BaseException]:
        """Runs several requests in one call: one result or exception per request.

        The caller-side batching of :class:`workers.actors.ReplicaPool` sends these, so
        that one actor call carries up to a batch. The requests enter the batcher
        together, with one wake-up of its scheduling loop and no task each, and so run
        as one batch; one bad request fails alone.
        """
        try:
            hosted = self._get(key)
        except SegmentNotLoadedError as e:
            return [e] * len(requests)
        results: list[Any] = [None] * len(requests)
        queued = []
        for i, (inputs, d, p) in enumerate(zip(requests, deadlines_unix_ms, priorities)):
            try:
                _, deadline_s = self._admit(hosted, inputs, d, None)
            except Exception as e:  # noqa: BLE001 - per-request errors are values
                results[i] = e
                continue
            try:
                queued.append((i, hosted.batcher.enqueue(inputs, deadline_s=deadline_s, priority=p,
                                                         shape_key=hosted.shape_key(inputs))))
            except Exception as e:  # noqa: BLE001
                hosted.failed += 1
                results[i] = e
        try:
            for i, request in queued:
                try:
                    results[i] = await request.future  # a batch answers its requests together: one suspension
                except Exception as e:  # noqa: BLE001 - CancelledError is not one: it goes on to the withdraw below
                    hosted.failed += 1
                    results[i] = e
                else:
                    hosted.completed += 1
        except asyncio.CancelledError:
            for _, request in queued:
                hosted.batcher.withdraw(request)
            raise
        return results

    def run_stage(self, key: str, packet: tuple[int, Mapping[str, np.ndarray]]) -> tuple[int, dict[str, np.ndarray]]:
        """Runs ``(frame, inputs)`` through segment ``key`` at once, without the batcher.

        Synchronous because compiled graphs call only synchronous methods; records
        when it ran so that pipelining can be checked (:meth:`spans`).
        """
        frame, inputs = packet
        hosted = self._get(key)
        hosted.requests += 1
        start = time.monotonic()
        try:
            out = hosted.engine.run(inputs, copy=True)
        except InputError:
            hosted.input_errors += 1
            raise
        hosted.completed += 1
        self._spans.append(StageSpan(frame=frame, stage=int(key.rsplit("stage", 1)[-1]) if "stage" in key else 0,
                                     start_s=start, end_s=time.monotonic()))
        return frame, out

    def echo(self, value: Any) -> Any:
        """Returns its argument: the transport cost alone (bench/workers.py)."""
        return value

    # -- introspection --------------------------------------------------------------

    def spans(self, clear: bool = False) -> list[StageSpan]:
        out = list(self._spans)
        if clear:
            self._spans.clear()
        return out

    async def stats(self) -> WorkerStats:
        return WorkerStats(
            pid=os.getpid(), started_unix_s=self._started_unix_s,
            segments=tuple(h.stats() for _, h in sorted(self._hosted.items())),
        )

    async def health(self) -> dict:
        """Liveness and what is loaded; cheap enough for a probe."""
        return {"ok": True, "pid": os.getpid(), "segments": sorted(self._hosted),
                "started_unix_s": self._started_unix_s}
