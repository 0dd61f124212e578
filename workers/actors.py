"""Ray actors of the cloud tier: segment workers, a replica pool and pipelined tails.

The only module of ``workers`` that imports Ray (the `ray` door of docs/architecture.md); the pure
parts (routing, deadlines, input checks, stage cuts) are in :mod:`workers._pool` and
:mod:`workers.pipeline`.

* :class:`SegmentWorker` (the actor form of :class:`workers._worker.SegmentHost`) hosts an :class:`~workers.engine.Engine`
  (and its instances: [Note: engine instances] in workers/segment.py) and a
  :class:`~workers.batcher.Batcher` per segment (``model@version@cut``).
* :class:`ReplicaPool` spreads requests over replicas of it, least-loaded first, and
  retries a request once when its replica dies (see [Note: fault tolerance]).
* :class:`Pipeline` chains stage actors so that frames overlap.

[Note: transport]
A plain actor call pickles its arguments, puts arrays over 100 KiB in the object store
and goes through the raylet's task machinery: 1.0 ms to echo 4 B and 2.8 ms to echo
1 MiB on this 2-core machine, against 0.08 and 0.15 ms over the direct channel
(``transport`` in bench/results/workers.json, side by side). So:

* the replica pool sends its batches (see [Note: caller-side batching]) over each
  replica's direct channel, a socket that the replica opens on request
  (``open_channel``; a Unix-domain socket on the caller's node, TCP across nodes; see
  [Note: direct channel] in workers/_transport/framing.py); Ray still creates, places,
  restarts and kills the replicas, and plain calls carry loads, stats and health.
  Until a channel is open, and with ``PoolConfig(direct=False)``, the same batches go
  by plain calls;
* the pipeline, a fixed chain of actors, uses a compiled graph (``ray.dag`` +
  ``experimental_compile``: shared-memory channels set up once, 0.33 ms to echo
  1 MiB here). Its results are views of the channel buffer, which stays locked while
  they live, so :class:`Pipeline` copies them out. Compiled graphs are static, call
  only synchronous methods, and a dead actor breaks the graph until it is compiled
  again; and their readers spin on ``sched_yield``, taking a core from the engines
  beside them on a small machine, which is why the pool does not use them.

[Note: fault tolerance]
Replicas are created with ``max_restarts`` and ``max_task_retries=0``: Ray restarts a
dead replica (re-running its constructor, which reloads the segments it was created
with), and the pool, not Ray, decides about retries so it can send the request to a
*different* replica and count it. A request whose replica dies is sent again up to
``PoolConfig.max_retries`` times; after that it fails with the retry-able
:class:`ReplicaUnavailableError`. A request whose replica's direct channel closes
under it counts the same way and is sent again by a plain call, avoiding that replica
while it restarts; the channel reconnects after ``down_s``. Every request ends in exactly one of the pool's
``completed``, ``failed`` and ``errors`` counters.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import ray
from ray.exceptions import RayActorError

from workers._address import address
from workers._transport import ChannelClient, ChannelClosedError, ChannelRefusedError, open_channel_server
from workers._transport.client import DirectLink
from workers._pool import PoolConfig, PoolStats, RequestTiming, WorkerStats, new_timing, num_gpus_for, pick_replica
from workers._worker import (
    DEFAULT_BATCHER_CONFIG,
    ModelSource,
    SegmentHost,
    SegmentSource,
    register_error_pickling,
)
from workers.batcher import NOT_NOW, Batcher, BatcherConfig
from workers.engine import EngineConfig, Place
from workers.errors import ActorConfigError, ReplicaUnavailableError, SegmentNotLoadedError
from workers.pipeline import StageSpan
from workers.segment import TimedInputs

# PoolConfig and the stats values live in workers/_pool.py (no Ray); this is their public door.
__all__ = ["DEFAULT_BATCHER_CONFIG", "Pipeline", "PoolConfig", "PoolStats", "ReplicaPool",
           "RequestTiming", "SegmentSource", "SegmentWorker", "WorkerStats", "make_worker"]

logger = logging.getLogger(__name__)

register_error_pickling()


class _TimingHost(SegmentHost):
    """SegmentHost whose ``infer_batch_timed`` also returns each request's RequestTiming
    ([Note: request timing] in workers/segment.py): the gateway's Prometheus metrics
    record them for Ray pools just as the in-process pool records its own
    (cluster.ray_cluster)."""

    @staticmethod
    def _timed(inputs: Any) -> Any:
        return TimedInputs.now(inputs) if isinstance(inputs, Mapping) else inputs

    async def infer_timed(
        self, key: str, inputs: Any, deadline_unix_ms: float | None, priority: int
    ) -> tuple[dict[str, np.ndarray], RequestTiming | None]:
        """``infer`` with the request's RequestTiming."""
        inputs = self._timed(inputs)
        out = await self.infer(key, inputs, deadline_unix_ms=deadline_unix_ms, priority=priority)
        return out, getattr(inputs, "timing", None)

    async def infer_batch_timed(
        self,
        key: str,
        requests: list[Mapping[str, np.ndarray]],
        deadlines_unix_ms: list[float | None],
        priorities: list[int],
    ) -> list[tuple[dict[str, np.ndarray], RequestTiming | None] | BaseException]:
        """``infer_batch`` with each result paired with its RequestTiming."""
        timed = [self._timed(r) for r in requests]
        results = await self.infer_batch(key, timed, deadlines_unix_ms, priorities)
        return [r if isinstance(r, BaseException) else (r, getattr(t, "timing", None)) for r, t in zip(results, timed)]

    def infer_batch_now(
        self,
        key: str,
        requests: list[Mapping[str, np.ndarray]],
        deadlines_unix_ms: list[float | None],
        priorities: list[int],
        *,
        place: Place | None = None,
    ) -> Any:
        """``infer_batch_timed`` answered at once, for a lone request that the batcher can
        run now (see :meth:`SegmentHost.infer_now`); ``NOT_NOW`` otherwise. The direct
        channel calls it first, with ``place`` from its arena ([Note: outputs placed] in
        workers/engine.py)."""
        if len(requests) != 1:
            return NOT_NOW
        arrival_s = time.monotonic()
        stamps: list[float] = []
        try:
            # Views: the channel sends the answer on before anything else can run.
            out = self.infer_now(key, requests[0], deadlines_unix_ms[0], priorities[0], views=True, place=place,
                                 stamps=stamps)
        except Exception as e:  # noqa: BLE001 - per-request errors are values, as infer_batch returns them
            return [e]
        if out is NOT_NOW:
            return out
        start_s, end_s = stamps
        return [(out, new_timing((start_s - arrival_s, end_s - start_s, 1, True)))]

    async def open_channel(self, tcp_pickle: bool = False) -> dict:
        """Starts this worker's direct channel once (see [Note: direct channel] in
        workers/_transport/framing.py); returns where it listens and which node this is.
        ``tcp_pickle`` (PoolConfig.tcp_pickle) lets TCP connections accepted from now on
        carry pickle frames ([Note: no pickle over TCP] in workers/_transport/framing.py)."""
        if getattr(self, "_channel", None) is None:
            self._channel = await open_channel_server(self.infer_batch_timed, now=self.infer_batch_now,
                                                      tcp_host=ray.util.get_node_ip_address(), tcp_pickle=tcp_pickle)
        self._channel.tcp_pickle = self._channel.tcp_pickle or tcp_pickle
        return {"path": self._channel.path, "tcp": self._channel.tcp_address, "token": self._channel.token,
                "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}


SegmentWorker = ray.remote(_TimingHost)
"""The Ray actor class. Create it through :func:`make_worker` (which sets resources)
or ``SegmentWorker.options(...).remote(segments, engine_config=...)``."""


def worker_asks(engine_config: EngineConfig, *, num_cpus: float = 0.0,
                resources: Mapping[str, float] | None = None) -> dict[str, float]:
    """What one SegmentWorker asks Ray for: ``CPU``, ``GPU`` (one when its engine runs
    on a GPU) and its custom ``resources``."""
    return {"CPU": num_cpus, "GPU": num_gpus_for(engine_config), **(resources or {})}


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
    instances: int = 1,
    resources: Mapping[str, float] | None = None,
):
    """Starts one SegmentWorker actor; asks Ray for a GPU when the engine runs on one,
    and for ``resources`` (Ray custom resources: where it may be placed).

    With ``max_restarts`` and model bytes, pass ``segments`` as an ObjectRef
    (``ray.put``) and keep it: Ray may free by-value creation arguments that live in the
    object store after the first start, and a restart would then fail
    (ray-project/ray#53727). :class:`ReplicaPool` does that.
    """
    config = engine_config or EngineConfig()
    asks = worker_asks(config, num_cpus=num_cpus, resources=resources)
    options: dict[str, Any] = dict(
        max_restarts=max_restarts, max_task_retries=0, max_concurrency=max_concurrency,
        num_cpus=asks.pop("CPU"), num_gpus=asks.pop("GPU"),
    )
    if name is not None:
        options["name"] = name
    if asks:
        options["resources"] = asks
    if not isinstance(segments, ray.ObjectRef):
        segments = dict(segments or {})
    return SegmentWorker.options(**options).remote(
        segments, engine_config=config, batcher_config=batcher_config, registry_dir=registry_dir,
        instances=instances,
    )


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
        self.replica_asks = worker_asks(self._engine_config, num_cpus=cfg.num_cpus, resources=cfg.resources)
        """What each replica asks Ray for (:func:`worker_asks`)."""
        # Held for the pool's lifetime so that restarts find the creation arguments.
        self._segments_ref = ray.put(self._segments)
        self.replicas = [
            make_worker(self._segments_ref, engine_config=self._engine_config, batcher_config=batcher_config,
                        registry_dir=registry_dir, max_restarts=cfg.max_restarts,
                        max_concurrency=cfg.max_concurrency, num_cpus=cfg.num_cpus, instances=cfg.instances,
                        resources=cfg.resources)
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
        node_id = ray.get_runtime_context().get_node_id()
        self._links = [DirectLink(r, node_id, over_tcp=cfg.direct_over_tcp, shared_memory=cfg.shared_memory,
                                   tcp_pickle=cfg.tcp_pickle)
                       for r in self.replicas] if cfg.direct else []
        self._direct_calls = 0
        self._refused = 0
        self._shared: dict[int, tuple[int, ChannelClient, np.ndarray, int]] = {}
        """Arrays of :meth:`shared_array`, by id: (replica, channel, the array, its address)."""

    async def shared_array(self, shape: Sequence[int], dtype: Any, *, wait_s: float = 10.0) -> np.ndarray:
        """A writable array in memory shared with one replica, for a caller's inputs.

        [Note: inputs kept in the arena] in workers/_transport/arena.py: a request whose input is
        this array goes to its replica when that one is no busier
        than the others, and the replica reads it where it lies, without the copy into
        the channel that every other array takes. Write it only while no request that
        reads it is in flight; hand it back with :meth:`free_shared_array`. Without a
        direct channel with shared memory to a replica within ``wait_s`` (plain calls,
        TCP, shared memory off, a full arena), a private array: requests then work as
        usual, with the copy.
        """
        dt = np.dtype(dtype)
        if self._links:
            i = min(range(len(self._links)), key=lambda k: sum(1 for e in self._shared.values() if e[0] == k))
            stop = time.monotonic() + wait_s
            while (client := self._links[i].client()) is None and time.monotonic() < stop:
                await asyncio.sleep(0.01)
            array = client.pin_array(tuple(shape), dt) if client is not None else None
            if array is not None:
                self._shared[id(array)] = (i, client, array, address(array))
                return array
        return np.zeros(shape, dt)

    def free_shared_array(self, array: np.ndarray) -> None:
        """Gives back an array of :meth:`shared_array` (a private one: nothing to do);
        no request that reads it may be in flight."""
        entry = self._shared_entry(array)
        if entry is not None:
            del self._shared[id(entry[2])]
            entry[1].unpin(entry[2])

    def _shared_entry(self, value: Any) -> tuple[int, ChannelClient, np.ndarray, int] | None:
        """The :meth:`shared_array` entry of ``value``: found by identity, or, for a view
        that starts where one does, by address."""
        entry = self._shared.get(id(value))
        if entry is not None and entry[2] is value:
            return entry
        if not isinstance(value, np.ndarray):
            return None
        at = address(value)
        return next((e for e in self._shared.values() if e[3] == at), None)

    def _shared_replica(self, named: Iterable[Mapping[str, Any]]) -> int | None:
        """The replica whose channel holds one of these arrays in place, if any."""
        for arrays in named:
            for value in arrays.values():
                entry = self._shared_entry(value)
                if entry is not None:
                    return entry[0]
        return None

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
        """``infer`` and where the request's time went in the worker
        (see [Note: request timing] in workers/segment.py)."""
        self._requests += 1
        if budget_ms is not None:
            # A budget must not restart with each retry: fix it as a deadline now.
            d = time.time() * 1e3 + budget_ms
            deadline_unix_ms = d if deadline_unix_ms is None else min(deadline_unix_ms, d)
        request = (inputs, deadline_unix_ms, priority)
        try:
            if self.config.caller_batch_size > 1 and any(self._in_flight):
                result = await self._batcher(key).submit(request, priority=priority)
            else:
                # Nothing in flight: there is nothing to batch with, so skip the
                # caller-side batcher's event-loop hops (see [Note: caller-side batching]).
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

    def _batcher(self, key: str) -> Batcher:
        """The caller-side batcher of ``key`` on the running event loop.

        [Note: caller-side batching]
        Requests that wait while every send slot is busy leave together in one send
        (``infer_batch_timed``'s arguments, over the direct channel or a plain call), so
        a busy pool pays the per-send cost (Python on both sides, and Ray's machinery
        for a plain call) once per batch instead of once per request. With no queue
        delay a lone request leaves at once.
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
                max_queue_size=1 << 20,
                max_concurrent_batches=cfg.num_replicas * cfg.sends_per_replica * cfg.instances,
            ))
            entry = self._batchers[key] = (loop, batcher)
        return entry[1]

    async def _send(self, key: str, requests: list[tuple]) -> list:
        """Sends requests in one call to the least-loaded replica, retrying on replica loss.

        Returns one (outputs, RequestTiming) or exception per request (the worker's
        ``infer_batch_timed``).
        """
        exclude: int | None = None
        attempts = 0
        reloaded = False
        n = len(requests)
        # A lone request takes no comprehension here and none in pick_replica: each is a
        # Python frame, and right after an engine run each frame costs about ten times its
        # warm time ([Note: lean lone path] in workers/_worker.py).
        if n == 1:
            [(inputs, deadline, priority)] = requests
            args = ([inputs], [deadline], [priority])
        else:
            args = ([r[0] for r in requests], [r[1] for r in requests], [r[2] for r in requests])
        home = self._shared_replica(r[0] for r in requests) if self._shared else None
        while True:
            start = self._next if home is None else home
            i = pick_replica(self._in_flight, self._down_until_s, time.monotonic(), start=start, exclude=exclude)
            assert i is not None  # the pool has at least one replica (PoolConfig checks)
            self._next = (i + 1) % len(self.replicas)
            self._in_flight[i] += n
            self._routed[i] += 1
            attempts += 1
            client = self._links[i].client() if self._links else None
            try:
                if client is not None:
                    try:
                        results = await client.call(key, *args)
                        self._direct_calls += n
                    except ChannelRefusedError as e:
                        # Pickle over TCP, refused: Ray carries it ([Note: no pickle over TCP]).
                        self._refused += n
                        logger.debug("request for %s goes by a plain call: %s", key, e)
                        results = await self.replicas[i].infer_batch_timed.remote(key, *args)
                else:
                    results = await self.replicas[i].infer_batch_timed.remote(key, *args)
            except (RayActorError, ChannelClosedError) as e:
                self._replica_failures += 1
                self._down_until_s[i] = time.monotonic() + self.config.down_s
                if isinstance(e, ChannelClosedError):
                    self._links[i].lost(self.config.down_s)
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
            if (not reloaded and isinstance(results[0], SegmentNotLoadedError) and key in self._segments
                    and all(isinstance(r, SegmentNotLoadedError) for r in results)):
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
            in_flight=tuple(self._in_flight), routed=tuple(self._routed), direct_calls=self._direct_calls,
            tcp_refused=self._refused,
        )

    async def worker_stats(self, *, return_exceptions: bool = False) -> list[WorkerStats | BaseException]:
        """Each replica's stats; with ``return_exceptions``, a replica that does not answer gives its
        exception in its place instead of failing the whole call."""
        calls = (r.stats.remote() for r in self.replicas)
        return list(await asyncio.gather(*calls, return_exceptions=return_exceptions))

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
        for link in self._links:
            link.close()
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

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Tears the graph down and lets the stage actors exit; one still running after
        ``timeout_s`` is killed. See [Note: channel semaphores]."""
        if self._dag is not None:
            self._dag.teardown()
            self._dag = None
        # [Note: channel semaphores]
        # Each shared-memory channel of a compiled graph holds two POSIX semaphores
        # (/dev/shm/sem.hdr<pid>-<ns> and sem.obj<pid>-<ns>). Ray (2.60) unlinks them only
        # in a process's MutableObjectManager destructor, which runs when the process
        # exits normally: not at `teardown()`, and not when `ray.kill` or `ray.shutdown`
        # ends the actor by force, so killing the stages left 8-20 files per graph behind
        # for good. `__ray_terminate__` is Ray's graceful actor exit.
        exits = [w.__ray_terminate__.remote() for w in self.workers]
        _, stuck = ray.wait(exits, num_returns=len(exits), timeout=timeout_s)
        for w, ref in zip(self.workers, exits):
            if ref in stuck:
                logger.warning("pipeline stage actor did not exit within %.0f s; killing it", timeout_s)
                ray.kill(w, no_restart=True)
