"""The gateway's pools: the interface a tail's workers sit behind, and pools in this process.

Pools sit behind one small interface (`Pool`, `PoolFactory`): `LocalPoolFactory` runs
Engines and a Batcher in this process (no Ray: unit tests, the edge-less demo,
`--ray-address local-noray`); cluster.ray_cluster builds pools of Ray actors. The
gateway (cluster/gateway.py, where these names are public) creates them and routes
requests to them.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from cluster.metrics import GatewayMetrics
from cluster.registry import ModelConfig

__all__ = ["DEFAULT_POOL_START_TIMEOUT_S", "PRIORITY_LEVELS", "LocalPool", "LocalPoolFactory", "Pool", "PoolFactory",
           "PoolKey", "PoolResult", "bucket_sizes"]

PRIORITY_LEVELS = 4
"""Priority levels of a pool's batcher: a request's priority is clamped to 0..3."""


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


DEFAULT_POOL_START_TIMEOUT_S = 300.0
"""How long a Ray pool's replicas may take to be placed and load their tail (the
gateway's --pool-start-timeout-s). Long enough for an autoscaler to start a node for
them; a replica that no node can take (a ``ray_resources`` name that no worker group
offers) is then reported as Unavailable, not waited on for ever."""


class PoolFactory(Protocol):
    """Makes pools. `create` blocks (it loads a model): the gateway calls it off the event loop.

    It gets `sample_inputs=` (the tail's inputs made from the version's sample inputs,
    [Note: warm-up inputs] in cluster/_registry_disk.py) only where the version has some."""

    def create(self, key: PoolKey, tail_path: str, config: ModelConfig, metrics: GatewayMetrics) -> Pool: ...


def bucket_sizes(max_batch: int) -> tuple[int, ...]:
    """The batch buckets of a pool: powers of two below ``max_batch``, then ``max_batch``."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return tuple(out) + (max_batch,)


class LocalPool:
    """Engines and a dynamic Batcher in the gateway process.

    ``replicas`` engines of the tail (model instances, as Triton's instance groups;
    they share one set of weights, [Note: weight sharing] in workers/_weights.py) run
    up to ``replicas`` batches at once, each on an engine of its own: an engine's runs
    are serialised by its lock, so a second batch on one engine would only wait.
    """

    def __init__(self, key: PoolKey, tail_path: str, config: ModelConfig, metrics: GatewayMetrics,
                 *, cache_dir: str | None = None, provider: str = "auto",
                 sample_inputs: Mapping[str, np.ndarray] | None = None) -> None:
        from workers.batcher import Batcher, BatcherConfig
        from workers.engine import Engine, EngineConfig

        self.key = key
        self._metrics = metrics
        engine_config = EngineConfig(
            intra_op_threads=config.intra_op_threads, batch_buckets=bucket_sizes(config.max_batch_size),
            loop_fallback=True, cache_dir=cache_dir, provider=provider,  # type: ignore[arg-type]
            cuda_graphs=config.cuda_graphs,
        )
        self.engines: list = []
        try:
            for _ in range(config.replicas):
                self.engines.append(Engine(tail_path, engine_config, name=str(key), sample_inputs=sample_inputs))
        except BaseException:
            for engine in self.engines:
                engine.close()
            raise
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for engine in self.engines:
            self._free.put(engine)
        self.batcher = Batcher(self._run_batch, BatcherConfig(
            max_batch_size=config.max_batch_size, max_queue_delay_ms=config.max_queue_delay_ms,
            max_queue_size=config.max_queue_size, num_priority_levels=PRIORITY_LEVELS,
            max_concurrent_batches=config.replicas))
        self.batches = 0
        self._expected_rps, self._expected_at_s, self._expected_s = -1.0, -float("inf"), 0.0

    def _run_batch(self, payloads: list[tuple[Mapping[str, np.ndarray], float]]) -> list[PoolResult]:
        engine = self._free.get()  # never waits: the batcher runs at most `replicas` batches at once
        try:
            start = time.monotonic()
            outs = engine.run_batch([p[0] for p in payloads])
            compute_s = time.monotonic() - start
        finally:
            self._free.put(engine)
        self.batches += 1
        self._metrics.observe_batch(len(payloads))
        return [PoolResult(o, start - submitted, compute_s, len(payloads)) for o, (_, submitted) in zip(outs, payloads)]

    async def run(self, inputs: Mapping[str, np.ndarray], *, deadline_s: float | None, priority: int) -> PoolResult:
        # Requests of different per-sample shapes never share a batch ([Note: any shape] in workers/engine.py).
        shape_key = tuple(sorted((k, v.shape[1:], v.dtype.str) for k, v in inputs.items()))
        return await self.batcher.submit((inputs, time.monotonic()), deadline_s=deadline_s,
                                         priority=min(max(priority, 0), PRIORITY_LEVELS - 1), shape_key=shape_key)

    def load(self) -> tuple[int, float | None, float | None, int, float | None]:
        """(queue depth, predicted wait s, capacity req/s, discarded results, arrivals req/s) now."""
        load = self.batcher.load()
        return (load.queue_depth, load.predicted_wait_s, load.capacity_rps, self.batcher.stats().discarded,
                load.arrival_rps)

    def predicted_wait_s(self) -> float | None:
        return self.batcher.predicted_wait_s()

    def expected_load(self) -> tuple[float, float] | None:
        """(utilisation, expected wait s) now, from the batcher's arrival rate and batch times
        ([Note: expected wait] in workers/_batch_policy.py); None before any batch was timed."""
        load = self.batcher.load()
        if load.utilisation is None:
            return None
        now_s = time.monotonic()
        # The formula iterates (about 40 us); the arrival rate it reads changes once a second.
        if load.arrival_rps != self._expected_rps or now_s - self._expected_at_s >= 1.0:
            cfg = self.batcher.config
            wait_s = load.expected_wait_at(load.arrival_rps, self.batcher.run_times.estimate_s,
                                           max_batch_size=cfg.max_batch_size, instances=cfg.max_concurrent_batches,
                                           timeout_s=cfg.max_queue_delay_ms / 1e3)
            self._expected_rps, self._expected_at_s, self._expected_s = load.arrival_rps, now_s, wait_s or 0.0
        wait_s = self._expected_s
        if load.utilisation >= 1.0:
            wait_s = max(wait_s, load.predicted_wait_s or 0.0)
        return load.utilisation, wait_s

    async def close(self) -> None:
        await self.batcher.close(drain=True)
        for engine in self.engines:
            engine.close()


class LocalPoolFactory:
    """Pools in this process (`--ray-address local-noray`)."""

    def __init__(self, *, cache_dir: str | None = None, provider: str = "auto") -> None:
        self.cache_dir = cache_dir
        self.provider = provider

    def create(self, key: PoolKey, tail_path: str, config: ModelConfig, metrics: GatewayMetrics,
               *, sample_inputs: Mapping[str, np.ndarray] | None = None) -> Pool:
        return LocalPool(key, tail_path, config, metrics, cache_dir=self.cache_dir, provider=self.provider,
                         sample_inputs=sample_inputs)
