"""Reference devices: roofline estimates for hardware that is not at hand.

Pure data and arithmetic: no I/O, no clocks. Every figure here is an *estimate* built
from vendor datasheets and public measurements (sources in each device's
``sources`` and in docs/profiles.md), not a measurement of ours. Use them for
"what if" questions; measure a real profile (`splitinfer profile`) before trusting a
plan on real hardware.

[Note: roofline layer time]
A layer of F floating-point operations (per sample) that moves B bytes (its input and
output activations per sample, plus its weights once per run) takes, at batch b,

    ms = max(b * F / (peak[precision] * eff[op]), (b * B_act + B_weights) / bandwidth) * 1000
         + layer_overhead_ms

where ``op`` is the layer's anchor op type (its first node: Conv, Gemm, MaxPool, ...)
and ``eff[op]`` the fraction of peak that op reaches at small batch on that device
(``default_efficiency`` for op types not listed). ``fixed_ms`` is paid once per run
(session call, and on GPUs the host-device copies). `fit_efficiencies` inverts the
compute term on a measured profile, the way Neurosurgeon fits one regression per
layer type, so a roofline of this host ("this-host") can be derived from a
measurement and compared with the other devices on the same footing.

A layer whose FLOPs or activation sizes are unknown has no roofline: counting the
unknown part as 0 would make it free and draw the planner to it. `roofline_ms` and
`reference_profile` refuse it (`unknown_work_error`) naming the layers and the fix
(input shapes or sample inputs for unknown sizes; a measured profile for an op without
a FLOP count); the fits skip such layers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from partitioner.graph import Layer, LayerGraph
from planner.errors import PlannerError
from planner.profile import CodecModel, LayerTime, Profile

__all__ = [
    "Device",
    "UnknownDeviceError",
    "DEVICES",
    "THIS_HOST",
    "PRECISIONS",
    "get_device",
    "device_names",
    "anchor_op",
    "layer_bytes",
    "unknown_work_error",
    "roofline_ms",
    "reference_profile",
    "fit_efficiencies",
    "device_from_profile",
]

PRECISIONS = ("fp32", "fp16", "int8")
THIS_HOST = "this-host"
_GIB = 2**30


class UnknownDeviceError(PlannerError):
    """A device name that is not among the reference devices."""

    def __init__(self, message: str, *, name: str, known: tuple[str, ...]) -> None:
        super().__init__(message, field="device")
        self.name = name
        self.known = known


def _frozen(m: Mapping[str, float]) -> Mapping[str, float]:
    return MappingProxyType(dict(m))


@dataclass(frozen=True)
class Device:
    """One device as a roofline. All figures are estimates unless ``estimate`` is False."""

    name: str
    """Short name used on the command line (``rpi4``, ``t4``, ...)."""
    description: str
    """What the hardware is (SoC, cores, clocks, memory)."""
    peak_flops: Mapping[str, float]
    """Peak FLOP/s (int8: OP/s) per precision, keys fp32, fp16, int8."""
    mem_bw_bytes_per_s: float
    """Memory bandwidth the kernels can sustain, bytes/s."""
    efficiency: Mapping[str, float] = field(default_factory=dict)
    """Fraction of peak reached per anchor op type at small batch, in (0, 1]."""
    default_efficiency: float = 0.2
    """Efficiency of op types not in ``efficiency``."""
    layer_overhead_ms: float = 0.0
    """Per-layer cost beyond the roofline (kernel dispatch or launch), ms."""
    fixed_ms: float = 0.0
    """Per-run cost (session call; on a GPU the input and output copies), ms."""
    ep: str = "CPUExecutionProvider"
    """The ONNX Runtime execution provider the device would run."""
    compute_w: float = 0.0
    """Power while computing, W."""
    idle_w: float = 0.0
    """Power while waiting, W."""
    radio_tx_w: float = 0.0
    """Extra power while transmitting, W (0 for servers)."""
    memory_bytes: int | None = None
    """Memory a model may use on the device; None: not limited."""
    codec_scale: float = 1.0
    """Boundary encode/decode time relative to `CodecModel`'s defaults (slower cores > 1)."""
    host_copy_ms_per_mb: float = 0.0
    """An accelerator's copy of a segment's inputs from host memory and of its outputs
    back, ms per MB (`CodecModel.host_copy_ms_per_mb`); 0: none, or not measured."""
    sources: tuple[str, ...] = ()
    """Where the figures come from."""
    estimate: bool = True
    """True: datasheet/public-measurement estimate; False: fitted to a measurement here."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "peak_flops", _frozen(self.peak_flops))
        object.__setattr__(self, "efficiency", _frozen(self.efficiency))
        object.__setattr__(self, "sources", tuple(self.sources))
        for p in PRECISIONS:
            v = self.peak_flops.get(p)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise PlannerError(
                    f"device {self.name!r}: peak_flops[{p!r}] is {v!r}; give a FLOP/s figure > 0 for "
                    f"each of {list(PRECISIONS)}", field="peak_flops")
        if not math.isfinite(self.mem_bw_bytes_per_s) or self.mem_bw_bytes_per_s <= 0:
            raise PlannerError(f"device {self.name!r}: mem_bw_bytes_per_s is {self.mem_bw_bytes_per_s!r}; "
                               "it must be > 0 bytes/s", field="mem_bw_bytes_per_s")
        for op, e in list(self.efficiency.items()) + [("default", self.default_efficiency)]:
            if not isinstance(e, (int, float)) or not 0.0 < e <= 1.0:
                raise PlannerError(f"device {self.name!r}: efficiency of {op} is {e!r}; it is a fraction "
                                   "of peak in (0, 1]", field="efficiency")
        for name in ("layer_overhead_ms", "fixed_ms", "compute_w", "idle_w", "radio_tx_w", "host_copy_ms_per_mb"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise PlannerError(f"device {self.name!r}: {name} is {v!r}; it must be a number >= 0", field=name)
        if self.codec_scale <= 0:
            raise PlannerError(f"device {self.name!r}: codec_scale is {self.codec_scale!r}; it must be > 0",
                               field="codec_scale")

    def eff(self, op: str) -> float:
        return self.efficiency.get(op, self.default_efficiency)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "description": self.description, "peak_flops": dict(self.peak_flops),
            "mem_bw_bytes_per_s": self.mem_bw_bytes_per_s, "efficiency": dict(self.efficiency),
            "default_efficiency": self.default_efficiency, "layer_overhead_ms": self.layer_overhead_ms,
            "fixed_ms": self.fixed_ms, "ep": self.ep, "compute_w": self.compute_w, "idle_w": self.idle_w,
            "radio_tx_w": self.radio_tx_w, "memory_bytes": self.memory_bytes, "codec_scale": self.codec_scale,
            "host_copy_ms_per_mb": self.host_copy_ms_per_mb,
            "sources": list(self.sources), "estimate": self.estimate,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Device:
        try:
            return cls(**{**d, "sources": tuple(d.get("sources", ()))})
        except TypeError as e:
            raise PlannerError(f"device description is malformed ({e}); write it with Device.to_dict",
                               field="device") from e

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_json(cls, text: str) -> Device:
        return cls.from_dict(json.loads(text))


# Efficiencies at batch 1 are what ONNX Runtime's kernels (MLAS on CPUs, cuDNN/cuBLAS on
# GPUs) typically reach on the zoo's layer shapes; pooling and concatenation are bound by
# memory, so their compute efficiency only matters where the roofline's memory term is
# smaller than the true cost.
_CPU_EFF = {"Conv": 0.35, "Gemm": 0.45, "MatMul": 0.45, "MaxPool": 0.05, "AveragePool": 0.05,
            "GlobalAveragePool": 0.05, "LRN": 0.05, "Softmax": 0.05, "Concat": 0.05}
_GPU_EFF = {"Conv": 0.3, "Gemm": 0.25, "MatMul": 0.25, "MaxPool": 0.02, "AveragePool": 0.02,
            "GlobalAveragePool": 0.02, "LRN": 0.02, "Softmax": 0.02, "Concat": 0.02}

DEVICES: Mapping[str, Device] = MappingProxyType({d.name: d for d in (
    Device(
        name="rpi4",
        description="Raspberry Pi 4 Model B: BCM2711, 4x Cortex-A72 @ 1.5 GHz, 4 GB LPDDR4-3200 (32-bit)",
        peak_flops={"fp32": 48e9, "fp16": 48e9, "int8": 96e9},
        mem_bw_bytes_per_s=4.5e9, efficiency=_CPU_EFF, default_efficiency=0.1,
        layer_overhead_ms=0.02, fixed_ms=0.3, compute_w=6.4, idle_w=2.7, radio_tx_w=0.8,
        memory_bytes=3 * _GIB, codec_scale=3.0,
        sources=("Raspberry Pi 4 product brief (BCM2711, 4x A72 1.5 GHz, LPDDR4-3200)",
                 "Arm Cortex-A72 TRM: 2x 64-bit NEON pipes, 8 fp32 FLOP/cycle/core",
                 "public STREAM results on Pi 4: ~4-5 GB/s copy",
                 "Raspberry Pi power measurements: ~2.7 W idle, ~6.4 W all cores busy"),
    ),
    Device(
        name="rpi5",
        description="Raspberry Pi 5: BCM2712, 4x Cortex-A76 @ 2.4 GHz, 8 GB LPDDR4X-4267 (32-bit)",
        peak_flops={"fp32": 153.6e9, "fp16": 307.2e9, "int8": 614.4e9},
        mem_bw_bytes_per_s=10e9, efficiency=_CPU_EFF, default_efficiency=0.1,
        layer_overhead_ms=0.01, fixed_ms=0.15, compute_w=8.8, idle_w=2.7, radio_tx_w=0.8,
        memory_bytes=7 * _GIB, codec_scale=1.5,
        sources=("Raspberry Pi 5 product brief (BCM2712, 4x A76 2.4 GHz, LPDDR4X-4267)",
                 "Arm Cortex-A76: 2x 128-bit NEON FMA pipes, 16 fp32 FLOP/cycle/core; fp16 and "
                 "int8 dot product double and quadruple that",
                 "public STREAM results on Pi 5: ~10 GB/s",
                 "public power measurements on Pi 5: ~2.7 W idle, ~8-9 W under full CPU load"),
    ),
    Device(
        name="jetson-orin-nano",
        description="NVIDIA Jetson Orin Nano 8 GB: 1024-core Ampere GPU @ 625 MHz, 32 tensor cores, "
                    "128-bit LPDDR5 (68 GB/s), 15 W mode",
        peak_flops={"fp32": 1.28e12, "fp16": 10e12, "int8": 20e12},
        mem_bw_bytes_per_s=68e9, efficiency=_GPU_EFF, default_efficiency=0.05,
        layer_overhead_ms=0.04, fixed_ms=0.5, ep="CUDAExecutionProvider",
        compute_w=15.0, idle_w=5.0, radio_tx_w=0.8, memory_bytes=6 * _GIB, codec_scale=1.5,
        sources=("NVIDIA Jetson Orin Nano datasheet: 40 sparse INT8 TOPS (20 dense), 1024 CUDA "
                 "cores, 68 GB/s, 7-15 W",
                 "fp32 = 1024 cores x 2 x 625 MHz; fp16 dense estimated as half the dense int8 rate"),
    ),
    Device(
        name="phone-sd8g2",
        description="Snapdragon 8 Gen 2 class phone CPU: 1x Cortex-X3 @ 3.2 GHz, 4x A715/A710 @ 2.8 GHz, "
                    "3x A510 @ 2.0 GHz, LPDDR5X-4200 (64-bit)",
        peak_flops={"fp32": 330e9, "fp16": 660e9, "int8": 1320e9},
        mem_bw_bytes_per_s=35e9, efficiency=_CPU_EFF, default_efficiency=0.1,
        layer_overhead_ms=0.008, fixed_ms=0.1, compute_w=6.0, idle_w=0.6, radio_tx_w=2.0,
        memory_bytes=2 * _GIB, codec_scale=1.0,
        sources=("Qualcomm Snapdragon 8 Gen 2 product brief (core counts and clocks, LPDDR5X-4200)",
                 "Arm: X3 4x 128-bit FP pipes (32 FLOP/cycle), A715/A710 2x (16), A510 ~8",
                 "public phone CPU power measurements: ~5-7 W all-core; radio tx ~1.5-2.5 W (estimate)"),
    ),
    Device(
        name="t4",
        description="NVIDIA T4 (Turing, 16 GB GDDR6, 70 W)",
        peak_flops={"fp32": 8.1e12, "fp16": 65e12, "int8": 130e12},
        mem_bw_bytes_per_s=320e9, efficiency=_GPU_EFF, default_efficiency=0.05,
        layer_overhead_ms=0.03, fixed_ms=0.4, ep="CUDAExecutionProvider",
        compute_w=70.0, idle_w=10.0, memory_bytes=15 * _GIB, codec_scale=0.8,
        sources=("NVIDIA T4 datasheet: 8.1 TFLOPS fp32, 65 TFLOPS fp16, 130 TOPS int8, 320 GB/s, 70 W",),
    ),
    Device(
        name="a100",
        description="NVIDIA A100 SXM 80 GB (Ampere, HBM2e, 400 W)",
        peak_flops={"fp32": 19.5e12, "fp16": 312e12, "int8": 624e12},
        mem_bw_bytes_per_s=2039e9, efficiency=_GPU_EFF, default_efficiency=0.05,
        layer_overhead_ms=0.025, fixed_ms=0.3, ep="CUDAExecutionProvider",
        compute_w=400.0, idle_w=55.0, memory_bytes=78 * _GIB, codec_scale=0.8,
        sources=("NVIDIA A100 datasheet: 19.5 TFLOPS fp32 (156 TF32), 312 TFLOPS fp16, 624 TOPS int8 "
                 "(dense), 2039 GB/s, 400 W",),
    ),
    Device(
        name="h100",
        description="NVIDIA H100 SXM 80 GB (Hopper, HBM3, 700 W)",
        peak_flops={"fp32": 67e12, "fp16": 989e12, "int8": 1979e12},
        mem_bw_bytes_per_s=3350e9, efficiency=_GPU_EFF, default_efficiency=0.05,
        layer_overhead_ms=0.02, fixed_ms=0.1, ep="CUDAExecutionProvider",
        compute_w=700.0, idle_w=70.0, memory_bytes=78 * _GIB, codec_scale=0.8, host_copy_ms_per_mb=0.064,
        sources=("NVIDIA H100 datasheet: 67 TFLOPS fp32, 989 TFLOPS fp16, 1979 TOPS int8 (dense), "
                 "3.35 TB/s, 700 W",
                 "fixed_ms and host_copy_ms_per_mb measured on an H100 80GB HBM3 with the torch-cuda backend "
                 "(bench/results/gpu.json): a 3-layer transformer tail of 1.8 MFLOP took 4.43 ms at batch 32 "
                 "moving 67 MB (0.064 ms/MB); the transformer tails at batch 1 as CUDA graphs took 0.28-0.53 ms, "
                 "so a run's fixed cost is below the 0.25 ms first assumed"),
    ),
)})


def device_names() -> tuple[str, ...]:
    return tuple(DEVICES) + (THIS_HOST,)


def get_device(name: str) -> Device:
    """The reference device of that name; UnknownDeviceError lists the known ones."""
    key = str(name).lower().strip()
    if key in DEVICES:
        return DEVICES[key]
    known = device_names()
    if key == THIS_HOST:
        raise UnknownDeviceError(
            f"device {THIS_HOST!r} is derived from a measured profile: run 'splitinfer profile MODEL "
            "--calibrate' and use device_from_profile(graph, profile)", name=name, known=known)
    raise UnknownDeviceError(
        f"unknown device {name!r}; known devices: {', '.join(known)}", name=name, known=known)


def anchor_op(layer: Layer) -> str:
    """Op type of the layer's anchor node (the one it is named after)."""
    try:
        return layer.ops[layer.nodes.index(layer.name)]
    except ValueError:
        return layer.ops[0] if layer.ops else ""


def layer_bytes(graph: LayerGraph, layer: Layer, batch: int = 1) -> float | None:
    """Bytes a run of ``batch`` samples moves for the layer: activations in and out, weights
    once; None where an activation's size is unknown."""
    act = graph.bytes_total(t for t in layer.inputs + layer.outputs if t in graph.tensor).exact
    return None if act is None else float(batch * act + layer.param_bytes)


def unknown_work_error(graph: LayerGraph, layers: Sequence[Layer], what: str) -> PlannerError:
    """The refusal to time ``layers``, whose FLOPs or activation sizes are unknown, with
    ``what`` (a device's roofline, a FLOP rate): names them, the tensors of unknown size
    they touch and the fix."""
    shown = ", ".join(f"{ly.id} ({anchor_op(ly)})" for ly in layers[:5]) + (
        f" and {len(layers) - 5} more" if len(layers) > 5 else "")
    touched = [t for ly in layers for t in ly.inputs + ly.outputs]
    unsized = list(dict.fromkeys(t for t in touched if t in graph.tensor and graph.tensor[t].bytes_per_sample is None))
    no_count = sorted({anchor_op(ly) for ly in layers if ly.flops is None and layer_bytes(graph, ly) is not None})
    fixes = []
    if unsized:
        fixes.append("fix the input shapes with --input-shape NAME=D0xD1x... (input_shapes=) or pass sample "
                     "inputs with --inputs FILE.npz (inputs=)")
    if no_count:
        fixes.append(f"measure a profile with 'splitinfer profile' where FLOPs cannot be counted "
                     f"({', '.join(no_count)})")
    sizes = (f" (tensors of unknown size: {', '.join(repr(t) for t in unsized[:5])}"
             f"{f' and {len(unsized) - 5} more' if len(unsized) > 5 else ''})") if unsized else ""
    return PlannerError(
        f"cannot time {graph.model} with {what}: {'layers' if len(layers) > 1 else 'layer'} {shown} "
        f"{'have' if len(layers) > 1 else 'has'} unknown FLOPs or activation sizes{sizes}, "
        f"and unknown work cannot be priced; {'; '.join(fixes)}",
        model=graph.model, field="input_shapes" if unsized else "flops")


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise PlannerError(f"precision is {precision!r}; use one of {list(PRECISIONS)}", field="precision")


def roofline_ms(device: Device, graph: LayerGraph, layer: Layer, *, batch: int = 1,
                precision: str = "fp32") -> float:
    """Estimated ms of one layer; see [Note: roofline layer time]."""
    _check_precision(precision)
    moved = layer_bytes(graph, layer, batch)
    if layer.flops is None or moved is None:
        raise unknown_work_error(graph, [layer], f"{device.name}'s roofline")
    flops = float(layer.flops) * batch
    compute_s = flops / (device.peak_flops[precision] * device.eff(anchor_op(layer)))
    scale = {"fp32": 1.0, "fp16": 0.5, "int8": 0.25}[precision]
    memory_s = moved * scale / device.mem_bw_bytes_per_s
    return max(compute_s, memory_s) * 1e3 + device.layer_overhead_ms


def _resolve(device: Device | str) -> Device:
    return device if isinstance(device, Device) else get_device(device)


def reference_profile(device: Device | str, graph: LayerGraph, batch: int = 1, *, precision: str = "fp32",
                      batch_sizes: tuple[int, ...] = (1, 2, 4, 8)) -> Profile:
    """An estimated profile of ``graph`` on a reference device (by name or `Device`).

    ``layers`` are at ``batch``; ``batch_ms`` holds the whole-model roofline for
    ``batch_sizes`` (weights are read once per run, so larger batches amortise them).
    """
    dev = _resolve(device)
    _check_precision(precision)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise PlannerError(f"batch is {batch!r}; use a batch size >= 1", field="batch")
    unknown = [ly for ly in graph.layers if ly.flops is None or layer_bytes(graph, ly) is None]
    if unknown:
        raise unknown_work_error(graph, unknown, f"{dev.name}'s roofline")
    layers = {ly.id: LayerTime(ms=roofline_ms(dev, graph, ly, batch=batch, precision=precision))
              for ly in graph.layers}
    batch_ms = {b: sum(roofline_ms(dev, graph, ly, batch=b, precision=precision) for ly in graph.layers)
                for b in sorted(set(batch_sizes) | {1})}
    codec = replace(CodecModel().scaled(dev.codec_scale), host_copy_ms_per_mb=dev.host_copy_ms_per_mb)
    label = "estimate" if dev.estimate else "fitted"
    return Profile(
        device=dev.name, layers=layers, ep=dev.ep, ort_version=f"roofline-{label}", threads=1, batch=batch,
        fixed_ms=dev.fixed_ms, batch_ms=batch_ms, compute_w=dev.compute_w, radio_tx_w=dev.radio_tx_w,
        idle_w=dev.idle_w, memory_bytes=dev.memory_bytes, codec=codec, model=graph.model,
    )


def fit_efficiencies(graph: LayerGraph, measured: Profile, peak: float, *, layer_overhead_ms: float = 0.0,
                     min_ms: float = 0.0) -> dict[str, float]:
    """Per anchor-op efficiency that best explains a measured profile's compute time.

    For each op type: eff = sum(flops) / (peak * sum(measured seconds - overhead)) over
    its layers with FLOPs and a time above ``min_ms``: the flop-weighted least-squares
    estimate of a zero-intercept line time = flops / (peak * eff), as Neurosurgeon fits
    one regression per layer type. Clamped to (0, 1]. Op types without usable layers are
    left out (they take the device's default).
    """
    if not (isinstance(peak, (int, float)) and math.isfinite(peak) and peak > 0):
        raise PlannerError(f"peak is {peak!r}; give the device's peak FLOP/s (> 0)", field="peak")
    flops: dict[str, float] = {}
    secs: dict[str, float] = {}
    for ly in graph.layers:
        t = measured.layer_ms(ly.id)
        if ly.flops is None or ly.flops <= 0 or t <= min_ms:  # unknown FLOPs tell nothing of the rate
            continue
        f = float(ly.flops)
        op = anchor_op(ly)
        flops[op] = flops.get(op, 0.0) + f * measured.batch
        secs[op] = secs.get(op, 0.0) + max(t - layer_overhead_ms, 1e-6) / 1e3
    return {op: min(1.0, max(1e-6, flops[op] / (peak * secs[op]))) for op in sorted(flops) if secs[op] > 0}


def device_from_profile(graph: LayerGraph, measured: Profile, *, name: str = THIS_HOST,
                        peak_flops: float | None = None, mem_bw_bytes_per_s: float | None = None) -> Device:
    """A roofline of the host a profile was measured on ("this-host").

    Without figures for it, the peak is taken as the fastest FLOP rate any layer reached
    and the bandwidth as the fastest byte rate: lower bounds, so the fitted efficiencies
    are relative to what this host showed it can do.
    """
    rates = []
    bws = []
    for ly in graph.layers:
        t_s = measured.layer_ms(ly.id) / 1e3
        moved = layer_bytes(graph, ly, measured.batch)
        if t_s > 0:  # a layer of unknown FLOPs or sizes shows no rate
            if ly.flops is not None:
                rates.append(float(ly.flops) * measured.batch / t_s)
            if moved is not None:
                bws.append(moved / t_s)
    peak = peak_flops or max(rates, default=0.0)
    bw = mem_bw_bytes_per_s or max(bws, default=0.0)
    if peak <= 0 or bw <= 0:
        raise PlannerError(
            f"profile of {measured.model or graph.model!r} has no timed layer with FLOPs; measure it "
            "with 'splitinfer profile' before deriving this host's roofline", field="layers")
    eff = fit_efficiencies(graph, measured, peak)
    return Device(
        name=name, description=f"roofline fitted to a profile of {measured.model or graph.model} "
                               f"({measured.threads} thread(s), {measured.ep}, ORT {measured.ort_version})",
        peak_flops={"fp32": peak, "fp16": peak, "int8": peak}, mem_bw_bytes_per_s=bw, efficiency=eff,
        default_efficiency=min(eff.values(), default=0.1), fixed_ms=measured.fixed_ms, ep=measured.ep,
        compute_w=measured.compute_w, idle_w=measured.idle_w, radio_tx_w=measured.radio_tx_w,
        memory_bytes=measured.memory_bytes, sources=("fitted by planner.devices.device_from_profile",),
        estimate=False,
    )
