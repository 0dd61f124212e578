"""The e2e grid's real-weight models and every model's accuracy table.

Real-weight models come from PyPI wheels (`bench._wild_models`, the ``wild`` extra) with
their realistic sample inputs (text rendered on a page, as each package's own
preprocessing builds it). Their dynamic input dims are fixed to the samples' shapes, so
that heads, tails and profiles are those of one camera frame or text line, as the zoo
models' are. `prepare_real` builds what `splitinfer.demo.setup.prepare` builds for a
zoo model: the registry entry, the two profiles and the throttled edge at the
reference device ratio (rpi4 against t4, [Note: demo speed ratio]).

`calibrate` runs ``splitinfer calibrate`` on the model file the grid serves, with the
sample inputs the edge sends, into a cache outside the run's temporary folder: a second
run of the grid on the same model and samples measures nothing ([Note: accuracy cache]
in `cluster.calibrate`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from statistics import median
from typing import Any

import numpy as np
import onnx

__all__ = ["CALIBRATION_SAMPLES", "FULL_REAL", "QUICK_REAL", "accuracy_cache_dir", "calibrate",
           "describe_real", "installed_real", "is_real", "make_static", "prepare_real", "write_samples"]

#: The quick grid's real-weight models: a classifier, an OCR transformer, a detector.
QUICK_REAL = ("ppocr_cls", "ppocr_rec", "ppocr_det")
#: The full grid adds a second detector.
FULL_REAL = ("ppocr_cls", "ppocr_rec", "ppocr_det", "ddddocr_det")
#: Sample inputs per model: the accuracy table's samples; the edge sends the first.
CALIBRATION_SAMPLES = 8
_VERSION = "1"


def _wild() -> dict[str, Any]:
    from bench._wild_models import WILD_MODELS

    return {m.key: m for m in WILD_MODELS}


def is_real(name: str) -> bool:
    """Whether `name` is a real-weight model of `bench._wild_models`."""
    return name in _wild()


def installed_real(keys: tuple[str, ...] | list[str]) -> tuple[list[str], list[str]]:
    """(installed keys, one line per key whose wheel is missing, naming the install command)."""
    from bench._wild_models import INSTALL_HINT, locate

    wild, ok, missing = _wild(), [], []
    for k in keys:
        if locate(wild[k]) is None:
            missing.append(f"{k}: {wild[k].distribution}=={wild[k].version} is not installed; skipped "
                           f"(pip install -e .[wild] installs it: {INSTALL_HINT})")
        else:
            ok.append(k)
    return ok, missing


def describe_real(key: str) -> dict[str, str]:
    from bench._wild_models import describe

    return describe(_wild()[key])


def accuracy_cache_dir() -> str:
    """Where the grid's accuracy tables are cached between runs."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "splitinfer", "e2e-accuracy")


def make_static(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> onnx.ModelProto:
    """A copy of `model` whose graph inputs have exactly `shapes` (by name)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for i in out.graph.input:
        if i.name not in shapes:
            continue
        dims = i.type.tensor_type.shape.dim
        if len(dims) != len(shapes[i.name]):
            raise ValueError(f"input {i.name} of {model.graph.name} has rank {len(dims)}, the sample "
                             f"{shapes[i.name]}; give samples of the model's rank")
        for d, n in zip(dims, shapes[i.name]):
            d.Clear()
            d.dim_value = int(n)
    return out


def real_samples(key: str, count: int = CALIBRATION_SAMPLES) -> dict[str, np.ndarray]:
    """`count` realistic samples of the real-weight model `key`, stacked on the batch axis."""
    from bench._wild_models import make_sample_inputs

    rows = [make_sample_inputs(_wild()[key], i) for i in range(count)]
    return {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}


def write_samples(path: str, samples: dict[str, np.ndarray]) -> str:
    np.savez(path, **samples)
    return path


def prepare_real(key: str, work_dir: str, *, runs: int, slowdown: float | None = None,
                 say: Callable[[str], None]) -> Any:
    """The registry entry, profiles and emulated edge of the real-weight model `key`, as a
    `splitinfer.demo.setup.DemoModel` (no frontier), plus its samples' path as `samples_path`.
    The device is one thread here stretched by `slowdown`, or (None) by the factor that makes
    it the reference ratio slower than the cloud side (`splitinfer.demo.setup.emulate_device`)."""
    from bench._wild_models import locate
    from partitioner import build_graph, load_model
    from splitinfer.demo.setup import DemoModel, emulate_device, measure_profiles, reference_ratio, write_version

    wm = _wild()[key]
    samples = real_samples(key)
    first = {k: v[:1] for k, v in samples.items()}
    model = make_static(load_model(locate(wm)), {k: v.shape for k, v in first.items()})
    say(f"[1/3] {key}: {wm.distribution}=={wm.version} {wm.relpath} (real weights), inputs "
        + ", ".join(f"{k} {list(v.shape)}" for k, v in first.items()))
    graph = build_graph(model, name=key, inputs=first)
    vdir = os.path.join(work_dir, "registry", key, _VERSION)
    os.makedirs(os.path.join(vdir, "profiles"), exist_ok=True)
    model_path = os.path.join(vdir, "model.onnx")
    onnx.save_model(model, model_path)
    samples_path = write_samples(os.path.join(work_dir, f"{key}.samples.npz"), samples)
    ref = reference_ratio(graph)
    say("[2/3] profiling the device and the cloud side")
    dev, cloud, source, dev_ms, cloud_ms = measure_profiles(model, graph, runs, say, lambda: None)
    dev, dev_ms, emulation = emulate_device(dev, dev_ms, cloud_ms, ref, slowdown, say)
    dev_path = write_version(vdir, {"name": key, "description": f"{wm.description} ({wm.distribution} {wm.version}, "
                                                                "real weights)", "max_batch_size": 1, "replicas": 1},
                             dev, cloud)
    say(f"[3/3] whole model: edge {dev_ms:.0f} ms, cloud {cloud_ms:.1f} ms ({dev_ms / max(cloud_ms, 1e-6):.1f}x; "
        f"reference {ref['edge_device']}/{ref['cloud_device']} {ref['ratio']:.3g}x)")
    dm = DemoModel(key, model, graph, os.path.join(work_dir, "registry"), model_path, dev_path, dev, cloud, source,
                   dev_ms, cloud_ms, None, {"reference": ref, **emulation}, emulation["slowdown"])
    dm.samples_path = samples_path  # type: ignore[attr-defined]
    return dm


def zoo_samples_path(dm: Any, work_dir: str) -> str:
    """The zoo model's calibration samples (smooth colour images, seed 0), written beside the run."""
    from splitinfer.calibrate_cmd import make_samples

    samples = make_samples(dm.model, dm.graph, CALIBRATION_SAMPLES, seed=0)
    return write_samples(os.path.join(work_dir, f"{dm.name}.samples.npz"), samples)


def calibrate(dm: Any, samples_path: str, *, max_chain_points: int, say: Callable[[str], None]) -> Any:
    """The accuracy table of the served model file on the samples, measured as ``splitinfer
    calibrate MODEL --inputs SAMPLES`` measures it (`cluster.calibrate.measure_accuracy` on
    `select_cuts`, the default encodings, each sample's own image range) and cached
    (`accuracy_cache_dir`): only what the cached table lacks is measured.

    The library is called rather than the command because the command types the graph
    with all the samples at once, which a model whose batch dim is fixed at 1 refuses."""
    from cluster.calibrate import measure_accuracy, select_cuts, split_samples
    from partitioner import Splitter, build_graph
    from planner.accuracy import AccuracyTable

    out = os.path.join(accuracy_cache_dir(), f"{dm.name}.accuracy.json")
    t0 = time.monotonic()
    with np.load(samples_path) as z:
        samples = {k: z[k] for k in z.files}
    splitter = Splitter(dm.model, build_graph(dm.model, name=dm.graph.model,
                                              inputs=split_samples(dm.model, samples)[0]))
    previous = None
    if os.path.exists(out):
        try:
            with open(out, encoding="utf-8") as fh:
                previous = AccuracyTable.from_json(fh.read())
        except Exception:  # noqa: BLE001 - a broken cache is measured again
            previous = None
    cuts = select_cuts(splitter.graph, max_chain_points=max_chain_points)
    result = measure_accuracy(dm.model_path, samples, cuts=cuts, previous=previous, model_name=dm.name,
                              sample_source=os.path.basename(samples_path), show_progress=False, splitter=splitter)
    if result.measured or previous is None:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w", encoding="utf-8") as fh:
            fh.write(result.table.to_json(indent=1, sort_keys=True))
    table = result.table
    ok = [e.agreement for e in table.entries if e.agreement is not None]
    say(f"      accuracy table: {len(table.entries)} (cut, encoding) entries on {table.num_samples} samples, "
        f"{result.measured} measured now, in {time.monotonic() - t0:.0f} s (cached as {os.path.basename(out)}); "
        f"median agreement {median(ok) if ok else float('nan'):.3f}")
    return table

