"""The batcher's pure decisions: which batch to form now, how long batches take, and how
long a request would wait. Nothing here reads a clock: time is passed in.

[Note: pure scheduling]
Which batch to form, and how long to sleep otherwise, is decided by the pure function
:func:`_next_batch` with the time passed in, in the style of Ray Serve's autoscaling
``policy(ctx)``. The event loop in :class:`Batcher` only applies its decisions, so unit
tests drive the policy without sleeping.

[Note: deadline-aware batching]
A result that arrives after its deadline is computed for nothing, and under overload
such results take the whole engine: a batch formed of requests that can no longer make
their deadline still runs, and the requests behind it then miss theirs too, so goodput
falls to zero while the engine is busy. The batcher therefore keeps, per batch size, an
EWMA of how long its batches took (:class:`RunTimes`), and uses it twice:

* on arrival (:meth:`Batcher.enqueue`): the predicted wait (the batches ahead of the
  request, ``max_concurrent_batches`` at a time, plus what is left of the running ones)
  plus its own batch's run time; a request whose deadline comes before that is refused
  at once ('predicted_wait');
* when a batch forms (:func:`_next_batch`): a request whose deadline comes before the
  batch's predicted end is left out of it and refused ('deadline_unreachable').

In both, the request's own batch is priced at its run time's EWMA plus `RUN_SPREADS`
times the EWMA of its absolute deviation (:meth:`RunTimes.upper_s`), as TCP prices a
retransmission timer: priced at the mean, a batch that ran long answered late. ResNet50
whole on one engine, 64 closed-loop clients at 3x the c1 p50 (`bench.overload`, two cores
shared with the clients), two runs each: at the mean, 59 and 88 answers came after the
client's deadline and the goodput within it was 0.82 and 0.77 of capacity; with the
spread, 7 and 13, and 0.89 and 0.84.
Both refusals carry ``retry_after_s``. Results that finish after their deadline anyway
(the estimate was short) are counted in ``BatcherStats.discarded``. Before the first
batch is timed there is no estimate and nothing is refused on it.

[Note: expected wait]
The predicted wait above is what a request arriving now would wait: 0 unless every
instance is busy or a whole round of full batches is queued, so at 90% utilisation it
is 0 most of the time, and a device that sends one frame every few seconds reads the
cloud as idle. What such a device can plan with is the mean: :meth:`BatcherLoad.expected_wait_at`
gives the mean time a request spends in the pool beyond a lone batch's run, at the
measured arrival rate, from the batch queue the fleet planner uses ([Note: batch queue]
in planner/queueing.py, one pool): the wait for an instance that requests merging into
the next batch see (Allen-Cunneen at full batches), plus the formed batch's fill, plus
its longer run, T(b) - T(1). At or past
capacity there is no steady state, and admission control bounds the queue by the
deadlines instead: the figure is then the formula at ``_RHO_CAP``.

A request of a higher priority ([Note: priority under overload] in edge_agent/hedge.py)
waits for an instance behind its own class only: by Cobham's formula for a queue served by
priority without preemption, the highest class's mean wait is the residual work, W0,
over 1 - rho_1 (its own utilisation), where arrival order's is W0 over 1 - rho. So the
instance wait at arrival order is scaled by (1 - rho) / (1 - rho * share), share being
the class's part of the arrivals (``ahead_share``): at 99 % busy with 10 % of the
arrivals urgent, an urgent request waits 1 % of a priority-0 request's wait for an
instance, and the same fill and batch run.

The figure is never below the predicted wait: a request arriving now waits at least
that long, whatever the mean. The arrival rate is the last whole second's, so in the
first second of a burst it is the quiet second's rate while the queue is already long,
and the mean at that rate says the pool is idle.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from planner.queueing import batch_queue
from workers._batcher_config import BatcherConfig
from workers.errors import BatcherConfigError

__all__ = ["ArrivalRate", "BatcherLoad", "ExpectedLoad", "RunTimes", "ShapeRunTimes"]

RUN_SPREADS = 2.0
"""A request's own batch is priced at this many mean absolute deviations over its mean run
time ([Note: deadline-aware batching])."""
_RHO_CAP = 0.99
"""Utilisation at which the expected wait stops rising ([Note: expected wait])."""


class RunTimes:
    """How long a batch of each size takes: an EWMA per size of the runs timed.

    A size never timed is estimated from its timed neighbours: linearly between two,
    the larger neighbour's time below the smallest timed size, and the largest timed
    size's time scaled by size above it. Both ends err long, since batching costs
    less than linearly per request: a long estimate refuses a little early, a short
    one runs requests that then miss their deadline.
    """

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0.0 < alpha <= 1.0:
            raise BatcherConfigError(f"alpha={alpha} must be in (0, 1]; 0.2 weighs the last five runs",
                                     field_name="alpha", value=alpha)
        self.alpha = alpha
        self._s: dict[int, float] = {}
        self._dev: dict[int, float] = {}
        """EWMA of each size's absolute deviation from its mean."""
        self._estimates: dict[int, float] = {}
        """Estimates of untimed sizes since the last observation: admission asks for
        several sizes per request, and a batch updates them once."""

    def observe(self, size: int, run_s: float) -> None:
        prev = self._s.get(size)
        if prev is None:
            self._s[size], self._dev[size] = run_s, 0.0
        else:
            err = run_s - prev
            self._s[size] = prev + self.alpha * err
            self._dev[size] += self.alpha * (abs(err) - self._dev[size])
        self._estimates.clear()

    def copy(self) -> RunTimes:
        twin = RunTimes(self.alpha)
        twin._s, twin._dev = dict(self._s), dict(self._dev)
        return twin

    def upper_s(self, size: int) -> float | None:
        """The run time a batch of ``size`` stays within: the mean plus `RUN_SPREADS` mean
        absolute deviations (of its own size, else the largest timed); None before any batch
        was timed."""
        mean = self.estimate_s(size)
        if mean is None:
            return None
        dev = self._dev.get(size)
        return mean + RUN_SPREADS * (max(self._dev.values()) if dev is None else dev)

    def estimate_s(self, size: int) -> float | None:
        """The predicted run time of a batch of ``size``; None before any batch was timed."""
        known = self._s
        if size in known:
            return known[size]
        if not known:
            return None
        cached = self._estimates.get(size)
        if cached is None:
            cached = self._estimates[size] = self._interpolate(size)
        return cached

    def _interpolate(self, size: int) -> float:
        known = self._s
        below = max((k for k in known if k < size), default=None)
        above = min((k for k in known if k > size), default=None)
        if below is None:
            assert above is not None
            return known[above]
        if above is None:
            return known[below] * size / below
        return known[below] + (known[above] - known[below]) * (size - below) / (above - below)

    def as_dict(self) -> dict[int, float]:
        return dict(sorted(self._s.items()))


class ArrivalRate:
    """Arrivals per second over the last whole second, time passed in: the rate of a window
    of at least a second, read when the next one starts; a window of two seconds or more
    with nothing read in between reads 0 (the arrivals it counted are that old). The urgent
    ones (priority above 0) are also counted apart."""

    __slots__ = ("rps", "urgent_rps", "_start_s", "_count", "_urgent")

    def __init__(self) -> None:
        self.rps = self.urgent_rps = 0.0
        self._start_s = float("-inf")
        self._count = self._urgent = 0

    def count(self, now_s: float, n: int = 1, *, urgent: bool = False) -> None:
        """Counts ``n`` arrivals (urgent ones) at ``now_s`` (0: only brings the window up to ``now_s``)."""
        if now_s - self._start_s >= 1.0:
            elapsed_s = now_s - self._start_s
            recent = elapsed_s < 2.0
            self.rps = self._count / elapsed_s if recent else 0.0
            self.urgent_rps = self._urgent / elapsed_s if recent else 0.0
            self._start_s, self._count, self._urgent = now_s, 0, 0
        self._count += n
        if urgent:
            self._urgent += n


_NO_SHAPE = object()


class ShapeRunTimes:
    """Batch run times over every shape, and of each shape key apart for the most
    recent ``limit`` shapes: a batch of small images is not predicted to take what one
    of large images took."""

    def __init__(self, limit: int = 64) -> None:
        self.overall = RunTimes()
        """Batch run time by size, over every shape."""
        self.limit = limit
        self._by_shape: collections.OrderedDict[Hashable, RunTimes] = collections.OrderedDict()
        self._only: Hashable = _NO_SHAPE
        """The one shape timed while `_by_shape` is empty."""

    def observe(self, shape_key: Hashable, size: int, run_s: float) -> None:
        """Times a batch: over every shape, and for its own shape. While one shape is all
        there is, its times are the overall ones, kept once: the batcher's lone request at
        c1 runs about 4,900 Python bytecodes against 4,964 keeping them twice."""
        by_shape = self._by_shape
        if not by_shape:
            if self._only is _NO_SHAPE or self._only == shape_key:
                self._only = shape_key
                self.overall.observe(size, run_s)
                return
            by_shape[self._only] = self.overall.copy()  # a second shape: the first keeps its times so far
        self.overall.observe(size, run_s)
        times = by_shape.get(shape_key)
        if times is None:
            times = self._by_shape[shape_key] = RunTimes()
            if len(self._by_shape) > self.limit:
                self._by_shape.popitem(last=False)
        else:
            self._by_shape.move_to_end(shape_key)
        times.observe(size, run_s)

    def of(self, shape_key: Hashable) -> Callable[[int], float | None]:
        """The run-time estimate of a batch of ``shape_key``: its own where it was
        timed, else the one over every shape."""
        times = self._by_shape.get(shape_key)
        return times.estimate_s if times is not None else self.overall.estimate_s

    def upper_of(self, shape_key: Hashable) -> Callable[[int], float | None]:
        """`of`'s `RunTimes.upper_s`: the run time a batch of ``shape_key`` stays within."""
        times = self._by_shape.get(shape_key)
        return times.upper_s if times is not None else self.overall.upper_s


class ExpectedLoad(NamedTuple):
    """A pool's load keys now ([Note: expected wait])."""

    utilisation: float
    wait_s: float
    """The expected wait of a request of priority 0."""
    urgent_wait_s: float
    """That of a request of priority 1, which waits behind its own class only."""


@dataclass(frozen=True)
class BatcherLoad:
    """How loaded a batcher is now (the gateway's gauges and ``/readyz?load=1``)."""

    queue_depth: int
    """Requests waiting (not yet in a batch)."""
    running_batches: int
    """Batches running now."""
    predicted_wait_s: float | None
    """How long a request arriving now would wait for its batch to start; None before
    any batch was timed."""
    batch_run_s: float | None
    """Predicted run time of a full batch (``max_batch_size``); None before any run."""
    capacity_rps: float | None
    """Requests per second at full batches on every instance: the most this batcher
    can answer. None before any run."""
    arrival_rps: float = 0.0
    """Requests that arrived per second (admitted or not) over the last whole second."""
    urgent_arrival_rps: float = 0.0
    """Those of them with a priority above 0."""
    urgent_predicted_wait_s: float | None = None
    """`predicted_wait_s` for a request of priority 1: behind those of priority 1 or higher."""

    @property
    def headroom_rps(self) -> float | None:
        """Capacity left: ``capacity_rps - arrival_rps``; negative when overloaded."""
        return None if self.capacity_rps is None else self.capacity_rps - self.arrival_rps

    @property
    def utilisation(self) -> float | None:
        """``arrival_rps / capacity_rps``: the busy share of the instances at full batches (above 1:
        overloaded); None before any run."""
        return None if not self.capacity_rps else self.arrival_rps / self.capacity_rps

    @staticmethod
    def expected_wait_at(arrival_rps: float, run_s: Callable[[int], float | None], *, max_batch_size: int,
                         instances: int, timeout_s: float, predicted_wait_s: float = 0.0,
                         ahead_share: float = 1.0) -> float | None:
        """Mean seconds a request spends in a pool receiving ``arrival_rps`` beyond a lone batch's
        run, where ``run_s(size)`` is a batch's run time, and at least ``predicted_wait_s`` (the
        wait of a request arriving now); None before any run. ``ahead_share``: the share of the
        arrivals served before or with the request (its priority or higher), 1 for the lowest
        priority. Pure; see [Note: expected wait]."""
        one_s, full_s = run_s(1), run_s(max_batch_size)
        if one_s is None or full_s is None or not math.isfinite(arrival_rps) or arrival_rps <= 0:
            return None if one_s is None else max(0.0, predicted_wait_s)
        capacity_rps = max_batch_size * instances / max(full_s, 1e-9)
        rate = min(arrival_rps, _RHO_CAP * capacity_rps)
        times = [run_s(b) for b in range(1, max_batch_size + 1)]
        assert all(t is not None for t in times)  # one size timed: every size has an estimate
        table = np.array([[t * 1e3 for t in times]])  # type: ignore[operator]
        q = batch_queue(np.array([rate]), table, instances, timeout_s * 1e3)
        rho = min(q.utilisation, _RHO_CAP)
        wait_ms = q.wait_ms * (1.0 - rho) / (1.0 - rho * min(max(ahead_share, 0.0), 1.0))  # Cobham
        expected_s = (wait_ms + q.fill_ms[0] + q.run_ms[0]) / 1e3 - one_s
        return max(expected_s, predicted_wait_s)


@dataclass(eq=False)
class _Request:
    """One waiting request. Ordered in its queue by (-priority, seq)."""

    seq: int
    payload: Any
    shape_key: Hashable
    priority: int
    arrival_s: float
    deadline_s: float | None
    future: asyncio.Future[Any] | None = field(default=None, repr=False)

    @property
    def sort_key(self) -> tuple[int, int]:
        return (-self.priority, self.seq)

    def expired(self, now_s: float) -> bool:
        return self.deadline_s is not None and self.deadline_s <= now_s


Queues = Mapping[Hashable, Sequence[_Request]]
"""shape_key -> waiting requests of that shape, ordered by (-priority, arrival)."""


class _Decision(NamedTuple):
    batch: tuple[_Request, ...]
    """Requests to run now as one batch (all of one shape), or empty."""
    expired: tuple[_Request, ...]
    """Requests whose deadline has passed: reject them, never run them."""
    wait_s: float | None
    """If no batch formed: how long until the decision may change without a new
    arrival (a delay runs out or a deadline passes); None means only an arrival can."""
    unreachable: tuple[_Request, ...] = ()
    """Requests left out of the batch because it is predicted to end after their
    deadline: refuse them now, never run them ([Note: deadline-aware batching])."""
    batch_end_s: float | None = None
    """When the batch is predicted to end (None: no estimate yet)."""


def _batch_size(n_waiting: int, config: BatcherConfig, delay_over: bool) -> int:
    """How many of ``n_waiting`` same-shape requests to batch now (0: keep waiting)."""
    if n_waiting >= config.max_batch_size:
        return config.max_batch_size
    reachable = [s for s in config.preferred_batch_sizes if s <= n_waiting]
    if reachable:
        return reachable[-1]
    if delay_over:
        return n_waiting
    return 0


def _fit(live: Sequence[_Request], size: int, start_s: float,
         run_s: Callable[[int], float | None]) -> tuple[list[_Request], list[_Request], float | None]:
    """(batch, unreachable, predicted end).

    ``unreachable``: the requests whose deadline comes before even a batch of one
    would end. ``batch``: the largest batch, up to ``size``, whose predicted end comes
    before the deadline of each of its members, taking them in queue order. A batch
    too large for the deadlines it holds would serve none of them: it shrinks instead
    (a request it skips stays queued, for a later batch or its own refusal).
    """
    one_s = run_s(1)
    if one_s is None:
        return list(live[:size]), [], None
    # The usual case, deadlines far enough for a full batch: one pass over a prefix.
    end_s = start_s + run_s(size)  # type: ignore[operator] # one size timed: every size has one
    batch: list[_Request] = []
    unreachable: list[_Request] = []
    for r in live:
        if r.deadline_s is not None and r.deadline_s < start_s + one_s:
            unreachable.append(r)
        elif r.deadline_s is not None and r.deadline_s < end_s:
            break
        else:
            batch.append(r)
            if len(batch) == size:
                return batch, unreachable, end_s
    unreachable = [r for r in live if r.deadline_s is not None and r.deadline_s < start_s + one_s]
    candidates = [r for r in live if r.deadline_s is None or r.deadline_s >= start_s + one_s]
    for n in range(min(size, len(candidates)), 0, -1):
        est = run_s(n)
        assert est is not None  # one size timed: every size has an estimate
        end_s = start_s + est
        batch = [r for r in candidates if r.deadline_s is None or r.deadline_s >= end_s][:n]
        if len(batch) == n:
            return batch, unreachable, end_s
    return [], unreachable, None


def _next_batch(
    queues: Queues, now_s: float, config: BatcherConfig, *, flush: bool = False,
    run_s: Callable[[int], float | None] | None = None, start_s: float | None = None,
    run_s_of_shape: Callable[[Hashable], Callable[[int], float | None]] | None = None,
) -> _Decision:
    """Decides the next batch. Pure: reads ``queues``, changes nothing.

    Among the shapes that can form a batch now, the one whose best request has the
    highest priority (then the earliest arrival) wins. ``flush`` treats every delay as
    over, which is how ``close(drain=True)`` empties the queue promptly.

    ``run_s(size)`` predicts a batch's run time and ``start_s`` when the next batch can
    start (default ``now_s``; later while every instance is busy). With them, a request
    that the batch would finish after its deadline is left out and returned in
    ``unreachable`` ([Note: deadline-aware batching]). ``run_s_of_shape(shape_key)``,
    where given, is the ``run_s`` of each shape's batches (a tail over symbolic dims
    runs a large image far longer than a small one).
    """
    delay_s = config.max_queue_delay_ms / 1000.0
    start_s = now_s if start_s is None else max(start_s, now_s)
    expired: list[_Request] = []
    unreachable: list[_Request] = []
    best: tuple[tuple[int, int], list[_Request], float | None] | None = None
    wait_s: float | None = None
    for shape_key, requests in queues.items():
        live = []
        dated = False
        for r in requests:
            if r.expired(now_s):
                expired.append(r)
            else:
                live.append(r)
                if r.deadline_s is not None:
                    dated = True
                    until = r.deadline_s - now_s
                    wait_s = until if wait_s is None else min(wait_s, until)
        if not live:
            continue
        oldest_arrival_s = min(r.arrival_s for r in live)
        due_s = oldest_arrival_s + delay_s
        delay_over = flush or due_s <= now_s
        size = _batch_size(len(live), config, delay_over)
        if size == 0:
            until = due_s - now_s
            wait_s = until if wait_s is None else min(wait_s, until)
            continue
        shape_run_s = run_s if run_s_of_shape is None else run_s_of_shape(shape_key)
        if shape_run_s is None:
            batch, end_s = live[:size], None
        elif not dated:  # no deadline to fit: the first `size`, ending when a batch of that size does
            batch = live[:size]
            run = shape_run_s(size)
            end_s = None if run is None else start_s + run
        else:
            batch, left_out, end_s = _fit(live, size, start_s, shape_run_s)
            unreachable.extend(left_out)
            if not batch:
                continue
        if best is None or batch[0].sort_key < best[0]:
            best = (batch[0].sort_key, batch, end_s)
    if best is None:
        return _Decision((), tuple(expired), wait_s, tuple(unreachable))
    _, batch, end_s = best
    return _Decision(tuple(batch), tuple(expired), 0.0, tuple(unreachable), end_s)


class AheadSize:
    """The size of the batches that queued requests form ([Note: batches ahead]): an EWMA
    of the sizes of batches formed while others still waited; ``max_batch_size`` before
    any did."""

    def __init__(self, alpha: float = 0.2) -> None:
        self._alpha = alpha
        self._ewma: float | None = None

    def formed(self, size: int) -> None:
        """A batch of ``size`` formed with requests still waiting behind it."""
        e = self._ewma
        self._ewma = float(size) if e is None else e + self._alpha * (size - e)

    def size(self, max_batch_size: int) -> int:
        e = self._ewma
        return max_batch_size if e is None else max(1, min(max_batch_size, round(e)))


def queue_wait_s(now_s: float, depth: int, batch_ends_s: Sequence[float], batch_s: float,
                      batch_size: int, instances: int) -> float:
    """How long a request arriving behind ``depth`` waiting ones waits for its batch to
    start, with batches of ``batch_size`` taking ``batch_s``, ``instances`` at a time,
    and ``batch_ends_s`` the predicted ends of the running ones. Pure.

    Its batch starts once the ``depth // batch_size`` batches ahead have each taken the
    instance that frees first (now for an idle one). Counting only the first instance to
    free plus whole rounds, as if the batches of a partial round all started then,
    under-reads the wait by up to a batch's run wherever ``instances`` > 1: with two
    instances busy and one batch queued, the request waits for the farther end, not the
    nearer. Once the instances free within ``batch_s`` of each other they take batches in
    turn, so only the batches before that are played out one by one."""
    ahead = depth // batch_size
    free = sorted([now_s] * max(0, instances - len(batch_ends_s)) + [max(now_s, e) for e in batch_ends_s])
    last_s = free[-1]
    while ahead and last_s - free[0] > batch_s:
        last_s = max(last_s, free[0] + batch_s)
        heapq.heapreplace(free, free[0] + batch_s)
        ahead -= 1
    free.sort()
    return free[ahead % instances] + (ahead // instances) * batch_s - now_s


def depth_from(queues: Queues, priority: int, depth: int) -> int:
    """How many of the `depth` queued requests a new one of `priority` waits behind: those of its
    priority or higher, which go first ([Note: priority under overload] in edge_agent/hedge.py)."""
    if priority <= min((q[-1].priority for q in queues.values() if q), default=priority):
        return depth  # each queue ends with its least urgent request
    return sum(1 for q in queues.values() for r in q if r.priority >= priority)


def _earliest_deadline_wait(queues: Queues, now_s: float) -> float | None:
    deadlines = [r.deadline_s for q in queues.values() for r in q if r.deadline_s is not None]
    if not deadlines:
        return None
    return max(0.0, min(deadlines) - now_s)
