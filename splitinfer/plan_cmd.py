"""`splitinfer plan`, `splitinfer sweep` and `splitinfer planner serve`.

Thin adapters over the typed what-if API (`planner.whatif`): the arguments become one
`PlanRequest` or `SweepRequest`, which checks its own limits, so the command line and
the HTTP API validate and answer alike.

A tier (``--edge``/``--cloud``) is a profile JSON file, a built-in reference device
(where `planner.devices` provides them), or ``<N>gflops``: a FLOPs roofline device
(per-layer ms = FLOPs / N GFLOP/s; an estimate, not a measurement).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from partitioner.cuts import id_ranges
from planner.errors import PlannerError
from planner.profile import Profile
from planner.types import COMPRESSIONS, Constraints, Objective
from planner.whatif import (
    ENCODING_CHOICES, MAX_SWEEP_POINTS, SERIES, DeviceSpec, InvalidRequestError, PlanAnswer, PlanRequest, Roofline,
    Scenario, SweepAnswer, SweepRequest, Workspace, metric_value, reference_devices,
)
from splitinfer.model_inputs import add_input_args, inputs_from_args
from splitinfer.units import arg_type, format_rate_bps, parse_args, parse_duration_ms, parse_rate_bps

if TYPE_CHECKING:
    from partitioner import LayerGraph
    from splitinfer.planner_api import PlannerService

__all__ = [
    "plan_main", "sweep_main", "planner_main", "make_service", "parse_size_bytes", "parse_rate_range", "format_plan",
    "format_sweep",
]

_SIZE_RE = re.compile(r"^\s*(?P<sign>[-+]?)(?P<num>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(?P<unit>[a-zA-Z]*)\s*$")
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_GFLOPS_RE = re.compile(r"^(?P<num>[0-9]*\.?[0-9]+)\s*gflops$", re.IGNORECASE)


def parse_size_bytes(text: str) -> float:
    """'64MiB' -> 67108864; decimal (kB, MB) and binary (KiB, MiB) units; a bare number is bytes.

    Raises ValueError naming the string and the accepted forms.
    """
    m = _SIZE_RE.match(text) if isinstance(text, str) else None
    unit = m.group("unit").lower() if m else ""
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(f"cannot parse size {text!r}: use '<number><unit>' with unit B, kB, MB, GB, "
                         f"KiB, MiB or GiB (e.g. '64MiB'); a bare number is bytes")
    value = float(m.group("num")) * _SIZE_UNITS[unit]
    if not math.isfinite(value):
        raise ValueError(f"size {text!r} is not finite")
    if m.group("sign") == "-" and value != 0:
        raise ValueError(f"size {text!r} cannot be negative; give e.g. {text.strip()[1:].lstrip()!r}")
    return value


def parse_rate_range(text: str) -> tuple[float, float]:
    """``'0.1mbit..1gbit'`` -> (1e5, 1e9) bits/s. Raises ValueError naming the string."""
    lo, sep, hi = text.partition("..")
    if not sep or not lo or not hi:
        raise ValueError(f"{text!r} is not a range; write LO..HI, e.g. 0.1mbit..1gbit")
    return parse_rate_bps(lo), parse_rate_bps(hi)


def make_service(*, registry_dir: str | None = None, **kw: Any) -> PlannerService:
    """The HTTP API's service (`splitinfer.planner_api`) reading rate, duration and size
    strings (see [Note: service units] there), planning for the models of `registry_dir`
    (see `_registry_models`) at their declared input shapes (`_registry_graph`)."""
    from splitinfer.planner_api import PlannerService, UnitParsers

    builder = functools.partial(_registry_graph, registry_dir) if registry_dir else None
    return PlannerService(units=UnitParsers(parse_rate_bps, parse_duration_ms, parse_size_bytes),
                          registry_models=_listing(registry_dir), graph_builder=builder, **kw)


def _listing(registry_dir: str | None) -> Callable[[], dict[str, str]] | None:
    return functools.partial(_registry_models, registry_dir) if registry_dir else None


def _workspace(registry_dir: str | None) -> Workspace:
    """The what-if workspace of `plan` and `sweep`: the registry's models are planned at
    the input_shapes and sample_inputs their model.yaml declares."""
    builder = functools.partial(_registry_graph, registry_dir) if registry_dir else None
    return Workspace(registry_models=_listing(registry_dir), graph_builder=builder)


def _registry_graph(root: str, name: str, path: str) -> LayerGraph:
    """The layer graph of ``path``: for a registry version (`<root>/<model>/<version>/
    model.onnx`), built at its model.yaml's input_shapes and sample_inputs (the graph the
    registry plans its frontier on); any other file as it is."""
    from partitioner import build_graph

    version_dir = os.path.dirname(os.path.abspath(path))
    model_dir, version = os.path.split(version_dir)
    registry, model = os.path.split(model_dir)
    if os.path.basename(path) == "model.onnx" and os.path.abspath(registry) == os.path.abspath(root):
        from cluster.registry import VersionFiles

        graph = VersionFiles(root, model, version).sized_graph()
        return graph if graph.model == name else graph.replace(model=name)
    return build_graph(path, name=name)


def _registry_models(root: str) -> dict[str, str]:
    """name -> model path: the registry's `<name>/<version>/model.onnx`, listed by the registry,
    which owns the version order (so 'name' is the version it serves as latest), and each
    `<name>.onnx` file in `root` as one more model `name`."""
    from cluster.registry import model_files

    flat = {}
    if os.path.isdir(root):
        flat = {e[: -len(".onnx")]: os.path.join(root, e) for e in sorted(os.listdir(root))
                if e.endswith(".onnx") and os.path.isfile(os.path.join(root, e))}
    return {**model_files(root), **flat}


def _device(value: str, flag: str) -> DeviceSpec:
    """A tier argument as a device spec."""
    m = _GFLOPS_RE.match(value)
    if m:
        try:
            return Roofline(float(m.group("num")))
        except InvalidRequestError as e:
            raise PlannerError(f"{flag} {value!r}: {e.message}", field=flag) from e
    if os.path.exists(value) or value.endswith(".json"):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise PlannerError(f"{flag} {value!r}: cannot read the profile ({e.strerror}); "
                               f"give an existing profile JSON file", field=flag) from e
        try:
            return Profile.from_json(text)
        except PlannerError as e:
            raise PlannerError(f"{flag} {value}: {e.message}", field=flag) from e
    names, _ = reference_devices()
    if value not in names:
        raise PlannerError(
            f"{flag} {value!r} is not a profile file, a reference device "
            f"(known: {', '.join(names) or 'none yet'}) or '<N>gflops'; give a profile JSON "
            f"written by 'splitinfer profile', or e.g. '5gflops' for a FLOPs roofline estimate",
            field=flag,
        )
    return value


def _add_common(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("model", metavar="MODEL", help="an .onnx file or a zoo name (resnet50, densenet121, ...)")
    ap.add_argument("--edge", required=True, help="device tier: profile JSON, reference device, or <N>gflops")
    ap.add_argument("--cloud", required=True, help="cloud tier: profile JSON, reference device, or <N>gflops")
    ap.add_argument("--rtt", type=arg_type(parse_duration_ms), default="0ms",
                    help="round-trip time, e.g. 20ms (default 0ms)")
    ap.add_argument("--loss", type=float, default=0.0, help="packet loss fraction in [0, 1) (default 0)")
    ap.add_argument("--objective", choices=[o.value for o in Objective], default="latency")
    ap.add_argument("--encoding", choices=ENCODING_CHOICES, default="fp32",
                    help="boundary precision; auto lets the planner choose (default fp32)")
    ap.add_argument("--compression", choices=COMPRESSIONS, default="none", help="lossless, after the cast")
    ap.add_argument("--device-memory", metavar="SIZE", type=arg_type(parse_size_bytes),
                    help="memory the head may use on the device, e.g. 64MiB")
    ap.add_argument("--slo", metavar="DURATION", type=arg_type(parse_duration_ms),
                    help="latency SLO for the throughput/energy objectives, e.g. 100ms")
    ap.add_argument("--keep-input-local", action="store_true", help="the raw input never leaves the device")
    ap.add_argument("--first-k-local", type=int, default=0, metavar="K",
                    help="the first K layers (topological order) run on the device")
    ap.add_argument("--min-agreement", type=float, metavar="FRACTION",
                    help="accuracy budget, e.g. 0.99: no plan agrees with the fp32 model less (needs the "
                         "model's table from splitinfer calibrate for encodings other than fp32)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_input_args(ap)


def _scenario(args: argparse.Namespace, workspace: Workspace) -> Scenario:
    from splitinfer.partition_cmd import resolve_model

    name = args.model
    if os.path.exists(args.model) or args.model.endswith(".onnx") or os.sep in args.model:
        path, name = resolve_model(args.model)
        if not os.path.isfile(path):
            raise PlannerError(f"MODEL {args.model!r} is not a file; give an .onnx file or a zoo name "
                               f"(splitinfer inspect lists a model's layers)", field="model")
        workspace.add_model(name, path)
    if args.input_shape or args.inputs:
        from partitioner import build_graph, load_model

        path = workspace.model_path(name)
        model = load_model(path)
        given = inputs_from_args(args, model)
        workspace.add_model(name, path, build_graph(model, name=name, input_shapes=given.input_shapes,
                                                    inputs=given.inputs))
    try:
        constraints = Constraints(
            device_memory_bytes=int(args.device_memory) if args.device_memory is not None else None,
            raw_input_stays_on_device=args.keep_input_local, first_k_local=args.first_k_local,
            latency_slo_ms=args.slo)
    except PlannerError as e:  # Constraints names its own fields; the user typed an option
        flag = _CONSTRAINT_FLAGS.get(e.field or "", "")
        raise PlannerError(f"{flag or e.field}: {e.message}", field=flag or e.field) from e
    return Scenario(
        model=name, edge=_device(args.edge, "--edge"), cloud=_device(args.cloud, "--cloud"), rtt_ms=args.rtt,
        loss=args.loss, objective=Objective(args.objective), encoding=args.encoding, compression=args.compression,
        constraints=constraints, min_agreement=args.min_agreement,
    )


_CONSTRAINT_FLAGS = {"device_memory_bytes": "--device-memory", "first_k_local": "--first-k-local",
                     "latency_slo_ms": "--slo"}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_plan(answer: PlanAnswer) -> str:
    """The human table of one plan."""
    from splitinfer.partition_cmd import format_bytes

    plan, b, link = answer.plan, answer.plan.breakdown, answer.plan.link
    enc = plan.encoding
    n, k = answer.layers, len(plan.edge_layers)
    lines = [
        f"{plan.model}: {k} of {n} layers on the device ({answer.edge_device}), "
        f"{n - k} in the cloud ({answer.cloud_device})",
        f"link     up {format_rate_bps(link.up_bps)}, down {format_rate_bps(link.down_bps)}, "
        f"rtt {link.rtt_ms:g} ms, loss {link.loss:g}",
        f"plan     objective {plan.objective.value}, encoding {enc.key if enc.lossy_codec else enc.precision}"
        + (f"+{enc.compression}" if enc.compression != "none" else ""),
        f"cut      device layers {_ranges(plan.edge_layers) or '(none: cloud only)'}",
        f"boundary {', '.join(plan.boundary) or '(nothing crosses: edge only)'}"
        + (f" ({format_bytes(answer.boundary_bytes)} fp32 per sample)" if plan.boundary else ""),
    ] + ([f"accuracy agreement with the fp32 model {plan.agreement:.4f}"] if plan.agreement is not None else []) + [
        "",
        f"  {'stage':<10}{'ms':>10}",
        f"  {'edge':<10}{_ms(b.edge_ms):>10}",
        f"  {'encode':<10}{_ms(b.encode_ms):>10}",
        f"  {'uplink':<10}{_ms(b.uplink_ms):>10}",
        f"  {'rtt':<10}{_ms(b.rtt_ms):>10}",
        f"  {'queue':<10}{_ms(b.queue_ms):>10}",
        f"  {'cloud':<10}{_ms(b.cloud_ms):>10}",
        f"  {'downlink':<10}{_ms(b.downlink_ms):>10}",
        f"  {'total':<10}{_ms(b.total_ms):>10}",
        "",
        f"bottleneck {b.bottleneck} (period {_ms(b.period_ms)} ms), device energy {b.energy_j * 1e3:.2f} mJ",
    ]
    unit = "mJ" if answer.metric == "energy_mj" else "ms"
    parts = []
    for base, gain, label in ((answer.edge_only, answer.gain_vs_edge_only, "edge-only"),
                              (answer.cloud_only, answer.gain_vs_cloud_only, "cloud-only")):
        parts.append(f"{label} {metric_value(plan.objective, base):.2f} {unit}"
                     + (f" ({gain:.2f}x)" if gain is not None else ""))
    if answer.cloud_only_image is not None:
        gain = answer.gain_vs_cloud_only_image
        value = metric_value(plan.objective, answer.cloud_only_image)
        parts.append(f"cloud-only {answer.cloud_only_image_encoding} {value:.2f} {unit}"
                     + (f" ({gain:.2f}x)" if gain is not None else "")
                     + f" at agreement {answer.cloud_only_image_agreement:.4f}")
    lines.append(f"vs       {'; '.join(parts)} [{answer.metric}]")
    return "\n".join(lines)


def _ranges(ids: Sequence[int]) -> str:
    return ",".join(id_ranges(ids))


def plan_main(argv: Sequence[str]) -> int:
    """`splitinfer plan MODEL --edge E --cloud C --uplink RATE ...`"""
    ap = argparse.ArgumentParser(prog="splitinfer plan", description="the best cut and encoding on one link")
    _add_common(ap)
    ap.add_argument("--uplink", required=True, type=arg_type(parse_rate_bps), help="uplink rate, e.g. 18.88mbit")
    ap.add_argument("--downlink", type=arg_type(parse_rate_bps), help="downlink rate (default: the uplink rate)")
    ap.add_argument("--registry", metavar="DIR", help="model registry directory (for MODEL names)")
    args = parse_args(ap, argv)
    workspace = _workspace(args.registry)
    answer = workspace.plan(PlanRequest(_scenario(args, workspace), args.uplink, args.downlink))
    print(answer.to_json(indent=1) if args.json else format_plan(answer))
    return 0


def format_sweep(answer: SweepAnswer, rows: int = 12) -> str:
    """A sampled table of the sweep and its breakpoints."""
    ups = answer.uplink_bps
    unit = "mJ" if answer.metric == "energy_mj" else "ms"
    lines = [f"{answer.model}: {answer.metric} ({unit}) against uplink, {answer.objective.value} objective, "
             f"{len(ups)} points, DAG optimum by {answer.method} ({answer.solves} solves)", "",
             f"  {'uplink':>12}{'edge-only':>12}{'cloud-only':>12}{'chain':>12}{'DAG opt':>12}{'dev layers':>12}"]
    step = max(1, (len(ups) - 1) // max(1, rows - 1))
    idx = sorted(set(list(range(0, len(ups), step)) + [len(ups) - 1]))
    for i in idx:
        layers = answer.dag_edge_layers[i]
        lines.append(f"  {format_rate_bps(ups[i]):>12}" + "".join(f"{_ms(answer.series(k)[i]):>12}" for k in SERIES)
                     + f"{layers if layers is not None else '-':>12}")
    lines.append("")
    if answer.breakpoints:
        lines.append("breakpoints (the DAG optimum changes plan):")
        for bp in answer.breakpoints:
            approx = "" if bp.exact else " (between samples)"
            lines.append(f"  {format_rate_bps(bp.up_bps)}{approx}: {bp.below.edge_layers} -> "
                         f"{bp.above.edge_layers} device layers, boundary "
                         f"{', '.join(bp.above.boundary) or '(none)'}")
    else:
        lines.append("no breakpoints: one plan is optimal across the range")
    if answer.max_gain_vs_chain is not None:
        lines.append(f"largest gain of the DAG optimum: {answer.max_gain_vs_chain:.3f}x over the chain scan, "
                     f"{answer.max_gain_vs_best_single_tier:.3f}x over the better of edge-only and cloud-only")
    return "\n".join(lines)


def sweep_main(argv: Sequence[str]) -> int:
    """`splitinfer sweep MODEL ... --uplink LO..HI --points N [--plot PNG] [--json]`"""
    ap = argparse.ArgumentParser(prog="splitinfer sweep",
                                 description="the objective against uplink rate: edge-only, cloud-only, "
                                             "chain scan (Neurosurgeon) and the DAG optimum")
    _add_common(ap)
    ap.add_argument("--uplink", type=arg_type(parse_rate_range), default="0.1mbit..1gbit",
                    help="range LO..HI (default 0.1mbit..1gbit)")
    ap.add_argument("--points", type=int, default=200, help=f"log-spaced rates, 2..{MAX_SWEEP_POINTS} (default 200)")
    link = ap.add_mutually_exclusive_group()
    link.add_argument("--down-ratio", type=float, default=1.0, help="downlink = ratio * uplink (default 1)")
    link.add_argument("--downlink", type=arg_type(parse_rate_bps), help="a fixed downlink rate instead (solves per point)")
    ap.add_argument("--plot", metavar="PNG", help="write the plot here")
    ap.add_argument("--registry", metavar="DIR", help="model registry directory (for MODEL names)")
    args = parse_args(ap, argv)
    workspace = _workspace(args.registry)
    lo, hi = args.uplink
    answer = workspace.sweep(SweepRequest(_scenario(args, workspace), lo, hi, points=args.points,
                                          down_ratio=args.down_ratio, down_bps=args.downlink))
    if args.plot:
        from splitinfer.plots import plot_sweep

        plot_sweep(answer.to_dict(), args.plot)
    print(answer.to_json(indent=1) if args.json else format_sweep(answer))
    if args.plot and not args.json:
        print(f"plot written to {args.plot}", flush=True)
    return 0


def planner_main(argv: Sequence[str]) -> int:
    """`splitinfer planner serve ...` (see splitinfer.planner_http)."""
    from splitinfer.planner_http import planner_main as serve

    return serve(argv)
