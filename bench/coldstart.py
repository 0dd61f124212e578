"""Cold start and weight sharing of the segment engine, against plain ONNX Runtime.

For every zoo model, side by side in one run, each measurement in a fresh process
(so nothing is warm but the OS page cache, as on a restarted worker):

* naive: ``InferenceSession(original model)`` plus the first run, ORT defaults;
* ours: ``Engine(original model)`` with a pre-optimised artefact in the cache; its
  construction includes one warm-up run, so it is the same work: ready plus one run.

The ratio naive / ours is the speed-up. The artefact build (done once, offline) is
reported separately. Then the resident memory of 4 engines of one model in one
process, with and without weight sharing, and of 4 plain sessions.

    python -m bench.coldstart [--models vgg19,resnet50] [--repeats 3] [--memory-models vgg19,bvlc_alexnet]

writes bench/results/coldstart.json and bench/results/coldstart.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

ZOO = (
    "bvlc_alexnet", "zfnet512", "vgg19", "resnet50", "densenet121",
    "inception_v1", "inception_v2", "shufflenet", "squeezenet",
)
RESULTS = os.path.join(ROOT, "bench", "results")


def _zoo_path(name: str) -> str:
    import onnx

    return os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light", f"light_{name}.onnx")


def _rss_bytes() -> int:
    from workers._ort import resident_bytes

    return resident_bytes()


# -- children: one measurement each, printed as JSON ---------------------------------


def _feed(session_inputs):
    import numpy as np

    return {i.name: np.random.default_rng(0).standard_normal([d if isinstance(d, int) else 1 for d in i.shape]).astype(np.float32)
            for i in session_inputs}


def _child_naive(model: str) -> dict:
    import onnxruntime as ort

    path = _zoo_path(model)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    t0 = time.perf_counter()
    session = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    t_loaded = time.perf_counter()
    feed = _feed(session.get_inputs())  # not timed: the engine's warm-up makes its own
    t_run = time.perf_counter()
    session.run(None, feed)
    t1 = time.perf_counter()
    return {"load_first_run_ms": ((t_loaded - t0) + (t1 - t_run)) * 1e3, "load_ms": (t_loaded - t0) * 1e3}


def _child_steady(model: str, cache_dir: str, runs: int) -> dict:
    """Warm run time of the engine against a plain session, interleaved in one process."""
    import onnxruntime as ort

    from workers.engine import Engine, EngineConfig

    path = _zoo_path(model)
    eng = Engine(path, EngineConfig(cache_dir=cache_dir, provider="cpu"))
    so = ort.SessionOptions()
    so.log_severity_level = 3
    plain = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    feed = _feed(plain.get_inputs())
    plain.run(None, feed)
    ours, theirs = [], []
    for _ in range(runs):
        t = time.perf_counter()
        eng.run(feed)
        ours.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        plain.run(None, feed)
        theirs.append((time.perf_counter() - t) * 1e3)
    return {"engine_run_ms": statistics.median(ours), "plain_run_ms": statistics.median(theirs)}


def _child_engine(model: str, cache_dir: str) -> dict:
    from workers.engine import Engine, EngineConfig

    cfg = EngineConfig(cache_dir=cache_dir, provider="cpu", warmup_runs=1)
    t0 = time.perf_counter()
    eng = Engine(_zoo_path(model), cfg)
    t1 = time.perf_counter()
    st = eng.stats()
    return {
        "load_first_run_ms": (t1 - t0) * 1e3,
        "from_cache": st.from_cache,
        "warmup_ms": st.warmup_ms,
        "artefact": json.loads(eng.artefact.to_json()),
    }


def _child_memory(model: str, cache_dir: str, mode: str, count: int) -> dict:
    import onnxruntime as ort

    from workers.engine import Engine, EngineConfig

    path = _zoo_path(model)
    before = _rss_bytes()
    held = []
    for _ in range(count):
        if mode == "plain":
            so = ort.SessionOptions()
            so.log_severity_level = 3
            s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
            s.run(None, _feed(s.get_inputs()))
            held.append(s)
        else:
            e = Engine(path, EngineConfig(cache_dir=cache_dir, provider="cpu", share_weights=(mode == "shared")))
            held.append(e)
    after = _rss_bytes()
    return {"rss_added_bytes": after - before, "engines": count}


def _run_child(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", *args],
        check=True, capture_output=True, text=True, cwd=ROOT,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- parent ------------------------------------------------------------------------------


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = result["coldstart"]
    names = [r["model"] for r in rows]
    naive = [r["naive_ms"] for r in rows]
    ours = [r["engine_ms"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [3, 1.3]})
    ax = axes[0]
    x = np.arange(len(names))
    naive_load = [r["naive_load_ms"] for r in rows]
    ours_load = [r["engine_without_first_run_ms"] for r in rows]
    ax.bar(x - 0.3, naive, 0.2, label="ORT session from the original: load + first run", color="tab:blue")
    ax.bar(x - 0.1, ours, 0.2, label="Engine from the pre-optimised artefact: load + first run", color="tab:orange")
    ax.bar(x + 0.1, naive_load, 0.2, label="ORT session: load only", color="tab:blue", alpha=0.45, hatch="//")
    ax.bar(x + 0.3, ours_load, 0.2, label="Engine: load only", color="tab:orange", alpha=0.45, hatch="//")
    for i, r in enumerate(rows):
        ax.text(x[i] - 0.2, max(naive[i], ours[i]) * 1.08, f"{r['speedup']:.1f}x", ha="center", fontsize=7)
        ax.text(x[i] + 0.2, max(naive_load[i], ours_load[i]) * 1.08, f"{r['load_speedup']:.0f}x", ha="center",
                fontsize=7, color="dimgray")
    ax.set_xticks(x, [n.replace("bvlc_", "") for n in names], rotation=30, ha="right")
    ax.set_ylabel("ms, median of fresh processes")
    ax.set_xlabel("labels: median of paired naive/engine ratios (load + first run; load only)")
    ax.set_yscale("log")
    ax.set_title("Cold start (CPU)")
    ax.legend(fontsize=8)
    ax = axes[1]
    mem = result["memory"]
    labels = [m["model"].replace("bvlc_", "") for m in mem]
    xm = np.arange(len(labels))
    for k, (key, lab) in enumerate([("plain_mb", "4 plain sessions"), ("unshared_mb", "4 engines, no sharing"), ("shared_mb", "4 engines, shared")]):
        ax.bar(xm + (k - 1) * 0.27, [m[key] for m in mem], 0.27, label=lab)
    ax.set_xticks(xm, labels)
    ax.set_ylabel("resident memory added (MB)")
    ax.set_title("Weights of 4 engines")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(ZOO))
    ap.add_argument("--memory-models", default="vgg19,bvlc_alexnet,resnet50")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steady-runs", type=int, default=7, help="interleaved warm runs for the run-time ratio")
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        kind, *rest = args.child
        if kind == "naive":
            res = _child_naive(rest[0])
        elif kind == "engine":
            res = _child_engine(rest[0], rest[1])
        elif kind == "steady":
            res = _child_steady(rest[0], rest[1], int(rest[2]))
        else:
            res = _child_memory(rest[0], rest[1], rest[2], int(rest[3]))
        print(json.dumps(res))
        return 0

    import onnxruntime as ort

    os.makedirs(args.out, exist_ok=True)
    models = [m for m in args.models.split(",") if m]
    rows = []
    with tempfile.TemporaryDirectory(prefix="coldstart-bench-") as cache_dir:
        for model in models:
            built = _run_child("engine", model, cache_dir)  # builds the artefact (offline step)
            naive, ours, naive_ready, ours_ready = [], [], [], []
            for _ in range(args.repeats):  # interleaved, so load drifts hit both alike
                n = _run_child("naive", model)
                e = _run_child("engine", model, cache_dir)
                if not e["from_cache"]:
                    raise RuntimeError(f"the engine did not find the artefact of {model} it had just built")
                naive.append(n["load_first_run_ms"])
                naive_ready.append(n["load_ms"])
                ours.append(e["load_first_run_ms"])
                ours_ready.append(e["load_first_run_ms"] - e["warmup_ms"])
            steady = _run_child("steady", model, cache_dir, str(args.steady_runs))
            row = {
                "model": model,
                "naive_ms": statistics.median(naive),
                "engine_ms": statistics.median(ours),
                "engine_without_first_run_ms": statistics.median(ours_ready),
                # The "cold-load time": from nothing to a session ready to run.
                "naive_load_ms": statistics.median(naive_ready),
                "load_speedup": statistics.median(n / e for n, e in zip(naive_ready, ours_ready)),
                "load_speedup_range": [min(n / e for n, e in zip(naive_ready, ours_ready)),
                                       max(n / e for n, e in zip(naive_ready, ours_ready))],
                # each naive sample ran right before its engine sample: pairs share the
                # machine's load at that moment, so the median of pair ratios is steadier
                "speedup": statistics.median(n / e for n, e in zip(naive, ours)),
                "speedup_of_medians": statistics.median(naive) / statistics.median(ours),
                "speedup_range": [min(n / e for n, e in zip(naive, ours)), max(n / e for n, e in zip(naive, ours))],
                "naive_samples_ms": naive,
                "engine_samples_ms": ours,
                "engine_run_ms": steady["engine_run_ms"],
                "plain_run_ms": steady["plain_run_ms"],
                "steady_run_ratio": steady["engine_run_ms"] / steady["plain_run_ms"],
                "build_ms": built["artefact"]["build_ms"],
                "batch_safe": built["artefact"]["batch_safe"],
                "batch_rewrites": built["artefact"]["batch_rewrites"],
                "folded_constants": built["artefact"]["folded_constants"],
                "weights_bytes": built["artefact"]["weights_bytes"],
            }
            rows.append(row)
            print(f"{model:14s} naive {row['naive_ms']:8.0f} ms  engine {row['engine_ms']:7.0f} ms  "
                  f"(of which load {row['engine_without_first_run_ms']:.0f} ms)  speed-up {row['speedup']:5.1f}x  "
                  f"load only {row['naive_load_ms']:.0f} / {row['engine_without_first_run_ms']:.0f} ms = "
                  f"{row['load_speedup']:.1f}x  "
                  f"warm run engine/plain {row['steady_run_ratio']:.2f}  "
                  f"(build once {row['build_ms']:.0f} ms)", flush=True)

        memory = []
        for model in [m for m in args.memory_models.split(",") if m]:
            _run_child("engine", model, cache_dir)
            plain = _run_child("memory", model, cache_dir, "plain", "4")["rss_added_bytes"]
            unshared = _run_child("memory", model, cache_dir, "unshared", "4")["rss_added_bytes"]
            shared = _run_child("memory", model, cache_dir, "shared", "4")["rss_added_bytes"]
            one = _run_child("memory", model, cache_dir, "shared", "1")["rss_added_bytes"]
            m = {
                "model": model,
                "plain_mb": plain / 2**20,
                "unshared_mb": unshared / 2**20,
                "shared_mb": shared / 2**20,
                "one_shared_engine_mb": one / 2**20,
                "saved_mb": (unshared - shared) / 2**20,
                "unshared_over_shared": unshared / max(shared, 1),
                "plain_over_shared": plain / max(shared, 1),
            }
            memory.append(m)
            print(f"{model:14s} 4 engines: plain {m['plain_mb']:.0f} MB, unshared {m['unshared_mb']:.0f} MB, "
                  f"shared {m['shared_mb']:.0f} MB (1 engine {m['one_shared_engine_mb']:.0f} MB): "
                  f"{m['unshared_over_shared']:.1f}x less", flush=True)

    result = {
        "what": ("cold start, fresh process each: load (until ready to run) and load + first run; "
                 "memory: RSS added by 4 engines of one model"),
        "onnxruntime": ort.__version__,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "repeats": args.repeats,
        "load_average_1min_at_end": os.getloadavg()[0],
        "coldstart": rows,
        "memory": memory,
    }
    with open(os.path.join(args.out, "coldstart.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    _plot(result, os.path.join(args.out, "coldstart.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
