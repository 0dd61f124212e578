"""The cloud GPU tier measured: the torch-cuda backend raw, served, and against the cost model.

One prepared command for a bare GPU host (PyTorch with CUDA, onnx and a CPU-only
onnxruntime; no Ray, no registry). It carries the project tree and the onnx2torch wheel
(``pip download onnx2torch --no-deps``, 81 kB) and runs, on the GPU host::

    pip install --no-deps onnx2torch-*.whl && python -m bench.gpu

in about 5 minutes of device time (``--seconds`` sets each point's length). It measures,
with the torch-cuda backend (workers/_torch_engine.py):

* raw: ResNet50's and DenseNet121's tails and the generated transformer tail
  (bench/workers.py's models) at batches 1, 8, 32 and 128, one engine called directly:
  items/s and p50 latency, fp32 and fp16, and with CUDA graphs at batch 1;
* ours: the in-process pool (cluster LocalPool: its Batcher and engines, provider
  torch-cuda through ``Engine``, unchanged) at concurrency 1, 32 and 128 (closed loop);
* the peer: a plain asyncio batcher equivalent to Ray Serve's ``@serve.batch``
  (:class:`ServeBatchPeer`) on the same engine;
* GPU memory per engine with and without shared weights, and cold load to first answer;
* the cost model: tails at several cuts timed at batch 1, a measured ``Profile`` built
  from them, and the reference profile ``h100`` against those segment times (median
  absolute error).

Keys: ``ours_c32_over_raw_cuda_batched`` (ours at concurrency 32 over the raw engine at
batch 32, items/s), ``added_p50_ms`` (ours at concurrency 1 minus raw batch 1, p50),
``ours_over_serve_gpu`` (ours over the peer at concurrency 32, items/s), all from one run.
Writes bench/results/gpu.json and gpu.png.

``--dry-run`` runs every step on the CPU with tiny tails and short points (torch on the CPU
where installed, else ONNX Runtime standing in for the backend), in under 2 minutes on 2
cores, and writes to a temporary file unless ``--out`` names one: a dry run's numbers are
never results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

import partitioner  # noqa: E402
from workers._torch_engine import torch_available  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")
BATCHES = (1, 8, 32, 128)
CONCURRENCY = (1, 32, 128)
DRY_BATCHES = (1, 4)
DRY_CONCURRENCY = (1, 8)
BIG_BATCH = 32
"""The cost model's second batch: compute-bound where batch 1 is launch-bound."""
REFERENCE_DEVICE = "h100"
"""The planner's reference GPU (planner/devices.py has h100, no h200: an H200 is checked against it)."""


# -- models --------------------------------------------------------------------------------


def _cut_tail(model, layer: int, graph=None):
    graph = graph or partitioner.build_graph(model)
    _, tail = partitioner.split(model, partitioner.prefix_cut(graph, layer), graph=graph)
    return tail.model


def _transformer(dry: bool):
    from tests.unit._engine_models import make_transformer_block

    return make_transformer_block(seq=16, hidden=32, heads=4) if dry else make_transformer_block(
        seq=1024, hidden=256, heads=4)


def full_models(dry: bool) -> dict:
    """The whole models whose tails are measured (random weights: timing does not depend on them)."""
    return {"resnet50": partitioner.load_zoo("resnet50", random_weights=True),
            "densenet121": partitioner.load_zoo("densenet121", random_weights=True),
            "transformer": _transformer(dry)}


def served_tail(name: str, model, dry: bool):
    """The tail served: bench/workers.py's cuts (ResNet50 after layer 50, DenseNet121 after
    227, the transformer after its attention); a dry run takes the last chain point's tail."""
    graph = partitioner.build_graph(model)
    chain = partitioner.chain_points(graph)
    if dry:
        return _cut_tail(model, chain[-2] if len(chain) > 1 else chain[-1], graph)
    layer = {"resnet50": 50, "densenet121": 227}.get(name, chain[0])
    return _cut_tail(model, layer, graph)


# -- the backend ---------------------------------------------------------------------------


def backend(dry: bool) -> str:
    """The provider measured: torch-cuda; a dry run takes torch-cpu, or onnxruntime's cpu
    standing in where torch is not installed."""
    if not dry:
        return "torch-cuda"
    return "torch-cpu" if torch_available() is None else "cpu"


def make_engine(model, provider: str, *, buckets, share: bool = True, precision: str = "fp32",
                cuda_graphs: bool = False, cache_dir: str | None = None):
    from workers.engine import Engine, EngineConfig

    config = EngineConfig(provider=provider, batch_buckets=tuple(buckets), share_weights=share,  # type: ignore[arg-type]
                          loop_fallback=True, cache_dir=cache_dir, intra_op_threads=0 if provider == "cpu" else 0)
    if provider.startswith("torch"):  # graphs as asked (Engine's default would capture where it can)
        from workers._torch_engine import TorchEngine

        return TorchEngine(model, config, precision=precision, cuda_graphs=cuda_graphs)
    return Engine(model, config)


def _sync(provider: str) -> None:
    if provider == "torch-cuda":
        import torch

        torch.cuda.synchronize()


def _percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else 0.0


def time_raw(engine, batch: int, seconds: float, provider: str) -> dict:
    """The engine called directly at one batch: items/s and latency percentiles (ms)."""
    feed = engine.random_inputs(batch, seed=batch)
    for _ in range(3):
        engine.run(feed)
    _sync(provider)
    lat: list[float] = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or len(lat) < 5:
        t = time.perf_counter()
        engine.run(feed)
        lat.append((time.perf_counter() - t) * 1e3)
    elapsed = time.perf_counter() - start
    return {"batch": batch, "items_per_s": batch * len(lat) / elapsed, "p50_ms": statistics.median(lat),
            "p90_ms": _percentile(lat, 90), "runs": len(lat)}


# -- the peer ------------------------------------------------------------------------------


class ServeBatchPeer:
    """A plain asyncio batcher with Ray Serve's ``@serve.batch`` semantics, on one engine.

    Exactly: requests go into one asyncio queue; one loop takes the first request, then
    waits until ``max_batch_size`` requests are in hand or ``batch_wait_timeout_s`` has
    passed since the first arrived (Serve's defaults are 10 and 0.01 s; the size here is
    ours, 32, so only the policy differs), then runs the batch with ``engine.run_batch``
    in a worker thread and answers it, one batch at a time (Serve runs one batch of a
    replica's method at a time unless told otherwise). It has no priorities, deadlines,
    shape grouping or concurrent batches.
    """

    def __init__(self, engine, *, max_batch_size: int = 32, batch_wait_timeout_s: float = 0.01) -> None:
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.timeout_s = batch_wait_timeout_s
        self.queue: asyncio.Queue = asyncio.Queue()
        self.batches = 0
        self.task = asyncio.get_running_loop().create_task(self._loop())

    async def submit(self, inputs):
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put((inputs, fut))
        return await fut

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            deadline = loop.time() + self.timeout_s
            while len(batch) < self.max_batch_size:
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    batch.append(await asyncio.wait_for(self.queue.get(), left))
                except asyncio.TimeoutError:
                    break
            self.batches += 1
            try:
                outs = await loop.run_in_executor(None, self.engine.run_batch, [b[0] for b in batch])
            except Exception as e:  # noqa: BLE001 - every waiter gets the failure
                for _, fut in batch:
                    fut.set_exception(e)
                continue
            for (_, fut), out in zip(batch, outs):
                fut.set_result(out)

    async def close(self) -> None:
        self.task.cancel()


# -- served --------------------------------------------------------------------------------


async def _closed_loop(submit, feeds: list, concurrency: int, seconds: float, batches=lambda: 0) -> dict:
    lat: list[float] = []
    done = 0
    stop = time.perf_counter() + seconds

    async def client(i: int) -> None:
        nonlocal done
        feed = feeds[i % len(feeds)]
        while time.perf_counter() < stop:
            t = time.perf_counter()
            await submit(feed)
            lat.append((time.perf_counter() - t) * 1e3)
            done += 1

    for _ in range(2):  # warm the path
        await submit(feeds[0])
    start = time.perf_counter()
    first_batch = batches()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    elapsed = time.perf_counter() - start
    ran = batches() - first_batch
    return {"concurrency": concurrency, "items_per_s": done / elapsed, "p50_ms": statistics.median(lat),
            "p90_ms": _percentile(lat, 90), "requests": done, "mean_batch": done / ran if ran else None}


def served(tail, provider: str, concurrency: tuple[int, ...], seconds: float, max_batch: int,
           cache_dir: str, *, cuda_graphs: bool | None = None, replicas: int = 1, peer: bool = True,
           delay_ms: float = 0.0) -> dict:
    """Ours (the in-process LocalPool, provider through Engine unchanged; model.yaml's
    ``cuda_graphs`` as given) and the peer on the same engine."""
    from cluster._pools import LocalPool
    from cluster._registry_disk import ModelConfig
    from cluster.metrics import GatewayMetrics

    path = os.path.join(cache_dir, "tail.onnx")
    with open(path, "wb") as f:
        f.write(tail.SerializeToString())
    pool_provider = "cpu" if provider == "cpu" else provider
    config = ModelConfig(name="tail", max_batch_size=max_batch, max_queue_delay_ms=delay_ms, replicas=replicas,
                         cuda_graphs=cuda_graphs)

    async def run() -> dict:
        pool = LocalPool("tail", path, config, GatewayMetrics(), cache_dir=cache_dir, provider=pool_provider)
        engine = pool.engines[0]
        feeds = [engine.random_inputs(1, seed=i) for i in range(8)]
        ours = {}
        for c in concurrency:
            ours[c] = await _closed_loop(lambda x: pool.run(x, deadline_s=None, priority=0), feeds, c, seconds,
                                         lambda: pool.batches)
        theirs = {}
        if peer:
            them = ServeBatchPeer(engine, max_batch_size=max_batch)
            for c in concurrency:
                theirs[c] = await _closed_loop(them.submit, feeds, c, seconds, lambda: them.batches)
            await them.close()
        raw1 = time_raw(engine, 1, seconds, provider)
        rawb = time_raw(engine, max_batch, seconds, provider)
        await pool.close()
        out = {"engine": type(engine).__name__, "provider": engine.provider, "cuda_graphs": cuda_graphs,
               "cuda_graphs_used": getattr(engine, "cuda_graphs", False),
               "graphs_refused": getattr(engine, "graphs_refused", ""), "replicas": replicas, "delay_ms": delay_ms,
               "batch_safe": engine.batch_safe, "batch_reason": getattr(engine, "batch_reason", ""),
               "ours": ours, "serve_batch_peer": theirs, "raw_batch1": raw1, "raw_batched": rawb}
        c_mid = concurrency[1]
        out["ours_c32_over_raw_cuda_batched"] = ours[c_mid]["items_per_s"] / rawb["items_per_s"]
        out["added_p50_ms"] = ours[1]["p50_ms"] - raw1["p50_ms"]
        if theirs:
            out["ours_over_serve_gpu"] = ours[c_mid]["items_per_s"] / theirs[c_mid]["items_per_s"]
        return out

    return asyncio.run(run())


# -- memory and cold start -----------------------------------------------------------------


def memory_and_cold(tail, provider: str, buckets) -> dict:
    """GPU memory per engine (4 engines, with and without shared weights) and cold load to
    first answer (an engine of a model not yet loaded in this process)."""
    out: dict = {}
    t = time.perf_counter()
    eng = make_engine(tail, provider, buckets=buckets, share=False)
    feed = eng.random_inputs(1)
    eng.run(feed)
    _sync(provider)
    out["cold_load_to_first_answer_ms"] = (time.perf_counter() - t) * 1e3
    out["load_ms"] = eng.stats().load_ms
    for attr in ("convert_ms", "verify_ms"):
        if hasattr(eng, attr):
            out[attr] = getattr(eng, attr)
    eng.close()
    if provider != "torch-cuda":
        out["gpu_memory"] = "not measured: no GPU in this run"
        return out
    import torch

    from workers._torch_engine import forget_shared_modules

    for share in (True, False):
        forget_shared_modules()  # the pool's engine shared its module: count one copy here
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        engines = [make_engine(tail, provider, buckets=buckets, share=share) for _ in range(4)]
        for e in engines:
            e.run(feed)
        torch.cuda.synchronize()
        out[f"gpu_bytes_per_engine_{'shared' if share else 'unshared'}"] = (torch.cuda.memory_allocated() - before) / 4
        for e in engines:
            e.close()
        del engines
    return out


# -- the cost model ------------------------------------------------------------------------


def segment_io_mb(graph, layers) -> float:
    """MB per sample a segment copies in (the tensors it reads from outside it) and out
    (the model outputs it computes)."""
    made = {t for ly in graph.layers if ly.id in layers for t in ly.outputs}
    ins = {t for ly in graph.layers if ly.id in layers for t in ly.inputs if t not in made and t in graph.tensor}
    outs = {t for t in graph.outputs if t in made}
    return sum(float(graph.tensor[t].bytes_per_sample or 0) for t in ins | outs) / 1e6


def predict_segment(graph, layers, ref, batch: int) -> float:
    """The reference profile's time for ``layers`` run as one segment at ``batch``: the layers'
    rooflines, the run's fixed cost and the host copies ([Note: cost model] in planner.costmodel)."""
    return (sum(ref.layers[i].ms for i in layers) + ref.fixed_ms
            + batch * segment_io_mb(graph, layers) * ref.codec.host_copy_ms_per_mb)


def segment_parts(graph, cuts: int) -> list[frozenset]:
    """The layers of the whole model and of the tails after ``cuts`` evenly spread chain points."""
    chain = list(partitioner.chain_points(graph))
    picks = sorted({chain[round(i * (len(chain) - 1) / max(cuts - 1, 1))] for i in range(cuts)}) if chain else []
    all_layers = frozenset(ly.id for ly in graph.layers)
    tails = [all_layers - partitioner.prefix_cut(graph, layer).device for layer in picks]
    return [all_layers] + [t for t in tails if t]


def check_reference(result: dict, dry: bool = False) -> dict:
    """The reference profile now in planner/devices.py against the segment times a run
    measured (``result`` a gpu.json): batch 1 as served (CUDA graphs), and batch 32."""
    from planner.devices import reference_profile

    out: dict = {"reference_device": REFERENCE_DEVICE, "models": {}}
    every: dict[str, list[float]] = {"b1_cuda_graphs": [], f"b{BIG_BATCH}": []}
    models = full_models(dry)
    for name, cm in result.get("cost_model", {}).items():
        if "segments" not in cm or name not in models:
            continue
        graph = partitioner.build_graph(models[name])
        refs = {1: reference_profile(REFERENCE_DEVICE, graph), BIG_BATCH: reference_profile(
            REFERENCE_DEVICE, graph, batch=BIG_BATCH)}
        rows = []
        parts = segment_parts(graph, cm.get("cuts", 3 if dry else 4))
        if [len(p) for p in parts] != [seg["layers"] for seg in cm["segments"]]:
            out["models"][name] = {"failed": "the run's segments are not this graph's: another model or cut count"}
            continue
        for layers, seg in zip(parts, cm["segments"]):
            row = {"layers": len(layers), "first_layer": min(layers)}
            for key, batch, measured in (("b1_cuda_graphs", 1, seg.get("measured_cuda_graphs_ms")),
                                         (f"b{BIG_BATCH}", BIG_BATCH, seg.get(f"measured_b{BIG_BATCH}_ms"))):
                if measured:
                    pred = predict_segment(graph, layers, refs[batch], batch)
                    row[key] = {"measured_ms": measured, "predicted_ms": pred, "error": (pred - measured) / measured}
                    every[key].append(abs(pred - measured) / measured)
            rows.append(row)
        out["models"][name] = rows
    out["median_abs_error"] = {k: statistics.median(v) if v else None for k, v in every.items()}
    both = every["b1_cuda_graphs"] + every[f"b{BIG_BATCH}"]
    out["median_abs_error"]["all"] = statistics.median(both) if both else None
    return out


def cost_model(name: str, model, provider: str, seconds: float, cuts: int = 4) -> dict:
    """Tails at ``cuts`` chain points timed at batch 1 against the reference profile, and a
    measured Profile from them: the time between two cuts is spread over the layers between
    them by FLOPs."""
    from planner.devices import reference_profile
    from planner.profile import LayerTime, Profile

    graph = partitioner.build_graph(model)
    ref = reference_profile(REFERENCE_DEVICE, graph)
    ref_big = reference_profile(REFERENCE_DEVICE, graph, batch=BIG_BATCH)
    segments = []
    measured_by_cut: list[tuple[frozenset, float]] = []
    all_layers = frozenset(ly.id for ly in graph.layers)
    parts = [(layers, model if layers == all_layers else partitioner.split(
        model, partitioner.Cut(all_layers - layers), graph=graph)[1].model) for layers in segment_parts(graph, cuts)]
    for layers, segment in parts:
        eng = make_engine(segment, provider, buckets=(1, BIG_BATCH), share=False)
        ms = time_raw(eng, 1, seconds, provider)["p50_ms"]
        big_ms = time_raw(eng, BIG_BATCH, seconds, provider)["p50_ms"]
        eng.close()
        graphs_ms = None
        if provider == "torch-cuda":  # launch overhead out: what the roofline's compute terms should explain
            g = _step(lambda: make_engine(segment, provider, buckets=(1,), share=False, cuda_graphs=True))
            if not isinstance(g, dict):
                graphs_ms = time_raw(g, 1, seconds, provider)["p50_ms"] if g.cuda_graphs else None
                g.close()
        measured_by_cut.append((layers, ms))
        predicted = predict_segment(graph, layers, ref, 1)
        predicted_big = predict_segment(graph, layers, ref_big, BIG_BATCH)
        segments.append({"layers": len(layers), "first_layer": min(layers), "flops": sum(
                            float(graph.layers[i].flops or 0.0) for i in layers),
                         "measured_ms": ms, "predicted_ms": predicted,
                         "abs_error": abs(predicted - ms) / ms if ms else None,
                         "measured_cuda_graphs_ms": graphs_ms, f"measured_b{BIG_BATCH}_ms": big_ms,
                         f"predicted_b{BIG_BATCH}_ms": predicted_big})
    # a measured profile: nested tails, differences spread by FLOPs
    layer_ms: dict[int, float] = {}
    ordered = sorted(measured_by_cut, key=lambda p: -len(p[0]))
    for k, (layers, ms) in enumerate(ordered):
        inner, inner_ms = (ordered[k + 1] if k + 1 < len(ordered) else (frozenset(), 0.0))
        own = layers - inner
        share = max(ms - inner_ms, 0.0)
        flops = {i: float(graph.layers[i].flops or 0.0) + 1.0 for i in own}
        total = sum(flops.values()) or 1.0
        for i in own:
            layer_ms[i] = share * flops[i] / total
    profile = Profile(device=f"measured-{provider}", layers={i: LayerTime(ms=v) for i, v in layer_ms.items()},
                      ep=provider, ort_version="torch", model=graph.model)
    errors = [s["abs_error"] for s in segments if s["abs_error"] is not None]
    return {"reference_device": REFERENCE_DEVICE, "segments": segments, "cuts": cuts,
            "median_abs_error": statistics.median(errors) if errors else None,
            "measured_profile_total_ms": sum(layer_ms.values()), "measured_profile_layers": len(profile.layers),
            "measured_profile": profile.to_dict()}


# -- the run -------------------------------------------------------------------------------


def environment(provider: str) -> dict:
    import onnx
    import onnxruntime as ort

    env = {"python": platform.python_version(), "onnx": onnx.__version__, "onnxruntime": ort.__version__,
           "host": platform.node(), "backend": provider}
    if provider.startswith("torch"):
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        if provider == "torch-cuda":
            t = time.perf_counter()
            torch.ones(1, device="cuda").sum().item()
            env["cuda_init_ms"] = (time.perf_counter() - t) * 1e3
            env["device"] = torch.cuda.get_device_name(0)
            props = torch.cuda.get_device_properties(0)
            env["gpu_memory_bytes"] = props.total_memory
            try:
                import subprocess

                env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                               capture_output=True, text=True, timeout=20).stdout.strip()
            except (OSError, subprocess.SubprocessError):
                env["driver"] = "unknown (nvidia-smi did not answer)"
    if provider == "cpu":
        env["stand_in"] = "onnxruntime CPU stands in for the torch backend (torch is not installed)"
    return env


def _step(fn) -> dict:
    """``fn()``, or its failure as ``{"failed": ...}`` (printed too)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - any failure of one step is a finding to keep
        print(f"step failed: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}", file=sys.stderr)
        return {"failed": f"{type(e).__name__}: {e}"}


def _graphs_raw(tail, provider: str, buckets, batches, seconds: float) -> dict:
    t = time.perf_counter()
    eng = make_engine(tail, provider, buckets=buckets, cuda_graphs=True, share=False)
    load_ms = (time.perf_counter() - t) * 1e3
    out = {"load_ms": load_ms, "warmup_ms": eng.stats().warmup_ms, "graphs_refused": eng.graphs_refused,
           "points": [time_raw(eng, b, seconds, provider) for b in batches]}
    eng.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="everything on the CPU with tiny tails; not a result")
    ap.add_argument("--out", help="JSON path (default bench/results/gpu.json; a dry run: a temporary file)")
    ap.add_argument("--seconds", type=float, default=None, help="length of each measured point (default 2; dry 0.2)")
    ap.add_argument("--models", default="resnet50,densenet121,transformer", help="comma-separated")
    ap.add_argument("--check-reference", metavar="GPU_JSON",
                    help="no GPU: the reference profile now in planner/devices.py against the segment times "
                         "GPU_JSON measured; writes bench/results/gpu_cost_model.json (or --out)")
    args = ap.parse_args(argv)
    dry = args.dry_run
    if args.check_reference:
        with open(args.check_reference, encoding="utf-8") as f:
            measured = json.load(f)
        check = {"measured_in": os.path.basename(args.check_reference),
                 "device": measured.get("environment", {}).get("device"),
                 **check_reference(measured, dry=bool(measured.get("dry_run")))}
        path = args.out or os.path.join(RESULTS, "gpu_cost_model.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(check, f, indent=1, sort_keys=True)
        print(f"median |error| of the {REFERENCE_DEVICE} reference: {check['median_abs_error']}; wrote {path}")
        return 0
    seconds = args.seconds if args.seconds is not None else (0.2 if dry else 2.0)
    out = args.out or (os.path.join(tempfile.gettempdir(), "splitinfer-gpu-dry-run.json") if dry
                       else os.path.join(RESULTS, "gpu.json"))
    if dry and os.path.abspath(out) == os.path.abspath(os.path.join(RESULTS, "gpu.json")):
        print(f"--out {out}: a dry run never writes the results file; name another path", file=sys.stderr)
        return 2
    provider = backend(dry)
    from workers import keep_freed_memory

    kept = keep_freed_memory()  # as the gateway's process does (cluster.server.serve): ours as deployed
    if not dry and torch_available() is not None:
        print(f"bench/gpu.py: {torch_available()}", file=sys.stderr)
        return 2
    if provider == "torch-cuda":
        import torch

        if not torch.cuda.is_available():
            print("bench/gpu.py: torch sees no CUDA device; run it on the GPU host, or pass --dry-run", file=sys.stderr)
            return 2
    batches = DRY_BATCHES if dry else BATCHES
    concurrency = DRY_CONCURRENCY if dry else CONCURRENCY
    max_batch = batches[-1] if dry else 32
    t_all = time.perf_counter()
    result: dict = {"dry_run": dry, "environment": {**environment(provider), "freed_memory_kept": kept},
                    "seconds_per_point": seconds,
                    "raw": {}, "served": {}, "memory": {}, "cost_model": {}}
    models = full_models(dry)
    names = [m for m in args.models.split(",") if m]
    with tempfile.TemporaryDirectory() as cache_dir:
        for name in names:
            if name not in models:
                print(f"--models {name}: unknown; use {', '.join(models)}", file=sys.stderr)
                return 2
            t_model = time.perf_counter()
            try:
                tail = served_tail(name, models[name], dry)
            except Exception as e:  # noqa: BLE001 - the other models' device time is kept
                result["raw"][name] = {"failed": f"cutting the tail: {type(e).__name__}: {e}"}
                continue
            buckets = tuple(sorted({1, 2, 4, 8, *batches}))
            raw: dict = {}
            for precision in ("fp32", "fp16") if provider.startswith("torch") else ("fp32",):
                try:
                    eng = make_engine(tail, provider, buckets=buckets, precision=precision, share=False)
                except Exception as e:  # noqa: BLE001 - a precision the tail refuses is a finding
                    raw[precision] = {"refused": str(e)}
                    continue
                raw[precision] = {"verify_error": getattr(eng, "verify_error", None),
                                  **_step(lambda: {"points": [time_raw(eng, b, seconds, provider) for b in batches]})}
                eng.close()
            if provider == "torch-cuda":
                raw["fp32_cuda_graphs"] = _step(lambda: _graphs_raw(tail, provider, buckets, batches, seconds))
            result["raw"][name] = raw
            sub = os.path.join(cache_dir, name)
            os.makedirs(sub, exist_ok=True)
            srv = _step(lambda: served(tail, provider, concurrency, seconds, max_batch, sub))
            result["served"][name] = srv
            if provider == "torch-cuda":  # ours again with eager runs: what the graphs are worth served
                sub_e = os.path.join(cache_dir, name + "-eager")
                os.makedirs(sub_e, exist_ok=True)
                result.setdefault("served_eager", {})[name] = _step(
                    lambda: served(tail, provider, concurrency, seconds, max_batch, sub_e, cuda_graphs=False))
            # a step that fails is recorded, not fatal: the device time of the others is kept
            result["memory"][name] = _step(lambda: memory_and_cold(tail, provider, buckets))
            result["cost_model"][name] = _step(lambda: cost_model(name, models[name], provider, seconds / 2,
                                                                  cuts=3 if dry else 4))
            c_mid = concurrency[1]
            if "failed" not in srv:
                print(f"{name}: c{c_mid} ours/raw {srv['ours_c32_over_raw_cuda_batched']:.2f}, added p50 "
                      f"{srv['added_p50_ms']:.3f} ms, ours/peer {srv['ours_over_serve_gpu']:.2f}, cost model median "
                      f"error {result['cost_model'][name].get('median_abs_error')}, "
                      f"{time.perf_counter() - t_model:.0f} s", flush=True)
            _write(result, out, t_all, final=False)  # what a run stopped at its limit still leaves
    _write(result, out, t_all, final=True)
    print(f"wrote {out} in {result['wall_s']:.0f} s")
    return 0


def _write(result: dict, out: str, t_all: float, *, final: bool) -> None:
    keys = ("ours_c32_over_raw_cuda_batched", "added_p50_ms", "ours_over_serve_gpu")
    result["keys"] = {k: {n: s[k] for n, s in result["served"].items() if k in s} for k in keys}
    result["keys_eager"] = {k: {n: s[k] for n, s in result.get("served_eager", {}).items() if k in s}
                            for k in keys}
    errors = [c["median_abs_error"] for c in result["cost_model"].values() if c.get("median_abs_error") is not None]
    result["cost_model_median_abs_error"] = statistics.median(errors) if errors else None
    result["not_measured"] = ["Ray Serve itself (no Ray on the GPU host: the peer is ServeBatchPeer)",
                              "onnxruntime-gpu (its CUDA 12 wheel does not match the host's CUDA 13)"]
    result["complete"] = final
    result["wall_s"] = time.perf_counter() - t_all
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, sort_keys=True, default=str)
    if final:
        _plot(result, os.path.splitext(out)[0] + ".png")


def _plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, raw in result["raw"].items():
        pts = raw.get("fp32", {}).get("points", [])
        srv = result["served"].get(name, {})
        if "ours" not in srv:
            continue
        axes[0].plot([p["batch"] for p in pts], [p["items_per_s"] for p in pts], marker="o", label=f"{name} raw fp32")
        cs = sorted(srv["ours"], key=int)
        axes[1].plot(cs, [srv["ours"][c]["items_per_s"] for c in cs], marker="o", label=f"{name} ours")
        axes[1].plot(cs, [srv["serve_batch_peer"][c]["items_per_s"] for c in cs], marker="x", ls="--",
                     label=f"{name} @serve.batch peer")
    axes[0].set(xscale="log", yscale="log", xlabel="batch", ylabel="items/s", title="raw backend")
    axes[1].set(xscale="log", yscale="log", xlabel="concurrency", ylabel="items/s", title="served")
    for ax in axes:
        ax.legend(fontsize=7)
    env = result["environment"]
    fig.suptitle(f"{env.get('device', env['backend'])}{' (dry run)' if result['dry_run'] else ''}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
