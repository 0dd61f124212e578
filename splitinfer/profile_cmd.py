"""`splitinfer profile`: measure a model's per-layer profile on this host, or estimate one
for a reference device.

    splitinfer profile MODEL -o PROFILE.json [--threads N] [--batch 1,8] [--ep cpu|cuda]
                       [--runs N] [--warmup N] [--segments N] [--calibrate]
                       [--device-name NAME] [--reference DEVICE] [--clock wall|thread]
                       [--layer-stat median|min] [--codec-cuts N] [--input-shape NAME=D0xD1x...]
                       [--inputs FILE.npz]

MODEL is a path to an .onnx file or a zoo short name (zoo models get seeded random
weights, so activations stay in a normal range while timing). ``--segments N`` times
the real head and tail segments of N cuts to fit the profile's corrections (0: none).
``--calibrate`` also fits the per-op-type efficiencies of this host's roofline and
writes them next to the profile as PROFILE.roofline.json. ``--reference DEVICE``
writes the roofline estimate for a reference device instead of measuring.
``--codec-cuts N`` times the fp16 and int8 casts of the model's inputs and of the boundary
tensors at N chain cuts, and the profile's codec carries those figures
(`splitinfer.codec_measure`; 0: the defaults).
``--input-shape`` fixes symbolic input dims and ``--inputs`` gives sample inputs, which
every timed run uses (see `splitinfer.model_inputs`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

from splitinfer.model_inputs import add_input_args
from splitinfer.units import int_at_least, parse_args

__all__ = ["profile_main", "parse_batches"]

logger = logging.getLogger(__name__)


def parse_batches(text: str) -> tuple[int, ...]:
    """``"1,8"`` -> (1, 8); argparse reports the ValueError as a usage error."""
    try:
        out = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch {text!r}: give batch sizes as integers, e.g. 1,8") from None
    if not out or out[0] < 1:
        raise argparse.ArgumentTypeError(f"--batch {text!r}: batch sizes must be >= 1, e.g. 1,8")
    return out






def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splitinfer profile", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="path to an .onnx file or a zoo name (resnet50, squeezenet, ...)")
    p.add_argument("-o", "--output", required=True, help="where to write the profile JSON")
    p.add_argument("--threads", type=int_at_least(1), default=os.cpu_count() or 1,
                   help="intra-op threads to measure with (default: all cores)")
    p.add_argument("--batch", type=parse_batches, default=(1,),
                   help="batch sizes for whole-model batch_ms, e.g. 1,8 (layers are timed at 1)")
    p.add_argument("--ep", choices=("cpu", "cuda"), default="cpu", help="execution provider")
    p.add_argument("--runs", type=int_at_least(1), default=20, help="timed runs (default 20)")
    p.add_argument("--warmup", type=int_at_least(0), default=3, help="warm-up runs (default 3)")
    p.add_argument("--segments", type=int_at_least(0), default=4,
                   help="cuts whose real segments are timed to fit corrections (default 4; 0: none)")
    p.add_argument("--calibrate", action="store_true",
                   help="also fit this host's roofline efficiencies; writes PROFILE.roofline.json")
    p.add_argument("--device-name", default="this-host", help="name recorded in the profile")
    p.add_argument("--reference", metavar="DEVICE",
                   help="estimate for a reference device (rpi4, rpi5, jetson-orin-nano, phone-sd8g2, t4, "
                        "a100, h100) instead of measuring")
    p.add_argument("--precision", choices=("fp32", "fp16", "int8"), default="fp32",
                   help="precision of a --reference estimate")
    p.add_argument("--clock", choices=("wall", "thread"), default="wall",
                   help="time runs by wall clock, or (1 thread only) by the thread's CPU time on a shared host")
    p.add_argument("--layer-stat", choices=("median", "min"), default="median",
                   help="per-layer ms over the runs: median, or min on a shared host (see docs/profiles.md)")
    p.add_argument("--codec-cuts", type=int_at_least(0), default=3,
                   help="chain cuts whose boundary tensors' casts are timed for the profile's codec "
                        "(default 3; 0: keep the default figures)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_input_args(p)
    return p


def _load(spec: str, args: argparse.Namespace | None = None):
    """The model, its layer graph and the model inputs ``args`` gives
    (``--input-shape``, ``--inputs``; see `splitinfer.model_inputs`)."""
    from partitioner import build_graph, load_model, load_zoo
    from splitinfer.model_inputs import ModelInputs, inputs_from_args
    from splitinfer.partition_cmd import resolve_model

    path, name = resolve_model(spec)
    if os.path.exists(spec) or spec.endswith(".onnx") or os.sep in spec:
        model = load_model(path)
    else:
        model = load_zoo(name, random_weights=True)
    given = inputs_from_args(args, model) if args is not None else ModelInputs()
    graph = build_graph(model, name=name, input_shapes=given.input_shapes, inputs=given.inputs)
    return model, graph, given


def _roofline_path(output: str) -> str:
    stem = output[:-5] if output.endswith(".json") else output
    return stem + ".roofline.json"


def _write(path: str, text: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def profile_main(argv: Sequence[str]) -> int:
    args = parse_args(_parser(), argv)
    model, graph, given = _load(args.model, args)
    if args.reference:
        from planner.devices import reference_profile

        prof = reference_profile(args.reference, graph, precision=args.precision,
                                 batch_sizes=tuple(sorted(set(args.batch) | {1})))
        _write(args.output, prof.to_json(indent=1))
        total = sum(t.ms for t in prof.layers.values()) + prof.fixed_ms
        print(f"{graph.model} on {prof.device} (roofline estimate, {args.precision}): {total:.2f} ms "
              f"per run; wrote {args.output}")
        return 0

    from workers.profile import measure

    m = measure(model, graph, threads=args.threads, ep=args.ep, warmup=args.warmup, runs=args.runs,
                progress=not args.no_progress, device=args.device_name,
                batch_sizes=args.batch if len(args.batch) > 1 or args.batch[0] != 1 else (),
                calibrate=args.segments, clock=args.clock, layer_stat=args.layer_stat, inputs=given.inputs)
    prof = m.profile
    if args.codec_cuts:
        from dataclasses import replace

        from splitinfer.codec_measure import measure_codec_model

        codec, _ = measure_codec_model(model, graph, inputs=given.inputs, cuts=args.codec_cuts,
                                       base=prof.codec, source=args.device_name)
        prof = replace(prof, codec=codec)
    _write(args.output, prof.to_json(indent=1))
    total = sum(t.ms for t in prof.layers.values())
    print(f"{graph.model}: {len(graph)} layers, {total:.2f} ms of kernels + {prof.fixed_ms:.2f} ms fixed per run "
          f"({args.threads} thread(s), {prof.ep}, ORT {prof.ort_version}); "
          f"{100 * m.attributed_fraction:.1f}% of kernel time placed on layers")
    if prof.corrections is not None:
        c = prof.corrections
        print(f"corrections: scale {c.scale:.3f}, offset {c.offset_ms:+.2f} ms from {c.segments} timed segments")
    if prof.batch_ms:
        print("batch_ms: " + ", ".join(f"{b}: {v:.2f}" for b, v in sorted(prof.batch_ms.items())))
    if m.batch_note:
        print(m.batch_note)
    if args.codec_cuts:
        c, inp = prof.codec, prof.codec.input_encode_ms_per_mb or {}
        print("casts, ms per MB of the input / of feature maps: " + ", ".join(
            f"{k} {inp.get(k, float('nan')):.3f} / {c.encode_ms_per_mb[k]:.3f}" for k in ("fp16", "int8"))
              + f"; {c.encode_fixed_ms:.4f} ms per tensor sent")
    if args.calibrate:
        from planner.devices import device_from_profile

        dev = device_from_profile(graph, prof, name=args.device_name)
        path = _roofline_path(args.output)
        _write(path, json.dumps({"device": dev.to_dict(), "measurement": {
            "attributed_fraction": m.attributed_fraction, "segments": [s.to_dict() for s in m.segments]}},
            indent=1))
        effs = ", ".join(f"{k} {v:.2f}" for k, v in dev.efficiency.items())
        print(f"roofline of {dev.name}: peak {dev.peak_flops['fp32'] / 1e9:.1f} GFLOP/s, "
              f"{dev.mem_bw_bytes_per_s / 1e9:.1f} GB/s; efficiencies {effs}; wrote {path}")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(profile_main(sys.argv[1:]))
