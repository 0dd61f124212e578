"""Profiles: what one tier (device, edge server or cloud) costs per layer.

A profile is data, not measurement: `workers.profile` measures one with ONNX Runtime
and writes it with `Profile.to_json`; the planner only reads it. Every field has a
docstring; loading a malformed profile raises `ProfileError` naming the field and the
fix.

[Note: segment time]
Fused runtimes do not add up per-layer times (QDMP). The planner therefore times a
*segment* (the layers one tier runs) as

    segment_ms = corrections.scale * sum(layers[v].ms for v in segment)
                 + corrections.offset_ms + fixed_ms          (segment not empty)
    segment_ms = 0                                           (segment empty)

A profile without ``corrections`` uses scale 1 and offset 0: the plain additive
model. Both terms keep the cost of a cut modular, so the min-cut solvers stay exact
(the non-empty condition is handled exactly by solving per emptiness pattern, see
`planner.solvers`). `workers.profile` calibrates scale and offset by a least-squares
fit of timed real head/tail segments against their per-layer sums.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from planner.errors import ProfileError

__all__ = ["PROFILE_SCHEMA", "LayerTime", "Corrections", "CodecModel", "Profile"]

PROFILE_SCHEMA = "splitinfer.profile/1"

_CASTS = ("fp16", "int8")
_COMPRESSIONS = ("zstd", "lz4")


def _num(d: Mapping[str, Any], key: str, where: str, *, default: Any = ..., lo: float = 0.0,
         allow_none: bool = False, integer: bool = False) -> Any:
    """Read a non-negative number ``d[key]``; raise ProfileError naming it otherwise."""
    if key not in d:
        if default is ...:
            raise ProfileError(
                f"profile field {where}.{key} is missing; add it (a number >= {lo:g})",
                field=f"{where}.{key}",
            )
        return default
    v = d[key]
    if v is None and allow_none:
        return None
    noun = "integer" if integer else "number"
    kind = f"an {noun}" if integer else f"a {noun}"
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise ProfileError(
            f"profile field {where}.{key} is {v!r}; it must be {kind} >= {lo:g}",
            field=f"{where}.{key}",
        )
    if not math.isfinite(v) or v < lo:
        raise ProfileError(
            f"profile field {where}.{key} is {v!r}; it must be a finite {noun} >= {lo:g}",
            field=f"{where}.{key}",
        )
    return v


def _check_keys(d: Any, allowed: tuple[str, ...], where: str) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        raise ProfileError(
            f"profile field {where} is {type(d).__name__}; it must be a JSON object",
            field=where,
        )
    unknown = sorted(set(d) - set(allowed))
    if unknown:
        raise ProfileError(
            f"profile field {where} has unknown key(s) {unknown}; allowed keys are "
            f"{list(allowed)} (check the spelling)",
            field=f"{where}.{unknown[0]}",
        )
    return d


@dataclass(frozen=True)
class LayerTime:
    """Measured time of one layer at batch 1."""

    ms: float
    """Median milliseconds per run."""
    p90_ms: float | None = None
    """90th-percentile milliseconds, where measured."""
    samples: int | None = None
    """How many timed runs the figures come from, where known."""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"ms": self.ms}
        if self.p90_ms is not None:
            d["p90_ms"] = self.p90_ms
        if self.samples is not None:
            d["samples"] = self.samples
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = "layers.?") -> LayerTime:
        d = _check_keys(d, ("ms", "p90_ms", "samples"), where)
        return cls(
            ms=float(_num(d, "ms", where)),
            p90_ms=_num(d, "p90_ms", where, default=None, allow_none=True),
            samples=_num(d, "samples", where, default=None, allow_none=True, integer=True),
        )


@dataclass(frozen=True)
class Corrections:
    """Per-segment correction of the additive model; see [Note: segment time]."""

    scale: float = 1.0
    """Multiplies the sum of per-layer ms of a segment (fusion makes it < 1)."""
    offset_ms: float = 0.0
    """Added once to every non-empty segment (may be negative, but not below -fixed_ms)."""
    segments: int = 0
    """How many real segments the fit used (0: set by hand)."""

    def to_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "offset_ms": self.offset_ms, "segments": self.segments}

    @classmethod
    def from_dict(cls, d: Any) -> Corrections:
        d = _check_keys(d, ("scale", "offset_ms", "segments"), "corrections")
        return cls(
            scale=float(_num(d, "scale", "corrections", default=1.0)),
            offset_ms=float(_num(d, "offset_ms", "corrections", default=0.0, lo=-math.inf)),
            segments=int(_num(d, "segments", "corrections", default=0, integer=True)),
        )


def _frozen_map(m: Mapping[Any, Any]) -> Mapping[Any, Any]:
    return MappingProxyType(dict(m))


@dataclass(frozen=True)
class CodecModel:
    """What encoding the boundary costs on this tier, per MB (1e6 bytes) and per tensor sent.

    The defaults are typical figures for one core of a recent x86 CPU (numpy casts,
    zstd level 3, lz4 default); a reference device keeps them, scaled by its
    ``codec_scale``. ``splitinfer profile`` replaces the casts' figures with times of the
    model's own tensors on the host that profiles (``source`` says so), and bench.e2e with
    times on the emulated device. A cast's time depends on the values, so the model input
    has figures of its own: numpy's fp16 cast took 0.38 ms/MB on 224x224 images and
    1.26 ms/MB on post-ReLU maps (half exact zeros) on one host, int8 0.13 and 0.10 ms/MB.
    A lossy codec's time comes from the accuracy table instead, measured at its cut.
    """

    encode_ms_per_mb: Mapping[str, float] = field(
        default_factory=lambda: _frozen_map({"fp16": 0.35, "int8": 0.9, "zstd": 2.5, "lz4": 0.8})
    )
    """Encode time on this tier per MB in: casts per MB of fp32 input, compressions per
    MB of (cast) input. Keys: fp16, int8, zstd, lz4. The casts' figures are for feature
    maps (tensors a layer computes)."""
    decode_ms_per_mb: Mapping[str, float] = field(
        default_factory=lambda: _frozen_map({"fp16": 0.3, "int8": 0.5, "zstd": 1.0, "lz4": 0.3})
    )
    """Decode time on this tier, same keys and units as ``encode_ms_per_mb``."""
    ratio: Mapping[str, float] = field(
        default_factory=lambda: _frozen_map({"zstd": 0.8, "lz4": 0.9})
    )
    """Estimated compressed/raw size for each lossless compression (post-ReLU
    activations compress; the sender's figure is used)."""
    host_copy_ms_per_mb: float = 0.0
    """An accelerator tier's copy of its inputs (as decoded) to the device and of the
    model outputs it computes back, per MB; 0 on a CPU."""
    input_encode_ms_per_mb: Mapping[str, float] | None = None
    """Cast time of the model's inputs per MB of fp32 (keys fp16, int8); None: the
    feature maps' figures of ``encode_ms_per_mb``."""
    encode_fixed_ms: float = 0.0
    """Time per tensor sent whatever its encoding (framing it into the request), in ms."""
    source: str = "defaults"
    """Where the figures come from: 'defaults', or what measured them."""

    def __post_init__(self) -> None:
        for name in ("encode_ms_per_mb", "decode_ms_per_mb", "ratio"):
            object.__setattr__(self, name, _frozen_map(getattr(self, name)))
        if self.input_encode_ms_per_mb is not None:
            object.__setattr__(self, "input_encode_ms_per_mb", _frozen_map(self.input_encode_ms_per_mb))
        for name, fix in (("host_copy_ms_per_mb", "give ms per MB >= 0 (0 on a CPU)"),
                          ("encode_fixed_ms", "give ms per tensor sent >= 0 (0: none)")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ProfileError(f"profile field codec.{name} is {v!r}; {fix}", field=f"codec.{name}")
        if not isinstance(self.source, str) or not self.source:
            raise ProfileError(f"profile field codec.source is {self.source!r}; name what measured the figures "
                               "(or 'defaults')", field="codec.source")

    def cast_ms_per_mb(self, precision: str, *, model_input: bool) -> float:
        """Encode ms per MB of fp32 of the cast to `precision`, for a model input or a feature map."""
        if model_input and self.input_encode_ms_per_mb is not None and precision in self.input_encode_ms_per_mb:
            return self.input_encode_ms_per_mb[precision]
        return self.encode_ms_per_mb[precision]

    def scaled(self, factor: float) -> CodecModel:
        """These figures on a tier `factor` times slower (every time, not the ratios)."""
        return replace(
            self, encode_ms_per_mb={k: v * factor for k, v in self.encode_ms_per_mb.items()},
            decode_ms_per_mb={k: v * factor for k, v in self.decode_ms_per_mb.items()},
            input_encode_ms_per_mb=None if self.input_encode_ms_per_mb is None
            else {k: v * factor for k, v in self.input_encode_ms_per_mb.items()},
            encode_fixed_ms=self.encode_fixed_ms * factor)

    def to_dict(self) -> dict[str, Any]:
        return {
            "encode_ms_per_mb": dict(self.encode_ms_per_mb),
            "decode_ms_per_mb": dict(self.decode_ms_per_mb),
            "ratio": dict(self.ratio),
            "host_copy_ms_per_mb": self.host_copy_ms_per_mb,
            "input_encode_ms_per_mb": None if self.input_encode_ms_per_mb is None
            else dict(self.input_encode_ms_per_mb),
            "encode_fixed_ms": self.encode_fixed_ms,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: Any) -> CodecModel:
        d = _check_keys(d, ("encode_ms_per_mb", "decode_ms_per_mb", "ratio", "host_copy_ms_per_mb",
                            "input_encode_ms_per_mb", "encode_fixed_ms", "source"), "codec")
        base = cls()
        out: dict[str, Any] = {}
        for name, keys in (
            ("encode_ms_per_mb", _CASTS + _COMPRESSIONS),
            ("decode_ms_per_mb", _CASTS + _COMPRESSIONS),
            ("ratio", _COMPRESSIONS),
        ):
            sub = _check_keys(d.get(name, {}), keys, f"codec.{name}")
            merged = dict(getattr(base, name))
            for k in sub:
                merged[k] = float(_num(sub, k, f"codec.{name}"))
            out[name] = merged
        for k, v in out["ratio"].items():
            if not 0.0 < v <= 1.0:
                raise ProfileError(
                    f"profile field codec.ratio.{k} is {v!r}; a compression ratio is "
                    f"compressed/raw size, in (0, 1]",
                    field=f"codec.ratio.{k}",
                )
        if d.get("input_encode_ms_per_mb") is not None:
            sub = _check_keys(d["input_encode_ms_per_mb"], _CASTS, "codec.input_encode_ms_per_mb")
            out["input_encode_ms_per_mb"] = {k: float(_num(sub, k, "codec.input_encode_ms_per_mb")) for k in sub}
        for key in ("host_copy_ms_per_mb", "encode_fixed_ms"):
            if key in d:
                out[key] = float(_num(d, key, "codec"))
        if "source" in d:
            out["source"] = d["source"]
        return cls(**out)


@dataclass(frozen=True)
class Profile:
    """Per-layer cost of one model on one tier (device, edge server or cloud)."""

    device: str
    """Free-form name of the hardware, e.g. 'rpi4', 'c5.xlarge', 'a100'."""
    layers: Mapping[int, LayerTime]
    """Time of each layer at batch 1, keyed by layer id (JSON keys are strings)."""
    ep: str = "CPUExecutionProvider"
    """ONNX Runtime execution provider the times were taken with."""
    ort_version: str = ""
    """ONNX Runtime version the times were taken with."""
    threads: int = 1
    """Intra-op threads the times were taken with."""
    batch: int = 1
    """Batch size of ``layers`` (always 1 for the planner's additive model)."""
    fixed_ms: float = 0.0
    """Fixed per-run overhead of a non-empty segment (session call, copies)."""
    batch_ms: Mapping[int, float] | None = None
    """Whole-model ms per batch size (throughput). A segment's per-sample time at
    batch B is its batch-1 time times batch_ms[B] / (B * batch_ms[1]); batch_ms[1]
    defaults to the sum of ``layers``. None: no batching."""
    corrections: Corrections | None = None
    """Per-segment correction; None is the plain additive model."""
    compute_w: float = 0.0
    """Power drawn while computing (W); the energy objective's first term."""
    radio_tx_w: float = 0.0
    """Power drawn while transmitting (W)."""
    idle_w: float = 0.0
    """Power drawn while waiting for the rest of the pipeline (W)."""
    memory_bytes: int | None = None
    """Memory available to the model on this tier; None: unlimited."""
    codec: CodecModel = field(default_factory=CodecModel)
    """Cost of encoding/decoding the boundary on this tier (defaults, see CodecModel)."""
    model: str = ""
    """Name of the model the profile belongs to (informative)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", _frozen_map(self.layers))
        if self.batch_ms is not None:
            object.__setattr__(self, "batch_ms", _frozen_map(self.batch_ms))

    # -- derived ---------------------------------------------------------------
    @property
    def scale(self) -> float:
        return 1.0 if self.corrections is None else self.corrections.scale

    @property
    def segment_const_ms(self) -> float:
        """What a non-empty segment costs beyond its scaled layer sum."""
        off = 0.0 if self.corrections is None else self.corrections.offset_ms
        return self.fixed_ms + off

    def batch_factor(self, batch: int) -> float:
        """Per-sample time at ``batch`` relative to batch 1 (1.0 without batch_ms)."""
        if batch == 1:
            return 1.0
        if not self.batch_ms or batch not in self.batch_ms:
            options = sorted(self.batch_ms or {})
            raise ProfileError(
                f"profile {self.device!r} has no time for batch {batch}; its batch_ms "
                f"covers {options or 'no batch sizes'}: measure batch {batch} or pick one of those",
                field="batch_ms",
                device=self.device,
            )
        one = self.batch_ms.get(1) or sum(t.ms for t in self.layers.values())
        if one <= 0:
            return 1.0
        return self.batch_ms[batch] / (batch * one)

    def layer_ms(self, layer: int) -> float:
        try:
            return self.layers[layer].ms
        except KeyError:
            raise ProfileError(
                f"profile {self.device!r} has no time for layer {layer}; re-profile the "
                f"model {self.model or '(unnamed)'} on this device, or check that the "
                f"profile belongs to this model",
                field=f"layers.{layer}",
                device=self.device,
                layer=layer,
            ) from None

    # -- JSON ------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "schema": PROFILE_SCHEMA,
            "model": self.model,
            "device": self.device,
            "ep": self.ep,
            "ort_version": self.ort_version,
            "threads": self.threads,
            "batch": self.batch,
            "fixed_ms": self.fixed_ms,
            "layers": {str(k): v.to_dict() for k, v in sorted(self.layers.items())},
            "batch_ms": None if self.batch_ms is None
            else {str(k): v for k, v in sorted(self.batch_ms.items())},
            "corrections": None if self.corrections is None else self.corrections.to_dict(),
            "compute_w": self.compute_w,
            "radio_tx_w": self.radio_tx_w,
            "idle_w": self.idle_w,
            "memory_bytes": self.memory_bytes,
            "codec": self.codec.to_dict(),
        }
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Profile:
        d = _check_keys(d, (
            "schema", "model", "device", "ep", "ort_version", "threads", "batch", "fixed_ms",
            "layers", "batch_ms", "corrections", "compute_w", "radio_tx_w", "idle_w",
            "memory_bytes", "codec",
        ), "profile")
        schema = d.get("schema")
        if schema != PROFILE_SCHEMA:
            raise ProfileError(
                f"profile field schema is {schema!r}; this planner reads "
                f"{PROFILE_SCHEMA!r} (re-run the profiler, or set schema if the file is one)",
                field="schema",
            )
        for key in ("device", "layers"):
            if key not in d:
                raise ProfileError(
                    f"profile field {key} is missing; a profile needs 'device' (a name) "
                    f"and 'layers' ({{\"<layer id>\": {{\"ms\": ...}}}})",
                    field=key,
                )
        device = d["device"]
        if not isinstance(device, str) or not device:
            raise ProfileError(
                f"profile field device is {device!r}; give the hardware a non-empty name",
                field="device",
            )
        layers_in = _check_keys(d["layers"], tuple(d["layers"]) if isinstance(d["layers"], Mapping) else (), "layers")
        layers: dict[int, LayerTime] = {}
        for k, v in layers_in.items():
            try:
                lid = int(k)
            except (TypeError, ValueError):
                raise ProfileError(
                    f"profile field layers has key {k!r}; keys are layer ids ('0', '1', ...)",
                    field=f"layers.{k}", device=device,
                ) from None
            layers[lid] = LayerTime.from_dict(v, f"layers.{k}")
        batch_ms = None
        if d.get("batch_ms") is not None:
            raw = _check_keys(d["batch_ms"], tuple(d["batch_ms"]) if isinstance(d["batch_ms"], Mapping) else (), "batch_ms")
            batch_ms = {}
            for k in raw:
                try:
                    b = int(k)
                except (TypeError, ValueError):
                    b = 0
                if b < 1:
                    raise ProfileError(
                        f"profile field batch_ms has key {k!r}; keys are batch sizes >= 1",
                        field=f"batch_ms.{k}", device=device,
                    )
                batch_ms[b] = float(_num(raw, k, "batch_ms"))
        corrections = None if d.get("corrections") is None else Corrections.from_dict(d["corrections"])
        fixed_ms = float(_num(d, "fixed_ms", "profile", default=0.0))
        if corrections is not None and corrections.offset_ms < -fixed_ms:
            raise ProfileError(
                f"profile field corrections.offset_ms is {corrections.offset_ms!r}, below "
                f"-fixed_ms ({-fixed_ms!r}): a segment would take negative time; refit it",
                field="corrections.offset_ms", device=device,
            )
        for key in ("ep", "ort_version", "model"):
            if key in d and not isinstance(d[key], str):
                raise ProfileError(
                    f"profile field {key} is {d[key]!r}; it must be a string",
                    field=key, device=device,
                )
        return cls(
            device=device,
            layers=layers,
            ep=d.get("ep", "CPUExecutionProvider"),
            ort_version=d.get("ort_version", ""),
            threads=int(_num(d, "threads", "profile", default=1, lo=1, integer=True)),
            batch=int(_num(d, "batch", "profile", default=1, lo=1, integer=True)),
            fixed_ms=fixed_ms,
            batch_ms=batch_ms,
            corrections=corrections,
            compute_w=float(_num(d, "compute_w", "profile", default=0.0)),
            radio_tx_w=float(_num(d, "radio_tx_w", "profile", default=0.0)),
            idle_w=float(_num(d, "idle_w", "profile", default=0.0)),
            memory_bytes=_num(d, "memory_bytes", "profile", default=None, allow_none=True, integer=True),
            codec=CodecModel.from_dict(d.get("codec", {})),
            model=d.get("model", ""),
        )

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProfileError(
                f"profile is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
                f"fix the file or re-run the profiler",
                field="(json)",
            ) from e
        return cls.from_dict(d)
