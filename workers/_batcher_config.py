"""The dynamic batcher's configuration and counters (workers.batcher exports both)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass

from workers.errors import BatcherConfigError

__all__ = ["BatcherConfig", "BatcherStats"]


@dataclass(frozen=True)
class BatcherConfig:
    """How the dynamic batcher groups requests. Limits are checked on construction."""

    max_batch_size: int = 8
    """Most requests in one batch; a batch forms at once when this many are waiting."""

    max_queue_delay_ms: float = 2.0
    """Longest the oldest waiting request waits for company before its batch forms,
    even if it is smaller than any preferred size. 0 dispatches at once."""

    preferred_batch_sizes: tuple[int, ...] = ()
    """Batch sizes the model runs best at (for example 4 and 8 on a GPU). As soon as
    one of them is reachable a batch of the largest reachable one forms, without
    waiting for the delay. Each must lie in [1, max_batch_size]."""

    max_queue_size: int = 1024
    """Most requests waiting (not yet running). Beyond it ``submit`` raises the
    retry-able QueueFullError instead of queueing forever."""

    num_priority_levels: int = 1
    """Priority levels; ``submit(priority=p)`` takes p in [0, num_priority_levels) and
    larger p is batched first."""

    max_concurrent_batches: int = 1
    """Batches running at once (one per model instance). While all are busy, requests
    keep queueing, so the next batch can grow."""

    inline_max_ms: float = 0.0
    """A lone request (a batch of one, nothing else waiting, one instance) runs a plain
    ``run_batch`` on the event loop's own thread, without the two thread hand-offs,
    when the last such run took at most this long (see [Note: inline runs] in
    workers/batcher.py). 0 never does; every batch then runs on the executor."""

    def _at_least(self, name: str, minimum: int, fix: str = "") -> None:
        value = getattr(self, name)
        if not value >= minimum:  # `not >=` also refuses NaN
            raise BatcherConfigError(f"{name}={value} must be >= {minimum}{fix}", field_name=name, value=value)

    def __post_init__(self) -> None:
        self._at_least("max_batch_size", 1, "; use 1 to disable batching")
        self._at_least("max_queue_delay_ms", 0, "; use 0 to dispatch without waiting")
        sizes = tuple(self.preferred_batch_sizes)
        bad = [s for s in sizes if not 1 <= s <= self.max_batch_size]
        if bad:
            raise BatcherConfigError(
                f"preferred_batch_sizes={sizes} has {bad} outside [1, max_batch_size="
                f"{self.max_batch_size}]; drop them or raise max_batch_size",
                field_name="preferred_batch_sizes",
                value=sizes,
            )
        # Sorted and deduplicated so that equal configs compare equal.
        object.__setattr__(self, "preferred_batch_sizes", tuple(sorted(set(sizes))))
        self._at_least("max_queue_size", 1)
        self._at_least("num_priority_levels", 1)
        self._at_least("max_concurrent_batches", 1)
        self._at_least("inline_max_ms", 0, "; use 0 to run every batch on the executor")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> BatcherConfig:
        data = json.loads(text)
        data["preferred_batch_sizes"] = tuple(data.get("preferred_batch_sizes", ()))
        return cls(**data)


@dataclass(frozen=True)
class BatcherStats:
    """A snapshot of the batcher's counters."""

    batches_formed: int
    """Batches handed to run_batch."""

    batch_size_histogram: Mapping[int, int]
    """Batch size -> number of batches of that size."""

    rejected: Mapping[str, int]
    """Reason -> requests rejected: 'deadline' (passed while queued), 'queue_full',
    'predicted_wait' and 'deadline_unreachable' (cannot finish in time: refused at once,
    see [Note: deadline-aware batching] in workers/_batch_policy.py), 'cancelled', 'closed'."""

    failed_batches: int
    """Batches whose run_batch raised."""

    completed: int
    """Requests answered with a result."""

    queue_depth: int
    """Requests waiting now (not yet in a batch)."""

    in_flight_batches: int
    """Batches running now."""

    inline_runs: int = 0
    """Lone requests run on the event loop's thread (``BatcherConfig.inline_max_ms``)."""

    discarded: int = 0
    """Results computed but thrown away: their deadline had passed, or their caller had
    stopped waiting, by the time their batch finished."""

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["batch_size_histogram"] = {str(k): v for k, v in self.batch_size_histogram.items()}
        data["rejected"] = dict(self.rejected)
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> BatcherStats:
        data = json.loads(text)
        data["batch_size_histogram"] = {
            int(k): v for k, v in data["batch_size_histogram"].items()
        }
        return cls(**data)
