"""Overload probe: goodput at the deadline of a gateway driven past its capacity.

    python -m bench.overload [--model resnet50] [--seconds 25] [--baseline PATH] [--out PATH]

The gateway serves a zoo model (seeded random weights) whole-model on the in-process
pool (`local-noray`) over gRPC on 127.0.0.1, in this process; the clients run in a
second process, so that they share the CPUs with the gateway but not its GIL. Three
phases:

1. p50 latency at concurrency 1; the deadline is 3x that p50.
2. capacity: requests/s of ``--capacity-clients`` closed-loop clients without a
   deadline (the batcher forms full batches), measured before and after phase 3;
   the higher of the two is the capacity (the conservative ratio on shared cores).
3. overload: ``--clients`` closed-loop clients, each request with the deadline, for
   ``--seconds``. A client refused with RESOURCE_EXHAUSTED waits its ``retry_after_ms``
   (at most 5 s) before its next request, as the hint asks; without a hint it retries
   at once.

The figure of merit is ``overload_goodput_over_capacity``: requests answered within the
deadline per second in phase 3 over the capacity of phase 2 (target >= 0.8). Also
written: refusals by kind and whether each carried a retry-after, expiries, results
the batcher computed after their deadline (discarded), batches run, and how long the
health check took during the overload. ``--baseline PATH`` embeds another run's JSON
(the same script on an older commit) as ``before``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from typing import Any

import numpy as np
import onnx

from cluster.errors import ClusterError, DeadlineExceeded, ResourceExhausted
from cluster.gateway import Gateway, LocalPoolFactory, PoolFactory, PoolKey
from cluster.protocol.client import InferenceClient, make_request
from cluster.registry import Registry
from cluster.server import new_event_loop, serve_in_thread
from partitioner import load_zoo

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
_MAX_BACKOFF_S = 5.0


def _repo(root: str, model: onnx.ModelProto, max_batch_size: int, extra_yaml: str = "") -> None:
    d = os.path.join(root, "net", "1")
    os.makedirs(d)
    onnx.save(model, os.path.join(d, "model.onnx"))
    with open(os.path.join(d, "model.yaml"), "w") as fh:
        fh.write(f"max_batch_size: {max_batch_size}\nintra_op_threads: 1\n{extra_yaml}"
                 "frontier: {default_cut_count: 0, include_cloud_only: true}\n")


def _served_whole(model_name: str, max_batch_size: int, prefix: str, *, pools: PoolFactory | None = None,
                  extra_yaml: str = "") -> tuple[Gateway, Any, Any, dict[str, np.ndarray]]:
    """Zoo model `model_name` (random weights, seed 1) as `net@1` in a fresh registry under a
    temporary directory named `prefix`... (`extra_yaml` added to its model.yaml), behind a
    gateway with `pools` (default in-process ones) served in a thread: (gateway, server, the
    cloud-only cut, a random input for the model)."""
    tmp = tempfile.mkdtemp(prefix=prefix)
    root = os.path.join(tmp, "repo")
    model = load_zoo(model_name, random_weights=True, seed=1)
    _repo(root, model, max_batch_size, extra_yaml)
    registry = Registry(root)
    gateway = Gateway(registry, pools or LocalPoolFactory(cache_dir=os.path.join(tmp, "ort")))
    registry.load_all()
    cut = next(c for c in registry.resolve("net", "1").frontier.cuts if not c.edge_layers)
    weights = {i.name for i in model.graph.initializer}
    inp = next(i for i in model.graph.input if i.name not in weights)
    shape = [d.dim_value or 1 for d in inp.type.tensor_type.shape.dim]
    x = {inp.name: np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
    return gateway, serve_in_thread(gateway), cut, x


async def _round_trips(address: str, cut_id: str, x: dict[str, np.ndarray], n: int) -> list[tuple[float, float]]:
    """`n` requests one after another: each one's round trip (s) and the gateway's queue and
    compute time for it (ms)."""
    out = []
    async with InferenceClient(address) as c:
        for _ in range(n):
            t0 = time.monotonic()
            resp = await c.infer(make_request("net", "1", cut_id, x, timeout_s=30.0))
            server_ms = resp.timings_ms.get("queue", 0.0) + resp.timings_ms.get("compute", 0.0)
            out.append((time.monotonic() - t0, server_ms))
    return out


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return float(np.percentile(values, q))


async def _closed_loop(address: str, cut_id: str, x: dict[str, np.ndarray], *, clients: int, seconds: float,
                       deadline_s: float | None) -> dict:
    """``clients`` closed-loop clients for ``seconds``; returns what each request got."""
    outcomes: Counter[str] = Counter()
    ok_latency_s: list[float] = []
    refused_latency_s: list[float] = []
    late_by_s: list[float] = []
    retry_after: Counter[str] = Counter()
    health_s: list[float] = []
    stop_at = time.monotonic() + seconds

    async with InferenceClient(address) as c:
        async def client() -> None:
            while time.monotonic() < stop_at:
                timeout_s = 30.0 if deadline_s is None else deadline_s
                t0 = time.monotonic()
                try:
                    await c.infer(make_request("net", "1", cut_id, x, timeout_s=timeout_s))
                except ResourceExhausted as e:
                    refused_latency_s.append(time.monotonic() - t0)
                    outcomes["refused"] += 1
                    after_ms = getattr(e, "retry_after_ms", None)
                    retry_after["with_retry_after" if after_ms is not None else "without_retry_after"] += 1
                    if after_ms is not None:
                        await asyncio.sleep(min(after_ms / 1e3, _MAX_BACKOFF_S))
                    continue
                except DeadlineExceeded:
                    outcomes["deadline_exceeded"] += 1
                    continue
                except ClusterError as e:
                    outcomes[type(e).__name__] += 1
                    continue
                elapsed = time.monotonic() - t0
                if deadline_s is None or elapsed <= deadline_s:
                    outcomes["ok_in_time"] += 1
                    ok_latency_s.append(elapsed)
                else:
                    outcomes["ok_late"] += 1
                    late_by_s.append(elapsed - deadline_s)

        async def probe() -> None:
            while time.monotonic() < stop_at:
                t0 = time.monotonic()
                await c.health(timeout_s=10.0)
                health_s.append(time.monotonic() - t0)
                await asyncio.sleep(0.5)

        t0 = time.monotonic()
        await asyncio.gather(probe(), *(client() for _ in range(clients)))
        wall_s = time.monotonic() - t0
    return {
        "clients": clients, "seconds": round(wall_s, 3), "deadline_ms": None if deadline_s is None else deadline_s * 1e3,
        "outcomes": dict(sorted(outcomes.items())), "refusals_retry_after": dict(sorted(retry_after.items())),
        "goodput_rps": outcomes["ok_in_time"] / wall_s,
        "ok_latency_ms": {"p50": _ms(_pct(ok_latency_s, 50)), "p95": _ms(_pct(ok_latency_s, 95))},
        "refusal_latency_ms": {"p50": _ms(_pct(refused_latency_s, 50)), "p95": _ms(_pct(refused_latency_s, 95))},
        "late_by_ms": {"p50": _ms(_pct(late_by_s, 50)), "p95": _ms(_pct(late_by_s, 95))},
        "health_ms": {"p50": _ms(_pct(health_s, 50)), "max": _ms(max(health_s, default=None))},
    }


def _clients_in_process(address: str, cut_id: str, x: dict[str, np.ndarray], clients: int, seconds: float,
                        deadline_s: float | None) -> dict:
    """`_closed_loop` in a process of its own (spawned: a fresh interpreter, its own GIL)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_run_clients, (address, cut_id, x, clients, seconds, deadline_s))


def _run_clients(address: str, cut_id: str, x: dict[str, np.ndarray], clients: int, seconds: float,
                 deadline_s: float | None) -> dict:
    loop = new_event_loop()
    try:
        return loop.run_until_complete(_closed_loop(address, cut_id, x, clients=clients, seconds=seconds,
                                                    deadline_s=deadline_s))
    finally:
        loop.close()


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1e3, 3)


def _pool_counts(gateway: Gateway, key: PoolKey) -> dict:
    pool = gateway._pools[key]
    stats = pool.batcher.stats()
    return {"batches": stats.batches_formed, "completed": stats.completed,
            "discarded": getattr(stats, "discarded", None), "rejected": dict(stats.rejected)}


def _delta(after: dict, before: dict) -> dict:
    out = {}
    for k, v in after.items():
        if isinstance(v, dict):
            out[k] = {r: n - before[k].get(r, 0) for r, n in v.items() if n - before[k].get(r, 0)}
        elif v is None:
            out[k] = None
        else:
            out[k] = v - before[k]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.overload")
    p.add_argument("--model", default="resnet50", help="zoo model served whole (default resnet50)")
    p.add_argument("--seconds", type=float, default=25.0, help="length of the overload phase")
    p.add_argument("--capacity-seconds", type=float, default=10.0, help="length of the capacity phase")
    p.add_argument("--clients", type=int, default=64, help="closed-loop clients in the overload phase")
    p.add_argument("--capacity-clients", type=int, default=16, help="closed-loop clients measuring capacity")
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--baseline", help="JSON of a run of this script on another commit, embedded as 'before'")
    p.add_argument("--out", default=os.path.join(RESULTS, "overload.json"))
    a = p.parse_args(argv)

    gateway, server, cut, x = _served_whole(a.model, a.max_batch_size, "bench-overload-")
    key = PoolKey("net", "1", cut.cut_id)
    loop = new_event_loop()
    try:
        loop.run_until_complete(_round_trips(server.address, cut.cut_id, x, 5))  # warm-up
        p50_s = statistics.median(s for s, _ in loop.run_until_complete(_round_trips(server.address, cut.cut_id,
                                                                                       x, 40)))
        deadline_s = 3 * p50_s
        capacity = _clients_in_process(server.address, cut.cut_id, x, a.capacity_clients, a.capacity_seconds, None)
        capacity_rps = capacity["goodput_rps"]
        before = _pool_counts(gateway, key)
        overload = _clients_in_process(server.address, cut.cut_id, x, a.clients, a.seconds, deadline_s)
        overload["pool"] = _delta(_pool_counts(gateway, key), before)
        capacity_after = _clients_in_process(server.address, cut.cut_id, x, a.capacity_clients,
                                             a.capacity_seconds, None)
        capacity_rps = max(capacity_rps, capacity_after["goodput_rps"])
    finally:
        loop.close()
        asyncio.run_coroutine_threadsafe(gateway.close(), server._loop).result()
        server.stop()

    out: dict = {
        "commit": _commit(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "model": a.model, "cut": "whole model (cloud only)", "pool": "in-process (local-noray)",
        "max_batch_size": a.max_batch_size, "intra_op_threads": 1,
        "p50_ms_concurrency_1": round(p50_s * 1e3, 3), "deadline_ms": round(deadline_s * 1e3, 3),
        "capacity_rps": round(capacity_rps, 3), "capacity": capacity, "capacity_after_overload": capacity_after,
        "overload": overload,
        "overload_goodput_over_capacity": round(overload["goodput_rps"] / capacity_rps, 4),
        "target_goodput_over_capacity": 0.8,
    }
    if a.baseline:
        with open(a.baseline) as fh:
            out["before"] = json.load(fh)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=2, sort_keys=True)
    print(json.dumps({k: v for k, v in out.items() if k != "before"}, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
