"""Dynamic batching of inference requests in pure asyncio.

Requests arrive one at a time through :meth:`Batcher.submit`; the batcher groups them
into batches for a ``run_batch`` callable the way Triton's dynamic batcher does:

* a batch forms at once when ``max_batch_size`` or one of ``preferred_batch_sizes``
  requests of the same shape are waiting;
* otherwise it forms when the oldest waiting request has waited ``max_queue_delay_ms``;
* higher priority requests go first, then older ones;
* requests with different ``shape_key`` never share a batch;
* a request whose deadline has passed is rejected and never runs;
* a request that cannot finish before its deadline is refused at once with a
  retry-able :class:`OverloadedError` ([Note: deadline-aware batching]);
* a full queue rejects new requests with a retry-able :class:`QueueFullError`.

The decisions are pure functions in workers/_batch_policy.py: [Note: pure scheduling]
and [Note: deadline-aware batching] there say how batches form and why a request that
cannot make its deadline is refused.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import inspect
import itertools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any

from workers._batch_policy import (
    AheadSize,
    ArrivalRate,
    BatcherLoad,
    ExpectedLoad,
    RunTimes,
    ShapeRunTimes,
    _batch_size,
    _Decision,
    _earliest_deadline_wait,
    _next_batch,
    _Request,
    depth_from,
    queue_wait_s,
)
from workers._batcher_config import BatcherConfig, BatcherStats
from workers.errors import (
    BatcherClosedError,
    BatcherConfigError,
    BatcherError,
    BatcherRequestError,
    BatchSizeMismatchError,
    DeadlineExceededError,
    OverloadedError,
    QueueFullError,
)

__all__ = [
    "AheadSize",
    "ArrivalRate",
    "BatchSizeMismatchError",
    "Batcher",
    "BatcherClosedError",
    "BatcherConfig",
    "BatcherConfigError",
    "BatcherError",
    "BatcherRequestError",
    "BatcherLoad",
    "BatcherStats",
    "DeadlineExceededError",
    "ExpectedLoad",
    "NOT_NOW",
    "OverloadedError",
    "QueueFullError",
    "RunBatch",
    "RunTimes",
    "queue_wait_s",
]

logger = logging.getLogger(__name__)

RunBatch = Callable[[list[Any]], Sequence[Any] | Awaitable[Sequence[Any]]]
"""Runs one batch: takes the payloads in order, returns one result per payload."""

NOT_NOW: Any = type("NotNow", (), {"__repr__": lambda self: "NOT_NOW"})()
"""What :meth:`Batcher.run_now` returns when the request must be submitted instead."""

# Reasons used in ``BatcherStats.rejected``.
_REJECT_DEADLINE = "deadline"
_REJECT_QUEUE_FULL = "queue_full"
_REJECT_CANCELLED = "cancelled"
_REJECT_CLOSED = "closed"
_REJECT_PREDICTED_WAIT = "predicted_wait"
_REJECT_UNREACHABLE = "deadline_unreachable"

_MIN_RETRY_AFTER_S = 0.001
_MAX_SHAPE_TIMES = 64
"""Shapes whose batch run times a batcher keeps apart; a new one pushes out the oldest."""


class Batcher:
    """Groups submitted requests into batches for ``run_batch`` (see the module doc).

    ``run_batch`` takes a list of payloads and returns a list of results of the same
    length. An ``async def`` one is awaited on the loop; a plain one runs in the
    loop's default executor so the loop keeps accepting requests meanwhile (a short
    lone request may run on the loop itself: ``BatcherConfig.inline_max_ms``). An
    exception from it fails exactly the requests of that batch, with that exception.

    Use it from one event loop. It starts on the first ``submit``; ``close()`` stops it.
    ``clock`` (seconds, monotonic) is injectable for tests; deadlines use the same clock.
    """

    def __init__(self, run_batch: RunBatch, config: BatcherConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._run_batch = run_batch
        self._config = config if config is not None else BatcherConfig()
        self._clock = clock
        # The policy's own answer for one request that has just arrived: a queue delay
        # waits for company unless a batch of one is full or preferred.
        self._one_goes_alone = _batch_size(1, self._config, delay_over=self._config.max_queue_delay_ms <= 0) == 1
        self._is_async = inspect.iscoroutinefunction(run_batch) or inspect.iscoroutinefunction(
            getattr(run_batch, "__call__", None)
        )
        self._queues: dict[Hashable, list[_Request]] = {}
        self._depth = 0
        self._seq = itertools.count()
        self._wakeup: asyncio.Event | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._batch_tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        self._drain = False
        self._batches_formed = 0
        self._failed_batches = 0
        self._completed = 0
        self._histogram: Counter[int] = Counter()
        self._rejected: Counter[str] = Counter()
        self._ahead = AheadSize()
        self._lone_run_s: float | None = None
        """How long the last batch of one took (on the executor: with the hand-offs)."""
        self._inline_runs = 0
        self._discarded = 0
        self._times = ShapeRunTimes(_MAX_SHAPE_TIMES)
        self.run_times = self._times.overall
        """Batch run time by size, over every shape ([Note: deadline-aware batching])."""
        self._arrivals = ArrivalRate()
        self._recent_refusals: collections.deque[float] = collections.deque()
        """When the refusals for load of the last second happened (the retry-after hint)."""
        self._batch_ends: dict[asyncio.Task[None], float] = {}
        """Running batch -> its predicted end on the batcher's clock."""
        self._plain_results = False
        """Whether a lone run returned its results directly (not an awaitable): run_now needs that."""

    @property
    def config(self) -> BatcherConfig:
        return self._config

    def stats(self) -> BatcherStats:
        return BatcherStats(
            batches_formed=self._batches_formed,
            batch_size_histogram=dict(sorted(self._histogram.items())),
            rejected=dict(sorted(self._rejected.items())),
            failed_batches=self._failed_batches,
            completed=self._completed,
            queue_depth=self._depth,
            in_flight_batches=len(self._batch_tasks),
            inline_runs=self._inline_runs,
            discarded=self._discarded,
        )

    def load(self) -> BatcherLoad:
        """Queue depth, predicted wait and capacity now (cheap: no lock, no copy of the queue)."""
        cfg = self._config
        full_s = self.run_times.estimate_s(cfg.max_batch_size)
        capacity = None if not full_s else cfg.max_batch_size * cfg.max_concurrent_batches / full_s
        now_s = self._clock()
        self._arrivals.count(now_s, 0)
        return BatcherLoad(queue_depth=self._depth, running_batches=len(self._batch_tasks),
                           predicted_wait_s=self.predicted_wait_s(now_s), batch_run_s=full_s, capacity_rps=capacity,
                           arrival_rps=self._arrivals.rps, urgent_arrival_rps=self._arrivals.urgent_rps,
                           urgent_predicted_wait_s=self.predicted_wait_s(now_s, priority=1))

    def predicted_wait_s(self, now_s: float | None = None, *, batch_size: int | None = None,
                         depth: int | None = None, priority: int = 0) -> float | None:
        """How long a request arriving now would wait for its batch to start: what is
        left of the running batches once every instance is busy, plus the batches of
        ``batch_size`` (default :meth:`ahead_batch_size`) queued ahead of it (``depth``
        requests, default all of ``priority`` or higher), ``max_concurrent_batches`` at a time.
        None before any timing."""
        size = self.ahead_batch_size() if batch_size is None else batch_size
        batch_s = self.run_times.estimate_s(size)
        if batch_s is None:
            return None
        now_s = self._clock() if now_s is None else now_s
        depth = depth_from(self._queues, priority, self._depth) if depth is None else depth
        return queue_wait_s(now_s, depth, tuple(self._batch_ends.values()),
                            batch_s, size, self._config.max_concurrent_batches)

    def ahead_batch_size(self) -> int:
        """The size of the batches that queued requests form: the size batches have formed
        at while others still waited (an EWMA), ``max_batch_size`` before any did.

        [Note: batches ahead]
        A queue drains in batches as large as ``max_batch_size`` only where the deadlines
        allow: a batch holds no request it would finish too late for
        ([Note: deadline-aware batching]), so past capacity with tight deadlines the
        queue drains in smaller batches, and a wait predicted at full batches reads short.
        ResNet50 on one engine of the in-process pool here, 64 closed-loop clients with
        200 ms deadlines, three alternating pairs of 10 s: batches of 2 formed; predicted at
        full batches, the admitted requests' wait read 48-61 ms where they waited 69-72 ms;
        at the size batches formed, 67.6-70.0 ms where they waited 68.0-70.2 ms (goodput
        28.0-29.2 against 25.0-28.3 req/s). A batch formed with nothing left waiting took
        what had arrived, which says nothing of this, so only batches formed with others
        still waiting are counted."""
        return self._ahead.size(self._config.max_batch_size)

    def _retry_after_s(self, now_s: float, *, wait_s: float | None = None, batch_size: int | None = None) -> float:
        """When a refused request should come back ([Note: retry after]); counts the refusal."""
        refused = self._recent_refusals
        refused.append(now_s)
        while refused and refused[0] < now_s - 1.0:
            refused.popleft()
        if wait_s is None:
            wait_s = self.predicted_wait_s(now_s, batch_size=batch_size)
        if wait_s is None:
            return max(self._config.max_queue_delay_ms / 1e3, _MIN_RETRY_AFTER_S)
        size = self._config.max_batch_size if batch_size is None else batch_size
        batch_s = self.run_times.estimate_s(size)
        assert batch_s is not None  # a wait estimate implies a timed run
        capacity_rps = size * self._config.max_concurrent_batches / max(batch_s, 1e-9)
        # [Note: retry after]
        # The queue ahead must drain before a request like this one fits, and so must
        # the other requests refused meanwhile, which come back too: the hint is the
        # longer of the predicted wait and the time the pool needs to serve the
        # requests it refused in the last second. A hint of the wait alone brings all
        # refused clients back at once to be refused again; on 2 cores, 64 clients
        # sending a ResNet50 input then spent the gateway's CPU on refusals.
        return max(wait_s, batch_s, len(refused) / capacity_rps, _MIN_RETRY_AFTER_S)

    async def submit(
        self,
        payload: Any,
        *,
        deadline_s: float | None = None,
        priority: int = 0,
        shape_key: Hashable = None,
    ) -> Any:
        """Queues one request and returns its result once its batch has run.

        ``deadline_s`` is absolute, on the batcher's clock (``time.monotonic()`` by
        default). Raises DeadlineExceededError if it passes before the request runs,
        QueueFullError (retry-able) when the queue is full, BatcherClosedError after
        ``close()``, or whatever ``run_batch`` raised for this request's batch.
        Cancelling the call removes the request from the queue.
        """
        request = self.enqueue(payload, deadline_s=deadline_s, priority=priority, shape_key=shape_key)
        assert request.future is not None
        try:
            return await request.future
        except asyncio.CancelledError:
            self.withdraw(request)
            raise

    def enqueue(
        self,
        payload: Any,
        *,
        deadline_s: float | None = None,
        priority: int = 0,
        shape_key: Hashable = None,
    ) -> _Request:
        """``submit`` without waiting: queues the request and returns it; its ``future``
        gets the result. Raises at once what ``submit`` raises at once. A caller that
        stops waiting must :meth:`withdraw` it.

        Several requests enqueued in one go cost one wake-up of the scheduling loop and
        no task each (a frame of requests from a pool: ``SegmentHost.infer_batch``).
        """
        now_s = self._admit(deadline_s, priority, shape_key)
        if self._depth >= self._config.max_queue_size:
            self._rejected[_REJECT_QUEUE_FULL] += 1
            retry_s = self._retry_after_s(now_s)
            raise QueueFullError(
                f"queue full: {self._depth} requests waiting, limit max_queue_size="
                f"{self._config.max_queue_size}; retry-able: retry after {retry_s * 1e3:.0f} ms, or "
                "raise max_queue_size",
                queue_size=self._depth,
                max_queue_size=self._config.max_queue_size,
                retry_after_s=retry_s,
            )
        if deadline_s is not None:
            self._refuse_if_late(now_s, deadline_s, shape_key, priority)
        request = _Request(
            seq=next(self._seq),
            payload=payload,
            shape_key=shape_key,
            priority=priority,
            arrival_s=now_s,
            deadline_s=deadline_s,
            future=asyncio.get_running_loop().create_future(),
        )
        queue = self._queues.setdefault(shape_key, [])
        bisect.insort(queue, request, key=lambda r: r.sort_key)
        self._depth += 1
        self._ensure_running()
        assert self._wakeup is not None
        self._wakeup.set()
        return request

    def _refuse_if_late(self, now_s: float, deadline_s: float, shape_key: Hashable = None, priority: int = 0) -> None:
        """Refuses a new request whose predicted wait and run end after its deadline.

        The batches ahead of it are taken to be as large as its own deadline allows
        (what :func:`_fit` forms), at least one request, and no larger than the batches
        that form under a queue ([Note: batches ahead]); its own batch takes what batches
        of its shape take. Only the requests of its priority or higher are ahead of it."""
        est = self._times.upper_of(shape_key)
        one_s = est(1)
        if one_s is None:
            return
        depth = depth_from(self._queues, priority, self._depth)
        budget_s = deadline_s - now_s
        if one_s <= budget_s and depth == 0 and len(self._batch_tasks) < self._config.max_concurrent_batches:
            return  # an idle instance runs it alone at once: the lone request's path stays short
        size = 1
        while size < self._config.max_batch_size and est(size + 1) <= budget_s:  # type: ignore[operator]
            size += 1
        ahead = min(size, self.ahead_batch_size())
        wait_s = self.predicted_wait_s(now_s, batch_size=ahead, depth=depth)
        assert wait_s is not None
        run_s = est(depth % ahead + 1)  # its own batch: what the batches ahead leave, and itself
        assert run_s is not None
        finish_s = now_s + wait_s + run_s
        if finish_s <= deadline_s:
            return
        self._rejected[_REJECT_PREDICTED_WAIT] += 1
        retry_s = self._retry_after_s(now_s, wait_s=wait_s, batch_size=size)
        raise OverloadedError(
            f"refused at once: predicted to finish {(finish_s - now_s) * 1e3:.1f} ms from now "
            f"({wait_s * 1e3:.1f} ms queued behind {depth} requests + {run_s * 1e3:.1f} ms run), "
            f"after its deadline {(deadline_s - now_s) * 1e3:.1f} ms from now; retry after "
            f"{retry_s * 1e3:.0f} ms, send a later deadline or add capacity",
            reason=_REJECT_PREDICTED_WAIT, predicted_finish_s=finish_s, deadline_s=deadline_s,
            retry_after_s=retry_s,
        )

    def withdraw(self, request: _Request) -> bool:
        """Takes back a request from :meth:`enqueue` that has not run; False if it already
        ran or was rejected. Its future is left as it is."""
        if self._remove(request):
            self._rejected[_REJECT_CANCELLED] += 1
            return True
        return False

    def run_now(
        self,
        payload: Any,
        *,
        deadline_s: float | None = None,
        priority: int = 0,
        shape_key: Hashable = None,
        run: Callable[[list[Any]], Sequence[Any]] | None = None,
    ) -> Any:
        """Runs a lone request at once, on the calling thread, when the batcher is idle
        (nothing waiting, nothing running) and lone runs are short (``inline_max_ms``,
        [Note: inline runs]); returns :data:`NOT_NOW` otherwise, and the caller then
        submits it. ``run`` (default: the batcher's ``run_batch``) runs it, given the
        one-payload list. With several instances too: nothing runs on them meanwhile, and
        what arrives during the run waits in the caller's socket, as it would wait for
        the engine.

        [Note: run now]
        Through ``submit`` a lone request still takes three event-loop iterations before
        and after its inline run (the scheduling loop's wake-up, the batch's task, the
        caller's wake-up). Here it takes none. The request counts as a batch of one in
        the stats, and raises at once what ``submit`` would raise for it.
        """
        if not self.can_run_now():
            return NOT_NOW
        now_s = self._admit(deadline_s, priority, shape_key)
        if deadline_s is not None:
            self._refuse_if_late(now_s, deadline_s, shape_key)
        self._batches_formed += 1
        self._histogram[1] += 1
        start_s = time.perf_counter()
        try:
            results = (run or self._run_batch)([payload])
        except Exception as e:
            self._failed_batches += 1
            logger.warning("run_batch failed for a batch of 1 (shape_key=%r): %r", shape_key, e)
            raise
        finally:
            self._lone_run_s = time.perf_counter() - start_s
            self._times.observe(shape_key, 1, self._lone_run_s)
        self._inline_runs += 1
        results = list(results)  # type: ignore[arg-type] # _plain_results: run_batch returns results, not awaitables
        if len(results) != 1:
            self._failed_batches += 1
            raise _size_mismatch(1, len(results))
        self._completed += 1
        return results[0]

    def takes_priority(self, priority: int) -> bool:
        """Whether ``priority`` is one of this batcher's levels."""
        return type(priority) is int and 0 <= priority < self._config.num_priority_levels

    def can_run_now(self) -> bool:
        """Whether :meth:`run_now` would run a request now: idle, lone runs short, and no
        queue delay to wait for company."""
        return not (self._depth or self._batch_tasks or self._closing or not self._plain_results
                    or not self._one_goes_alone or self._lone_run_s is None
                    or self._lone_run_s * 1e3 > self._config.inline_max_ms)

    def _admit(self, deadline_s: float | None, priority: int, shape_key: Hashable) -> float:
        """Checks a new request (closed, priority, shape key, deadline); returns now."""
        if self._closing:
            self._rejected[_REJECT_CLOSED] += 1
            raise BatcherClosedError(
                "the batcher is closed and takes no new requests; create a new Batcher",
                pending=self._depth,
            )
        levels = self._config.num_priority_levels
        if not (isinstance(priority, int) and 0 <= priority < levels):
            raise BatcherRequestError(
                f"priority={priority!r} is outside [0, {levels}); pass an int in that range "
                "or raise BatcherConfig.num_priority_levels",
                field_name="priority",
                value=priority,
            )
        try:
            hash(shape_key)
        except TypeError as e:
            raise BatcherRequestError(
                f"shape_key={shape_key!r} is not hashable; pass a tuple such as the input shape",
                field_name="shape_key",
                value=repr(shape_key),
            ) from e
        now_s = self._clock()
        self._arrivals.count(now_s, urgent=priority > 0)
        if deadline_s is not None and deadline_s <= now_s:
            self._rejected[_REJECT_DEADLINE] += 1
            raise DeadlineExceededError(
                f"deadline_s={deadline_s:.6f} had already passed at submit (now {now_s:.6f}); "
                "send a later deadline",
                deadline_s=deadline_s,
                now_s=now_s,
            )
        return now_s

    async def close(self, *, drain: bool = True) -> None:
        """Stops taking requests. ``drain=True`` runs everything queued first, without
        waiting for the delay; ``drain=False`` fails the queued requests with
        BatcherClosedError. Batches already running finish in both cases."""
        self._closing = True
        self._drain = drain
        logger.info("closing batcher: drain=%s, %d queued, %d batches running",
                    drain, self._depth, len(self._batch_tasks))
        if not drain:
            for request in [r for q in self._queues.values() for r in q]:
                self._remove(request)
                self._rejected[_REJECT_CLOSED] += 1
                self._fail(request, BatcherClosedError(
                    "the batcher was closed with drain=False before this request ran; "
                    "resubmit it to another batcher or close with drain=True",
                    pending=1,
                ))
        if self._loop_task is not None:
            assert self._wakeup is not None
            self._wakeup.set()
            await asyncio.shield(self._loop_task)
        if self._batch_tasks:
            await asyncio.gather(*self._batch_tasks, return_exceptions=True)

    # -- the loop -----------------------------------------------------------------

    def _ensure_running(self) -> None:
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._schedule_loop())

    def _remove(self, request: _Request) -> bool:
        queue = self._queues.get(request.shape_key)
        if queue is None:
            return False
        i = bisect.bisect_left(queue, request.sort_key, key=lambda r: r.sort_key)
        if i < len(queue) and queue[i] is request:
            del queue[i]
            self._depth -= 1
            if not queue:
                del self._queues[request.shape_key]
            return True
        return False

    @staticmethod
    def _fail(request: _Request, error: BaseException) -> None:
        if request.future is not None and not request.future.done():
            request.future.set_exception(error)

    async def _schedule_loop(self) -> None:
        try:
            await self._schedule_forever()
        except BaseException as e:
            # Nothing would ever answer the queued requests: fail them rather than
            # leave their callers waiting forever.
            if not isinstance(e, asyncio.CancelledError):
                logger.exception("batcher scheduling loop failed; failing %d queued requests",
                                 self._depth)
            for request in [r for q in self._queues.values() for r in q]:
                self._remove(request)
                self._fail(request, BatcherClosedError(
                    f"the batcher's scheduling loop stopped ({e!r}) before this request ran; "
                    "resubmit it to a new Batcher",
                    pending=1, detail=repr(e),
                ))
            if not isinstance(e, Exception):
                raise
            # Logged above and answered: a task left holding it would log it again when
            # collected, at any later point of the process.

    async def _schedule_forever(self) -> None:
        assert self._wakeup is not None
        while True:
            decision, now_s = self._start_ready()
            if self._closing and self._depth == 0:
                return
            if decision.batch:
                # All instances busy: a finishing batch sets the wake-up; meanwhile
                # only a deadline can change anything.
                timeout_s = _earliest_deadline_wait(self._queues, now_s)
            else:
                timeout_s = decision.wait_s
            self._wakeup.clear()
            try:
                async with asyncio.timeout(timeout_s):
                    await self._wakeup.wait()
            except TimeoutError:
                pass

    def _start_ready(self) -> tuple[_Decision, float]:
        """Fails the expired requests and starts batches while an instance is free;
        returns the decision that started none, and when it was made."""
        while True:
            now_s = self._clock()
            decision = _next_batch(self._queues, now_s, self._config, flush=self._closing,
                                   run_s=self.run_times.upper_s, start_s=self._free_at_s(now_s),
                                   run_s_of_shape=self._times.upper_of)
            for request in decision.unreachable:
                self._remove(request)
                self._rejected[_REJECT_UNREACHABLE] += 1
                assert request.deadline_s is not None
                end_s = decision.batch_end_s if decision.batch_end_s is not None else now_s
                retry_s = self._retry_after_s(now_s)
                self._fail(request, OverloadedError(
                    f"refused before running: its batch is predicted to end {(end_s - now_s) * 1e3:.1f} ms "
                    f"from now, after its deadline {(request.deadline_s - now_s) * 1e3:.1f} ms from now "
                    f"(it waited {(now_s - request.arrival_s) * 1e3:.1f} ms); retry after "
                    f"{retry_s * 1e3:.0f} ms, send a later deadline or add capacity",
                    reason=_REJECT_UNREACHABLE, predicted_finish_s=end_s, deadline_s=request.deadline_s,
                    retry_after_s=retry_s,
                ))
            for request in decision.expired:
                self._remove(request)
                self._rejected[_REJECT_DEADLINE] += 1
                self._fail(request, DeadlineExceededError(
                    f"deadline_s={request.deadline_s:.6f} passed after "
                    f"{(now_s - request.arrival_s) * 1e3:.3f} ms in the queue, before the "
                    "request could run; send a later deadline or add capacity",
                    deadline_s=request.deadline_s,
                    now_s=now_s,
                ))
            if decision.batch and len(self._batch_tasks) < self._config.max_concurrent_batches:
                self._dispatch(decision.batch, now_s, decision.batch_end_s)
                continue
            return decision, now_s

    def _free_at_s(self, now_s: float) -> float:
        """When an instance is predicted free: now if one is, else the earliest predicted end."""
        if len(self._batch_tasks) < self._config.max_concurrent_batches or not self._batch_ends:
            return now_s
        return max(now_s, min(self._batch_ends.values()))

    def _dispatch(self, batch: tuple[_Request, ...], now_s: float, end_s: float | None) -> None:
        for request in batch:
            self._remove(request)
        if self._depth:  # [Note: batches ahead]
            self._ahead.formed(len(batch))
        self._batches_formed += 1
        self._histogram[len(batch)] += 1
        logger.debug("batch formed: size=%d shape_key=%r queue_depth=%d",
                     len(batch), batch[0].shape_key, self._depth)
        loop = asyncio.get_running_loop()
        payloads = [r.payload for r in batch]
        cfg = self._config
        # [Note: inline runs]
        # Handing a batch to the executor and its results back to the loop wakes a
        # sleeping thread each way: 0.2 ms each on 2 cores here, a third of what serving
        # adds to a lone request. A lone request whose runs are short runs on the loop
        # instead; the loop takes nothing in meanwhile, and what arrives waits in the
        # socket and forms the next batch, as it would have waited for the engine anyway.
        # Never with company waiting or another instance running: there, overlapping the
        # run with the loop's work is worth more than the hand-offs.
        inline = (not self._is_async and len(batch) == 1 and self._depth == 0 and cfg.max_concurrent_batches == 1
                  and self._lone_run_s is not None and self._lone_run_s * 1e3 <= cfg.inline_max_ms)
        # Otherwise a plain run_batch starts on the executor now rather than in the task's
        # first step, an event-loop iteration later (see [Note: back-to-back batches]).
        running = None if self._is_async or inline else loop.run_in_executor(None, self._run_batch, payloads)
        task = loop.create_task(self._execute(batch, payloads, running, inline, now_s))
        self._batch_tasks.add(task)
        self._batch_ends[task] = end_s if end_s is not None else now_s
        task.add_done_callback(self._batch_done)

    def _batch_done(self, task: asyncio.Task[None]) -> None:
        self._batch_tasks.discard(task)
        self._batch_ends.pop(task, None)
        if self._wakeup is not None:
            self._wakeup.set()

    def _start_next(self) -> None:
        """Frees the current batch's instance and starts the next batch on it.

        [Note: back-to-back batches]
        A finished batch first starts the next one, then answers its own callers.
        Left to the scheduling loop, the next batch would start only after the wake-ups
        of every caller in this batch had run (they are queued on the event loop before
        the loop's own): measured 0.9 ms (p50) between batch-8 runs of the DenseNet121
        tail at concurrency 32 on 2 cores with the next batch already waiting, 10 % of
        the engine's time. With this order it measured 0.54-0.87 ms over five runs on a
        noisy machine: most of the gap is the hand-off from the executor thread to the
        loop and back (an empty ``run_in_executor`` takes 0.2 ms here) and the loop's
        other Python work, which holds the GIL the engine thread needs to start.
        """
        task = asyncio.current_task()
        self._batch_tasks.discard(task)  # type: ignore[arg-type]
        self._batch_ends.pop(task, None)  # type: ignore[arg-type]
        try:
            self._start_ready()
        except Exception:  # noqa: BLE001 - this batch is answered regardless; the
            # scheduling loop, woken by _batch_done, meets the same failure and fails the queue.
            pass

    async def _execute(self, batch: tuple[_Request, ...], payloads: list[Any], running: Any, inline: bool,
                       dispatched_s: float) -> None:
        try:
            start_s = time.perf_counter()
            if inline:
                results = self._run_batch(payloads)
            elif running is None:
                results = await self._run_batch(payloads)
            else:
                results = await running
            if not self._is_async:
                if len(batch) == 1:
                    self._lone_run_s = time.perf_counter() - start_s
                    self._inline_runs += inline
                    self._plain_results = not inspect.isawaitable(results)
                if inspect.isawaitable(results):
                    results = await results
            results = list(results)
            if len(results) != len(batch):
                raise _size_mismatch(len(batch), len(results))
            self._times.observe(batch[0].shape_key, len(batch), self._clock() - dispatched_s)
        except asyncio.CancelledError:
            for request in batch:
                self._fail(request, BatcherClosedError(
                    "the batch running this request was cancelled (event loop shutting "
                    "down); resubmit it to a new Batcher",
                    pending=len(batch),
                ))
            raise
        except Exception as e:  # noqa: BLE001 - any failure belongs to this batch only
            self._failed_batches += 1
            logger.warning("run_batch failed for a batch of %d (shape_key=%r): %r",
                           len(batch), batch[0].shape_key, e)
            self._start_next()
            for request in batch:
                self._fail(request, e)
            return
        self._start_next()
        now_s = self._clock()
        for request, result in zip(batch, results):
            if request.expired(now_s) or request.future is None or request.future.done():
                # Computed for nothing ([Note: deadline-aware batching]); still handed
                # over when someone waits, as the caller decides what is late.
                self._discarded += 1
            if request.future is not None and not request.future.done():
                request.future.set_result(result)
                self._completed += 1


def _size_mismatch(batch_size: int, num_results: int) -> BatchSizeMismatchError:
    return BatchSizeMismatchError(
        f"run_batch returned {num_results} results for a batch of {batch_size} "
        "requests; it must return exactly one result per payload, in order",
        batch_size=batch_size,
        num_results=num_results,
    )
