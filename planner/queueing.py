"""The cloud tier as a queue: c workers serving batches of several pools (model@cut).

Pure arithmetic on numpy arrays; no I/O, no clocks. `planner.fleet` calls it inside its
fixed point; the method is stated once here.

[Note: batch queue]
Pools p (one per model@cut) receive Poisson arrivals at lambda_p req/s. A batch of b
requests of pool p runs in T_p(b) ms on any of the c workers (T from the cloud profile's
batch curve, see `run_ms_table`). The batcher (workers/batcher.py) waits up to
``timeout_ms`` for company when a worker is free, and takes whatever is waiting, up to
``max_batch``, when a worker frees. So a batch holds the arrivals of the timeout window,
and more when requests had to queue for a worker:

    b_p = clip(1 + lambda_p * (timeout_ms + Wq) / 1000, 1, max_batch)

This is a fixed point in (b, Wq), solved by damped iteration (``_B_ITERATIONS`` steps;
each step moves b halfway, and b is monotone in Wq, so it settles). Batches then form a
queue of their own (an M/G/c of batches):

    Lambda_p = lambda_p / b_p,   a = sum_p Lambda_p * T_p(b_p) / 1000 (Erlangs),   rho = a / c
    Wq = ErlangC(c, a) * E[S] / (c - a) * (ca^2 + cs^2) / 2            (Allen-Cunneen)

with E[S] the batch-weighted mean run time, cs^2 its squared coefficient of variation
across pools (each pool's run time is deterministic unless ``service_cv2`` says
otherwise), and ca^2 = the batch-weighted mean of 1/b_p (a batch is b Poisson arrivals
apart: Erlang-b spacing, CV^2 = 1/b). At b = 1 with exponential service (ca^2 = cs^2 = 1)
this is exactly M/M/c. A request of pool p waits, before its batch starts, Wq plus the
fill time: the batch's first request waits the timeout, the others half of it on
average, so fill_p = timeout_ms * (b_p + 1) / (2 b_p). The wait for a worker is 0 with
probability 1 - ErlangC and exponential beyond (the M/M/c shape), which gives the
percentiles. At rho >= 1 with every pool at max_batch there is no steady state: the
caller applies admission control (`planner.fleet`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["QueueState", "erlang_c", "batch_queue", "run_ms_table"]

_B_ITERATIONS = 60
_B_TOLERANCE = 1e-4


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
    b = np.clip(1.0 + rates * timeout_ms / 1000.0, 1.0, max_batch)
    wq, pw, rho = 0.0, 0.0, 0.0
    for _ in range(_B_ITERATIONS):
        wq, pw, rho = _wait(rates, b, table, workers, service_cv2)
        w_for_b = wq if math.isfinite(wq) else math.inf
        target = np.clip(1.0 + rates * (timeout_ms + w_for_b) / 1000.0, 1.0, max_batch)
        if float(np.abs(target - b).max()) < _B_TOLERANCE:
            break
        b = b + 0.5 * (target - b) if math.isfinite(w_for_b) else target
    wq, pw, rho = _wait(rates, b, table, workers, service_cv2)
    fill = timeout_ms * (b + 1.0) / (2.0 * b)
    return QueueState(b, _run_at(table, b), fill, wq, pw, rho, capacity)


def _wait(rates: np.ndarray, b: np.ndarray, table: np.ndarray, workers: int,
          service_cv2: float) -> tuple[float, float, float]:
    """(Wq ms, P(wait), utilisation) of the batch queue at batch sizes ``b``."""
    lam_b = rates / b  # batches per second
    run = _run_at(table, b)
    total_b = float(lam_b.sum())
    if total_b <= 0:
        return 0.0, 0.0, 0.0
    erlangs = float((lam_b * run).sum()) / 1000.0
    rho = erlangs / workers
    if rho >= 1.0:
        return math.inf, 1.0, rho
    w = lam_b / total_b
    mean_s = float((w * run).sum())
    var_s = float((w * run * run).sum()) - mean_s * mean_s + service_cv2 * float((w * run * run).sum())
    cs2 = max(0.0, var_s) / (mean_s * mean_s) if mean_s > 0 else 0.0
    ca2 = float((w / b).sum())
    pw = erlang_c(workers, erlangs)
    wq = pw * mean_s / (workers - erlangs) * (ca2 + cs2) / 2.0
    return wq, pw, rho
