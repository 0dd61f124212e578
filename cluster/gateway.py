"""The gateway: the backend that `cluster.server` calls, over the registry and worker pools.

A request goes: authorise (cluster.auth) -> lease a version from the registry (canary
routing by device id) -> find the pool of model@version@cut (materialising the tail on
demand) -> decode the boundary -> the pool's dynamic batcher, with the request's
deadline -> outputs. Every error leaves as a cluster.errors class, which
cluster.protocol.status turns into a status code.

Pools sit behind one small interface (`Pool`, `PoolFactory`, in cluster/_pools.py with
the in-process `LocalPool`); cluster.ray_cluster builds pools of Ray actors.

[Note: preload] When a version loads, the tail of every cut in its frontier is cut
(or read from segments/) and its pool started, in the loading thread. The gateway
is ready (gRPC health SERVING, /readyz 200) only once that is done for every version
the registry found at start; until then /readyz names each model or version that is not
ready and why ('loading', 'failed: <error>', 'no versions: ...'). A cut outside the
frontier is materialised on its first request.

[Note: tail load time] The requests that wait for a tail to be cut and its pool started
carry that wait as `timings_ms['load']`, a server time (`cluster.protocol.client.
SERVER_TIME_KEYS`): seconds on Ray, which a client would otherwise read as a slow link
(the edge agent's link monitor subtracts server time from a round trip) or a slow path.

[Note: policy sync] With `registry.policy_dir` set (the registry ConfigMap mounted
read-only; `splitinfer cluster rollout/rollback` patch it), the gateway polls that
directory every `policy_poll_s` and hands each `<model>.policy.yaml` whose content hash
changed to `Registry.apply_policy`, off the event loop. Polling, not inotify: the
kubelet updates a mounted ConfigMap by swapping a symlink, which inotify on the key
files does not see. A file that fails validation is logged with its reason and
ignored until its content changes again; the model keeps its last good policy and
readiness is unchanged (a version that a policy adds joins routing only once its
tails are loaded). A removed file puts the model back on its volume policy.

[Note: admission] A request that cannot be answered before its deadline is refused at
once with RESOURCE_EXHAUSTED and `retry_after_ms`, never queued to time out: the pool's
batcher predicts its wait and its batch's run time from the batches it has timed
([Note: deadline-aware batching] in workers/_batch_policy.py) and refuses it on arrival, or
when its batch forms if the queue ran slower than predicted. Every refusal and expiry
is counted by reason (`splitinfer_refusals_total`, cluster.metrics.REFUSAL_REASONS),
the time a failed request spent in the pool is observed as its queue stage, each
response's `timings_ms['utilisation']`, arrivals over capacity, and
`timings_ms['expected_wait']`, the mean wait at that rate ([Note: expected wait] in
workers/_batch_policy.py; a Ray pool estimates both from its answers, cluster._pools.AnswerLoad;
keys an older agent ignores), and, where the pool runs its batcher here,
`timings_ms['predicted_wait']`, the wait of a request arriving now; the same of a request of
priority 1, which the batcher serves first (`urgent_expected_wait`, `urgent_predicted_wait`:
[Note: priority under overload] in edge_agent/hedge.py); and
`/readyz?load=1` shows every pool's load and reports the gateway overloaded for
`overload_window_s` after a refusal for load.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from cluster._load_failures import NoTailLoaded, failed_tail, is_transient, load_failure_reason, one_line, service_health
from cluster._plan import GatewayPlanner, read_query
from cluster._pools import (
    DEFAULT_POOL_START_TIMEOUT_S,
    LocalPool,
    LocalPoolFactory,
    Pool,
    PoolFactory,
    PoolKey,
    PoolResult,
)
from cluster.auth import Authorizer
from cluster.errors import (
    ClusterError,
    DeadlineExceeded,
    FailedPrecondition,
    InternalError,
    ProtocolError,
    ResourceExhausted,
    Unavailable,
    UnknownCutError,
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
from cluster.registry import LoadedVersion, Registry, read_policy_dir

__all__ = ["DEFAULT_POOL_START_TIMEOUT_S", "Gateway", "Pool", "PoolFactory", "PoolKey", "PoolResult", "LocalPool", "LocalPoolFactory",
           "load_failure_reason", "refusal_reason", "to_cluster_error"]

logger = logging.getLogger(__name__)

_RETRY_AFTER_NO_ESTIMATE_MS = 100.0
"""The retry-after of a full queue whose batcher has timed no batch yet: a short back-off."""

_LOAD_REASONS = frozenset({"queue_full", "predicted_wait", "deadline_unreachable"})
"""Refusals that mean the pool is overloaded (not a bad or late request)."""


def refusal_reason(e: BaseException) -> str | None:
    """The REFUSAL_REASONS entry of a worker-side refusal or expiry; None for other errors."""
    from workers import errors as W

    if isinstance(e, W.OverloadedError):
        return e.reason
    if isinstance(e, W.QueueFullError):
        return "queue_full"
    if isinstance(e, W.DeadlineExceededError):
        return "expired_in_queue"
    return None


def to_cluster_error(e: BaseException, where: str) -> ClusterError:
    """The cluster error a worker-side failure becomes (the status table then picks its code)."""
    if isinstance(e, ClusterError):
        return e
    from workers import errors as W

    if isinstance(e, W.DeadlineExceededError):
        return DeadlineExceeded(where=f"in the queue of {where}", overdue_ms=max(0.0, (e.now_s - e.deadline_s) * 1e3))
    if isinstance(e, W.OverloadedError):
        # [Note: admission]
        what = "the queue ahead" if e.reason == "predicted_wait" else "its batch"
        return ResourceExhausted(resource=f"capacity of {where} ({what} ends after the deadline)",
                                 retry_after_ms=round(e.retry_after_s * 1e3, 1))
    if isinstance(e, W.QueueFullError):
        after_s = getattr(e, "retry_after_s", None)
        return ResourceExhausted(resource=f"queue of {where}", limit=e.max_queue_size,
                                 retry_after_ms=_RETRY_AFTER_NO_ESTIMATE_MS if after_s is None
                                 else round(after_s * 1e3, 1))
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
                 metrics: GatewayMetrics | None = None, policy_poll_s: float = 5.0,
                 overload_window_s: float = 5.0) -> None:
        if not policy_poll_s > 0:
            raise ValueError(f"policy_poll_s {policy_poll_s} must be > 0; a few seconds suits a mounted ConfigMap")
        if not overload_window_s > 0:
            raise ValueError(f"overload_window_s {overload_window_s} must be > 0; a few seconds "
                             "keeps /readyz?load=1 from flapping")
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
        self.policy_poll_s = policy_poll_s
        self.policy_polls = 0
        """Completed polls of `registry.policy_dir` (tests wait on it)."""
        self._policy_seen: dict[str, str] = {}
        self._policy_status: dict[str, dict[str, Any]] = {}
        self._policy_task: asyncio.Task[None] | None = None
        self._planner: GatewayPlanner | None = None
        self._closed = False
        self.overload_window_s = overload_window_s
        self._in_pool: dict[PoolKey, int] = {}
        """Requests inside pool.run now, per pool without a load() of its own (Ray pools)."""
        self._overloaded_at: dict[str, float] = {}
        """'model@version@cut' -> when it last refused a request for load (time.monotonic())."""
        self._failed_tails: dict[PoolKey, str] = {}
        """Tails whose pool could not start -> why ([Note: failed tails])."""
        registry.on_failed.append(self._count_failed_version)
        self.metrics.set_load_source(self._load_samples)
        self.metrics.load_view = self.load
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
        ready, detail = self.readiness()
        coro = self._health.set_ready(ready, services=service_health(detail))
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._keep(self._loop.create_task(coro))
        else:
            asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def start(self, *, keep_going: bool = False) -> None:
        """Loads every model's versions per policy and preloads their frontier tails.

        The first model that fails to load is raised; with `keep_going` (the gateway
        process) it does not stop the others: `readiness()` names it with its error, and
        the gateway stays NOT_SERVING (see [Note: not ready] in cluster/registry.py)."""
        self._loop = asyncio.get_running_loop()
        await self._loop.run_in_executor(None, functools.partial(self.registry.load_all, keep_going=keep_going))
        if self.registry.policy_dir is not None:
            # The first pass re-applies what load_all read (a no-op) and catches any change since.
            await self.sync_policies()
            self._policy_task = self._loop.create_task(self._watch_policies())
        self._push_health()

    # -- policy sync (see [Note: policy sync]) -------------------------------------------

    async def sync_policies(self) -> list[str]:
        """One poll of `registry.policy_dir`: applies every changed policy; returns those models."""
        policy_dir = self.registry.policy_dir
        if policy_dir is None:
            return []
        loop = asyncio.get_running_loop()
        try:
            files = await loop.run_in_executor(None, read_policy_dir, policy_dir)
        except OSError as e:
            logger.warning("cannot read the policy directory %s (%s); keeping the current policies", policy_dir, e)
            return []
        hashes = {m: hashlib.sha256(data).hexdigest() for m, data in files.items()}
        changed = sorted(m for m in set(hashes) | set(self._policy_seen) if hashes.get(m) != self._policy_seen.get(m))
        for model in changed:
            data = files.get(model)
            path = f"{policy_dir}/{model}.policy.yaml" if data is not None else ""
            status: dict[str, Any] = {"sha256": hashes.get(model), "error": None}
            try:
                status["applied"] = await loop.run_in_executor(None, self._apply_policy, model, data, path)
            except ClusterError as e:
                status["error"] = str(e)
                logger.error("ignoring the new policy of %s, keeping the last good one: %s", model, e)
            except Exception as e:  # noqa: BLE001 - a failed version load must not stop the watch
                status["error"] = f"{type(e).__name__}: {e}"
                logger.exception("could not apply the new policy of %s; keeping the last good one", model)
            # Replaced, never mutated: readiness() reads it from the metrics server's thread.
            statuses = {m: s for m, s in self._policy_status.items() if m != model}
            if model in hashes:
                self._policy_seen[model] = hashes[model]
                statuses[model] = status
            else:
                self._policy_seen.pop(model, None)
            self._policy_status = statuses
        if changed:
            self._push_health()
        self.policy_polls += 1
        return changed

    def _apply_policy(self, model: str, data: bytes | None, path: str) -> dict[str, Any]:
        if data is None and model not in self.registry.available():
            return {}
        return self.registry.apply_policy(model, data, path=path)

    async def _watch_policies(self) -> None:
        while True:
            await asyncio.sleep(self.policy_poll_s)
            try:
                await self.sync_policies()
            except Exception:  # noqa: BLE001 - the watch outlives any one bad poll
                logger.exception("policy poll of %s failed", self.registry.policy_dir)

    def policy_status(self) -> dict[str, dict[str, Any]]:
        """model -> {sha256, error, applied} of the last content seen in the policy directory."""
        return {m: dict(s) for m, s in self._policy_status.items()}

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """(ready, detail): ready once every model and version the registry found has been
        tried (none is queued or loading) and at least one serves with all its frontier
        tails that could start (see [Note: not ready] in cluster/registry.py). A model,
        version or tail that failed does not hold readiness back: the others serve, and
        it is listed with its cause ([Note: failed tails]).

        detail: versions loaded, pools, missing (tails without a pool yet), not_ready
        ({'model@version' or 'model': why}), failed (every version, model and
        'model@version@cut' tail not served, with why) and, when not ready, reason (one line)."""
        loaded = self.registry.loaded()
        not_ready = self.registry.not_ready()
        failed_tails = self.failed_tails()
        with self._pools_lock:
            missing = [f"{lv.key}@{c}" for lv in loaded for c in lv.frontier.cut_ids
                       if PoolKey(lv.model, lv.version, c) not in self._pools
                       and f"{lv.key}@{c}" not in failed_tails]
            n = len(self._pools)
        waiting = {k: why for k, why in not_ready.items() if why in ("queued", "loading")}
        failed = {k: why for k, why in not_ready.items() if k not in waiting} | failed_tails
        detail: dict[str, Any] = {"versions": [lv.key for lv in loaded], "pools": n, "missing": missing[:20],
                                  "not_ready": not_ready, "failed": failed}
        if self.registry.policy_dir is not None:
            # Shown, not counted: a bad policy file leaves the last good policy serving.
            detail["policy_errors"] = {m: s["error"] for m, s in self._policy_status.items() if s["error"]}
        ready = bool(loaded) and not missing and not waiting
        if not ready:
            detail["reason"] = self._why_not_ready(bool(loaded), missing, not_ready if waiting or not loaded else {})
        return ready, detail

    def _why_not_ready(self, any_loaded: bool, missing: list[str], not_ready: Mapping[str, str]) -> str:
        if not self.registry.scanned and not any_loaded:
            return "starting: the registry is not read yet"
        if not_ready:
            shown = "; ".join(f"{k}: {v}" for k, v in list(not_ready.items())[:5])
            return shown + (f" (and {len(not_ready) - 5} more)" if len(not_ready) > 5 else "")
        if missing:
            return f"{len(missing)} frontier tails have no pool yet: {', '.join(missing[:3])}"
        return (f"no model in the registry {self.registry.root}: it holds no <name>/<version>/model.onnx; "
                f"add one with 'splitinfer registry add MODEL {self.registry.root}' and restart")

    def _count_failed_version(self, model: str, version: str, e: BaseException) -> None:
        if not isinstance(e, NoTailLoaded):  # its tails were counted as they failed
            self.metrics.observe_load_failure(model, version, load_failure_reason(e))

    def _preload(self, lv: LoadedVersion) -> None:
        """[Note: failed tails] A frontier tail whose pool cannot start (a cut that cannot be
        made, a tail that ONNX Runtime refuses, a warm-up that fails) is recorded with its
        cause and counted, and the version's other tails load and serve: /readyz, the health
        service and GetArtifacts (failed_tails.json) name it, and its requests get
        FAILED_PRECONDITION with the cause. Only a version none of whose tails starts fails
        as a whole (the registry then records it as failed)."""
        t0 = time.monotonic()
        failed: list[str] = []
        for cut in lv.frontier.cut_ids:
            if self._closed:  # shutting down while loading: the pools made so far are closed by close()
                raise Unavailable(reason=f"the gateway is shutting down; {lv.key} was not loaded")
            try:
                self._create_pool(lv, cut)
            except FailedPrecondition as e:
                failed.append(f"{cut}: {e.reason}")
        if failed and len(failed) == len(lv.frontier.cut_ids):
            for cut in lv.frontier.cut_ids:  # listed once, as the failed version (counted by tail already)
                self._failed_tails.pop(PoolKey(lv.model, lv.version, cut), None)
            raise NoTailLoaded(reason=f"no tail of {lv.key} could be loaded: {'; '.join(failed[:3])}",
                                fix="check the model with 'splitinfer split --verify'")
        logger.info("%s: preloaded %d frontier tails in %.1f s%s", lv.key, len(lv.frontier.cuts) - len(failed),
                    time.monotonic() - t0, f"; {len(failed)} failed: {'; '.join(failed)}" if failed else "")

    @staticmethod
    def _pool_samples(lv: LoadedVersion, cut_id: str) -> dict[str, Any]:
        """`sample_inputs=` for the pool factory, where the version has sample inputs."""
        samples = lv.files.tail_samples(cut_id, known=lv.frontier.cut_ids)
        return {} if samples is None else {"sample_inputs": samples}

    def failed_tails(self, model: str | None = None, version: str | None = None) -> dict[str, str]:
        """'model@version@cut' -> why its pool could not start ([Note: failed tails])."""
        return {str(k): why for k, why in list(self._failed_tails.items())
                if (model is None or k.model == model) and (version is None or k.version == version)}

    def _started_pool(self, key: PoolKey) -> Pool | None:
        """The pool of `key` if it started, None if it has not yet; FailedPrecondition if it failed to."""
        with self._pools_lock:
            pool = self._pools.get(key)
        if pool is not None:
            return pool
        why = self._failed_tails.get(key)
        if why is not None:
            raise failed_tail(key, why)
        return None

    def _create_pool(self, lv: LoadedVersion, cut_id: str) -> Pool:
        key = PoolKey(lv.model, lv.version, cut_id)
        pool = self._started_pool(key)
        if pool is not None:
            return pool
        cutting = True
        try:
            path = lv.files.tail_path(cut_id, known=lv.frontier.cut_ids)
            cutting = False
            pool = self.pool_factory.create(key, path, lv.config, self.metrics, **self._pool_samples(lv, cut_id))
        except Exception as e:  # noqa: BLE001 - recorded, or becomes Unavailable/Internal with the details logged
            if isinstance(e, UnknownCutError) or is_transient(e) or self._closed:
                raise to_cluster_error(e, str(key)) from e
            why = one_line(e)
            self._failed_tails[key] = why
            self.metrics.observe_load_failure(lv.model, lv.version, load_failure_reason(e, cutting=cutting))
            logger.error("the tail %s failed to load; the other tails keep serving: %s", key, why,
                         exc_info=not isinstance(e, ClusterError))
            self._push_health()
            raise failed_tail(key, why) from e
        with self._pools_lock:
            if not self._closed:
                self._pools[key] = pool
                return pool
        # close() ran while this pool started: nobody else will close it.
        if self._loop is not None and self._loop.is_running():
            asyncio.run_coroutine_threadsafe(pool.close(), self._loop)
        raise Unavailable(reason=f"the gateway is shutting down; {key} was not started")

    async def _pool(self, lv: LoadedVersion, cut_id: str) -> Pool:
        key = PoolKey(lv.model, lv.version, cut_id)
        pool = self._started_pool(key)
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
        """Stops loading (a version being loaded finishes its current tail) and closes every pool."""
        self._closed = True
        self.registry.stop_loading()
        if self._policy_task is not None:
            self._policy_task.cancel()
            await asyncio.gather(self._policy_task, return_exceptions=True)
            self._policy_task = None
        with self._pools_lock:
            pools = list(self._pools.values())
            self._pools.clear()
        await asyncio.gather(*(p.close() for p in pools), *self._closing, return_exceptions=True)

    # -- load (see [Note: admission]) --------------------------------------------------

    def _load_samples(self) -> list[Any]:
        with self._pools_lock:
            pools = list(self._pools.items())
        out = []
        for key, pool in pools:
            load = getattr(pool, "load", None)
            labels = (key.model, key.version, key.cut_id)
            if load is not None:
                out.append((labels, *load()))
            else:
                # Its batchers live in the workers: what the gateway sees is the requests
                # inside the pool, waiting or running, and no prediction.
                out.append((labels, self._in_pool.get(key, 0), None, None, 0, None))
        return out

    def load(self, now_s: float | None = None) -> dict[str, Any]:
        """{'overloaded': bool, 'pools': {'model@version@cut': {queue_depth, predicted_wait_ms,
        capacity_rps, arrival_rps, headroom_rps, discarded, overloaded}}}: what `/readyz?load=1`
        shows. Headroom is capacity less arrivals (negative: overloaded). A pool is
        overloaded for `overload_window_s` after it refused a request for load."""
        now_s = time.monotonic() if now_s is None else now_s
        pools = {}
        for (model, version, cut), depth, wait_s, capacity, discarded, arrival_rps in self._load_samples():
            name = f"{model}@{version}@{cut}"
            at = self._overloaded_at.get(name)
            pools[name] = {"queue_depth": depth, "discarded": discarded,
                           "predicted_wait_ms": None if wait_s is None else round(wait_s * 1e3, 3),
                           "capacity_rps": None if capacity is None else round(capacity, 3),
                           "arrival_rps": None if arrival_rps is None else round(arrival_rps, 3),
                           "headroom_rps": None if capacity is None or arrival_rps is None
                           else round(capacity - arrival_rps, 3),
                           "overloaded": at is not None and now_s - at < self.overload_window_s}
        return {"overloaded": any(p["overloaded"] for p in pools.values()), "pools": pools}

    def observe_refusal(self, model: str, status: str, reason: str) -> None:
        """Counts a request the server refused before calling `infer` (cluster.server)."""
        self.metrics.observe_request(model or "-", "", status)
        self.metrics.observe_refusal(model, reason)

    # -- methods ------------------------------------------------------------------------

    async def infer(self, request: InferRequest, context: Any) -> InferResponse:
        entered = time.monotonic()
        m = self.metrics
        m.inflight.inc()
        version, status = request.version, "OK"
        submitted_s: float | None = None
        try:
            principal = self.auth.authorize(context.metadata, model=request.model, device_id=request.device_id)
            with self.registry.lease(request.model, request.version, request.device_id) as lv:
                version = lv.version
                nbytes = request.tensor_bytes()
                if nbytes > lv.config.max_request_bytes:
                    m.observe_refusal(request.model, "request_too_large")
                    raise ResourceExhausted(resource=f"request size of {lv.key}", limit=lv.config.max_request_bytes)
                m.add_bytes("in", nbytes)
                pool = self._started_pool(PoolKey(lv.model, lv.version, request.cut_id))
                load_s = 0.0
                if pool is None:  # [Note: tail load time]
                    t = time.monotonic()
                    pool = await self._pool(lv, request.cut_id)
                    load_s = time.monotonic() - t
                t = time.monotonic()
                inputs = {k: decode(v) if isinstance(v, EncodedTensor) else v for k, v in request.tensors.items()}
                decode_s = (entered - context.received_monotonic_s) + (time.monotonic() - t)
                self.backend_calls += 1
                submitted_s = time.monotonic()
                counted = None if hasattr(pool, "load") else PoolKey(lv.model, lv.version, request.cut_id)
                if counted is not None:
                    self._in_pool[counted] = self._in_pool.get(counted, 0) + 1
                try:
                    result = await pool.run(inputs, deadline_s=context.deadline_monotonic_s,
                                            priority=principal.priority(request.priority))  # [Note: priority claims]
                except ClusterError:
                    raise
                except Exception as e:  # noqa: BLE001 - worker errors become cluster errors here
                    self._refused(e, request.model, f"{lv.key}@{request.cut_id}", submitted_s)
                    raise to_cluster_error(e, f"{lv.key}@{request.cut_id}") from e
                finally:
                    if counted is not None:
                        self._in_pool[counted] -= 1
                submitted_s = None
                t = time.monotonic()
                outputs = {k: as_wire_array(np.asarray(v), k) for k, v in result.outputs.items()}
                encode_s = time.monotonic() - t
            m.add_bytes("out", sum(v.nbytes for v in outputs.values()))
            for stage, s in (("decode", decode_s), ("queue", result.queue_s), ("compute", result.compute_s),
                             ("encode", encode_s)):
                m.observe_stage(stage, s)
            if logger.isEnabledFor(logging.DEBUG):  # the extra fields cost a dict per request
                logger.debug("served %s for %s on %s (batch %d)", request.request_id, principal.name, lv.key,
                             result.batch_size, extra={"request_id": request.request_id, "model": request.model,
                                                       "cut_id": request.cut_id, "version": version,
                                                       "principal": principal.name})
            timings_ms = {"queue": result.queue_s * 1e3, "compute": result.compute_s * 1e3,
                          "decode_tensors": decode_s * 1e3, "batch_size": float(result.batch_size)}
            if load_s:
                timings_ms["load"] = load_s * 1e3
            keys = getattr(pool, "load_keys", None)
            if keys is not None:  # cluster._pools.load_keys
                timings_ms.update(keys())
            return InferResponse(request_id=request.request_id, outputs=outputs, timings_ms=timings_ms,
                                 served_by=lv.key)
        except asyncio.CancelledError:
            left = context.remaining_s()
            status = "DEADLINE_EXCEEDED" if left is not None and left <= 0 else "CANCELLED"
            if status == "DEADLINE_EXCEEDED":
                m.observe_refusal(request.model, "expired_in_pool")
            if submitted_s is not None:
                m.observe_stage("queue", time.monotonic() - submitted_s)
            raise
        except ClusterError as e:
            status = status_of(e).name
            logger.info("request %s failed: %s", request.request_id, status,
                        extra={"request_id": request.request_id, "model": request.model, "cut_id": request.cut_id,
                               "status": status})
            raise
        finally:
            m.inflight.dec()
            m.observe_request(request.model, version, status)

    def _refused(self, e: BaseException, model: str, where: str, submitted_s: float) -> None:
        """Counts a pool's refusal or expiry by reason and observes its time in the pool as queue."""
        self.metrics.observe_stage("queue", time.monotonic() - submitted_s)
        reason = refusal_reason(e)
        if reason is None:
            return
        self.metrics.observe_refusal(model, reason)
        if reason in _LOAD_REASONS:
            self._overloaded_at[where] = time.monotonic()

    async def get_artifacts(self, request: ArtifactsRequest, context: Any) -> ArtifactsResponse:
        """The model, model.yaml, profiles and frontier of model@version (routed when version is '')."""
        principal = self.auth.authorize(context.metadata, model=request.model, device_id=request.device_id,
                                        action="fetch artifacts of")
        with self.registry.lease(request.model, request.version, request.device_id) as lv:
            files = await asyncio.get_running_loop().run_in_executor(None, lv.files.artifact_files)
            failed = {k.rsplit("@", 1)[1]: why for k, why in self.failed_tails(lv.model, lv.version).items()}
            if failed:
                # [Note: failed tails]: the agent learns which preloaded cuts this gateway cannot serve.
                files["failed_tails.json"] = json.dumps(failed, sort_keys=True, indent=1).encode()
        logger.info("artifacts of %s (%d files) sent to %s/%s", lv.key, len(files), principal.name,
                    request.device_id or "-")
        return ArtifactsResponse(model=lv.model, version=lv.version, files=files)

    async def plan(self, request: PlanRequest, context: Any) -> PlanResponse:
        """The planner's plan and frontier for a device and link against the cloud profile of
        model@version in the registry (see [Note: gateway plan] in cluster._plan)."""
        try:
            query = read_query(request.query)
        except ClusterError:
            # An unauthenticated caller learns nothing about its query: auth answers first.
            self.auth.authorize(context.metadata, model=None, action="plan")
            raise
        principal = self.auth.authorize(context.metadata, model=query.model, device_id=query.device_id,
                                        action="plan")
        if self._planner is None:
            self._planner = GatewayPlanner()
        with self.registry.lease(query.model, query.version, query.device_id) as lv:
            answer = await asyncio.get_running_loop().run_in_executor(None, self._planner.plan, lv, query)
        logger.info("plan for %s sent to %s/%s", lv.key, principal.name, query.device_id or "-",
                    extra={"request_id": request.request_id, "model": lv.model, "version": lv.version})
        return PlanResponse(request_id=request.request_id, plan=answer)
