"""The gateway: the backend that `cluster.server` calls, over the registry and worker pools.

A request goes: authorise (cluster.auth) -> lease a version from the registry (canary
routing by device id) -> find the pool of model@version@cut (materialising the tail on
demand) -> decode the boundary -> the pool's dynamic batcher, with the request's
deadline -> outputs. Every error leaves as a cluster.errors class, which
cluster.protocol.status turns into a status code.

Pools sit behind one small interface (`Pool`, `PoolFactory`): `LocalPoolFactory` runs
Engines and a Batcher in this process (no Ray: unit tests, the edge-less demo,
`--ray-address local-noray`); cluster.ray_cluster builds pools of Ray actors.

[Note: preload] When a version loads, the tail of every cut in its frontier is cut
(or read from segments/) and its pool started, in the loading thread. The gateway
is ready (gRPC health SERVING, /readyz 200) only once that is done for every loaded
version; a cut outside the frontier is materialised on its first request.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from cluster.auth import Authorizer
from cluster.errors import (
    ClusterError,
    DeadlineExceeded,
    InternalError,
    NotSupported,
    ProtocolError,
    ResourceExhausted,
    Unavailable,
)
from cluster.metrics import GatewayMetrics
from cluster.protocol.encoding import decode
from cluster.protocol.messages import (
    ArtifactsRequest,
    ArtifactsResponse,
    InferRequest,
    InferResponse,
    PlanRequest,
    PlanResponse,
)
from cluster.protocol.status import status_of
from cluster.protocol.tensors import EncodedTensor, as_wire_array
from cluster.registry import LoadedVersion, ModelConfig, Registry

__all__ = ["Gateway", "Pool", "PoolFactory", "PoolKey", "PoolResult", "LocalPool", "LocalPoolFactory", "to_cluster_error"]

logger = logging.getLogger(__name__)

_PRIORITY_LEVELS = 4


@dataclass(frozen=True)
class PoolKey:
    """The workers of one tail: model@version@cut."""

    model: str
    version: str
    cut_id: str

    def __str__(self) -> str:
        return f"{self.model}@{self.version}@{self.cut_id}"


@dataclass(frozen=True)
class PoolResult:
    """One request's outputs and where its time went."""

    outputs: Mapping[str, np.ndarray]
    queue_s: float
    """Submit to the start of its batch."""
    compute_s: float
    """Its batch's run time."""
    batch_size: int


class Pool(Protocol):
    """Runs one tail for many requests (batched). Raises workers or cluster errors."""

    async def run(self, inputs: Mapping[str, np.ndarray], *, deadline_s: float | None, priority: int) -> PoolResult: ...

    async def close(self) -> None: ...


class PoolFactory(Protocol):
    """Makes pools. `create` blocks (it loads a model): the gateway calls it off the event loop."""

    def create(self, key: PoolKey, tail_path: str, config: ModelConfig, metrics: GatewayMetrics) -> Pool: ...


def _buckets(max_batch: int) -> tuple[int, ...]:
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return tuple(out) + (max_batch,)


class LocalPool:
    """An Engine and a dynamic Batcher in the gateway process."""

    def __init__(self, key: PoolKey, tail_path: str, config: ModelConfig, metrics: GatewayMetrics,
                 *, cache_dir: str | None = None, provider: str = "auto") -> None:
        from workers.batcher import Batcher, BatcherConfig
        from workers.engine import Engine, EngineConfig

        self.key = key
        self._metrics = metrics
        self.engine = Engine(
            tail_path,
            EngineConfig(intra_op_threads=config.intra_op_threads, batch_buckets=_buckets(config.max_batch_size),
                         loop_fallback=True, cache_dir=cache_dir, provider=provider),  # type: ignore[arg-type]
            name=str(key),
        )
        self.batcher = Batcher(self._run_batch, BatcherConfig(
            max_batch_size=config.max_batch_size, max_queue_delay_ms=config.max_queue_delay_ms,
            max_queue_size=config.max_queue_size, num_priority_levels=_PRIORITY_LEVELS,
            max_concurrent_batches=config.replicas))
        self.batches = 0

    def _run_batch(self, payloads: list[tuple[Mapping[str, np.ndarray], float]]) -> list[PoolResult]:
        start = time.monotonic()
        outs = self.engine.run_batch([p[0] for p in payloads])
        compute_s = time.monotonic() - start
        self.batches += 1
        self._metrics.observe_batch(len(payloads))
        return [PoolResult(o, start - submitted, compute_s, len(payloads)) for o, (_, submitted) in zip(outs, payloads)]

    async def run(self, inputs: Mapping[str, np.ndarray], *, deadline_s: float | None, priority: int) -> PoolResult:
        shape_key = tuple(sorted((k, v.shape[1:], v.dtype.str) for k, v in inputs.items()))
        return await self.batcher.submit((inputs, time.monotonic()), deadline_s=deadline_s,
                                         priority=min(max(priority, 0), _PRIORITY_LEVELS - 1), shape_key=shape_key)

    async def close(self) -> None:
        await self.batcher.close(drain=True)
        self.engine.close()


class LocalPoolFactory:
    """Pools in this process (`--ray-address local-noray`)."""

    def __init__(self, *, cache_dir: str | None = None, provider: str = "auto") -> None:
        self.cache_dir = cache_dir
        self.provider = provider

    def create(self, key: PoolKey, tail_path: str, config: ModelConfig, metrics: GatewayMetrics) -> Pool:
        return LocalPool(key, tail_path, config, metrics, cache_dir=self.cache_dir, provider=self.provider)


def to_cluster_error(e: BaseException, where: str) -> ClusterError:
    """The cluster error a worker-side failure becomes (the status table then picks its code)."""
    if isinstance(e, ClusterError):
        return e
    from workers import errors as W

    if isinstance(e, W.DeadlineExceededError):
        return DeadlineExceeded(where=f"in the queue of {where}", overdue_ms=max(0.0, (e.now_s - e.deadline_s) * 1e3))
    if isinstance(e, W.QueueFullError):
        return ResourceExhausted(resource=f"queue of {where}", limit=e.max_queue_size)
    if isinstance(e, (W.InputError, W.BatcherRequestError)):
        return ProtocolError(reason=str(e), where=where)
    if isinstance(e, W.BatcherClosedError):
        return Unavailable(reason=f"{where} is shutting down")
    if isinstance(e, (W.ReplicaUnavailableError, W.SegmentNotLoadedError)):
        logger.warning("workers of %s unavailable: %s", where, e)
        return Unavailable(reason=f"the workers of {where} are restarting")
    if isinstance(e, W.EngineLoadError):
        logger.error("could not load %s", where, exc_info=e)
        return Unavailable(reason=f"the tail {where} could not be loaded")
    logger.error("unexpected error in %s", where, exc_info=e)
    return InternalError(detail=f"the tail {where} failed")


class Gateway:
    """The inference backend: auth, routing, tails and pools, metrics.

    Call `start()` (or `registry.load_all()` from a thread) before serving; `close()` at the end.
    """

    def __init__(self, registry: Registry, pools: PoolFactory, *, authorizer: Authorizer | None = None,
                 metrics: GatewayMetrics | None = None) -> None:
        self.registry = registry
        self.pool_factory = pools
        self.auth = authorizer or Authorizer(None)
        self.metrics = metrics or GatewayMetrics()
        self._pools: dict[PoolKey, Pool] = {}
        self._pools_lock = threading.Lock()
        self._creating: dict[PoolKey, asyncio.Future[Pool]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._health: Any = None
        self._closing: set[asyncio.Task[Any]] = set()
        self.backend_calls = 0
        """Requests that got past auth and routing to a pool (tests count them)."""
        registry.on_loaded.append(self._preload)
        registry.on_drained.append(self._on_drained)

    # -- lifecycle ----------------------------------------------------------------------

    def bind_health(self, health: Any) -> None:
        self._health = health
        self._loop = asyncio.get_running_loop()
        self._push_health()

    def _push_health(self) -> None:
        if self._health is None or self._loop is None:
            return
        ready, _ = self.readiness()
        coro = self._health.set_ready(ready)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._keep(self._loop.create_task(coro))
        else:
            asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def start(self) -> None:
        """Loads every model's versions per policy and preloads their frontier tails."""
        self._loop = asyncio.get_running_loop()
        await self._loop.run_in_executor(None, self.registry.load_all)
        self._push_health()

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """(ready, detail): ready when a version is loaded and all its frontier tails have pools."""
        loaded = self.registry.loaded()
        with self._pools_lock:
            missing = [f"{lv.key}@{c}" for lv in loaded for c in lv.frontier.cut_ids
                       if PoolKey(lv.model, lv.version, c) not in self._pools]
            n = len(self._pools)
        return bool(loaded) and not missing, {"versions": [lv.key for lv in loaded], "pools": n,
                                              "missing": missing[:20]}

    def _preload(self, lv: LoadedVersion) -> None:
        t0 = time.monotonic()
        for cut in lv.frontier.cut_ids:
            self._create_pool(lv, cut)
        logger.info("%s: preloaded %d frontier tails in %.1f s", lv.key, len(lv.frontier.cuts), time.monotonic() - t0)

    def _create_pool(self, lv: LoadedVersion, cut_id: str) -> Pool:
        key = PoolKey(lv.model, lv.version, cut_id)
        with self._pools_lock:
            pool = self._pools.get(key)
        if pool is not None:
            return pool
        path = lv.files.tail_path(cut_id, known=lv.frontier.cut_ids)
        try:
            pool = self.pool_factory.create(key, path, lv.config, self.metrics)
        except Exception as e:  # noqa: BLE001 - becomes Unavailable/Internal with the details logged
            raise to_cluster_error(e, str(key)) from e
        with self._pools_lock:
            self._pools[key] = pool
        return pool

    async def _pool(self, lv: LoadedVersion, cut_id: str) -> Pool:
        key = PoolKey(lv.model, lv.version, cut_id)
        with self._pools_lock:
            pool = self._pools.get(key)
        if pool is not None:
            return pool
        fut = self._creating.get(key)
        if fut is None:
            # One creation per key however many requests wait on it.
            loop = asyncio.get_running_loop()
            fut = loop.run_in_executor(None, self._create_pool, lv, cut_id)
            self._creating[key] = fut
            fut.add_done_callback(lambda _: self._creating.pop(key, None))
        return await asyncio.shield(fut)

    def _on_drained(self, lv: LoadedVersion) -> None:
        with self._pools_lock:
            gone = [k for k in self._pools if k.model == lv.model and k.version == lv.version]
            pools = [self._pools.pop(k) for k in gone]
        logger.info("%s drained: closing %d pools", lv.key, len(pools))
        loop = self._loop
        for p in pools:
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self._close_later, p)
        self._push_health()

    def _close_later(self, pool: Pool) -> None:
        self._keep(asyncio.get_running_loop().create_task(pool.close()))

    def _keep(self, task: asyncio.Task[Any]) -> None:
        # The loop keeps only weak references to tasks: hold each one until it ends.
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def load_version(self, model: str, version: str) -> LoadedVersion:
        """Loads a version and preloads its frontier tails (off the event loop)."""
        lv = await asyncio.get_running_loop().run_in_executor(None, self.registry.load, model, version)
        self._push_health()
        return lv

    async def close(self) -> None:
        with self._pools_lock:
            pools = list(self._pools.values())
            self._pools.clear()
        await asyncio.gather(*(p.close() for p in pools), *self._closing, return_exceptions=True)

    # -- methods ------------------------------------------------------------------------

    async def infer(self, request: InferRequest, context: Any) -> InferResponse:
        entered = time.monotonic()
        m = self.metrics
        m.inflight.inc()
        version, status = request.version, "OK"
        extra = {"request_id": request.request_id, "model": request.model, "cut_id": request.cut_id}
        try:
            principal = self.auth.authorize(context.metadata, model=request.model, device_id=request.device_id)
            with self.registry.lease(request.model, request.version, request.device_id) as lv:
                version = lv.version
                nbytes = request.tensor_bytes()
                if nbytes > lv.config.max_request_bytes:
                    raise ResourceExhausted(resource=f"request size of {lv.key}", limit=lv.config.max_request_bytes)
                m.add_bytes("in", nbytes)
                pool = await self._pool(lv, request.cut_id)
                t = time.monotonic()
                inputs = {k: decode(v) if isinstance(v, EncodedTensor) else v for k, v in request.tensors.items()}
                decode_s = (entered - context.received_monotonic_s) + (time.monotonic() - t)
                self.backend_calls += 1
                try:
                    result = await pool.run(inputs, deadline_s=context.deadline_monotonic_s, priority=request.priority)
                except ClusterError:
                    raise
                except Exception as e:  # noqa: BLE001 - worker errors become cluster errors here
                    raise to_cluster_error(e, f"{lv.key}@{request.cut_id}") from e
                t = time.monotonic()
                outputs = {k: as_wire_array(np.asarray(v), k) for k, v in result.outputs.items()}
                encode_s = time.monotonic() - t
            m.add_bytes("out", sum(v.nbytes for v in outputs.values()))
            for stage, s in (("decode", decode_s), ("queue", result.queue_s), ("compute", result.compute_s),
                             ("encode", encode_s)):
                m.observe_stage(stage, s)
            logger.debug("served %s for %s on %s (batch %d)", request.request_id, principal.name, lv.key,
                         result.batch_size, extra=dict(extra, version=version, principal=principal.name))
            return InferResponse(
                request_id=request.request_id,
                outputs=outputs,
                timings_ms={"queue": result.queue_s * 1e3, "compute": result.compute_s * 1e3,
                            "decode_tensors": decode_s * 1e3, "batch_size": float(result.batch_size)},
                served_by=lv.key,
            )
        except asyncio.CancelledError:
            left = context.remaining_s()
            status = "DEADLINE_EXCEEDED" if left is not None and left <= 0 else "CANCELLED"
            raise
        except ClusterError as e:
            status = status_of(e).name
            logger.info("request %s failed: %s", request.request_id, status, extra=dict(extra, status=status))
            raise
        finally:
            m.inflight.dec()
            m.observe_request(request.model, version, status)

    async def get_artifacts(self, request: ArtifactsRequest, context: Any) -> ArtifactsResponse:
        """The model, model.yaml, profiles and frontier of model@version (routed when version is '')."""
        principal = self.auth.authorize(context.metadata, model=request.model, device_id=request.device_id,
                                        action="fetch artifacts of")
        with self.registry.lease(request.model, request.version, request.device_id) as lv:
            files = await asyncio.get_running_loop().run_in_executor(None, lv.files.artifact_files)
        logger.info("artifacts of %s (%d files) sent to %s/%s", lv.key, len(files), principal.name,
                    request.device_id or "-")
        return ArtifactsResponse(model=lv.model, version=lv.version, files=files)

    async def plan(self, request: PlanRequest, context: Any) -> PlanResponse:
        self.auth.authorize(context.metadata, model=None, action="plan")
        raise NotSupported(what="Plan on the gateway (fetch the frontier with GetArtifacts, or ask "
                                "'splitinfer planner serve')")
