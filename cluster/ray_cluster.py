"""Ray for the gateway: connecting to (or starting) a cluster, and pools of Ray actors.

The only module of `cluster` that imports Ray (the `ray` door of docs/architecture.md). The actors
themselves are `workers.actors` (SegmentWorker, ReplicaPool); this module adapts one
ReplicaPool per tail to the gateway's `Pool` interface.

    connect("auto")                       # the Ray cluster this pod belongs to
    gateway = Gateway(registry, RayPoolFactory())
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

try:
    import ray
except ImportError as e:  # pragma: no cover - the base (edge) install has no Ray
    raise ImportError(
        "the Ray pools need Ray: pip install 'splitinfer[cloud]', or run the gateway with "
        "--ray-address local-noray to serve tails in-process"
    ) from e

from cluster._pools import (
    DEFAULT_POOL_START_TIMEOUT_S,
    PRIORITY_LEVELS,
    AnswerLoad,
    PoolKey,
    PoolResult,
    WorkerCount,
    bucket_sizes,
    load_keys,
)
from cluster.errors import Unavailable
from cluster.metrics import GatewayMetrics
from cluster.registry import ModelConfig

if TYPE_CHECKING:
    from workers.actors import PoolConfig

__all__ = ["connect", "shutdown", "RayPool", "RayPoolFactory", "pool_config"]

logger = logging.getLogger(__name__)

DISCARDS_EVERY_S = 5.0
"""How often a Ray pool reads its workers' discarded results (`RayPool.read_discards`)."""


def connect(address: str, *, num_cpus: int | None = None, quiet: bool = False) -> dict[str, Any]:
    """Joins the Ray cluster at `address` ('auto', 'ray://host:10001', 'host:6379'), or starts
    a local one for 'local'. Returns the cluster's resources. Raises Unavailable when it cannot.

    ``quiet`` (the demo's console) keeps the workers' stdout and stderr in Ray's log files
    (/tmp/ray/session_latest/logs) instead of forwarding them to this process, and Ray's
    own Python logger logs at ERROR. The C++ core worker inside this process writes its
    error lines (``E ... core_worker.cc``, e.g. ray-project/ray#53727's line for every
    actor made with ``max_restarts`` and its arguments in the object store) straight to
    this process's stderr; quiet sets its level to FATAL (``RAY_BACKEND_LOG_LEVEL``,
    unless already set) and drops the one line that setting prints at start."""
    if ray.is_initialized():
        return dict(ray.cluster_resources())
    kwargs: dict[str, Any] = {"ignore_reinit_error": True, "include_dashboard": False,
                              "logging_level": logging.ERROR if quiet else logging.WARNING}
    if quiet:
        kwargs["log_to_driver"] = False
        os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
    if address == "local":
        kwargs["num_cpus"] = num_cpus
    else:
        kwargs["address"] = address
    try:
        try:
            with _stderr_without(_RAY_LOG_LEVEL_LINE if quiet else None):
                ray.init(**kwargs)
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception when its raylet never starts
            if address != "local" or "timed out during startup" not in str(e):
                raise
            # Seen on a loaded 2-core machine: the local raylet never registered; a second
            # start is a fresh session.
            logger.warning("local Ray did not start (%s); trying once more", e)
            ray.shutdown()
            ray.init(**kwargs)
    except Exception as e:  # noqa: BLE001 - every way of not reaching Ray becomes Unavailable
        raise Unavailable(reason=f"cannot reach the Ray cluster at {address!r} ({e}); check --ray-address, "
                                 "or use --ray-address local-noray to run without Ray") from e
    res = dict(ray.cluster_resources())
    logger.info("connected to Ray at %s: %s", address, {k: v for k, v in res.items() if k in ("CPU", "GPU")})
    return res


# What the C++ logger prints when RAY_BACKEND_LOG_LEVEL is set, whatever the level.
_RAY_LOG_LEVEL_LINE = re.compile(rb"^\[[^\]]*\] logging\.cc:\d+: Set ray log level from environment variable")


@contextlib.contextmanager
def _stderr_without(pattern: re.Pattern[bytes] | None) -> Iterator[None]:
    """Runs the block with file descriptor 2 on a temporary file, then writes what it
    caught to the real stderr less the lines that match ``pattern``. C++ code writes to
    the descriptor, not to ``sys.stderr``, so only this catches it."""
    if pattern is None:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().splitlines(keepends=True) if not pattern.match(line)]
            if kept:
                os.write(2, b"".join(kept))


def shutdown() -> None:
    """Leaves (or stops the local) Ray cluster."""
    if ray.is_initialized():
        ray.shutdown()


def pool_config(config: ModelConfig, *, direct: bool = True, tcp_pickle: bool = False) -> PoolConfig:
    """The ReplicaPool settings of one model version: its model.yaml plus the gateway's
    transport choices (workers.PoolConfig.direct and .tcp_pickle)."""
    from workers.actors import PoolConfig

    return PoolConfig(num_replicas=config.replicas, instances=config.instances, direct=direct,
                      tcp_pickle=tcp_pickle, resources=dict(config.ray_resources))


class RayPool:
    """One tail on a ReplicaPool of SegmentWorker actors (batching happens inside each actor)."""

    def __init__(self, key: PoolKey, tail_path: str, config: ModelConfig, *, provider: str = "auto",
                 metrics: GatewayMetrics | None = None, direct: bool = True, tcp_pickle: bool = False,
                 start_timeout_s: float = DEFAULT_POOL_START_TIMEOUT_S,
                 sample_inputs: Mapping[str, np.ndarray] | None = None) -> None:
        from workers.actors import DEFAULT_BATCHER_CONFIG, ReplicaPool, SegmentSource
        from workers.batcher import BatcherConfig
        from workers.engine import EngineConfig

        self.key = key
        self._metrics = metrics
        self.segment_key = f"{key.model}@{key.version}@{key.cut_id}"
        # The tail travels as bytes: workers on other nodes need not see the registry volume.
        with open(tail_path, "rb") as fh:
            model = fh.read()
        # The sample inputs travel with it, for the workers' warm-up and batch check.
        source = model if sample_inputs is None else SegmentSource(model, dict(sample_inputs))
        self.pool = ReplicaPool(
            {self.segment_key: source},
            config=pool_config(config, direct=direct, tcp_pickle=tcp_pickle),
            engine_config=EngineConfig(intra_op_threads=config.intra_op_threads, loop_fallback=True,
                                       batch_buckets=bucket_sizes(config.max_batch_size), provider=provider,  # type: ignore[arg-type]
                                       cuda_graphs=config.cuda_graphs),
            batcher_config=BatcherConfig(max_batch_size=config.max_batch_size,
                                         max_queue_delay_ms=config.max_queue_delay_ms,
                                         max_queue_size=config.max_queue_size, num_priority_levels=PRIORITY_LEVELS,
                                         inline_max_ms=DEFAULT_BATCHER_CONFIG.inline_max_ms),
        )
        # Block until the replicas have loaded the tail: readiness means "can serve now".
        try:
            ray.get([r.health.remote() for r in self.pool.replicas], timeout=start_timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            self.pool.shutdown()
            asks = {name: amount for name, amount in self.pool.replica_asks.items() if amount}
            offered = ray.cluster_resources()
            have = {name: offered.get(name, 0.0) for name in asks}
            raise Unavailable(reason=(
                f"the Ray workers of {key} did not start and load the tail within {start_timeout_s:g} s; each of "
                f"the {config.replicas} replicas asks Ray for {asks or 'nothing but a worker process'}"
                + (f", and the whole cluster offers {have}" if asks else "")
                + "; add nodes that offer it (a worker group's rayResources in the Helm chart), change ray_resources "
                "in the model's model.yaml, or allow longer with the gateway's --pool-start-timeout-s")) from e
        except Exception as e:  # noqa: BLE001 - actor construction errors arrive wrapped by Ray
            self.pool.shutdown()
            raise Unavailable(reason=f"the Ray workers of {key} did not start ({type(e).__name__}: {str(e)[:300]})") from e
        self.batches = 0
        self.answers = AnswerLoad(max_batch_size=config.max_batch_size, replicas=config.replicas,
                                  instances=config.instances, timeout_s=config.max_queue_delay_ms / 1e3)
        """The pool's load as its answers show it: the answers' load keys (`expected_load`)."""
        self.discards = WorkerCount()
        """Results the workers computed after their deadline (`read_discards` updates it)."""
        self._reader: asyncio.Task[None] | None = None

    async def run(self, inputs: Mapping[str, np.ndarray], *, deadline_s: float | None, priority: int) -> PoolResult:
        deadline_unix_ms = None
        if deadline_s is not None:
            deadline_unix_ms = (time.time() + (deadline_s - time.monotonic())) * 1e3
        t0 = time.monotonic()
        urgent = priority > 0
        ahead = self.answers.arrived(t0, urgent)
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_discards_every())
        try:
            out, timing = await self.pool.infer_timed(self.segment_key, dict(inputs), deadline_unix_ms=deadline_unix_ms,
                                                      priority=min(max(priority, 0), PRIORITY_LEVELS - 1))
        except BaseException:
            self.answers.failed(urgent)
            raise
        total_s = time.monotonic() - t0
        if timing is None:  # a worker that does not report timings: all of it counts as compute
            result = PoolResult(out, 0.0, total_s, 1)
            self.answers.answered(result, False, urgent)
            return result
        if timing.first_in_batch and self._metrics is not None:
            self._metrics.observe_batch(timing.batch_size)
        # Everything but the batch's run is waiting: the caller-side batcher, the actor
        # call's transport and the worker's queue (the worker's share is timing.queue_s).
        result = PoolResult(out, max(0.0, total_s - timing.compute_s), timing.compute_s, timing.batch_size)
        self.answers.answered(result, timing.first_in_batch, urgent, ahead)
        return result

    def load_keys(self) -> dict[str, float]:
        """An answer's load keys now, from the requests inside the pool and the answers
        (:class:`cluster._pools.AnswerLoad`, [Note: a Ray pool's predicted wait] there)."""
        now_s = time.monotonic()
        predicted = self.answers.predicted_waits(now_s)
        return load_keys(self.answers.expected_load(now_s, predicted), *(predicted or (None, None)))

    def load(self) -> tuple[int, float | None, float | None, int, float | None]:
        """(requests in the pool, predicted wait s, capacity req/s, discarded results, arrivals req/s) now.
        The wait is the gateway's reading ([Note: a Ray pool's predicted wait] in cluster/_pools.py); the
        discarded results are the workers' count, read every `DISCARDS_EVERY_S`."""
        a = self.answers
        now_s = time.monotonic()
        predicted = a.predicted_waits(now_s)
        return (a.in_flight, None if predicted is None else predicted[0], a.capacity_rps(), self.discards.total,
                a.arrival_rps(now_s))

    async def read_discards(self) -> int:
        """Reads the workers' discarded results of this tail into `discards` and returns the total.
        A replica that does not answer keeps the count it last reported."""
        for replica, stats in enumerate(await self.pool.worker_stats(return_exceptions=True)):
            if isinstance(stats, BaseException):
                logger.debug("replica %d of %s did not report its counts: %s", replica, self.key, stats)
                continue
            count = sum(s.discarded for s in stats.segments if s.key == self.segment_key)
            self.discards.report(replica, stats.pid, count)
        return self.discards.total

    async def _read_discards_every(self) -> None:
        while True:
            await asyncio.sleep(DISCARDS_EVERY_S)
            try:
                await self.read_discards()
            except Exception as e:  # noqa: BLE001 - the next read tries again
                logger.debug("could not read the discarded results of %s: %s", self.key, e)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        await self.pool.aclose()


class RayPoolFactory:
    """Pools of Ray actors; call `connect(address)` first."""

    def __init__(self, *, provider: str = "auto", direct: bool = True, tcp_pickle: bool = False,
                 start_timeout_s: float = DEFAULT_POOL_START_TIMEOUT_S) -> None:
        if not start_timeout_s > 0:
            raise ValueError(f"start_timeout_s={start_timeout_s!r} must be > 0; the default is "
                             f"{DEFAULT_POOL_START_TIMEOUT_S:g} s")
        self.provider = provider
        self.start_timeout_s = start_timeout_s
        self.direct = direct
        """Send requests to same-node workers over their direct channel
        (workers.PoolConfig.direct); off, every request is a plain Ray actor call."""
        self.tcp_pickle = tcp_pickle
        """Let the direct channel carry pickle frames over TCP (workers.PoolConfig.tcp_pickle);
        only where nobody else can reach the cluster network."""

    def create(self, key: PoolKey, tail_path: str, config: ModelConfig, metrics: GatewayMetrics,
               *, sample_inputs: Mapping[str, np.ndarray] | None = None) -> RayPool:
        if not ray.is_initialized():
            raise Unavailable(reason="Ray is not connected; call cluster.ray_cluster.connect(address) first")
        return RayPool(key, tail_path, config, provider=self.provider, metrics=metrics, direct=self.direct,
                       tcp_pickle=self.tcp_pickle,
                       start_timeout_s=self.start_timeout_s, sample_inputs=sample_inputs)
