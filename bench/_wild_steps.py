"""The steps of `bench.wild` that run through the Python API, each in its own process.

    python -m bench._wild_steps int8  KEY MODEL.onnx OUT.json
    python -m bench._wild_steps serve KEY MODEL.onnx REGISTRY SAMPLES.npz OUT.json [SPLIT_DIR]
    python -m bench._wild_steps serve-shared REGISTRY MODELS.json OUT.json

`bench.wild` starts each as a child with a time limit, so one hung step never stalls the
run. Each writes one JSON object to OUT.json: ``status`` ('ok' or 'refused'), ``reason``
(the one-line error, never a traceback) and the step's numbers.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import onnxruntime as ort

from bench._wild_models import WILD_MODELS, WildModel, make_sample_inputs

__all__ = ["first_line", "run_int8", "run_serve", "run_serve_shared", "running_gateway", "sample_feeds",
           "splitinfer_argv", "summarize_int8"]

_GATEWAY_START_S = 120.0
_REQUEST_TIMEOUT_S = 120.0


def splitinfer_argv() -> list[str]:
    """The ``splitinfer`` console script beside this interpreter, or the module form."""
    script = os.path.join(os.path.dirname(sys.executable), "splitinfer")
    if os.path.isfile(script):
        return [script]
    return [sys.executable, "-c", "import sys; from splitinfer.cli import main; sys.exit(main())"]


def first_line(error: BaseException | str) -> str:
    """The first non-empty line of an error, with its type for an exception."""
    text = str(error).strip() if isinstance(error, str) else f"{type(error).__name__}: {error}".strip()
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), text)[:400]


def sample_feeds(model: WildModel, path: str, variant: int = 0) -> dict[str, np.ndarray]:
    """The model's sample inputs; a stateful model's state is the one an earlier call on
    another chunk returned (what a streaming caller passes), not zeros."""
    feeds = make_sample_inputs(model, variant)
    if model.state:
        session = _session(path)
        earlier = make_sample_inputs(model, variant + 100)
        names = [o.name for o in session.get_outputs()]
        outs = dict(zip(names, session.run(None, earlier)))
        for out_name, in_name in model.state.items():
            feeds[in_name] = outs[out_name].astype(feeds[in_name].dtype)
    return feeds


def run_int8(model: WildModel, path: str) -> dict[str, object]:
    """``workers.quantize.quantize`` with its defaults, calibrated on 4 sample variants and
    evaluated on 2 held-out ones."""
    from workers.quantize import quantize

    calib = [sample_feeds(model, path, v) for v in range(4)]
    evals = [sample_feeds(model, path, v) for v in range(4, 6)]
    t0 = time.perf_counter()
    try:
        result = quantize(path, calib, eval_data=evals)
    except Exception as e:  # every refusal is recorded with its one line
        return {"status": "refused", "reason": first_line(e), "wall_s": time.perf_counter() - t0}
    report = json.loads(result.report.to_json())
    out: dict[str, object] = {"status": "ok", "reason": "", "wall_s": time.perf_counter() - t0,
                              "report": report, "summary": summarize_int8(report)}
    agreement = out["summary"].get("agreement")  # type: ignore[union-attr]
    if isinstance(agreement, (int, float)) and agreement < ALTERNATIVES_BELOW:
        out["alternatives"] = [_alternative(path, calib, evals, kwargs) for kwargs in INT8_ALTERNATIVES]
    return out


ALTERNATIVES_BELOW = 0.99
"""Agreement under which the other INT8 settings are tried too."""

INT8_ALTERNATIVES: tuple[dict[str, object], ...] = (
    {"method": "percentile"},
    {"op_types_to_quantize": ["Conv"]},
    {"op_types_to_quantize": ["MatMul", "Gemm"]},
)
"""What to try when the defaults lose agreement: clipped calibration, or fewer op types
quantised (the weight-heavy ops alone)."""


def _alternative(path: str, calib, evals, kwargs: Mapping[str, object]) -> dict[str, object]:
    from workers.quantize import quantize

    try:
        report = json.loads(quantize(path, calib, eval_data=evals, **kwargs).report.to_json())
    except Exception as e:  # one setting's refusal does not hide the others
        return {"settings": dict(kwargs), "status": "refused", "reason": first_line(e)}
    s = summarize_int8(report)
    return {"settings": dict(kwargs), "status": "ok", "agreement": s.get("agreement"), "metric": s.get("metric"),
            "worst_output": s.get("worst_output"), "size_ratio": s.get("size_ratio"), "note": s.get("note")}


def summarize_int8(report: Mapping[str, object]) -> dict[str, object]:
    """The agreement figure, its metric and the worst output from a QuantizeReport's JSON,
    whichever of its fields the report carries."""
    stats = report.get("evaluation") or report.get("calibration") or {}
    out: dict[str, object] = {"per_channel": report.get("per_channel"), "kind": report.get("kind"),
                              "note": report.get("note")}
    fp32, after = report.get("size_fp32_bytes"), report.get("size_after_bytes")
    if isinstance(fp32, int) and isinstance(after, int) and fp32:
        out["size_ratio"] = after / fp32
    if not isinstance(stats, Mapping):
        return out
    for key in ("agreement", "worst_output", "top1_agreement", "max_abs_error", "output_name"):
        if key in stats:
            out[key] = stats[key]
    per_output = {o.get("output_name"): o for o in stats.get("outputs") or () if isinstance(o, Mapping)}
    worst = per_output.get(stats.get("worst_output"))
    if worst is not None:
        out["metric"] = worst.get("metric")
        out["value"] = worst.get("value")
        out["max_abs_error"] = worst.get("max_abs_error")
    out["metrics"] = {name: o.get("metric") for name, o in per_output.items()}
    return out


@contextlib.contextmanager
def running_gateway(registry: str) -> Iterator[tuple[str | None, str, Callable[[], str | None]]]:
    """``splitinfer gateway`` on loopback over ``registry``, in-process pools: yields its
    address (None when it did not start), its health once SERVING (or the last status
    seen) and a function that gives the gateway's last error line once it has exited."""
    proc = subprocess.Popen(
        splitinfer_argv() + ["gateway", "--registry", registry, "--port", "0", "--metrics-port", "-1",
                             "--ray-address", "local-noray", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    errors: list[str] = []
    threading.Thread(target=_pump, args=(proc.stdout, lines.put), daemon=True).start()
    threading.Thread(target=_pump, args=(proc.stderr, errors.append), daemon=True).start()

    def exited() -> str | None:
        return None if proc.poll() is None else _last_error(errors, proc)

    try:
        address = _wait_address(proc, lines)
        health = "not started"
        if address is not None:
            from cluster.protocol.client import SyncInferenceClient

            with SyncInferenceClient(address) as client:
                health = _wait_serving(client, proc)
        yield address, health, exited
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_serve(model: WildModel, path: str, registry: str, samples: str,
              split_dir: str | None) -> dict[str, object]:
    """Starts ``splitinfer gateway`` on loopback over ``registry`` and sends the sample
    inputs: the whole model (cut ``L``) and, given a verified split, its tail."""
    from cluster.protocol.client import SyncInferenceClient

    inputs = dict(np.load(samples))
    expected = _expected(path, inputs)
    with running_gateway(registry) as (address, health, exited):
        if address is None or exited():
            return {"status": "refused", "reason": "gateway exited: " + (exited() or "did not start"),
                    "health": health}
        result: dict[str, object] = {"status": "ok", "reason": "", "address": address, "health": health}
        with SyncInferenceClient(address) as client:
            result["whole"] = _serve_cut(client, model.key, "L", inputs, expected)
            if split_dir:
                with open(os.path.join(split_dir, "split.json"), encoding="utf-8") as fh:
                    meta = json.load(fh)
                head = _session(os.path.join(split_dir, "head.onnx"))
                head_feed = {i.name: inputs[i.name] for i in head.get_inputs()}
                produced = dict(zip([o.name for o in head.get_outputs()], head.run(None, head_feed)))
                available = {**inputs, **produced}
                tail_feed = {name: available[name] for name in meta["tail_inputs"]}
                result["split"] = _serve_cut(client, model.key, meta["cut_id"], tail_feed, expected)
                result["split"]["boundary_bytes"] = int(sum(v.nbytes for v in tail_feed.values()))
    failed = [k for k in ("whole", "split") if isinstance(result.get(k), dict) and result[k]["status"] != "ok"]
    if failed:
        result["status"] = "refused"
        result["reason"] = "; ".join(f"{k}: {result[k]['reason']}" for k in failed)
    return result


def run_serve_shared(registry: str, models: Mapping[str, Mapping[str, str]]) -> dict[str, object]:
    """One gateway over one registry holding every model (``{key: {path, samples}}``):
    a model that fails to load must not stop the others. One whole-model request each."""
    from cluster.protocol.client import SyncInferenceClient

    with running_gateway(registry) as (address, health, exited):
        if address is None or exited():
            return {"status": "refused", "reason": "gateway exited: " + (exited() or "did not start"),
                    "health": health}
        per_model: dict[str, object] = {}
        with SyncInferenceClient(address) as client:
            for key, spec in models.items():
                inputs = dict(np.load(spec["samples"]))
                per_model[key] = _serve_cut(client, key, "L", inputs, _expected(spec["path"], inputs))
                try:
                    per_model[key]["health"] = client.health(key, timeout_s=5.0)  # type: ignore[index]
                except Exception as e:  # the health service's refusal, as the client raises it
                    per_model[key]["health"] = first_line(e)  # type: ignore[index]
        gone = exited()
    served = sum(1 for r in per_model.values() if r["status"] == "ok")  # type: ignore[index]
    return {"status": "ok" if gone is None else "refused",
            "reason": "" if gone is None else "gateway exited: " + gone,
            "health": health, "served": served, "models": per_model}


def _expected(path: str, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    whole = _session(path)
    return dict(zip([o.name for o in whole.get_outputs()], whole.run(None, dict(inputs))))


def _serve_cut(client, key: str, cut_id: str, feed: Mapping[str, np.ndarray],
               expected: Mapping[str, np.ndarray]) -> dict[str, object]:
    """One cold request, then three timed ones; outputs against the whole model's."""
    from cluster.protocol.client import make_request

    times_ms = []
    try:
        for _ in range(4):
            t0 = time.perf_counter()
            response = client.infer(make_request(key, "1", cut_id, feed, timeout_s=_REQUEST_TIMEOUT_S))
            times_ms.append((time.perf_counter() - t0) * 1e3)
    except Exception as e:  # the gateway's refusal, as the client raises it
        return {"status": "refused", "reason": first_line(e), "cut_id": cut_id}
    diffs = {}
    for name, value in response.outputs.items():
        if name in expected:
            got = np.asarray(value)
            want = expected[name]
            diffs[name] = (float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
                           if got.shape == want.shape else f"shape {list(got.shape)} != {list(want.shape)}")
    return {"status": "ok", "reason": "", "cut_id": cut_id, "first_ms": times_ms[0],
            "latency_ms": statistics.median(times_ms[1:]), "served_by": response.served_by,
            "max_abs_diff": diffs}


def _wait_address(proc: subprocess.Popen, lines: queue.Queue[str]) -> str | None:
    deadline = time.monotonic() + _GATEWAY_START_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:
                return None
            continue
        if line.startswith("gateway serving on "):
            return line[len("gateway serving on "):].split(",")[0].strip()
    return None


def _wait_serving(client, proc: subprocess.Popen) -> str:
    """The gateway's health once SERVING, or the last status seen when it exits or the
    start time runs out (requests are sent anyway: their refusal says more)."""
    deadline = time.monotonic() + _GATEWAY_START_S
    status = "UNKNOWN"
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            status = client.health(timeout_s=5.0)
        except Exception as e:  # not listening yet, or refusing: keep the last word
            status = first_line(e)
        if status == "SERVING":
            break
        time.sleep(0.5)
    return status


def _last_error(errors: list[str], proc: subprocess.Popen) -> str:
    time.sleep(0.2)
    meaningful = [ln.strip() for ln in errors if ln.strip() and not ln.startswith(" ")]
    rc = proc.poll()
    return (meaningful[-1][:400] if meaningful else "no message") + ("" if rc is None else f" (exit {rc})")


def _pump(stream, sink) -> None:
    for line in stream:
        sink(line.rstrip("\n"))


def _session(path: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[0] == "serve-shared":
        registry, spec_path, out_path = args[1], args[2], args[3]
        with open(spec_path, encoding="utf-8") as fh:
            result = run_serve_shared(registry, json.load(fh))
        with open(out_path, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1, default=str)
        return 0
    step, key, path = args[0], args[1], args[2]
    model = next(m for m in WILD_MODELS if m.key == key)
    if step == "int8":
        out_path = args[3]
        result = run_int8(model, path)
    elif step == "serve":
        registry, samples, out_path = args[3], args[4], args[5]
        result = run_serve(model, path, registry, samples, args[6] if len(args) > 6 else None)
    else:
        raise SystemExit(f"unknown step {step!r}; use int8, serve or serve-shared")
    with open(out_path, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
