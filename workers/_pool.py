"""The pure parts of the cloud tier's actors: values, checks and routing decisions.

Nothing here imports Ray (that door is :mod:`workers.actors`), so the routing policy,
the deadline arithmetic and the input checks are unit-testable without a cluster.

[Note: least-loaded routing]
The caller counts its own requests in flight per replica and sends each new request to
the replica with the fewest, skipping replicas that recently failed (they are "down"
until ``down_until_s``) unless every replica is down. Ties go round-robin from a
rotating start so an idle pool spreads load. Counting on the caller's side costs no
round trip, and it is exact for one caller; with several callers it is each caller's
view, which is what Ray Serve's power-of-two router also settles for.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from workers.engine import EngineConfig, TensorSpec
from workers.errors import ActorConfigError, InputError

__all__ = [
    "PoolConfig",
    "PoolStats",
    "RequestTiming",
    "SegmentStats",
    "WorkerStats",
    "check_inputs",
    "make_segment_key",
    "num_gpus_for",
    "pick_replica",
    "to_monotonic_deadline",
]


def make_segment_key(model: str, version: str | int, cut: str | int) -> str:
    """``model@version@cut``: the name one engine is loaded and addressed under."""
    parts = [str(model), str(version), str(cut)]
    for p in parts:
        if not p or "@" in p:
            raise ActorConfigError(
                f"segment key part {p!r} of {parts} is empty or contains '@'; "
                "use names without '@' such as ('resnet50', '1', 'c43')",
                field_name="segment_key", value=p, model=str(model),
            )
    return "@".join(parts)


def num_gpus_for(config: EngineConfig) -> float:
    """GPUs to ask Ray for: one for the CUDA, TensorRT and torch-cuda providers, none for CPU.

    ``auto`` asks for none: it takes a GPU only when the actor happens to land on one,
    and asking would make the actor unschedulable on CPU-only clusters.
    """
    return 1.0 if config.provider in ("cuda", "tensorrt", "torch-cuda") else 0.0


def to_monotonic_deadline(
    *,
    deadline_unix_ms: float | None,
    budget_ms: float | None,
    now_unix_s: float,
    now_monotonic_s: float,
) -> float | None:
    """The earlier of an absolute wall-clock deadline and a relative budget, on the
    monotonic clock of this process (the batcher's clock); ``None`` when neither is set.

    Wall-clock deadlines cross machines (the gateway sets them); budgets do not depend
    on clock agreement but start counting only here, after the transport.
    """
    out: float | None = None
    if deadline_unix_ms is not None:
        out = now_monotonic_s + (deadline_unix_ms / 1e3 - now_unix_s)
    if budget_ms is not None:
        if budget_ms < 0:
            raise ActorConfigError(
                f"budget_ms={budget_ms} is negative; pass the time left in milliseconds (>= 0)",
                field_name="budget_ms", value=budget_ms,
            )
        b = now_monotonic_s + budget_ms / 1e3
        out = b if out is None else min(out, b)
    return out


def _describe(value: np.ndarray) -> str:
    return f"{value.dtype}[{','.join(map(str, value.shape))}]"


def check_inputs(
    specs: Sequence[TensorSpec], inputs: object, *, max_batch: int, name: str
) -> int:
    """Checks one request against a segment's inputs; returns its number of rows.

    Done per request before batching, so that one bad request fails alone instead of
    failing the batch it would have joined. Raises :class:`InputError` naming the
    input, what was expected and what came.
    """
    if not isinstance(inputs, Mapping):
        raise InputError(
            f"inputs of {name} must be a dict of name -> numpy array, got {type(inputs).__name__}",
            model=name,
        )
    want_names = {s.name for s in specs}
    if set(inputs) != want_names:
        missing = sorted(want_names - set(inputs))
        extra = sorted(map(str, set(inputs) - want_names))
        raise InputError(
            f"inputs of {name} do not match: missing {missing}, unexpected {extra}; "
            f"pass exactly {sorted(want_names)}",
            model=name, expected=", ".join(sorted(want_names)), given=", ".join(sorted(map(str, inputs))),
        )
    rows: int | None = None
    for spec in specs:
        value = inputs[spec.name]
        # Messages are formatted only on failure: this runs for every request.
        if not isinstance(value, np.ndarray):
            want = spec.describe(max_batch)
            raise InputError(
                f"input {spec.name!r} of {name} is a {type(value).__name__}, expected a numpy array "
                f"{want}; convert it with np.asarray(value, dtype=np.{spec.dtype})",
                model=name, input_name=spec.name, expected=want, given=type(value).__name__,
            )
        if value.dtype != spec.dtype:
            want = spec.describe(max_batch)
            raise InputError(
                f"input {spec.name!r} of {name} has dtype {value.dtype}, expected {want}; "
                f"cast it with .astype(np.{spec.dtype})",
                model=name, input_name=spec.name, expected=want, given=_describe(value),
            )
        shape = value.shape
        dims_ok = len(shape) == len(spec.shape) and all(d is None or d == g for d, g in zip(spec.shape, shape))
        n = shape[0] if shape else 1
        if not dims_ok or (spec.shape and spec.shape[0] is None and not 1 <= n <= max_batch):
            want = spec.describe(max_batch)
            fix = "reshape it to the expected shape" if not dims_ok else f"send at most {max_batch} rows per request"
            raise InputError(
                f"input {spec.name!r} of {name} has shape {_describe(value)}, expected {want}; {fix}",
                model=name, input_name=spec.name, expected=want, given=_describe(value),
            )
        if rows is not None and n != rows:
            raise InputError(
                f"input {spec.name!r} of {name} has {n} rows but the other inputs have {rows}; "
                "give every input the same batch size",
                model=name, input_name=spec.name, expected=f"{rows} rows", given=f"{n} rows",
            )
        rows = n
    return rows or 1


def pick_replica(
    in_flight: Sequence[int],
    down_until_s: Sequence[float],
    now_s: float,
    *,
    start: int = 0,
    exclude: int | None = None,
) -> int | None:
    """Index of the replica to send the next request to (see [Note: least-loaded routing]).

    Pure. ``exclude`` is a replica just seen failing: it is chosen only when it is the
    sole replica. Returns ``None`` for an empty pool.
    """
    n = len(in_flight)
    if n <= 1:
        return 0 if n else None
    # One pass in round-robin order from ``start``: replicas that are up before those
    # that are down, then the fewest in flight; the first of equals wins.
    best, best_rank = 0, None
    for k in range(n):
        i = (start + k) % n
        if i == exclude:
            continue
        rank = (down_until_s[i] > now_s, in_flight[i])
        if best_rank is None or rank < best_rank:
            best, best_rank = i, rank
    return best


_RAY_OWN_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})
"""Resources Ray asks for by their own options, never in ``resources``."""


@dataclass(frozen=True)
class PoolConfig:
    """How a replica pool places, restarts and retries."""

    num_replicas: int = 1
    """Actors serving the same segments."""
    max_restarts: int = 3
    """Times Ray restarts a dead replica (its segments reload from the creation args)."""
    max_retries: int = 1
    """Times a request whose replica died is sent again, to another replica when one is up."""
    down_s: float = 1.0
    """After a replica fails, how long routing avoids it (it is restarting meanwhile)."""
    max_concurrency: int = 1000
    """Requests one replica accepts at once (Ray's async actor concurrency)."""
    num_cpus: float = 0.0
    """CPUs each replica reserves in Ray's scheduler (0 lets replicas share a small node)."""
    caller_batch_size: int = 8
    """Most requests one actor call carries (see [Note: caller-side batching] in
    workers/actors.py); 1 sends every request in its own call."""
    sends_per_replica: int = 2
    """Actor calls in flight per replica (per engine instance of it) before further
    requests wait to be batched."""
    direct: bool = True
    """Send requests to replicas over a direct channel (a Unix-domain socket on the
    caller's node, TCP to other nodes; see [Note: direct channel] in
    workers/_transport/framing.py) instead of plain actor calls; a replica gets plain calls until
    its channel is open. ``False`` sends everything by plain calls."""
    direct_over_tcp: bool = False
    """Use the TCP form of the channel for same-node replicas too (where the caller
    cannot reach the replica's temporary directory, e.g. another container)."""
    tcp_pickle: bool = False
    """Let the direct channel's TCP form (replicas on other nodes, or ``direct_over_tcp``)
    carry pickle frames. Off, a TCP channel carries tensor frames only and refuses pickle
    on both ends: a request or answer that needs pickle (an error, an object or strided
    array, a numpy scalar) goes by a plain Ray call instead. The channel's token travels
    in clear and pickle runs what it reads, so turn this on only where nobody else can
    reach the cluster network (see [Note: no pickle over TCP] in workers/_transport/framing.py)."""
    shared_memory: bool = True
    """On a Unix-domain channel, carry arrays of 32 KiB and more through memory shared
    with the replica rather than through the socket (see [Note: channel arena] in
    workers/_transport/arena.py); ``False`` sends every byte through the socket."""

    instances: int = 1
    """Engines per segment in each replica, running its batches side by side, each on
    its share of the engine's intra-op threads (see [Note: engine instances] in
    workers/segment.py); the pool keeps ``sends_per_replica`` sends in flight per instance."""
    resources: Mapping[str, float] = field(default_factory=dict)
    """Ray custom resources each replica asks for, which places replicas on the nodes
    that declare them (``ray start --resources='{"tail-tier": 4}'``, or a KubeRay worker
    group's ``rayStartParams``); a replica on another node than the caller's is reached
    over the direct channel's TCP form."""

    def __post_init__(self) -> None:
        checks = (
            ("num_replicas", self.num_replicas >= 1, "use 1 or more"),
            ("instances", type(self.instances) is int and self.instances >= 1, "use 1 or more engines per segment"),
            ("max_restarts", self.max_restarts >= -1, "use -1 (forever), 0 or more"),
            ("max_retries", self.max_retries >= 0, "use 0 (fail at once) or more"),
            ("down_s", self.down_s >= 0, "use 0 or more seconds"),
            ("max_concurrency", self.max_concurrency >= 1, "use 1 or more"),
            ("num_cpus", self.num_cpus >= 0, "use 0 or more"),
            ("caller_batch_size", self.caller_batch_size >= 1, "use 1 (no caller-side batching) or more"),
            ("sends_per_replica", self.sends_per_replica >= 1, "use 1 or more"),
            ("resources", isinstance(self.resources, Mapping) and all(
                isinstance(k, str) and k and k not in _RAY_OWN_RESOURCES
                and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                for k, v in self.resources.items()),
             'use a dict of custom resource name -> amount > 0, e.g. {"tail-tier": 1} (CPUs and GPUs come '
             "from num_cpus and the engine's provider)"),
        )
        for name, ok, fix in checks:
            if not ok:
                raise ActorConfigError(
                    f"PoolConfig.{name}={getattr(self, name)!r} is invalid; {fix}",
                    field_name=name, value=getattr(self, name),
                )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PoolConfig:
        return cls(**json.loads(text))


class RequestTiming(NamedTuple):
    """Where one request's time went inside a worker; it travels back with the outputs.

    A named tuple, not a frozen dataclass: one is made per answer on each side of the
    direct channel, and ``tuple.__new__(RequestTiming, (...))`` makes it in one C call
    (:func:`new_timing`), where the dataclass's ``__init__`` set each field through
    ``object.__setattr__``: about 18 us right after an engine run here, against 2 us.
    """

    queue_s: float
    """Arrival at the worker's batcher to the start of the request's batch."""
    compute_s: float
    """The run of the request's batch."""
    batch_size: int
    """Requests in that batch."""
    first_in_batch: bool = False
    """True for exactly one request of each batch, so a caller counts every batch once."""

    def to_json(self) -> str:
        return json.dumps(self._asdict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RequestTiming:
        return cls(**json.loads(text))


new_timing = functools.partial(tuple.__new__, RequestTiming)
"""``new_timing((queue_s, compute_s, batch_size, first_in_batch))``: a RequestTiming
without a Python frame, for the hot paths (all four fields given, of their types)."""


@dataclass(frozen=True)
class SegmentStats:
    """One loaded segment on one worker."""

    key: str
    """``model@version@cut``."""
    provider: str
    """Execution provider of its engine."""
    batch_safe: bool
    """Whether requests run as one batch."""
    max_batch: int
    """Largest batch bucket."""
    requests: int
    """Requests received (bad ones included)."""
    completed: int
    """Requests answered with outputs."""
    input_errors: int
    """Requests refused for bad names, dtypes or shapes."""
    failed: int
    """Requests that failed otherwise (deadline, queue full, run error)."""
    engine_median_ms: float
    """Median engine run time over its recent runs."""
    batches_formed: int
    """Batches the segment's batcher formed and ran."""
    batch_size_histogram: Mapping[int, int] = field(default_factory=dict)
    """Batch size -> number of batches."""
    instances: int = 1
    """Engines that run its batches side by side (see [Note: engine instances] in workers/segment.py)."""
    discarded: int = 0
    """Results computed after their deadline and thrown away (`workers.batcher.BatcherStats.discarded`)."""

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["batch_size_histogram"] = {str(k): v for k, v in self.batch_size_histogram.items()}
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SegmentStats:
        d = json.loads(text)
        d["batch_size_histogram"] = {int(k): v for k, v in d["batch_size_histogram"].items()}
        return cls(**d)


@dataclass(frozen=True)
class WorkerStats:
    """A snapshot of one SegmentWorker."""

    pid: int
    """Process id of the actor (changes when Ray restarts it)."""
    started_unix_s: float
    """When this incarnation started."""
    segments: tuple[SegmentStats, ...] = ()
    """The segments loaded now."""

    def to_json(self) -> str:
        return json.dumps({
            "pid": self.pid,
            "started_unix_s": self.started_unix_s,
            "segments": [json.loads(s.to_json()) for s in self.segments],
        }, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> WorkerStats:
        d = json.loads(text)
        segs = tuple(SegmentStats.from_json(json.dumps(s)) for s in d["segments"])
        return cls(pid=d["pid"], started_unix_s=d["started_unix_s"], segments=segs)


@dataclass(frozen=True)
class PoolStats:
    """The caller-side counters of a replica pool. Every request ends in exactly one of
    ``completed``, ``failed`` (replica loss after the retries) or ``errors`` (the
    request itself was refused: bad input, deadline, queue full)."""

    requests: int
    """Requests sent through the pool."""
    completed: int
    """Answered with outputs (possibly after a retry)."""
    retries: int
    """Requests sent again because their replica died, was restarting or lost the segment."""
    failed: int
    """Requests given up after the retries, with ReplicaUnavailableError (retry-able)."""
    errors: int
    """Requests answered with an error that retrying would not fix."""
    replica_failures: int
    """Times a replica was seen dead or unavailable."""
    in_flight: tuple[int, ...] = ()
    """Requests in flight per replica now."""
    routed: tuple[int, ...] = ()
    """Actor calls per replica so far (retries included); one call carries a batch."""
    direct_calls: int = 0
    """Requests answered over a replica's direct channel (see PoolConfig.direct)."""
    tcp_refused: int = 0
    """Requests that a TCP channel refused because they or their answers needed pickle
    (see PoolConfig.tcp_pickle), sent by a plain call instead."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PoolStats:
        d = json.loads(text)
        d["in_flight"] = tuple(d["in_flight"])
        d["routed"] = tuple(d["routed"])
        return cls(**d)


def now_pair() -> tuple[float, float]:
    """(wall-clock seconds, monotonic seconds), read together."""
    return time.time(), time.monotonic()
