"""Ray actors of the cloud tier: segment workers, a replica pool and pipelined tails.

The only module of ``workers`` that imports Ray (DESIGN.md's layer table); the pure
parts (routing, deadlines, input checks, stage cuts) are in :mod:`workers._pool` and
:mod:`workers.pipeline`.

* :class:`SegmentWorker` (the actor form of :class:`workers._worker.SegmentHost`) hosts one :class:`~workers.engine.Engine`
  and one :class:`~workers.batcher.Batcher` per segment (``model@version@cut``).
* :class:`ReplicaPool` spreads requests over replicas of it, least-loaded first, and
  retries a request once when its replica dies (see [Note: fault tolerance]).
* :class:`Pipeline` chains stage actors so that frames overlap.

[Note: transport]
A plain actor call pickles its arguments, puts arrays over 100 KiB in the object store
and goes through the raylet's task machinery: 5-10 ms to echo 1 MiB on a loaded
2-core machine. A compiled graph (``ray.dag`` + ``experimental_compile``) sets up
shared-memory channels between fixed actors once, and each execution only writes the
channel: 1-1.5 ms for the same echo, measured side by side in bench/workers.py.
Its results are views of the channel buffer, which stays locked while they live, so
:class:`Pipeline` copies them out. Compiled graphs are static (fixed
actors, one execution at a time per actor, in order), support only synchronous
methods, and a dead actor breaks the whole graph until it is compiled again. So:

* the pipeline, a fixed chain of actors, uses a compiled graph (``transport="compiled"``);
* the replica pool uses plain calls, because it routes each request to a different
  replica, batches requests from many callers inside the actor, and must survive a
  replica's death and restart; with ``PoolConfig(fast_path=True)`` a request that
  finds its replica idle takes a compiled graph to it instead (see [Note: fast path]).

[Note: fast path]
At concurrency 1 there is nothing to batch with, and a plain call's fixed cost (1.5-2.5
ms, and 8-13 ms for a 1 MiB echo here) is most of the added latency. So each replica
may also get a one-node compiled graph to its synchronous ``run_direct`` (one engine
run, no batcher), built in the background on first use. A request goes over it,
skipping the caller-side batcher too, only when this pool has nothing in flight on the
replica that routing picked and the graph is free; everything else goes the plain way.
Sending the caller-side batches over the graph as well was tried and measured worse
under load (DenseNet121 tail at concurrency 32: 226 against 282 requests/s, side by
side). A graph's readers busy-wait (Ray's channel read spins on ``sched_yield``): the
replica's loop waiting for the next request takes about 0.6 of a core even when idle,
and the caller's read spins while the engine runs, so the caller sleeps through most
of the expected run before it reads. That CPU is why the fast path is off by default:
on a 2-core machine it slows every CPU engine near it.

A graph that fails (the replica died or restarted, a channel error, a time-out) is
torn down off the event loop; the failure counts as a replica failure and a retry, the
request goes the plain way (which retries and counts as before), and the graph is
rebuilt after ``down_s``. Domain errors (InputError, deadline) come back as values, so
they do not break the graph. Outputs are copied out of the channel buffer, which stays
locked while views of it live; the worker must not keep views of its inputs either.
An actor takes part in one compiled graph at a time (a second one hangs), so replicas
are never also pipeline stages. Ray 2.60 aborts the caller's process when it first
reads a channel whose writer (the replica) has died, so each graph is read once, with
a no-op, as soon as it is built.

[Note: fault tolerance]
Replicas are created with ``max_restarts`` and ``max_task_retries=0``: Ray restarts a
dead replica (re-running its constructor, which reloads the segments it was created
with), and the pool, not Ray, decides about retries so it can send the request to a
*different* replica and count it. A request whose replica dies is sent again up to
``PoolConfig.max_retries`` times; after that it fails with the retry-able
:class:`ReplicaUnavailableError`. Every request ends in exactly one of the pool's
``completed``, ``failed`` and ``errors`` counters.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import ray
from ray.exceptions import RayActorError

from workers._pool import PoolConfig, PoolStats, RequestTiming, WorkerStats, num_gpus_for, pick_replica
from workers._worker import DEFAULT_BATCHER_CONFIG, ModelSource, SegmentHost, _Hosted, register_error_pickling
from workers.batcher import Batcher, BatcherConfig
from workers.engine import Engine, EngineConfig
from workers.errors import ActorConfigError, ReplicaUnavailableError, SegmentNotLoadedError
from workers.pipeline import StageSpan

# PoolConfig and the stats values live in workers/_pool.py (no Ray); this is their public door.
__all__ = ["DEFAULT_BATCHER_CONFIG", "Pipeline", "PoolConfig", "PoolStats", "ReplicaPool", "RequestTiming",
           "SegmentWorker", "WorkerStats", "make_worker"]

logger = logging.getLogger(__name__)

register_error_pickling()


class _TimedInputs(dict):
    """One request's inputs, carrying when it reached the worker and, once its batch ran,
    its RequestTiming (see [Note: request timing])."""

    __slots__ = ("arrival_s", "timing")


class _TimedHosted(_Hosted):
    def _run_batch(self, payloads: list) -> list:
        start = time.monotonic()
        outs = super()._run_batch(payloads)
        compute_s = time.monotonic() - start
        for i, p in enumerate(payloads):
            if isinstance(p, _TimedInputs):
                p.timing = RequestTiming(start - p.arrival_s, compute_s, len(payloads), i == 0)
        return outs


class _TimingHost(SegmentHost):
    """SegmentHost whose ``infer_batch_timed`` also returns each request's RequestTiming.

    [Note: request timing]
    The batcher knows when a batch starts and how big it is, but hands each request only
    its outputs. Each request's inputs are wrapped in a dict that the batch run stamps
    with that request's queue time, its batch's run time and size, and whether it came
    first in the batch; the gateway's Prometheus metrics record them for Ray pools just
    as the in-process pool records its own (cluster.ray_cluster).
    """

    def _make(self, key: str, source: ModelSource, config: EngineConfig) -> _Hosted:
        return _TimedHosted(key, Engine(self._resolve(source), config, name=key), self._batcher_config)

    async def infer_batch_timed(
        self,
        key: str,
        requests: list[Mapping[str, np.ndarray]],
        deadlines_unix_ms: list[float | None],
        priorities: list[int],
    ) -> list[tuple[dict[str, np.ndarray], RequestTiming | None] | BaseException]:
        """``infer_batch`` with each result paired with its RequestTiming."""

        async def one(inputs: Any, deadline: float | None, priority: int) -> tuple:
            if isinstance(inputs, Mapping):
                inputs = _TimedInputs(inputs)
                inputs.arrival_s, inputs.timing = time.monotonic(), None
            out = await self.infer(key, inputs, deadline_unix_ms=deadline, priority=priority)
            return out, getattr(inputs, "timing", None)

        return list(await asyncio.gather(
            *(one(r, d, p) for r, d, p in zip(requests, deadlines_unix_ms, priorities)), return_exceptions=True))


SegmentWorker = ray.remote(_TimingHost)
"""The Ray actor class. Create it through :func:`make_worker` (which sets resources)
or ``SegmentWorker.options(...).remote(segments, engine_config=...)``."""


def make_worker(
    segments: Mapping[str, ModelSource] | ray.ObjectRef | None = None,
    *,
    engine_config: EngineConfig | None = None,
    batcher_config: BatcherConfig | None = None,
    registry_dir: str | None = None,
    max_restarts: int = 0,
    max_concurrency: int = 1000,
    num_cpus: float = 0.0,
    name: str | None = None,
):
    """Starts one SegmentWorker actor; asks Ray for a GPU when the engine runs on one.

    With ``max_restarts`` and model bytes, pass ``segments`` as an ObjectRef
    (``ray.put``) and keep it: Ray may free by-value creation arguments that live in the
    object store after the first start, and a restart would then fail
    (ray-project/ray#53727). :class:`ReplicaPool` does that.
    """
    config = engine_config or EngineConfig()
    options: dict[str, Any] = dict(
        max_restarts=max_restarts, max_task_retries=0, max_concurrency=max_concurrency,
        num_cpus=num_cpus, num_gpus=num_gpus_for(config),
    )
    if name is not None:
        options["name"] = name
    if not isinstance(segments, ray.ObjectRef):
        segments = dict(segments or {})
    return SegmentWorker.options(**options).remote(
        segments, engine_config=config, batcher_config=batcher_config, registry_dir=registry_dir
    )


_FAST_PATH_TIMEOUT_S = 30.0
"""Longest a fast-path call waits without a deadline; then the graph counts as broken."""
_FAST_PATH_BUFFER_BYTES = 8 << 20
"""Size of a fast path's channels. Ray grows a channel for a larger frame, but growing
the replica's output channel makes the caller register a new buffer that the replica
owns, and that aborts the caller's process if the replica has died meanwhile (see
[Note: fast path]); so start large enough for any tail's outputs."""


class _FastPath:
    """A compiled graph from the caller to one replica's ``run_direct`` (see [Note: fast path]).

    Every graph call (compile, execute, read, teardown) blocks, so all of them run on
    this fast path's own thread, one at a time, which also keeps the graph's
    executions in order.
    """

    def __init__(self, actor) -> None:
        self._actor = actor
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fast-path")
        self._dag = None
        self._build_failures = 0
        self._run_ema_s = 0.0
        self.state = "idle"
        """idle (no graph) -> building -> ready <-> busy; broken -> idle after a teardown;
        closed at the end."""
        self.not_before_s = 0.0
        """Monotonic time before which no new graph is built (back-off after failures)."""

    def build(self) -> None:
        """Compiles the graph on the fast path's thread; ``state`` says when it is ready."""
        self.state = "building"
        self._thread.submit(self._build).add_done_callback(self._built)

    def _build(self) -> None:
        from ray.dag import InputNode

        with InputNode() as packet:
            node = self._actor.run_direct.bind(packet)
        ray.get(self._actor.health.remote())
        dag = node.experimental_compile(_buffer_size_bytes=_FAST_PATH_BUFFER_BYTES, _max_inflight_executions=1)
        self._dag = dag
        # The first read registers this process as the reader of the replica's output
        # channel, which the replica owns; registering after the replica died aborts
        # this process (Ray 2.60), so do it now, while it is known to be up.
        ray.get(dag.execute((None, [], [])), timeout=_FAST_PATH_TIMEOUT_S)

    def _built(self, fut: concurrent.futures.Future) -> None:
        if self.state != "building":  # closed meanwhile
            return
        if fut.exception() is not None:
            self._build_failures += 1
            backoff_s = min(60.0, 2.0 ** self._build_failures)
            self.not_before_s = time.monotonic() + backoff_s
            logger.warning("fast path to a replica not built (%r); plain calls serve it, next try in %.0f s",
                           fut.exception(), backoff_s)
            self.state = "broken"
            self._teardown_later()
        else:
            self.state = "ready"

    def _call(self, packet: tuple, timeout_s: float) -> object:
        ref = self._dag.execute(packet)
        if self._run_ema_s > 2e-3:
            # A channel read busy-waits (sched_yield) until the result is written, and
            # that takes CPU from the replica's engine on a small machine: sleep through
            # most of the expected run first.
            time.sleep(0.8 * self._run_ema_s)
        out = ray.get(ref, timeout=timeout_s)
        if isinstance(out, tuple):
            results, run_s, batch_size = out
            if batch_size:
                self._run_ema_s = run_s if not self._run_ema_s else 0.8 * self._run_ema_s + 0.2 * run_s
            # Views of the channel buffer, which stays locked while they live: copy out.
            results = [{k: np.array(v, copy=True) for k, v in r.items()} if isinstance(r, dict) else r
                       for r in results]
            return results, run_s, batch_size
        return out

    async def run(self, packet: tuple, timeout_s: float) -> object:
        """``run_direct``'s answer: ``(results, run_s, batch_size)`` or a WorkerError value.

        Raises whatever broke the graph; the graph is then torn down and ``state``
        is ``broken`` until that is done.
        """
        self.state = "busy"
        fut = self._thread.submit(self._call, packet, timeout_s)

        def done(f: concurrent.futures.Future) -> None:
            if self.state != "busy":
                return
            if f.cancelled() or f.exception() is not None:
                self.state = "broken"
                self._teardown_later()
            else:
                self.state = "ready"

        fut.add_done_callback(done)
        # Shielded: a cancelled caller must not leave the graph with an unread result.
        return await asyncio.shield(asyncio.wrap_future(fut))

    def _teardown_later(self) -> None:
        self._thread.submit(self._teardown)

    def _teardown(self) -> None:
        dag, self._dag = self._dag, None
        if dag is not None:
            try:
                dag.teardown()
            except Exception as e:  # noqa: BLE001 - a broken graph may fail to tear down; it is dropped either way
                logger.debug("fast path teardown: %r", e)
        if self.state == "broken":
            self.state = "idle"

    def close(self, *, wait: bool) -> None:
        self.state = "closed"
        self._thread.submit(self._teardown)
        self._thread.shutdown(wait=wait)


class ReplicaPool:
    """Replicas of a SegmentWorker behind least-loaded routing and one retry.

    Use from one asyncio event loop. See [Note: least-loaded routing] in
    workers/_pool.py and [Note: fault tolerance] above.
    """

    def __init__(
        self,
        segments: Mapping[str, ModelSource],
        *,
        config: PoolConfig | None = None,
        engine_config: EngineConfig | None = None,
        batcher_config: BatcherConfig | None = None,
        registry_dir: str | None = None,
    ) -> None:
        self.config = cfg = config or PoolConfig()
        self._segments = dict(segments)
        self._engine_config = engine_config or EngineConfig()
        # Held for the pool's lifetime so that restarts find the creation arguments.
        self._segments_ref = ray.put(self._segments)
        self.replicas = [
            make_worker(self._segments_ref, engine_config=self._engine_config, batcher_config=batcher_config,
                        registry_dir=registry_dir, max_restarts=cfg.max_restarts,
                        max_concurrency=cfg.max_concurrency, num_cpus=cfg.num_cpus)
            for _ in range(cfg.num_replicas)
        ]
        n = cfg.num_replicas
        self._in_flight = [0] * n
        self._routed = [0] * n
        self._down_until_s = [0.0] * n
        self._next = 0
        self._requests = self._completed = self._retries = self._failed = self._errors = 0
        self._replica_failures = 0
        self._batchers: dict[str, tuple[asyncio.AbstractEventLoop, Batcher]] = {}
        self._fast = [_FastPath(r) for r in self.replicas] if cfg.fast_path else []
        self._fast_calls = 0

    async def ready(self) -> list[dict]:
        """Waits until every replica has loaded its segments; returns their health."""
        return list(await asyncio.gather(*(r.health.remote() for r in self.replicas)))

    async def load(self, key: str, model: ModelSource) -> None:
        """Loads a segment on every replica; a restarted replica gets it back on demand."""
        self._segments[key] = model
        await asyncio.gather(*(r.load.remote(key, model) for r in self.replicas))

    async def infer(
        self,
        key: str,
        inputs: Mapping[str, np.ndarray],
        *,
        deadline_unix_ms: float | None = None,
        budget_ms: float | None = None,
        priority: int = 0,
    ) -> dict[str, np.ndarray]:
        """Runs one request on the least-loaded replica (see the class docs).

        Raises what the worker raised (InputError, DeadlineExceededError, ...), or
        ReplicaUnavailableError (retry-able) when replicas died ``max_retries + 1`` times.
        """
        out, _ = await self.infer_timed(key, inputs, deadline_unix_ms=deadline_unix_ms, budget_ms=budget_ms,
                                        priority=priority)
        return out

    async def infer_timed(
        self,
        key: str,
        inputs: Mapping[str, np.ndarray],
        *,
        deadline_unix_ms: float | None = None,
        budget_ms: float | None = None,
        priority: int = 0,
    ) -> tuple[dict[str, np.ndarray], RequestTiming | None]:
        """``infer`` and where the request's time went in the worker (see [Note: request timing])."""
        self._requests += 1
        if budget_ms is not None:
            # A budget must not restart with each retry: fix it as a deadline now.
            d = time.time() * 1e3 + budget_ms
            deadline_unix_ms = d if deadline_unix_ms is None else min(deadline_unix_ms, d)
        request = (inputs, deadline_unix_ms, priority)
        try:
            result = await self._try_fast(key, request) if self._fast else None
            if result is None and self.config.caller_batch_size > 1:
                result = await self._batcher(key).submit(request, priority=priority)
            elif result is None:
                [result] = await self._send(key, [request])
        except ReplicaUnavailableError:
            self._failed += 1
            raise
        except BaseException:
            self._errors += 1
            raise
        if isinstance(result, BaseException):
            self._errors += 1
            raise result
        self._completed += 1
        return result

    async def _try_fast(self, key: str, request: tuple) -> object | None:
        """Serves a lone request over an idle replica's compiled graph, skipping the
        caller-side batcher; ``None`` when it must go the usual way (see [Note: fast path])."""
        now_s = time.monotonic()
        i = pick_replica(self._in_flight, self._down_until_s, now_s, start=self._next)
        if i is None or self._in_flight[i] or self._down_until_s[i] > now_s:
            return None
        results = await self._send_fast(i, key, [request])
        return None if results is None else results[0]

    def _fast_ready(self, i: int) -> bool:
        """Whether replica ``i``'s graph can take a call now; starts building it if due."""
        fast = self._fast[i]
        if fast.state == "idle" and time.monotonic() >= fast.not_before_s:
            fast.build()
        return fast.state == "ready"

    async def _send_fast(self, i: int, key: str, requests: list[tuple]) -> list | None:
        """Sends requests as one batch over replica ``i``'s compiled graph (one, today).

        Returns one (outputs, RequestTiming) or exception per request, or ``None`` when
        the graph is not ready or failed (the caller then sends them the plain way).
        """
        if not self._fast or not self._fast_ready(i):
            return None
        n = len(requests)
        deadlines = [r[1] for r in requests]
        timeout_s = _FAST_PATH_TIMEOUT_S
        if all(d is not None for d in deadlines):
            # The worker refuses expired requests itself; this only bounds the wait.
            timeout_s = max(1.0, min(timeout_s, max(deadlines) / 1e3 - time.time() + 1.0))
        self._next = (i + 1) % len(self.replicas)
        self._in_flight[i] += n
        self._routed[i] += 1
        try:
            out = await self._fast[i].run((key, [r[0] for r in requests], deadlines), timeout_s)
        except Exception as e:  # noqa: BLE001 - any graph failure: the plain path serves the requests
            self._replica_failures += 1
            self._retries += n
            self._fast[i].not_before_s = time.monotonic() + self.config.down_s
            logger.warning("fast path to replica %d failed on %s (%s, %d requests); sending the plain way",
                           i, key, type(e).__name__, n)
            return None
        finally:
            self._in_flight[i] -= n
        if isinstance(out, SegmentNotLoadedError):
            return None  # the plain path reloads the segment
        if isinstance(out, BaseException):
            return [out] * n
        self._fast_calls += n
        results, run_s, batch_size = out
        timings = iter(range(batch_size))
        return [r if isinstance(r, BaseException) else (r, RequestTiming(0.0, run_s, batch_size, next(timings) == 0))
                for r in results]

    def _batcher(self, key: str) -> Batcher:
        """The caller-side batcher of ``key`` on the running event loop.

        [Note: caller-side batching]
        Requests that wait while every send slot is busy leave together in one actor
        call (``infer_batch``), so a busy pool pays Ray's per-call cost once per batch
        instead of once per request. With no queue delay a lone request leaves at once.
        """
        loop = asyncio.get_running_loop()
        entry = self._batchers.get(key)
        if entry is None or entry[0] is not loop:
            cfg = self.config

            async def send(requests: list) -> list:
                return await self._send(key, requests)

            # Priorities only order the waiting requests here; the worker's batcher
            # enforces its own range and answers a bad one with BatcherRequestError.
            batcher = Batcher(send, BatcherConfig(
                max_batch_size=cfg.caller_batch_size, max_queue_delay_ms=0.0, num_priority_levels=1 << 16,
                max_queue_size=1 << 20, max_concurrent_batches=cfg.num_replicas * cfg.sends_per_replica,
            ))
            entry = self._batchers[key] = (loop, batcher)
        return entry[1]

    async def _send(self, key: str, requests: list[tuple]) -> list:
        """Sends requests in one call to the least-loaded replica, retrying on replica loss.

        Returns one (outputs, RequestTiming) or exception per request (the worker's ``infer_batch_timed``).
        """
        exclude: int | None = None
        attempts = 0
        reloaded = False
        n = len(requests)
        args = ([r[0] for r in requests], [r[1] for r in requests], [r[2] for r in requests])
        while True:
            i = pick_replica(self._in_flight, self._down_until_s, time.monotonic(), start=self._next, exclude=exclude)
            assert i is not None  # the pool has at least one replica (PoolConfig checks)
            self._next = (i + 1) % len(self.replicas)
            self._in_flight[i] += n
            self._routed[i] += 1
            attempts += 1
            try:
                results = await self.replicas[i].infer_batch_timed.remote(key, *args)
            except RayActorError as e:
                self._replica_failures += 1
                self._down_until_s[i] = time.monotonic() + self.config.down_s
                logger.warning("replica %d failed on %s (attempt %d, %d requests): %s",
                               i, key, attempts, n, type(e).__name__)
                if attempts > self.config.max_retries:
                    raise ReplicaUnavailableError(
                        f"request for {key} failed on {attempts} replicas that died or were restarting; "
                        "retry-able: send it again after a back-off (replicas restart), or add replicas",
                        key=key, attempts=attempts, detail=f"{type(e).__name__}: {str(e)[:300]}",
                    ) from e
                self._retries += n
                exclude = i
                continue
            finally:
                self._in_flight[i] -= n
            if not reloaded and key in self._segments and all(isinstance(r, SegmentNotLoadedError) for r in results):
                # A replica restarted by Ray knows only its creation segments.
                reloaded = True
                self._retries += n
                await self.replicas[i].load.remote(key, self._segments[key])
                continue
            return results

    def stats(self) -> PoolStats:
        return PoolStats(
            requests=self._requests, completed=self._completed, retries=self._retries,
            failed=self._failed, errors=self._errors, replica_failures=self._replica_failures,
            in_flight=tuple(self._in_flight), routed=tuple(self._routed), fast_path_calls=self._fast_calls,
        )

    async def worker_stats(self) -> list[WorkerStats]:
        return list(await asyncio.gather(*(r.stats.remote() for r in self.replicas)))

    async def aclose(self, *, timeout_s: float = 10.0) -> None:
        """Closes the caller-side batchers, then kills the replicas (see :meth:`shutdown`).

        Queued requests fail with BatcherClosedError; batches already sent get up to
        ``timeout_s`` to finish. A batcher left open would leave its scheduling task
        pending when the event loop ends ("Task was destroyed but it is pending").
        """
        await self._close_batchers(timeout_s)
        self.shutdown()

    async def _close_batchers(self, timeout_s: float) -> None:
        running = asyncio.get_running_loop()
        batchers, self._batchers = self._batchers, {}
        for key, (loop, batcher) in batchers.items():
            try:
                if loop is running:
                    await asyncio.wait_for(batcher.close(drain=False), timeout_s)
                elif loop.is_running() and not loop.is_closed():
                    fut = asyncio.run_coroutine_threadsafe(batcher.close(drain=False), loop)
                    await asyncio.wait_for(asyncio.wrap_future(fut), timeout_s)
            except TimeoutError:
                logger.warning("the caller-side batcher of %s did not close within %.0f s", key, timeout_s)

    def shutdown(self) -> None:
        """Kills the replicas for good (no restart). From a coroutine, await :meth:`aclose`
        instead: it also closes the caller-side batchers."""
        live = [key for key, (loop, _) in self._batchers.items() if not loop.is_closed()]
        if live:
            logger.warning("ReplicaPool.shutdown() left the caller-side batchers of %s open; "
                           "await aclose() instead to close them", ", ".join(live))
        self._batchers = {}
        for fast in self._fast:
            # A graph is torn down while its replica lives (quick); one still waiting
            # on a call is left to fail when the replica goes.
            fast.close(wait=fast.state != "busy")
        for r in self.replicas:
            ray.kill(r, no_restart=True)


class Pipeline:
    """A tail cut into stages, one SegmentWorker per stage, frames overlapping.

    ``stages`` are the stage models in order (see :func:`workers.pipeline.make_stages`),
    whose outputs feed the next stage's inputs by name. ``transport`` picks a compiled
    graph (default) or chained plain calls (see [Note: transport]); both pass the
    stage outputs from actor to actor without the caller in between.
    """

    def __init__(
        self,
        stages: Sequence[ModelSource],
        *,
        engine_configs: Sequence[EngineConfig] | None = None,
        transport: Literal["compiled", "calls"] = "compiled",
        max_inflight: int = 4,
        buffer_size_bytes: int = 8 << 20,
    ) -> None:
        if not stages:
            raise ActorConfigError("a pipeline needs at least one stage", field_name="stages", value=0)
        if transport not in ("compiled", "calls"):
            raise ActorConfigError(f"transport={transport!r} is unknown; use 'compiled' or 'calls'",
                                   field_name="transport", value=transport)
        if max_inflight < 1:
            raise ActorConfigError(f"max_inflight={max_inflight} must be >= 1", field_name="max_inflight",
                                   value=max_inflight)
        configs = list(engine_configs or [EngineConfig()] * len(stages))
        if len(configs) != len(stages):
            raise ActorConfigError(
                f"{len(configs)} engine configs for {len(stages)} stages; give one per stage",
                field_name="engine_configs", value=len(configs),
            )
        self.keys = [f"stage{i}" for i in range(len(stages))]
        self.workers = [make_worker({k: s}, engine_config=c) for k, s, c in zip(self.keys, stages, configs)]
        self.transport = transport
        self.max_inflight = max_inflight
        self._frame = 0
        self._dag = None
        ray.get([w.health.remote() for w in self.workers])
        if transport == "compiled":
            from ray.dag import InputNode

            with InputNode() as packet:
                node = packet
                for key, worker in zip(self.keys, self.workers):
                    node = worker.run_stage.bind(key, node)
            self._dag = node.experimental_compile(
                _buffer_size_bytes=buffer_size_bytes, _max_inflight_executions=max_inflight
            )

    def _submit(self, inputs: Mapping[str, np.ndarray]):
        packet = (self._frame, dict(inputs))
        self._frame += 1
        if self._dag is not None:
            return self._dag.execute(packet)
        ref = packet
        for key, worker in zip(self.keys, self.workers):
            ref = worker.run_stage.remote(key, ref)
        return ref

    def _collect(self, ref) -> dict[str, np.ndarray]:
        _, outputs = ray.get(ref)
        if self._dag is None:
            return outputs
        # A compiled graph's result arrays are views of its channel buffer, which stays
        # locked (stalling the next frames) for as long as they live: copy them out.
        return {k: np.array(v, copy=True) for k, v in outputs.items()}

    def run_many(self, frames: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """Runs frames in order with up to ``max_inflight`` in the pipeline at once."""
        out: list[dict[str, np.ndarray]] = []
        window: list = []
        for inputs in frames:
            if len(window) >= self.max_inflight:
                out.append(self._collect(window.pop(0)))
            window.append(self._submit(inputs))
        out.extend(self._collect(ref) for ref in window)
        return out

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.run_many([inputs])[0]

    def spans(self, clear: bool = False) -> list[StageSpan]:
        """When each stage ran each frame (monotonic clock of this host)."""
        return [s for w in self.workers for s in ray.get(w.spans.remote(clear))]

    def shutdown(self) -> None:
        if self._dag is not None:
            self._dag.teardown()
            self._dag = None
        for w in self.workers:
            ray.kill(w, no_restart=True)
