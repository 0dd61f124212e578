"""Gateway benchmark: a tail served through the gateway against the same tail run directly.

    python -m bench.gateway [--quick]

Writes bench/results/gateway.json and bench/results/gateway.png. The gateway runs on
127.0.0.1 in this process (server on a background thread) with in-process pools
(`local-noray`), token auth on, and a ResNet50 tail (zoo architecture, seeded
random weights) cut at its middle chain point. The limit is `Engine.run` on the
same tail file in this process: no wire, no auth, no batching.


For two cuts: the middle chain point (a heavy tail, 784 KiB boundary) and the last
chain point (a light tail: pooling and the classifier, where fixed costs show):

1. latency at concurrency 1: gateway Infer (auth on) vs Engine.run, interleaved
   sample by sample; and auth on vs auth off, interleaved the same way.
2. throughput at concurrency 8: gateway requests/s (the batcher forms batches)
   vs sequential Engine.run calls/s.
Quote the ratios; absolute times depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort

from cluster.auth import Authorizer, TokenTable
from cluster.gateway import Gateway, LocalPoolFactory
from cluster.protocol.client import InferenceClient, SyncInferenceClient, make_request
from cluster.registry import Registry
from cluster.server import serve_in_thread
from partitioner import boundary, chain_points, load_zoo, prefix_cut
from workers.engine import Engine, EngineConfig

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
TOKEN = "bench-token-0123456789abcdef"


def _repo(root: str, model: onnx.ModelProto, yaml_text: str) -> None:
    d = os.path.join(root, "net", "1")
    os.makedirs(d)
    onnx.save(model, os.path.join(d, "model.onnx"))
    with open(os.path.join(d, "model.yaml"), "w") as fh:
        fh.write(yaml_text)


def _stop(server, gateway) -> None:
    asyncio.run_coroutine_threadsafe(gateway.close(), server._loop).result()
    server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gateway")
    p.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    a = p.parse_args(argv)
    n_lat = 10 if a.quick else 40
    n_tput = 16 if a.quick else 64
    tmp = tempfile.mkdtemp(prefix="bench-gateway-")
    root = os.path.join(tmp, "repo")
    _repo(root, load_zoo("resnet50", random_weights=True, seed=1),
          "max_batch_size: 8\nintra_op_threads: 2\n"
          "frontier: {default_cut_count: 1, include_cloud_only: false}\n")
    registry = Registry(root)
    table = TokenTable.from_dicts([{"name": "bench", "token": TOKEN}])
    gw_auth = Gateway(registry, LocalPoolFactory(cache_dir=os.path.join(tmp, "ort")), authorizer=Authorizer(table))
    registry.load_all()
    lv = registry.resolve("net", "1")
    (mid,) = lv.frontier.cuts
    graph = lv.files.splitter().graph
    late = prefix_cut(graph, [p for p in chain_points(graph) if p < len(graph) - 1][-1])
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    # A second gateway on the same registry files, without auth, for the auth-overhead pair.
    registry2 = Registry(root)
    gw_open = Gateway(registry2, LocalPoolFactory(cache_dir=os.path.join(tmp, "ort")))
    registry2.load_all()
    s_auth, s_open = serve_in_thread(gw_auth), serve_in_thread(gw_open)
    out: dict = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()}, "model": "resnet50",
                 "cuts": {}}
    try:
        for label, cut_id in (("middle", mid.cut_id), ("late", late.key)):
            head, _ = lv.files.splitter().split(lv.files.resolve_cut(cut_id))
            hs = ort.InferenceSession(head.model.SerializeToString(), providers=["CPUExecutionProvider"])
            bnd = dict(zip([o.name for o in hs.get_outputs()], hs.run(None, {hs.get_inputs()[0].name: x})))
            bnd = {k: bnd[k] for k in boundary(graph, lv.files.resolve_cut(cut_id))}
            out["cuts"][label] = _measure(lv, cut_id, bnd, s_auth, s_open, gw_auth, tmp, n_lat, n_tput)
    finally:
        _stop(s_auth, gw_auth)
        _stop(s_open, gw_open)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "gateway.json"), "w") as fh:
        json.dump(out, fh, indent=2, sort_keys=True)
    _plot(out)
    print(json.dumps(out, indent=2, sort_keys=True))
    return 0


def _measure(lv, cut_id: str, bnd: dict, s_auth, s_open, gw_auth, tmp: str, n_lat: int, n_tput: int) -> dict:
    engine = Engine(lv.files.tail_path(cut_id), EngineConfig(intra_op_threads=2, cache_dir=os.path.join(tmp, "ort")))
    out: dict = {"cut_id": cut_id, "boundary": sorted(bnd), "boundary_bytes": sum(v.nbytes for v in bnd.values())}
    try:
        c_auth = SyncInferenceClient(s_auth.address, token=TOKEN)
        c_open = SyncInferenceClient(s_open.address)
        for _ in range(3):  # warm-up of every path (the first request also loads an on-demand tail)
            engine.run(bnd)
            c_auth.infer(make_request("net", "1", cut_id, bnd, timeout_s=120))
            c_open.infer(make_request("net", "1", cut_id, bnd, timeout_s=120))
        direct, via_auth, via_open = [], [], []
        for _ in range(n_lat):
            t = time.perf_counter()
            engine.run(bnd)
            direct.append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            c_auth.infer(make_request("net", "1", cut_id, bnd, timeout_s=60))
            via_auth.append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            c_open.infer(make_request("net", "1", cut_id, bnd, timeout_s=60))
            via_open.append((time.perf_counter() - t) * 1e3)
        med = {k: statistics.median(v) for k, v in (("direct_ms", direct), ("gateway_auth_ms", via_auth),
                                                       ("gateway_noauth_ms", via_open))}
        out["latency_c1"] = dict(med, samples=n_lat,
                                 gateway_over_direct=med["gateway_auth_ms"] / med["direct_ms"],
                                 gateway_overhead_ms=med["gateway_auth_ms"] - med["direct_ms"],
                                 auth_over_noauth=med["gateway_auth_ms"] / med["gateway_noauth_ms"])
        c_auth.close()
        c_open.close()
        t = time.perf_counter()
        for _ in range(n_tput):
            engine.run(bnd)
        direct_rps = n_tput / (time.perf_counter() - t)

        async def burst() -> float:
            async with InferenceClient(s_auth.address, token=TOKEN) as c:
                sem = asyncio.Semaphore(8)

                async def one() -> None:
                    async with sem:
                        await c.infer(make_request("net", "1", cut_id, bnd, timeout_s=120))

                t0 = time.perf_counter()
                await asyncio.gather(*(one() for _ in range(n_tput)))
                return n_tput / (time.perf_counter() - t0)

        before = gw_auth.metrics.sample("splitinfer_batch_size_count") or 0.0
        gw_rps = asyncio.run(burst())
        batches = (gw_auth.metrics.sample("splitinfer_batch_size_count") or 0.0) - before
        out["throughput_c8"] = {"direct_sequential_rps": direct_rps, "gateway_rps": gw_rps,
                                "gateway_over_direct": gw_rps / direct_rps, "requests": n_tput,
                                "mean_batch_size": n_tput / batches if batches else None}
    finally:
        engine.close()
    return out


def _plot(out: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(out["cuts"]), 2, figsize=(9, 3.3 * len(out["cuts"])), squeeze=False)
    for (label, r), (ax1, ax2) in zip(out["cuts"].items(), axes):
        lat, tp = r["latency_c1"], r["throughput_c8"]
        ax1.bar(["Engine.run", "gateway\n(no auth)", "gateway\n(auth)"],
                [lat["direct_ms"], lat["gateway_noauth_ms"], lat["gateway_auth_ms"]], color=["grey", "C0", "C1"])
        ax1.set_ylabel("median ms per request")
        ax1.set_title(f"{label} cut ({r['boundary_bytes'] / 1024:.0f} KiB): gateway/direct "
                      f"{lat['gateway_over_direct']:.2f}", fontsize=9)
        ax2.bar(["Engine.run\nsequential", "gateway\nconcurrency 8"],
                [tp["direct_sequential_rps"], tp["gateway_rps"]], color=["grey", "C1"])
        ax2.set_ylabel("requests / s")
        ax2.set_title(f"throughput ratio {tp['gateway_over_direct']:.2f}", fontsize=9)
    fig.suptitle("ResNet50 tails through the gateway (loopback gRPC) vs Engine.run")
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "gateway.png"), dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
