"""Dynamic batcher benchmark: batched against unbatched serving, and against the limit.

    python -m bench.batcher [--quick]

Writes bench/results/batcher.json and bench/results/batcher.png.

64 closed-loop clients on one asyncio loop send single-sample requests to the digits
MLP (workers.testmodels) through a Batcher whose run_batch stacks the payloads and
runs one ONNX Runtime session (one intra-op thread). Side by side in one run:

* batched: max_batch_size 32, max_queue_delay_ms 1;
* unbatched: the same Batcher with max_batch_size 1 (same machinery, no batching);
* limits: the session called directly in a loop at batch 32 and at batch 1, without
  asyncio or the executor: the most the batched and unbatched setups could reach.

Quote the ratios; absolute numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

import numpy as np
import onnxruntime as ort

from workers.batcher import Batcher, BatcherConfig
from workers.testmodels import DIGITS_INPUT_NAME, DIGITS_OUTPUT_NAME, make_digits_mlp

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CLIENTS = 64


def _session(model) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def _serve(session: ort.InferenceSession, x: np.ndarray, config: BatcherConfig,
           n_requests: int) -> dict[str, object]:
    def run_batch(payloads: list[np.ndarray]) -> list[np.ndarray]:
        out = session.run([DIGITS_OUTPUT_NAME], {DIGITS_INPUT_NAME: np.stack(payloads)})[0]
        return list(out)

    async def main() -> tuple[float, list[float], dict]:
        batcher = Batcher(run_batch, config)
        latencies_s: list[float] = []
        remaining = [n_requests]

        async def client(k: int) -> None:
            i = k
            while remaining[0] > 0:
                remaining[0] -= 1
                t0 = time.perf_counter()
                await batcher.submit(x[i % len(x)], shape_key=x.shape[1:])
                latencies_s.append(time.perf_counter() - t0)
                i += CLIENTS

        t0 = time.perf_counter()
        await asyncio.gather(*(client(k) for k in range(CLIENTS)))
        wall_s = time.perf_counter() - t0
        await batcher.close()
        return wall_s, latencies_s, batcher.stats()

    wall_s, latencies_s, stats = asyncio.run(main())
    latencies_s.sort()
    return {
        "requests_per_s": n_requests / wall_s,
        "latency_p50_ms": statistics.median(latencies_s) * 1e3,
        "latency_p99_ms": latencies_s[int(0.99 * (len(latencies_s) - 1))] * 1e3,
        "batches_formed": stats.batches_formed,
        "mean_batch_size": n_requests / stats.batches_formed,
        "batch_size_histogram": {str(k): v for k, v in stats.batch_size_histogram.items()},
    }


def _direct_rows_per_s(session: ort.InferenceSession, x: np.ndarray, batch: int,
                       n_rows: int) -> float:
    feed = {DIGITS_INPUT_NAME: np.ascontiguousarray(x[:batch])}
    for _ in range(5):
        session.run(None, feed)
    runs = max(1, n_rows // batch)
    t0 = time.perf_counter()
    for _ in range(runs):
        session.run(None, feed)
    return runs * batch / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    args = parser.parse_args(argv)
    n_requests = 2000 if args.quick else 8000
    model, x, _ = make_digits_mlp(seed=0)
    session = _session(model)
    batched_cfg = BatcherConfig(max_batch_size=32, max_queue_delay_ms=1.0,
                                max_queue_size=4 * CLIENTS)
    unbatched_cfg = BatcherConfig(max_batch_size=1, max_queue_delay_ms=0.0,
                                  max_queue_size=4 * CLIENTS)
    # Alternate the two setups so that load from other processes hits both alike.
    runs: dict[str, list[dict]] = {"batched": [], "unbatched": []}
    for _ in range(3):
        runs["batched"].append(_serve(session, x, batched_cfg, n_requests))
        runs["unbatched"].append(_serve(session, x, unbatched_cfg, n_requests))
    best = {k: max(v, key=lambda r: r["requests_per_s"]) for k, v in runs.items()}
    limit_32 = _direct_rows_per_s(session, x, 32, n_requests * 4)
    limit_1 = _direct_rows_per_s(session, x, 1, n_requests)
    results = {
        "model": "digits MLP 64-128-64-10, ONNX Runtime CPU, 1 intra-op thread",
        "clients": CLIENTS,
        "requests_per_run": n_requests,
        "batched": {"config": json.loads(batched_cfg.to_json()), **best["batched"]},
        "unbatched": {"config": json.loads(unbatched_cfg.to_json()), **best["unbatched"]},
        "direct_rows_per_s": {"batch_32": limit_32, "batch_1": limit_1},
        "ratios": {
            "batched_over_unbatched_throughput":
                best["batched"]["requests_per_s"] / best["unbatched"]["requests_per_s"],
            "batched_over_direct_batch32": best["batched"]["requests_per_s"] / limit_32,
            "unbatched_over_direct_batch1": best["unbatched"]["requests_per_s"] / limit_1,
        },
        "note": "best of 3 alternating runs per setup",
    }
    os.makedirs(RESULTS_DIR, exist_ok=True)
    with open(os.path.join(RESULTS_DIR, "batcher.json"), "w") as f:
        json.dump(results, f, indent=2, sort_keys=True)
    _plot(results, os.path.join(RESULTS_DIR, "batcher.png"))
    print(json.dumps(results["ratios"], indent=2))
    for key in ("batched", "unbatched"):
        r = results[key]
        print(f"{key:9s} {r['requests_per_s']:9.0f} req/s  p50 {r['latency_p50_ms']:.2f} ms  "
              f"p99 {r['latency_p99_ms']:.2f} ms  mean batch {r['mean_batch_size']:.1f}")
    print(f"direct    batch 32 {limit_32:9.0f} rows/s   batch 1 {limit_1:9.0f} rows/s")
    return results


def _plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["Batcher\nmax 32", "direct\nbatch 32", "Batcher\nmax 1", "direct\nbatch 1"]
    values = [results["batched"]["requests_per_s"], results["direct_rows_per_s"]["batch_32"],
              results["unbatched"]["requests_per_s"], results["direct_rows_per_s"]["batch_1"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(labels, values, color=["tab:blue", "tab:grey", "tab:orange", "tab:grey"])
    ax.set_ylabel("requests (rows) per second")
    ax.set_yscale("log")
    ax.set_title(f"Dynamic batching, digits MLP, {results['clients']} clients: "
                 f"{results['ratios']['batched_over_unbatched_throughput']:.1f}x unbatched",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
