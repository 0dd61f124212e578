"""`splitinfer calibrate`: measure how closely every encoding of every candidate cut agrees
with the fp32 model, and store it as the model's accuracy table.

    splitinfer calibrate MODEL [-o TABLE.json] [--inputs FILE.npz] [--input-shape NAME=DIMS]
                         [--samples N] [--seed S] [--encodings LIST] [--input-encodings LIST]
                         [--max-chain-points N] [--image-norm imagenet|fit] [--image-mean M,M,M]
                         [--image-std S,S,S] [--image-scale X] [--image-layout NCHW|NHWC] [--json]
    splitinfer calibrate NAME[@VERSION] --registry ROOT [...]

MODEL is an .onnx file or a zoo name; the table goes to ``-o`` (default: beside the model,
``MODEL.accuracy.json``). With ``--registry`` the model is a registry entry: the samples
are model.yaml's ``sample_inputs``, the cuts include the version's frontier, and the table
is written as ``accuracy.json`` beside its profiles, where the gateway, the planner and the
edge agent read it. A second run on the same model, samples and normalisation measures
only what the stored table lacks (nothing, if it lacks nothing). docs/accuracy.md
explains the metrics and the codecs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from splitinfer.model_inputs import add_input_args
from splitinfer.units import int_at_least, parse_args

__all__ = ["calibrate_main", "make_samples"]

logger = logging.getLogger(__name__)


def _keys(text: str) -> tuple[str, ...]:
    from planner import PlannerError
    from planner.accuracy import parse_encoding_key

    keys = tuple(k.strip() for k in text.split(",") if k.strip())
    try:
        for k in keys:
            parse_encoding_key(k)
    except PlannerError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return keys


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers, "
                                         "e.g. 0.485,0.456,0.406") from None


def _parser() -> argparse.ArgumentParser:
    from cluster.calibrate import DEFAULT_ENCODINGS, DEFAULT_INPUT_ENCODINGS

    p = argparse.ArgumentParser(prog="splitinfer calibrate", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="an .onnx file, a zoo name, or NAME[@VERSION] with --registry")
    p.add_argument("--registry", metavar="ROOT", help="the model is an entry of this registry; the table is "
                                                      "written as its accuracy.json")
    p.add_argument("-o", "--output", help="where the table goes (default: MODEL.accuracy.json beside the model)")
    p.add_argument("--samples", type=int_at_least(1), default=8,
                   help="generated samples when no sample inputs are given (default 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated samples")
    p.add_argument("--encodings", type=_keys, default=DEFAULT_ENCODINGS,
                   help=f"boundary encodings to measure at every cut (default {','.join(DEFAULT_ENCODINGS)})")
    p.add_argument("--input-encodings", type=_keys, default=DEFAULT_INPUT_ENCODINGS,
                   help="image codecs of the model input, measured where it crosses "
                        f"(default {','.join(DEFAULT_INPUT_ENCODINGS)}; '' for none)")
    p.add_argument("--max-chain-points", type=int_at_least(0), default=8,
                   help="chain points measured besides the empty cut and the frontier (default 8)")
    p.add_argument("--image-norm", choices=("imagenet", "fit"), default=None,
                   help="how image inputs become pixels: the torchvision ImageNet normalisation, or each "
                        "sample's per-channel range (default: fit, unless --image-mean/--image-std are given)")
    p.add_argument("--image-mean", type=_floats, help="per-channel mean of x = (pixel/scale - mean) / std")
    p.add_argument("--image-std", type=_floats, help="per-channel std of x = (pixel/scale - mean) / std")
    p.add_argument("--image-scale", type=float, default=255.0, help="pixel divisor (default 255)")
    p.add_argument("--image-layout", choices=("NCHW", "NHWC"), default="NCHW", help="image layout (default NCHW)")
    p.add_argument("--json", action="store_true", help="print the table as JSON instead of text")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_input_args(p)
    return p


def _norm(args: argparse.Namespace) -> Any:
    from cluster.protocol.lossy import ImageNorm

    if args.image_norm == "imagenet":
        return ImageNorm.imagenet(args.image_layout)
    if args.image_mean is not None or args.image_std is not None:
        return ImageNorm(args.image_mean or (0.0,), args.image_std or (1.0,), args.image_scale, args.image_layout)
    return None


def _smooth_images(rng: np.random.Generator, shape: tuple[int, ...], layout: str, norm: Any) -> np.ndarray:
    """Random smooth colour images (a coarse grid of colours, upsampled and blurred) in the
    model's normalisation: inputs an image codec sees as a camera frame, not as noise."""
    from cluster.protocol.lossy import ImageNorm

    n, c, h, w = shape if layout == "NCHW" else (shape[0], shape[3], shape[1], shape[2])
    coarse = rng.random((n, c, 5, 5))
    yi = np.linspace(0, 4, h)
    xi = np.linspace(0, 4, w)
    y0, x0 = np.minimum(yi.astype(int), 3), np.minimum(xi.astype(int), 3)
    fy, fx = (yi - y0)[:, None], (xi - x0)[None, :]
    img = (coarse[:, :, y0][:, :, :, x0] * (1 - fy) * (1 - fx) + coarse[:, :, y0 + 1][:, :, :, x0] * fy * (1 - fx)
           + coarse[:, :, y0][:, :, :, x0 + 1] * (1 - fy) * fx + coarse[:, :, y0 + 1][:, :, :, x0 + 1] * fy * fx)
    pixels = np.clip(img * 255 + rng.normal(0, 1, img.shape), 0, 255)
    lo, step = (norm or ImageNorm.imagenet()).affine(c)
    x = (lo[None, :, None, None] + step[None, :, None, None] * pixels).astype(np.float32)
    return x if layout == "NCHW" else np.ascontiguousarray(np.moveaxis(x, 1, 3))


def make_samples(model: Any, graph: Any, count: int, *, seed: int = 0,
                 input_shapes: Any = None, norm: Any = None) -> dict[str, np.ndarray]:
    """``count`` generated samples: smooth images for image inputs ([N, 3, H, W] floats),
    the partitioner's random inputs for the others."""
    from cluster.protocol.errors import EncodingError
    from cluster.protocol.lossy import image_layout
    from partitioner import make_inputs

    rows = [make_inputs(model, graph, seed=seed + i, batch=1, input_shapes=input_shapes) for i in range(count)]
    out = {k: np.concatenate([r[k] for r in rows]) if np.ndim(rows[0][k]) else rows[0][k] for k in rows[0]}
    rng = np.random.default_rng(seed)
    for k, v in out.items():
        if v.dtype.kind == "f" and v.ndim == 4:
            try:
                layout = image_layout(v, None if norm is None else norm.layout)
            except EncodingError:
                continue
            if (v.shape[1] if layout == "NCHW" else v.shape[3]) == 3:
                out[k] = _smooth_images(rng, v.shape, layout, norm).astype(v.dtype)
    return out


def _registry_entry(root: str, spec: str) -> Any:
    from cluster.registry import RegistryError, VersionFiles, versions_on_disk

    name, _, version = spec.partition("@")
    versions = versions_on_disk(root).get(name)
    if not versions:
        raise RegistryError(path=os.path.join(root, name), reason="is no model of the registry",
                            fix=f"name one of {sorted(versions_on_disk(root)) or 'its models'} "
                                "(splitinfer registry add MODEL ROOT puts one there)")
    return VersionFiles(root, name, version or versions[0])


def _print(table: Any, measured: int, reused: int, where: str) -> None:
    rows = sorted(table.entries, key=lambda e: (table.cut_ids.index(e.cut_id), e.encoding))
    print(f"{table.model}: {table.num_samples} samples ({table.sample_source}); agreement with the fp32 model, "
          "worst output")
    print(f"{'cut':<16} {'encoding':<14} {'agreement':>9}  {'bytes/sample':>12}  {'codec ms':>8}  worst output")
    for e in rows:
        if e.agreement is None:
            print(f"{e.cut_id[:16]:<16} {e.encoding:<14} {'n/a':>9}  {'':>12}  {'':>8}  {e.reason}")
        else:
            print(f"{e.cut_id[:16]:<16} {e.encoding:<14} {e.agreement:>9.4f}  {e.wire_bytes:>12.0f}  "
                  f"{e.codec_ms:>8.3f}  {e.worst_output} ({e.metric})")
    print(f"measured {measured} (cut, encoding) pairs, reused {reused}; wrote {where}")


def calibrate_main(argv: Sequence[str]) -> int:
    args = parse_args(_parser(), argv)
    from cluster.calibrate import measure_accuracy, select_cuts, split_samples
    from partitioner import Splitter, build_graph
    from planner.accuracy import AccuracyTable
    from splitinfer.model_inputs import inputs_from_args

    norm = _norm(args)
    previous = None
    if args.registry:
        files = _registry_entry(args.registry, args.model)
        splitter = files.splitter()
        model_path, name = files.model_path, f"{files.model}@{files.version}"
        samples, source = files.sample_inputs(), "model.yaml"
        extra = [files.resolve_cut(i) for i in files.frontier().cut_ids]
        previous = files.accuracy()
        out_path = args.output
        given_shapes: Any = dict(files.config.input_shapes)
    else:
        from splitinfer.profile_cmd import _load

        model, graph, given = _load(args.model, args)
        splitter = Splitter(model, graph)
        model_path = args.model if os.path.exists(args.model) else None
        name = graph.model
        samples, source = given.inputs, os.path.basename(args.inputs) if args.inputs else "generated"
        extra = []
        given_shapes = dict(given.input_shapes)
        stem = model_path[:-5] if model_path and model_path.endswith(".onnx") else (model_path or name)
        out_path = args.output or f"{stem}.accuracy.json"
    if samples is None:
        samples, source = make_samples(splitter.model, splitter.graph, args.samples, seed=args.seed,
                                       input_shapes=given_shapes or None, norm=norm), "generated"
    # the samples type what shape inference leaves unknown, so every candidate cut can be exported
    splitter = Splitter(splitter.model, build_graph(splitter.model, name=splitter.graph.model,
                                                    inputs=split_samples(splitter.model, samples)[0]))
    if out_path and os.path.exists(out_path):
        try:
            with open(out_path, encoding="utf-8") as fh:
                previous = AccuracyTable.from_json(fh.read())
        except Exception as e:  # noqa: BLE001 - a broken cache is measured again, not fatal
            logger.warning("ignoring %s (%s); measuring again", out_path, e)
    cuts = select_cuts(splitter.graph, extra=extra, max_chain_points=args.max_chain_points)
    result = measure_accuracy(
        model_path if model_path else splitter.model, samples, cuts=cuts, encodings=args.encodings,
        input_encodings=args.input_encodings, norm=norm, previous=previous, model_name=name,
        sample_source=source, show_progress=not args.no_progress, splitter=splitter)
    if args.registry and not out_path:
        where = files.write_accuracy(result.table)
    else:
        where = out_path
        parent = os.path.dirname(os.path.abspath(where))
        os.makedirs(parent, exist_ok=True)
        if result.measured or not os.path.exists(where):
            with open(where, "w", encoding="utf-8") as fh:
                fh.write(result.table.to_json(indent=1, sort_keys=True))
    if args.json:
        print(json.dumps(result.table.to_dict(), indent=1, sort_keys=True))
    else:
        _print(result.table, result.measured, result.reused, where)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(calibrate_main(sys.argv[1:]))
