"""The planner's values: links, encodings, objectives, constraints, breakdowns, plans.

All are frozen dataclasses with an exact `to_json`/`from_json` round trip.
Profiles live in `planner.profile`.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from partitioner.cuts import Cut
from planner.errors import PlannerError

__all__ = [
    "Link",
    "LinkRange",
    "Encoding",
    "Objective",
    "Constraints",
    "Breakdown",
    "Plan",
    "PRECISIONS",
    "COMPRESSIONS",
    "LOSSY_CODECS",
    "finite_or_null",
]

PRECISIONS = ("fp32", "fp16", "int8")
COMPRESSIONS = ("none", "zstd", "lz4")
#: Lossy codecs (cluster.protocol.lossy implements them): the model input as an image,
#: feature maps tiled into images, and levels of a chosen bit depth.
LOSSY_CODECS: tuple[str, ...] = ("jpeg", "webp", "tiled-jpeg", "tiled-webp", "bits")


def codec_levels(codec: str) -> tuple[int, int]:
    """The level range of a lossy codec: quality 1..100, or the bit depth 2..8 of 'bits'."""
    return (2, 8) if codec == "bits" else (1, 100)


def finite_or_null(x: Any) -> Any:
    """`x` with every non-finite float in it, through dicts, lists and tuples, made None:
    JSON has no inf or NaN, so they become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite_or_null(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_or_null(v) for v in x]
    return x


def _positive(name: str, v: float, fix: str) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise PlannerError(f"{name} is {v!r}; it must be a finite number > 0 ({fix})", field=name)


class _Json:
    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)  # type: ignore[attr-defined]

    @classmethod
    def from_json(cls, text: str) -> Any:
        return cls.from_dict(json.loads(text))  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Link(_Json):
    """One network hop."""

    up_bps: float
    """Uplink (towards the cloud) bits per second."""
    down_bps: float
    """Downlink bits per second."""
    rtt_ms: float = 0.0
    """Round-trip time, paid once per request that crosses the hop."""
    loss: float = 0.0
    """Packet loss fraction in [0, 1); goodput is rate * (1 - loss)."""

    def __post_init__(self) -> None:
        _positive("up_bps", self.up_bps, "e.g. 18.88e6 for 18.88 Mbit/s")
        _positive("down_bps", self.down_bps, "e.g. 50e6 for 50 Mbit/s")
        if not (isinstance(self.rtt_ms, (int, float)) and math.isfinite(self.rtt_ms) and self.rtt_ms >= 0):
            raise PlannerError(f"rtt_ms is {self.rtt_ms!r}; it must be a finite number >= 0", field="rtt_ms")
        if not (isinstance(self.loss, (int, float)) and 0.0 <= self.loss < 1.0):
            raise PlannerError(f"loss is {self.loss!r}; it must be a fraction in [0, 1)", field="loss")

    @property
    def up_goodput_bps(self) -> float:
        return self.up_bps * (1.0 - self.loss)

    @property
    def down_goodput_bps(self) -> float:
        return self.down_bps * (1.0 - self.loss)

    def to_dict(self) -> dict[str, Any]:
        return {"up_bps": self.up_bps, "down_bps": self.down_bps, "rtt_ms": self.rtt_ms, "loss": self.loss}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Link:
        return cls(d["up_bps"], d["down_bps"], d.get("rtt_ms", 0.0), d.get("loss", 0.0))


@dataclass(frozen=True)
class LinkRange(_Json):
    """A family of links for the frontier: down = down_ratio * up, RTT and loss fixed."""

    up_lo_bps: float
    """Lowest uplink rate considered."""
    up_hi_bps: float
    """Highest uplink rate considered."""
    down_ratio: float = 1.0
    """Downlink rate as a multiple of the uplink rate."""
    rtt_ms: float = 0.0
    """Round-trip time, fixed across the range."""
    loss: float = 0.0
    """Loss fraction, fixed across the range."""

    def __post_init__(self) -> None:
        _positive("up_lo_bps", self.up_lo_bps, "the lowest uplink rate in bits/s")
        _positive("up_hi_bps", self.up_hi_bps, "the highest uplink rate in bits/s")
        _positive("down_ratio", self.down_ratio, "downlink rate / uplink rate")
        if self.up_hi_bps < self.up_lo_bps:
            raise PlannerError(
                f"up_hi_bps ({self.up_hi_bps!r}) is below up_lo_bps ({self.up_lo_bps!r}); swap them",
                field="up_hi_bps",
            )
        self.at(self.up_lo_bps)  # validates rtt and loss

    def at(self, up_bps: float) -> Link:
        return Link(up_bps, up_bps * self.down_ratio, self.rtt_ms, self.loss)

    def to_dict(self) -> dict[str, Any]:
        return {"up_lo_bps": self.up_lo_bps, "up_hi_bps": self.up_hi_bps, "down_ratio": self.down_ratio,
                "rtt_ms": self.rtt_ms, "loss": self.loss}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LinkRange:
        return cls(d["up_lo_bps"], d["up_hi_bps"], d.get("down_ratio", 1.0), d.get("rtt_ms", 0.0),
                   d.get("loss", 0.0))


@dataclass(frozen=True)
class Encoding(_Json):
    """How boundary tensors travel. Only floating-point tensors are cast.

    Wire bytes of a float32 tensor of b bytes: b * {fp32: 1, fp16: 0.5, int8: 0.25},
    plus for int8 8 bytes (fp32 scale, int32 zero point) per tensor, or per channel
    (dimension 1) when ``per_channel``; then times the sender's compression ratio.
    Codec time is in the tiers' `CodecModel`.

    With a lossy ``codec`` the float32 tensors go through it instead of a cast: b *
    ``ratio`` bytes, and ``codec_ms_per_mb`` per MB of b on the sender. Both are
    measured (the accuracy table's entry for the cut, ``planner.budget.lossy_encoding``),
    because a codec's size depends on the content: a lossy encoding without them
    cannot be priced. See [Note: accuracy budget] in planner.budget for where lossy
    codecs are placed.
    """

    precision: str = "fp32"
    """fp32, fp16 or int8."""
    compression: str = "none"
    """none, zstd or lz4 (lossless, after the cast)."""
    per_channel: bool = False
    """int8 only: one scale and zero point per channel instead of per tensor."""
    codec: str = "none"
    """'none', or a lossy codec of LOSSY_CODECS (precision fp32, no compression)."""
    level: int = 0
    """The codec's quality (1..100) or bit depth ('bits', 2..8); 0 without a codec."""
    ratio: float | None = None
    """Lossy codec: measured wire bytes per byte of float32 it encodes."""
    codec_ms_per_mb: float | None = None
    """Lossy codec: measured encode + decode ms per MB (1e6 bytes) of float32 it encodes."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise PlannerError(
                f"precision is {self.precision!r}; use one of {list(PRECISIONS)}", field="precision"
            )
        if self.compression not in COMPRESSIONS:
            raise PlannerError(
                f"compression is {self.compression!r}; use one of {list(COMPRESSIONS)}",
                field="compression",
            )
        if self.per_channel and self.precision != "int8":
            raise PlannerError(
                f"per_channel applies to int8 only, not {self.precision!r}; drop per_channel "
                f"or use precision 'int8'",
                field="per_channel",
            )
        if self.codec == "none":
            if self.level or self.ratio is not None or self.codec_ms_per_mb is not None:
                raise PlannerError("level, ratio and codec_ms_per_mb apply to a lossy codec only; "
                                   f"set codec to one of {list(LOSSY_CODECS)} or drop them", field="codec")
            return
        if self.codec not in LOSSY_CODECS:
            raise PlannerError(f"codec is {self.codec!r}; use 'none' or one of {list(LOSSY_CODECS)}", field="codec")
        if self.precision != "fp32" or self.compression != "none":
            raise PlannerError(f"the lossy codec {self.codec} replaces the cast and the compression; use precision "
                               f"'fp32' and compression 'none' with it, not {self.precision!r}/{self.compression!r}",
                               field="codec")
        lo, hi = codec_levels(self.codec)
        if isinstance(self.level, bool) or not isinstance(self.level, int) or not lo <= self.level <= hi:
            what = "bit depth" if self.codec == "bits" else "quality"
            raise PlannerError(f"{self.codec} {what} (level) is {self.level!r}; use {lo}..{hi}", field="level")
        if self.ratio is not None:
            _positive("ratio", self.ratio, "the measured wire bytes per float32 byte, e.g. 0.05")
        if self.codec_ms_per_mb is not None and not (
                isinstance(self.codec_ms_per_mb, (int, float)) and math.isfinite(self.codec_ms_per_mb)
                and self.codec_ms_per_mb >= 0):
            raise PlannerError(f"codec_ms_per_mb is {self.codec_ms_per_mb!r}; it must be a finite number >= 0",
                               field="codec_ms_per_mb")

    @property
    def lossy_codec(self) -> bool:
        return self.codec != "none"

    @property
    def lossless(self) -> bool:
        """fp32 with or without compression: the tail gets exactly what the head computed."""
        return self.precision == "fp32" and self.codec == "none"

    @property
    def scale(self) -> float:
        return {"fp32": 1.0, "fp16": 0.5, "int8": 0.25}[self.precision]

    @property
    def key(self) -> str:
        if self.codec != "none":
            return f"{self.codec}@{self.level}"
        parts = [self.precision]
        if self.per_channel:
            parts.append("pc")
        if self.compression != "none":
            parts.append(self.compression)
        return "+".join(parts)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"precision": self.precision, "compression": self.compression,
                             "per_channel": self.per_channel}
        if self.codec != "none":
            d |= {"codec": self.codec, "level": self.level, "ratio": self.ratio,
                  "codec_ms_per_mb": self.codec_ms_per_mb}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Encoding:
        return cls(d.get("precision", "fp32"), d.get("compression", "none"), bool(d.get("per_channel", False)),
                   d.get("codec", "none"), d.get("level", 0), d.get("ratio"), d.get("codec_ms_per_mb"))


class Objective(str, enum.Enum):
    """What the solver minimises."""

    LATENCY = "latency"
    """End-to-end ms of one request (batch 1)."""
    THROUGHPUT = "throughput"
    """The pipelined period: the slowest stage's ms per sample (cloud batching allowed)."""
    ENERGY = "energy"
    """Device joules per request."""

    @classmethod
    def parse(cls, value: str | Objective) -> Objective:
        try:
            return cls(value)
        except ValueError:
            raise PlannerError(
                f"objective is {value!r}; use one of {[o.value for o in cls]}", field="objective"
            ) from None


@dataclass(frozen=True)
class Constraints(_Json):
    """What every plan must satisfy."""

    device_memory_bytes: int | None = None
    """Memory the head may use on the device (weights + peak activations); None: the
    device profile's memory_bytes, or unlimited."""
    pinned_device_layers: frozenset[int] = frozenset()
    """Layers that must run on the device (with everything they depend on)."""
    raw_input_stays_on_device: bool = False
    """Privacy: no model input may cross the first link (its readers run on the device)."""
    first_k_local: int = 0
    """The first k layers (topological order) run on the device."""
    latency_slo_ms: float | None = None
    """Upper bound on end-to-end ms, for the throughput and energy objectives."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "pinned_device_layers", frozenset(int(x) for x in self.pinned_device_layers))
        if self.device_memory_bytes is not None and self.device_memory_bytes < 0:
            raise PlannerError(
                f"device_memory_bytes is {self.device_memory_bytes!r}; it must be >= 0 or None",
                field="device_memory_bytes",
            )
        if self.first_k_local < 0:
            raise PlannerError(f"first_k_local is {self.first_k_local!r}; it must be >= 0", field="first_k_local")
        if self.latency_slo_ms is not None:
            _positive("latency_slo_ms", self.latency_slo_ms, "or None for no SLO")

    def to_dict(self) -> dict[str, Any]:
        return {
            "device_memory_bytes": self.device_memory_bytes,
            "pinned_device_layers": sorted(self.pinned_device_layers),
            "raw_input_stays_on_device": self.raw_input_stays_on_device,
            "first_k_local": self.first_k_local,
            "latency_slo_ms": self.latency_slo_ms,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Constraints:
        return cls(
            d.get("device_memory_bytes"),
            frozenset(d.get("pinned_device_layers", ())),
            bool(d.get("raw_input_stays_on_device", False)),
            int(d.get("first_k_local", 0)),
            d.get("latency_slo_ms"),
        )


@dataclass(frozen=True)
class Breakdown(_Json):
    """Predicted cost of one plan. All times are ms per request (batch 1 unless
    ``batch`` > 1, where ``cloud_ms`` is the batch's run and ``queue_ms`` the wait for it).

    total_ms = edge_ms + encode_ms + uplink_ms + rtt_ms + queue_ms + cloud_ms + downlink_ms.
    """

    edge_ms: float
    """Device compute (its segment, see [Note: segment time] in planner.profile)."""
    encode_ms: float
    """Boundary codec time, all tiers (encode on the sender, decode on the receiver)."""
    uplink_ms: float
    """Boundary transfer towards the cloud, all hops."""
    rtt_ms: float
    """Round trips, one per hop that a request crosses."""
    queue_ms: float
    """Waiting for a cloud batch to fill (0 at batch 1)."""
    cloud_ms: float
    """Compute beyond the device: edge server and cloud tiers."""
    downlink_ms: float
    """Outputs computed beyond the device coming back, all hops."""
    total_ms: float
    """End-to-end latency of one request."""
    energy_j: float
    """Device energy per request: compute_w * (edge + device codec) + radio_tx_w * first
    uplink + idle_w * the rest of total_ms, over 1000."""
    bottleneck: str
    """The slowest pipelined stage: 'edge', 'server', 'cloud', 'uplink', 'downlink',
    'uplink2', 'downlink2' (second hop)."""
    period_ms: float = 0.0
    """The slowest stage's ms per sample: 1000 / period_ms is the throughput."""
    batch: int = 1
    """Cloud batch size the figures assume."""
    tier_ms: tuple[float, ...] = ()
    """Compute per tier (device first), batch-1 segment ms."""
    tier_codec_ms: tuple[float, ...] = ()
    """Codec ms per tier."""
    hop_up_ms: tuple[float, ...] = ()
    """Uplink transfer ms per hop."""
    hop_down_ms: tuple[float, ...] = ()
    """Downlink transfer ms per hop."""

    @property
    def transfer_ms(self) -> float:
        return self.encode_ms + self.uplink_ms + self.rtt_ms + self.downlink_ms

    @property
    def throughput_rps(self) -> float:
        return math.inf if self.period_ms <= 0 else 1000.0 / self.period_ms

    def to_dict(self) -> dict[str, Any]:
        return {
            "edge_ms": self.edge_ms, "encode_ms": self.encode_ms, "uplink_ms": self.uplink_ms,
            "rtt_ms": self.rtt_ms, "queue_ms": self.queue_ms, "cloud_ms": self.cloud_ms,
            "downlink_ms": self.downlink_ms, "total_ms": self.total_ms, "energy_j": self.energy_j,
            "bottleneck": self.bottleneck, "period_ms": self.period_ms, "batch": self.batch,
            "tier_ms": list(self.tier_ms), "tier_codec_ms": list(self.tier_codec_ms),
            "hop_up_ms": list(self.hop_up_ms), "hop_down_ms": list(self.hop_down_ms),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Breakdown:
        return cls(
            edge_ms=d["edge_ms"], encode_ms=d["encode_ms"], uplink_ms=d["uplink_ms"], rtt_ms=d["rtt_ms"],
            queue_ms=d["queue_ms"], cloud_ms=d["cloud_ms"], downlink_ms=d["downlink_ms"],
            total_ms=d["total_ms"], energy_j=d["energy_j"], bottleneck=d["bottleneck"],
            period_ms=d.get("period_ms", 0.0), batch=int(d.get("batch", 1)),
            tier_ms=tuple(d.get("tier_ms", ())), tier_codec_ms=tuple(d.get("tier_codec_ms", ())),
            hop_up_ms=tuple(d.get("hop_up_ms", ())), hop_down_ms=tuple(d.get("hop_down_ms", ())),
        )


@dataclass(frozen=True)
class Plan(_Json):
    """Where each layer runs, how the boundary travels, and what that costs."""

    model: str
    """The model's name."""
    cuts: tuple[Cut, ...]
    """Nested device sets: one cut for two tiers, k-1 for k tiers (device first)."""
    encoding: Encoding
    """How boundary tensors travel."""
    objective: Objective
    """What the plan was chosen for."""
    link: Link
    """The device's link (the first hop)."""
    breakdown: Breakdown
    """Predicted cost."""
    boundary: tuple[str, ...] = ()
    """Tensors crossing the first cut, in graph order."""
    next_links: tuple[Link, ...] = ()
    """Links of the later hops (edge server -> cloud), for multi-tier plans."""
    agreement: float | None = None
    """Predicted agreement of the outputs with the fp32 model (the accuracy table's
    measurement for this cut and encoding; 1 for fp32 and for edge-only plans); None
    when the plan was made without an accuracy budget."""

    @property
    def cut(self) -> Cut:
        return self.cuts[0]

    @property
    def edge_layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.cuts[0].device))

    @property
    def links(self) -> tuple[Link, ...]:
        return (self.link,) + self.next_links

    @property
    def key(self) -> str:
        """Stable id of the placement and encoding (cut ids joined, then the encoding)."""
        return "/".join(c.key for c in self.cuts) + ":" + self.encoding.key

    def to_dict(self) -> dict[str, Any]:
        b = self.breakdown
        return {
            "schema": "splitinfer.plan/1",
            "model": self.model,
            "edge_layers": list(self.edge_layers),
            "cuts": [sorted(c.device) for c in self.cuts],
            "boundary": list(self.boundary),
            "encoding": self.encoding.to_dict(),
            "objective": self.objective.value,
            "link": self.link.to_dict(),
            "next_links": [lk.to_dict() for lk in self.next_links],
            "predicted": {
                "edge_ms": b.edge_ms, "transfer_ms": b.transfer_ms, "queue_ms": b.queue_ms,
                "cloud_ms": b.cloud_ms, "total_ms": b.total_ms, "energy_j": b.energy_j,
                # strict JSON has no Infinity: a plan whose stages all take 0 ms says null
                "throughput_rps": b.throughput_rps if math.isfinite(b.throughput_rps) else None,
                "bottleneck": b.bottleneck,
            },
            "breakdown": b.to_dict(),
        } | ({} if self.agreement is None else {"agreement": self.agreement})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        return cls(
            model=d["model"],
            cuts=tuple(Cut(frozenset(int(x) for x in c)) for c in d["cuts"]),
            encoding=Encoding.from_dict(d["encoding"]),
            objective=Objective.parse(d["objective"]),
            link=Link.from_dict(d["link"]),
            breakdown=Breakdown.from_dict(d["breakdown"]),
            boundary=tuple(d.get("boundary", ())),
            next_links=tuple(Link.from_dict(x) for x in d.get("next_links", ())),
            agreement=d.get("agreement"),
        )
