"""The cloud tier as a queue: c workers serving batches of several pools (model@cut).

Pure arithmetic on numpy arrays; no I/O, no clocks. `planner.fleet` calls it inside its
fixed point; the method is stated once here.

[Note: batch queue]
Pools p (one per model@cut) receive Poisson arrivals at lambda_p req/s. A batch of b
requests of pool p runs in T_p(b) ms on any of the c workers (T from the cloud profile's
batch curve, see `run_ms_table`). The batcher (workers/batcher.py) waits up to
``timeout_ms`` for company when a worker is free, and when a worker frees it takes
everything waiting, up to ``max_batch``: waiting requests do not queue as batches, they
merge into the next one.

The wait for a worker. Requests wait whole rounds only while more than a full batch is
queued, so the queue behaves as one of full batches: B = max_batch requests a batch,
Lambda_p = lambda_p / B, a_B = sum_p Lambda_p T_p(B) / 1000 erlangs, rho_B = a_B / c,
and the Allen-Cunneen wait

    Wq = ErlangC(c, a_B) * E[S] / (c - a_B) * (ca^2 + cs^2) / 2

with S the full batches' run time, cs^2 its squared coefficient of variation across pools
(each pool's run time is deterministic unless ``service_cv2`` says otherwise) and
ca^2 = 1/B (a full batch spaces B Poisson arrivals). At max_batch 1 this is the M/G/c
wait, and with exponential runs exactly M/M/c. Batches queued as units at the formed
batches' own utilisation instead read 7.2 ms at 1 worker and 60% load where the merging
batcher waits 4.1 ms, and 20.6 against 14.7 ms at 90% (tests/unit/test_queueing_merge.py
runs the batcher's dispatch; this form reads 4.0 and 16.0 ms).

The batches that form hold the arrivals of the timeout window and of the first batch's
wait for a worker to free: every worker busy (ErlangC at the formed batches' erlangs
a = sum_p lambda_p T_p(b_p) / b_p / 1000) times the residual E[S_b^2] / (2 E[S_b] c) of
the first of c runs to end,

    b_p = clip(1 + lambda_p * (timeout_ms + first_free) / 1000, 1, max_batch),

a fixed point solved by damped iteration (``_B_ITERATIONS`` steps; each moves b
halfway). Where batches that small cannot keep up (a >= c), they grow, as the merge
makes them, to the smallest step towards full batches at which they do.

A request of pool p waits, besides Wq, for its batch to fill: the first request the
timeout (or less, where B - 1 more arrive sooner), the others half of that on average,
fill_p = min(timeout_ms, 1000 (B - 1) / lambda_p) (b_p + 1) / (2 b_p). The wait for a
worker is 0 with probability 1 - ErlangC(c, a_B) and exponential beyond (the M/M/c
shape), which gives the percentiles. At rho_B >= 1 there is no steady state without
admission control (below).

[Note: admission by deadline]
The gateway refuses a request whose predicted wait and run would end past its deadline
(workers/_batch_policy.py), each against its own: a request with little slack left is
refused at a queue that one with more slack joins. Refusals shorten the queue, so near
capacity the wait stays short where an unrefused queue's would grow without bound.
`admission` models it as a birth-death chain in full batches (n batches in the pool, c
workers, each ending a batch at rate 1000 / E[S]), whose wait in state n is the
Allen-Cunneen wait's: (n - c + 1) (ca^2 + cs^2) / 2 E[S] / c beyond c. A stream of
requests (one device class at one link point and option) joins in the states whose wait
is below its slack and balks in the others, so the arrival rate falls, state by state,
as the wait passes each stream's slack. With every slack infinite this is the
Allen-Cunneen wait above, exactly. Per stream it gives the share refused, the mean wait
of the admitted and their chance of waiting. At 6 workers on bench.fleet's fleet at 100%
load it reads 12.8% refused where the fleet simulator refuses 9.7% of its arrivals.
Cutting admission by the pools' mean wait against their mean slack instead admitted
every request and predicted a 22 ms wait at 99% of capacity, where the simulator
waited 3.2 ms, and sized that fleet one worker too many.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["QueueState", "admission", "erlang_c", "batch_queue", "run_ms_table"]

_B_ITERATIONS = 60
_B_TOLERANCE = 1e-4
_KEEP_UP = 0.999
"""Busy share below which batches of the formed size keep up with the rate."""


def erlang_c(workers: int, erlangs: float) -> float:
    """Probability that an arrival waits in M/M/c with ``workers`` servers and offered load ``erlangs``."""
    if erlangs <= 0.0:
        return 0.0
    if erlangs >= workers:
        return 1.0
    b = 1.0  # Erlang B by its stable recursion
    for k in range(1, workers + 1):
        b = erlangs * b / (k + erlangs * b)
    rho = erlangs / workers
    return b / (1.0 - rho + rho * b)


@dataclass(frozen=True)
class QueueState:
    """The cloud's steady state for given pool rates."""

    batch: np.ndarray
    """Mean batch size per pool."""
    run_ms: np.ndarray
    """Run time of that batch per pool."""
    fill_ms: np.ndarray
    """Mean wait for the batch to form per pool."""
    wait_ms: float
    """Mean wait for a worker (every pool: the workers are shared); inf when overloaded."""
    p_wait: float
    """Probability that a batch waits for a worker."""
    utilisation: float
    """Busy share of the workers (may exceed 1 when overloaded)."""
    capacity_rps: float
    """Requests per second the workers answer at full batches, at this pool mix."""

    @property
    def overloaded(self) -> bool:
        return not math.isfinite(self.wait_ms)


def run_ms_table(seg_ms: np.ndarray, const_ms: float, batch_ms: dict[int, float] | None, max_batch: int) -> np.ndarray:
    """T_p(b) for b = 1..max_batch, shape (P, max_batch): ``const + b * factor(b) * seg``.

    ``factor(b)`` is the cloud profile's per-sample time at b relative to b = 1, from its
    ``batch_ms`` curve (whole-model times at some batch sizes), linear between the sizes
    it has and constant past the largest (per-sample time no longer falls); 1 without a curve.
    """
    sizes = np.arange(1, max_batch + 1, dtype=float)
    if batch_ms and 1 in batch_ms and batch_ms[1] > 0:
        known = sorted(batch_ms)
        per_sample = np.array([batch_ms[k] / (k * batch_ms[1]) for k in known])
        factor = np.interp(sizes, np.array(known, dtype=float), per_sample)
    else:
        factor = np.ones_like(sizes)
    seg = np.asarray(seg_ms, dtype=float).reshape(-1, 1)
    return const_ms + sizes[None, :] * factor[None, :] * seg


def _run_at(table: np.ndarray, b: np.ndarray) -> np.ndarray:
    """T_p(b_p) for fractional b in [1, max_batch] (linear between whole sizes)."""
    lo = b.astype(int)  # b >= 1, so this is floor
    hi = np.minimum(lo + 1, table.shape[1])
    frac = b - lo
    rows = np.arange(table.shape[0])
    return table[rows, lo - 1] * (1.0 - frac) + table[rows, hi - 1] * frac


def batch_queue(rates_rps: np.ndarray, table: np.ndarray, workers: int, timeout_ms: float,
                *, service_cv2: float = 0.0) -> QueueState:
    """The steady state of [Note: batch queue] for pools with ``rates_rps`` and run times ``table``."""
    rates = np.asarray(rates_rps, dtype=float)
    max_batch = table.shape[1]
    full = table[:, -1]
    total = float(rates.sum())
    mix = rates / total if total > 0 else np.full(len(rates), 1.0 / max(1, len(rates)))
    per_req_full = float((mix * full / max_batch).sum())
    capacity = workers * 1000.0 / per_req_full if per_req_full > 0 else math.inf
    if total <= 0:
        one = np.ones(len(rates))
        return QueueState(one, table[:, 0].copy(), np.full(len(rates), timeout_ms), 0.0, 0.0, 0.0, capacity)
    wq, pw = _full_batch_wait(rates, table, workers, service_cv2)
    if not math.isfinite(wq):
        b = np.full(len(rates), float(max_batch))
        return QueueState(b, table[:, -1].copy(), np.full(len(rates), timeout_ms), wq, 1.0,
                          _busy(rates, b, table, workers), capacity)
    b = np.clip(1.0 + rates * timeout_ms / 1000.0, 1.0, max_batch)
    for _ in range(_B_ITERATIONS):
        target = np.clip(1.0 + rates * (timeout_ms + _first_free_ms(rates, b, table, workers)) / 1000.0,
                         1.0, max_batch)
        if float(np.abs(target - b).max()) < _B_TOLERANCE:
            break
        b = b + 0.5 * (target - b)
    if _busy(rates, b, table, workers) >= _KEEP_UP:
        # Batches too small for the rate grow until the workers keep up (the merge makes
        # them): the smallest step towards full batches at which they do.
        lo, hi = 0.0, 1.0
        for _ in range(_B_ITERATIONS):
            mid = (lo + hi) / 2
            if _busy(rates, b + mid * (max_batch - b), table, workers) < _KEEP_UP:
                hi = mid
            else:
                lo = mid
        b = b + hi * (max_batch - b)
    # A batch leaves once full: at a high rate it fills before the timeout.
    window = np.minimum(timeout_ms, 1000.0 * (max_batch - 1) / np.where(rates > 0, rates, 1e-9))
    fill = window * (b + 1.0) / (2.0 * b)
    return QueueState(b, _run_at(table, b), fill, wq, pw, _busy(rates, b, table, workers), capacity)


def _busy(rates: np.ndarray, b: np.ndarray, table: np.ndarray, workers: int) -> float:
    """Busy share of the workers with batches of ``b``."""
    return float((rates / b * _run_at(table, b)).sum()) / 1000.0 / workers


def _first_free_ms(rates: np.ndarray, b: np.ndarray, table: np.ndarray, workers: int) -> float:
    """Mean ms until a worker frees for a batch whose timeout ran out: every worker busy
    (ErlangC at batches of ``b``) times the residual of the first run of c to end."""
    lam_b = rates / b
    run = _run_at(table, b)
    erlangs = float((lam_b * run).sum()) / 1000.0
    if erlangs <= 0:
        return 0.0
    w = lam_b / float(lam_b.sum())
    return erlang_c(workers, min(erlangs, workers)) * float((w * run * run).sum()) / (2.0 * float((w * run).sum()) * workers)


def _full_batches(rates: np.ndarray, full_ms: np.ndarray, max_batch: int, service_cv2: float) -> tuple[float, float, float]:
    """(full batches per second, their mean run ms, Allen-Cunneen's (ca^2 + cs^2) / 2) for
    streams offering ``rates`` to pools whose full batches run ``full_ms``."""
    lam_b = rates / max_batch
    total_b = float(lam_b.sum())
    if total_b <= 0:
        return 0.0, 0.0, 0.0
    w = lam_b / total_b
    mean_s = float((w * full_ms).sum())
    second = float((w * full_ms * full_ms).sum())
    cs2 = max(0.0, second - mean_s * mean_s + service_cv2 * second) / (mean_s * mean_s) if mean_s > 0 else 0.0
    return total_b, mean_s, (1.0 / max_batch + cs2) / 2.0


def _full_batch_wait(rates: np.ndarray, table: np.ndarray, workers: int, service_cv2: float) -> tuple[float, float]:
    """(Wq ms, P(wait)): Allen-Cunneen at full batches ([Note: batch queue])."""
    per_s, mean_s, factor = _full_batches(rates, table[:, -1], table.shape[1], service_cv2)
    if per_s <= 0:
        return 0.0, 0.0
    erlangs = per_s * mean_s / 1000.0
    if erlangs >= workers:
        return math.inf, 1.0
    pw = erlang_c(workers, erlangs)
    return pw * mean_s / (workers - erlangs) * factor, pw


_MAX_QUEUE_STATES = 50_000


def admission(rates: np.ndarray, slack_ms: np.ndarray, full_ms: np.ndarray, workers: int, max_batch: int,
              *, service_cv2: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per stream (offered ``rates`` req/s, each with the ``slack_ms`` its requests have for the
    wait, on pools whose full batches run ``full_ms``): the share refused, the mean wait of
    the admitted and their chance of waiting at all ([Note: admission by deadline])."""
    rates = np.asarray(rates, dtype=float).ravel()
    slack = np.asarray(slack_ms, dtype=float).ravel()
    full = np.asarray(full_ms, dtype=float).ravel()
    zero = np.zeros(len(rates))
    per_s, mean_s, factor = _full_batches(rates, full, max_batch, service_cv2)
    if per_s <= 0:
        return zero, zero, zero
    lam_b = rates / max_batch
    step_ms = factor * mean_s / workers  # the wait one more full batch ahead adds
    finite = slack[np.isfinite(slack)]
    top = float(finite.max()) if finite.size else 0.0
    n_states = workers + int(min(_MAX_QUEUE_STATES, max(0.0, top) / step_ms + 2))
    n = np.arange(n_states)
    wait = np.maximum(0, n - workers + 1) * step_ms
    order = np.argsort(slack)
    # arrivals (in full batches) in state n: the streams whose slack exceeds the wait there
    k = np.searchsorted(slack[order], wait, side="right")
    behind = np.concatenate([np.cumsum(lam_b[order][::-1])[::-1], [0.0]])
    lam_n = behind[k]
    mu_n = np.minimum(n + 1, workers) * (1000.0 / mean_s)
    with np.errstate(divide="ignore"):
        logp = np.concatenate([[0.0], np.cumsum(np.log(lam_n[:-1] / mu_n[:-1]))])
    p = np.exp(logp - logp.max())
    p /= p.sum()
    # a stream is admitted in the states whose wait is below its slack (the last state: never)
    first_out = np.minimum(np.searchsorted(wait, slack, side="left"), n_states - 1)
    cum_p = np.concatenate([[0.0], np.cumsum(p)])
    cum_pw = np.concatenate([[0.0], np.cumsum(p * wait)])
    waiting = np.concatenate([[0.0], np.cumsum(np.where(n >= workers, p, 0.0))])
    admitted = cum_p[first_out]
    refused = np.clip(1.0 - admitted, 0.0, 1.0)
    safe = np.where(admitted > 0, admitted, 1.0)
    return refused, np.where(admitted > 0, cum_pw[first_out] / safe, 0.0), np.where(admitted > 0, waiting[first_out] / safe, 0.0)
