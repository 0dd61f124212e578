"""The replica pool's serving path in one short run, for paired before/after comparisons.

    python bench/pool_quick.py [--seconds 2] [--out FILE]

One local Ray (2 CPUs), one ReplicaPool of one SegmentWorker (two engine instances, as
bench/workers.py runs ours) on the transformer tail of bench/workers.py (1 MiB in and
out), over the direct channel (a Unix-domain socket and shared memory, the default):

* c1: one client, one request at a time: the median latency and the median serving
  overhead (latency minus the worker's engine run), plain and with the input kept in
  shared memory (``ReplicaPool.shared_array``);
* c32: 32 closed-loop clients: requests answered per second.

Prints one JSON line (and appends it to ``--out``). It uses only the pool's public API,
so the same script times two versions of the code: run it with ``PYTHONPATH`` naming
each checkout in turn, alternating, and compare the medians over the pairs. A run takes
12-18 s on 2 cores, most of it Ray's start and the engine's load (its artefact is
cached in ``--cache-dir`` after the first run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time

import numpy as np

KEY = "transformer@1@tail"


async def _c1(pool, x: dict, seconds: float) -> tuple[float, float]:
    latencies, overheads = [], []
    end = time.monotonic() + seconds
    warm = 20
    while time.monotonic() < end or len(latencies) < 20:
        t = time.perf_counter()
        _, timing = await pool.infer_timed(KEY, x)
        elapsed = time.perf_counter() - t
        if warm:
            warm -= 1
            continue
        latencies.append(elapsed * 1e3)
        overheads.append((elapsed - timing.compute_s) * 1e3)
    return statistics.median(latencies), statistics.median(overheads)


async def _c32(pool, x: dict, seconds: float) -> float:
    done = 0
    counting = False
    stop = False

    async def client() -> None:
        nonlocal done
        while not stop:
            await pool.infer(KEY, x)
            if counting:
                done += 1

    tasks = [asyncio.ensure_future(client()) for _ in range(32)]
    await asyncio.sleep(seconds / 4)  # warm-up: batches form, both instances busy
    counting, start = True, time.perf_counter()
    await asyncio.sleep(seconds)
    counting, elapsed = False, time.perf_counter() - start
    stop = True
    await asyncio.gather(*tasks)
    return done / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="measured seconds per point")
    parser.add_argument("--out", default="", help="append the JSON line to this file too")
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "splitinfer-pool-quick"),
                        help="engine artefact cache, kept between runs")
    args = parser.parse_args()

    import ray

    from bench.workers import _transformer_tail
    from workers._pool import PoolConfig
    from workers.actors import ReplicaPool
    from workers.engine import EngineConfig

    tail = _transformer_tail()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
             configure_logging=False)
    config = EngineConfig(intra_op_threads=2, cache_dir=args.cache_dir, share_weights=False)
    pool = ReplicaPool({KEY: tail.SerializeToString()}, engine_config=config,
                       config=PoolConfig(num_replicas=1, max_restarts=0, instances=2))
    x = {tail.graph.input[0].name: np.random.default_rng(0).standard_normal((1, 1024, 256)).astype(np.float32)}

    async def run() -> dict:
        await pool.ready()
        while pool.stats().direct_calls < 5:  # the channel opens in the background
            await pool.infer(KEY, x)
        c1_ms, c1_overhead_ms = await _c1(pool, x, args.seconds)
        kept = await pool.shared_array(x[next(iter(x))].shape, np.float32)
        kept[...] = next(iter(x.values()))
        c1_kept_ms, c1_kept_overhead_ms = await _c1(pool, {next(iter(x)): kept}, args.seconds)
        c32_per_s = await _c32(pool, x, args.seconds)
        return {"c1_ms": c1_ms, "c1_overhead_ms": c1_overhead_ms, "c1_kept_ms": c1_kept_ms,
                "c1_kept_overhead_ms": c1_kept_overhead_ms, "c32_per_s": c32_per_s,
                "direct_calls": pool.stats().direct_calls}

    try:
        result = asyncio.run(run())
    finally:
        pool.shutdown()
        ray.shutdown()
    line = json.dumps(result, sort_keys=True)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
