"""The gateway's pools: the interface a tail's workers sit behind, and pools in this process.

Pools sit behind one small interface (`Pool`, `PoolFactory`): `LocalPoolFactory` hosts
each tail in this process on the segment host the Ray workers use,
`workers.segment.HostedSegment` (no Ray: unit tests, the edge-less demo,
`--ray-address local-noray`); cluster.ray_cluster builds pools of Ray actors. The
gateway (cluster/gateway.py, where these names are public) creates them and routes
requests to them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from cluster.metrics import GatewayMetrics
from cluster.registry import ModelConfig

if TYPE_CHECKING:
    from workers.batcher import ExpectedLoad

__all__ = ["DEFAULT_POOL_START_TIMEOUT_S", "PRIORITY_LEVELS", "AnswerLoad", "LocalPool", "LocalPoolFactory", "Pool",
           "PoolFactory", "PoolKey", "PoolResult", "WorkerCount", "bucket_sizes", "load_keys"]

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


class PoolResult(NamedTuple):
    """One request's outputs and where its time went.

    A named tuple, not a frozen dataclass: one is made per answer on the gateway's event
    loop, 0.16 us against 0.40 us (as workers' RequestTiming)."""

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


def load_keys(expected: ExpectedLoad | None, predicted_s: float | None = None,
              urgent_predicted_s: float | None = None) -> dict[str, float]:
    """The load keys of an answer's `timings_ms` (ms; `utilisation` a ratio): the predicted waits of
    a request of priority 0 and 1 arriving now where the pool knows them, and the expected ones
    ([Note: expected wait] in workers/_batch_policy.py, [Note: priority under overload] in
    edge_agent/hedge.py)."""
    keys = {k: s * 1e3 for k, s in (("predicted_wait", predicted_s), ("urgent_predicted_wait", urgent_predicted_s))
            if s is not None}
    if expected is not None:
        keys.update(utilisation=expected.utilisation, expected_wait=expected.wait_s * 1e3,
                    urgent_expected_wait=expected.urgent_wait_s * 1e3)
    return keys


class WorkerCount:
    """A count that a pool's workers keep, summed over them as they report it. A restarted worker
    (the same replica, another process) counts from 0 again, so what the one before it had
    counted is kept."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[int, int]] = {}  # replica -> (pid, count)
        self._gone = 0

    def report(self, replica: int, pid: int, count: int) -> None:
        old = self._last.get(replica)
        if old is not None and old[0] != pid:
            self._gone += old[1]
        elif old is not None:
            count = max(count, old[1])
        self._last[replica] = (pid, count)

    @property
    def total(self) -> int:
        return self._gone + sum(count for _, count in self._last.values())


class AnswerLoad:
    """The load of a pool whose batchers run in its workers (a Ray pool), read from the
    gateway's own requests and their answers, with no call of its own: the arrivals per
    second, the batches' run times by size (each batch timed once, by the answer marked
    first in it) and an EWMA of the time each answer spent beyond a lone batch's run.
    Time is passed in.

    ``expected_load`` means what the in-process pool's means
    (workers.segment.HostedSegment.expected_load, [Note: expected wait] in
    workers/_batch_policy.py): utilisation is the arrivals over the full-batch capacity of
    every replica's instances; the expected wait is the batch queue of one replica at its
    share of the arrivals (least-loaded routing spreads them evenly), and never below the
    recent answers' own wait, which stands where the in-process pool has its predicted
    wait: the gateway does not see the workers' queues, but past capacity the answers wait
    what those queues hold. The urgent figure is the same at the urgent share of the
    arrivals and over the urgent answers (priority above 0) alone.

    ``predicted_waits`` stands for the workers' batchers' predicted waits, from the requests
    inside the pool; see [Note: a Ray pool's predicted wait].
    """

    def __init__(self, *, max_batch_size: int, replicas: int, instances: int, timeout_s: float,
                 alpha: float = 0.2, fit_alpha: float = 0.05) -> None:
        from workers.batcher import ArrivalRate, RunTimes

        self.max_batch_size, self.replicas, self.instances = max_batch_size, replicas, max(1, instances)
        self.timeout_s = timeout_s
        self.alpha = alpha
        self.run_times = RunTimes()
        self.in_flight = 0
        """Requests sent and not yet answered."""
        self.urgent_in_flight = 0
        """Of those, the requests of priority above 0."""
        self._arrivals = ArrivalRate()
        self._beyond_s: list[float | None] = [None, None]
        """EWMA of the answers' time beyond a lone batch's run: priority 0, urgent."""
        self._cached: tuple[float, float, tuple[float, float]] = (-1.0, -float("inf"), (0.0, 0.0))
        self.fit_alpha = fit_alpha
        self._fit = [0.0, 0.0, 0.0, 0.0]
        """EWMAs of x, y, x*x and x*y: x the requests a priority-0 request found inside, y its time in
        the pool (s)."""
        self._fitted = 0

    def arrived(self, now_s: float, urgent: bool = False) -> int:
        """Counts a request sent to the pool; returns how many were inside it already."""
        self._arrivals.count(now_s, urgent=urgent)
        ahead = self.in_flight
        self.in_flight += 1
        self.urgent_in_flight += urgent
        return ahead

    def answered(self, result: PoolResult, first_in_batch: bool, urgent: bool = False,
                 ahead: int | None = None) -> None:
        """Counts an answer (``result.queue_s``: all but its batch's run, on the gateway's clock) to a
        request of priority 0 (an urgent one) that found `ahead` requests inside the pool (`arrived`)."""
        self.failed(urgent)
        if ahead is not None and not urgent:
            # [Note: a Ray pool's predicted wait] the time in the pool against the requests ahead.
            f, a = self._fit, self.fit_alpha
            x, y = float(ahead), result.queue_s + result.compute_s
            for i, v in enumerate((x, y, x * x, x * y)):
                f[i] = v if self._fitted == 0 else f[i] + a * (v - f[i])
            self._fitted += 1
        if first_in_batch:
            self.run_times.observe(result.batch_size, result.compute_s)
        one_s = self.run_times.estimate_s(1)
        if one_s is None:
            return
        beyond_s = max(0.0, result.queue_s + result.compute_s - one_s)
        prev = self._beyond_s[urgent]
        self._beyond_s[urgent] = beyond_s if prev is None else prev + self.alpha * (beyond_s - prev)

    def failed(self, urgent: bool = False) -> None:
        """Counts a request that left the pool (answered, or failed)."""
        self.in_flight -= 1
        self.urgent_in_flight -= urgent

    def predicted_waits(self, now_s: float) -> tuple[float, float] | None:
        """How long a request of priority 0, and one of priority 1, arriving now would wait for its
        batch to start, from the requests inside the pool; None before a batch was timed.

        [Note: a Ray pool's predicted wait]
        The workers' batchers predict a new request's wait from their queues; the gateway asks
        them nothing per request, but it counts the requests it sent and has not had answered,
        and reads the same wait from them two ways, taking the longer:
        * The batch queue. Least-loaded routing spreads the requests inside over the replicas,
          so the one a new request goes to holds ``in_flight / replicas`` of them (rounded up).
          Its ``instances`` run batches of up to ``max_batch_size`` at once: those requests run,
          the rest wait, and urgent ones go first, so only the urgent requests beyond the
          running batches are ahead of an urgent request. The gateway does not see when a
          running batch started: a request that arrives at a moment unrelated to it finds, on
          average, half of its run left. The workers' formula
          (workers._batch_policy.queue_wait_s) then gives the wait.
        * The drain. A pool's requests also take the gateway's and the transport's time, which
          its batches' runs do not count: on 2 shared cores one replica of SqueezeNet answered
          131 requests a second where its batches' runs alone allowed 141, and from the batch
          queue alone the predicted wait read 3.3 ms at the median where requests sent at 1.5
          times the throughput met 48.7 ms. So the answers (priority 0)
          are fitted, as an EWMA least-squares line, by their time in the pool against the
          requests they found inside when sent; a new request waits the line's time at the
          requests inside now, less a lone batch's run (with none inside, nothing is drained:
          the line's intercept is the transport's time, not a wait for a batch).
        bench/ray_load.py measures it (one replica, open-loop arrivals at 0.5, 1 and 1.5 times
        the throughput measured first; each request's wait against the last answer's keys, as
        the agent reads them; figures in docs/fleet.md). It feeds the pool's gauge
        (`splitinfer_predicted_wait_seconds`, an autoscaling signal of the Helm chart) and
        `/readyz?load=1`.
        """
        from workers.batcher import queue_wait_s

        b, k = self.max_batch_size, self.instances
        full_s = self.run_times.estimate_s(b)
        if full_s is None:
            return None
        n = -(-max(0, self.in_flight) // self.replicas)
        urgent = -(-max(0, self.urgent_in_flight) // self.replicas)
        busy = min(k, -(-n // b))
        running_s = self.run_times.estimate_s(min(b, -(-n // busy))) if busy else None
        ends = [now_s + (running_s or full_s) / 2] * busy
        waits = (queue_wait_s(now_s, max(0, n - k * b), ends, full_s, b, k),
                 queue_wait_s(now_s, max(0, urgent - k * b), ends, full_s, b, k))
        drain = self._drain()
        one_s = self.run_times.estimate_s(1)
        if drain is None or one_s is None:
            return waits
        base_s, per_s = drain

        def drained(wait_s: float, ahead: int) -> float:
            return max(wait_s, base_s + per_s * ahead - one_s) if ahead > 0 else wait_s

        return drained(waits[0], self.in_flight), drained(waits[1], self.urgent_in_flight)

    def _drain(self) -> tuple[float, float] | None:
        """(s, s per request): the time in the pool of a request that finds none inside, and what each
        request inside adds, fitted over the recent answers; None until they found different numbers
        inside (by at least one request, as a spread) or where more inside did not take longer."""
        if self._fitted < 2:
            return None
        mx, my, mxx, mxy = self._fit
        var = mxx - mx * mx
        if var < 1.0:
            return None
        per_s = (mxy - mx * my) / var
        return (my - per_s * mx, per_s) if per_s > 0 else None

    def arrival_rps(self, now_s: float) -> float:
        self._arrivals.count(now_s, 0)
        return self._arrivals.rps

    def capacity_rps(self) -> float | None:
        """Requests per second at full batches on every replica's instances; None before a batch was timed."""
        full_s = self.run_times.estimate_s(self.max_batch_size)
        return None if not full_s else self.max_batch_size * self.instances * self.replicas / full_s

    def expected_load(self, now_s: float, predicted: tuple[float, float] | None = None) -> ExpectedLoad | None:
        """The load keys now, never below `predicted` (`predicted_waits`, read now); None before a
        batch was timed."""
        from workers.batcher import BatcherLoad, ExpectedLoad

        capacity = self.capacity_rps()
        if capacity is None:
            return None
        rate = self.arrival_rps(now_s)
        rps, at_s, waits = self._cached
        if rate != rps or now_s - at_s >= 1.0:  # the formula iterates; the rate changes once a second
            urgent = self._arrivals.urgent_rps / rate if rate > 0 else 0.0
            w0, w1 = (BatcherLoad.expected_wait_at(rate / self.replicas, self.run_times.estimate_s,
                                                   max_batch_size=self.max_batch_size, instances=self.instances,
                                                   timeout_s=self.timeout_s, ahead_share=share) or 0.0
                      for share in (1.0, urgent))
            waits = (w0, w1)
            self._cached = (rate, now_s, waits)
        p0, p1 = predicted or (0.0, 0.0)
        return ExpectedLoad(rate / capacity, max(waits[0], self._beyond_s[0] or 0.0, p0),
                            max(waits[1], self._beyond_s[1] or 0.0, p1))


class LocalPool:
    """One tail hosted in the gateway process: a :class:`workers.segment.HostedSegment`,
    the segment host the Ray workers use too.

    ``replicas`` engines of the tail (model instances, as Triton's instance groups;
    they share one set of weights, [Note: weight sharing] in workers/_weights.py) run
    up to ``replicas`` batches at once, each on an engine of its own: an engine's runs
    are serialised by its lock, so a second batch on one engine would only wait. Each
    has model.yaml's ``intra_op_threads`` (no engine with all the threads for lone
    requests, as a Ray worker's ``instances`` have). Requests are not checked before
    batching (``HostedSegment.shape_key_unchecked``): one of another shape or dtype batches
    apart and fails alone.
    """

    def __init__(self, key: PoolKey, tail_path: str, config: ModelConfig, metrics: GatewayMetrics,
                 *, cache_dir: str | None = None, provider: str = "auto",
                 sample_inputs: Mapping[str, np.ndarray] | None = None) -> None:
        from workers.batcher import BatcherConfig
        from workers.engine import EngineConfig
        from workers.segment import TimedInputs, load_segment

        self.key = key
        self._metrics = metrics
        engine_config = EngineConfig(
            intra_op_threads=config.intra_op_threads, batch_buckets=bucket_sizes(config.max_batch_size),
            loop_fallback=True, cache_dir=cache_dir, provider=provider,  # type: ignore[arg-type]
            cuda_graphs=config.cuda_graphs,
        )
        # inline_max_ms stays 0: the gateway's event loop must keep serving gRPC while a batch runs.
        batcher_config = BatcherConfig(
            max_batch_size=config.max_batch_size, max_queue_delay_ms=config.max_queue_delay_ms,
            max_queue_size=config.max_queue_size, num_priority_levels=PRIORITY_LEVELS)
        self.segment = load_segment(str(key), tail_path, engine_config, batcher_config, sample_inputs=sample_inputs,
                                    instances=config.replicas, lone_engine=False, on_batch=self._counted)
        self.batcher = self.segment.batcher
        self._timed, self._shape_key = TimedInputs.now, self.segment.shape_key_unchecked
        self.engines = list(self.segment.engines)
        self.batches = 0

    def _counted(self, size: int) -> None:
        self.batches += 1
        self._metrics.observe_batch(size)

    async def run(self, inputs: Mapping[str, np.ndarray], *, deadline_s: float | None, priority: int) -> PoolResult:
        timed = self._timed(inputs)  # [Note: request timing] in workers/segment.py
        priority = min(max(priority, 0), PRIORITY_LEVELS - 1)
        outputs = await self.batcher.submit(timed, deadline_s=deadline_s, priority=priority,
                                            shape_key=self._shape_key(inputs))
        timing = timed.timing
        return PoolResult(outputs, timing.queue_s, timing.compute_s, timing.batch_size)

    def load(self) -> tuple[int, float | None, float | None, int, float | None]:
        """(queue depth, predicted wait s, capacity req/s, discarded results, arrivals req/s) now."""
        load = self.batcher.load()
        return (load.queue_depth, load.predicted_wait_s, load.capacity_rps, self.batcher.stats().discarded,
                load.arrival_rps)

    def load_keys(self) -> dict[str, float]:
        """An answer's load keys now (`load_keys`), from one reading of the batcher."""
        load = self.batcher.load()
        return load_keys(self.segment.expected_load(load), load.predicted_wait_s, load.urgent_predicted_wait_s)

    async def close(self) -> None:
        await self.segment.close()


class LocalPoolFactory:
    """Pools in this process (`--ray-address local-noray`)."""

    def __init__(self, *, cache_dir: str | None = None, provider: str = "auto") -> None:
        self.cache_dir = cache_dir
        self.provider = provider

    def create(self, key: PoolKey, tail_path: str, config: ModelConfig, metrics: GatewayMetrics,
               *, sample_inputs: Mapping[str, np.ndarray] | None = None) -> Pool:
        return LocalPool(key, tail_path, config, metrics, cache_dir=self.cache_dir, provider=self.provider,
                         sample_inputs=sample_inputs)
