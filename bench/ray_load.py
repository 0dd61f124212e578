"""A Ray pool's load keys against the waits they stand for.

    python -m bench.ray_load [--model squeezenet] [--seconds 8] [--out PATH]

A local Ray (2 CPUs) runs one replica of a zoo model (random weights, seed 1) whole-model
behind the gateway, over gRPC on 127.0.0.1 (model.yaml: batches up to 4, no queue delay,
one intra-op thread). The replica's throughput is measured first: 16 closed-loop clients for
4 s, the requests answered per second (`throughput_rps`; `batch_capacity_rps` is what its batches' runs
alone would allow). Then one client sends open-loop (Poisson) arrivals at 0.5,
1.0 and 1.5 times that rate for ``--seconds`` each, and for every request compares the
wait it met (its answer's ``timings_ms['queue']``: all of its time in the gateway but its
batch's run) with what the keys of the last answer before its send said, as the agent's
`edge_agent.cloud_load.CloudLoad` reads them:

* ``predicted_wait``, less the time since that answer (the wait drains as the clock runs);
  the gateway's reading from the requests inside the pool ([Note: a Ray pool's predicted
  wait] in cluster/_pools.py);
* ``expected_wait``: the mean wait at the arrival rate, never below the answers' own wait
  and (now) the predicted one: before the predicted wait, the only figure a Ray pool gave.

Per load: the requests, the median wait met, and for each figure the median absolute
error and the correlation with the wait met. Writes ``bench/results/ray_load.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from typing import Any

import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
LOADS = (0.5, 1.0, 1.5)
THROUGHPUT_S = 4.0


def _serve(model_name: str) -> tuple[Any, Any, str, dict[str, np.ndarray]]:
    from bench.overload import _served_whole
    from cluster import ray_cluster

    ray_cluster.connect("local", num_cpus=2)
    gateway, server, cut, x = _served_whole(model_name, 4, "ray-load-", pools=ray_cluster.RayPoolFactory(provider="cpu"),
                                            extra_yaml="max_queue_delay_ms: 0\n")
    return gateway, server, cut.cut_id, x


def _summary(rows: list[tuple[float, float | None, float]]) -> dict[str, Any]:
    """rows: (wait met, predicted (None: not reported), expected) in ms."""
    met = np.array([r[0] for r in rows])
    out: dict[str, Any] = {"requests": len(rows), "wait_p50_ms": float(np.median(met)),
                           "wait_p95_ms": float(np.percentile(met, 95))}
    for i, name in ((1, "predicted_wait"), (2, "expected_wait")):
        if any(r[i] is None for r in rows):
            out[name] = None
            continue
        fig = np.array([r[i] for r in rows])
        corr = float(np.corrcoef(fig, met)[0, 1]) if fig.std() > 0 and met.std() > 0 else None
        out[name] = {"abs_error_p50_ms": float(np.median(np.abs(fig - met))), "correlation": corr,
                     "p50_ms": float(np.median(fig))}
    return out


async def _run(address: str, cut_id: str, x: dict[str, np.ndarray], seconds: float) -> dict[str, Any]:
    from cluster.protocol.client import InferenceClient, make_request

    async with InferenceClient(address) as c:
        def one():
            return c.infer(make_request("net", "1", cut_id, x, timeout_s=120.0))

        for _ in range(8):  # warm: the replica's first runs and the batch timings
            await asyncio.gather(*(one() for _ in range(4)))
        done = 0
        t0 = time.monotonic()

        async def client() -> None:  # closed loop: a request as soon as its last is answered
            nonlocal done
            while time.monotonic() - t0 < THROUGHPUT_S:
                await one()
                done += 1

        await asyncio.gather(*(client() for _ in range(16)))
        rps = done / (time.monotonic() - t0)
        last: tuple[float, dict[str, float]] | None = None  # the latest answer: when, and its keys

        async def sent(rows: list) -> None:
            nonlocal last
            at, prior = time.monotonic(), last
            r = await one()
            last = (time.monotonic(), r.timings_ms)
            if prior is not None:
                age_ms = (at - prior[0]) * 1e3
                pw = prior[1].get("predicted_wait")  # absent from a gateway before it
                rows.append((r.timings_ms["queue"], None if pw is None else max(0.0, pw - age_ms),
                             prior[1]["expected_wait"]))

        rng = random.Random(1)
        out: dict[str, Any] = {"throughput_rps": rps, "loads": {}}
        for load in LOADS:
            rows: list[tuple[float, float | None, float]] = []
            tasks = []
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                tasks.append(asyncio.ensure_future(sent(rows)))
                await asyncio.sleep(rng.expovariate(load * rps))
            await asyncio.gather(*tasks)
            out["loads"][f"{load:g}"] = {**_summary(rows), "rows_ms": [[round(v, 3) if v is not None else None
                                                                    for v in r] for r in rows]}
            await asyncio.sleep(1.0)  # drain before the next load
        return out


def _plot(result: dict[str, Any], path: str) -> None:
    """Per load, each request's wait met against what the last answer's keys said."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [("this run", result)] + ([("before", result["before"])] if "before" in result else [])
    fig, axes = plt.subplots(1, len(LOADS), figsize=(5 * len(LOADS), 4.4), squeeze=False)
    for ax, load in zip(axes[0], LOADS):
        top = 1.0
        for label, run in runs:
            rows = run["loads"].get(f"{load:g}", {}).get("rows_ms", [])
            for i, name, marker in ((1, "predicted_wait", "o"), (2, "expected_wait", "x")):
                pts = [(r[0], r[i]) for r in rows if r[i] is not None]
                if pts:
                    met, fig_ms = zip(*pts)
                    top = max(top, *met, *fig_ms)
                    ax.scatter(fig_ms, met, s=6, marker=marker, alpha=0.4, label=f"{name} ({label})")
        ax.plot([0, top], [0, top], color="grey", lw=0.8)
        ax.set(title=f"{load:g}x the measured throughput", xlabel="the last answer's figure (ms)",
               ylabel="wait met (ms)")
        ax.legend(fontsize=7, markerscale=2)
    fig.suptitle(f"A Ray pool's load keys against the waits met ({result['model']}, one replica, batches up to 4)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ray_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="squeezenet", help="zoo model (default squeezenet)")
    p.add_argument("--seconds", type=float, default=8.0, help="seconds of arrivals per load (default 8)")
    p.add_argument("--out", default=os.path.join(RESULTS, "ray_load.json"), help="the JSON (the PNG goes beside it)")
    p.add_argument("--baseline", metavar="PATH", help="another run's JSON (the same script on an older commit), "
                                                      "embedded as 'before'")
    args = p.parse_args(argv)
    if not args.seconds > 0:
        p.error(f"--seconds is {args.seconds!r}; it must be > 0")
    from cluster import ray_cluster

    gateway, server, cut_id, x = _serve(args.model)
    try:
        result = asyncio.run(_run(server.address, cut_id, x, args.seconds))
        # What its batches' runs alone would allow (full batches); the throughput measured counts the rest too.
        result["batch_capacity_rps"] = gateway.load()["pools"][f"net@1@{cut_id}"]["capacity_rps"]
    finally:
        asyncio.run_coroutine_threadsafe(gateway.close(), server._loop).result()
        server.stop()
        ray_cluster.shutdown()
    result = {"model": args.model, "seconds": args.seconds, **result}
    if args.baseline:
        with open(args.baseline) as fh:
            result["before"] = json.load(fh)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    _plot(result, os.path.splitext(args.out)[0] + ".png")
    for load, s in result["loads"].items():
        figures = "; ".join(f"{name} |error| p50 {f['abs_error_p50_ms']:.1f} ms, r {f['correlation']}"
                            for name in ("predicted_wait", "expected_wait") if (f := s[name]) is not None)
        print(f"load {load}: {s['requests']} requests, wait p50 {s['wait_p50_ms']:.1f} ms; {figures}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
