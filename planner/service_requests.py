"""The what-if service's requests: typed, validated, frozen.

Each request's `from_dict` reads the JSON body and raises `RequestError` naming the
field and the fix; `to_dict` writes the canonical form (plain numbers in bits/s, ms
and bytes), which `from_dict` reads back to an equal value.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from planner.errors import PlannerError
from planner.service_units import DURATION, MAX_GFLOPS, MIN_GFLOPS, POSITIVE_DURATION, RATE, SIZE, Quantity
from planner.types import PRECISIONS, COMPRESSIONS, Constraints, Encoding, Objective

__all__ = [
    "RequestError", "UnitParsers", "Scenario", "PlanRequest", "SweepRequest", "FrontierRequest",
    "ENCODING_CHOICES", "FRONTIER_OBJECTIVES", "MAX_SWEEP_POINTS", "ROOFLINE_KEYS",
]

ENCODING_CHOICES = PRECISIONS + ("auto",)
"""What a request's ``encoding`` may be; 'auto' lets the solver pick the precision."""
MAX_SWEEP_POINTS = 2000
"""Most points one sweep may ask for."""
FRONTIER_OBJECTIVES = (Objective.LATENCY.value, Objective.ENERGY.value)
"""Objectives a frontier covers: those affine in 1/bandwidth."""
ROOFLINE_KEYS = ("gflops", "fixed_ms", "compute_w", "radio_tx_w", "idle_w")
"""Keys of a roofline device spec; ``gflops`` is required."""


class RequestError(PlannerError):
    """A request the service cannot read or serve as asked.

    ``status`` is the HTTP status it maps to: 400 when the request breaks the OpenAPI
    document (not JSON, a missing or unknown field, a wrong type, a value out of the
    stated range or pattern), 405 and 413 for the method and the size, and 422 when it
    keeps the document but cannot be served as asked: a rule that spans fields or
    needs the model (uplink_hi below uplink_lo, a profile that does not fit the model).
    A schema cannot state those, so a client that follows the document meets only
    them. ``allow`` lists the methods the path takes, for a 405's ``Allow`` header.
    """

    def __init__(self, message: str, *, field: str, status: int = 400, allow: tuple[str, ...] = ()) -> None:
        super().__init__(message, field=field)
        self.status = status
        self.allow = allow


def _no_units(kind: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        raise ValueError(f"this service reads {kind} as plain numbers only; send a number")
    return parse


@dataclass(frozen=True)
class UnitParsers:
    """String parsers for rates, durations and sizes; see [Note: service units] in
    planner.service. Each raises ValueError with the accepted forms."""

    rate_bps: Callable[[str], float] = _no_units("rates (bits/s)")
    """'18.88mbit' -> 18.88e6."""
    duration_ms: Callable[[str], float] = _no_units("durations (ms)")
    """'20ms' -> 20.0."""
    size_bytes: Callable[[str], float] = _no_units("sizes (bytes)")
    """'64MiB' -> 67108864."""


class _Reader:
    """Reads fields of one JSON object, naming each bad one."""

    def __init__(self, d: Any, allowed: tuple[str, ...], units: UnitParsers) -> None:
        if not isinstance(d, Mapping):
            raise RequestError(
                f"the request body is a JSON {_kind(d)}; send a JSON object (see GET /openapi.json)",
                field="(body)", status=400,
            )
        unknown = sorted(str(k) for k in d if k not in allowed)
        if unknown:
            raise RequestError(
                f"unknown field {unknown[0]!r}; allowed fields are {', '.join(allowed)} (check the spelling)",
                field=unknown[0],
            )
        self.d, self.units = d, units

    def has(self, key: str) -> bool:
        return self.d.get(key) is not None

    def required(self, key: str, what: str) -> Any:
        if not self.has(key):
            raise RequestError(f"field {key!r} is missing; give {what}", field=key)
        return self.d[key]

    def string(self, key: str, default: str | None = None, choices: tuple[str, ...] = ()) -> str:
        v = self.d.get(key, default) if self.has(key) else default
        if v is None:
            raise RequestError(f"field {key!r} is missing; give a string", field=key)
        if not isinstance(v, str) or not v:
            raise RequestError(f"field {key!r} is {v!r}; it must be a non-empty string", field=key)
        if choices and v not in choices:
            raise RequestError(f"field {key!r} is {v!r}; use one of {', '.join(choices)}", field=key)
        return v

    def boolean(self, key: str) -> bool:
        v = self.d.get(key, False)
        if v is None:
            return False
        if not isinstance(v, bool):
            raise RequestError(f"field {key!r} is {v!r}; it must be true or false", field=key)
        return v

    def integer(self, key: str, default: int, lo: int, hi: int) -> int:
        v = self.d.get(key, default) if self.has(key) else default
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise RequestError(f"field {key!r} is {v!r}; it must be an integer in [{lo}, {hi}]", field=key)
        return v

    def quantity(self, key: str, parse: Callable[[str], float], unit: str, example: str,
                 lo: float, hi: float = math.inf, *, lo_open: bool = False, kind: Quantity | None = None) -> float:
        """A number in ``unit`` within [lo, hi], or a string of ``kind`` (see
        [Note: quantity strings] in planner.service_units) read by ``parse``."""
        v = self.d[key]
        if isinstance(v, str):
            try:
                x = float(parse(v))
            except ValueError as e:  # the parser's own words first: they name what is wrong
                raise RequestError(f"field {key!r}: {e}", field=key) from None
            if kind is not None and not re.search(kind.pattern, v):
                raise RequestError(f"field {key!r} is {v!r}; give {kind.forms}", field=key)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            x = float(v)
        else:
            raise RequestError(
                f"field {key!r} is {v!r}; give a number in {unit} or a string such as {example!r}", field=key)
        bad = not math.isfinite(x) or x < lo or x > hi or (lo_open and x <= lo)
        if bad:
            rel = ">" if lo_open else ">="
            top = f" and <= {hi:g}" if math.isfinite(hi) else ""
            raise RequestError(f"field {key!r} is {v!r} ({x:g} {unit}); it must be {rel} {lo:g}{top} {unit}",
                               field=key)
        return x

    def of(self, key: str, kind: Quantity, parse: Callable[[str], float]) -> float:
        return self.quantity(key, parse, kind.unit, kind.example, kind.lo, kind.hi, lo_open=kind.lo_open, kind=kind)

    def rate(self, key: str) -> float:
        return self.of(key, RATE, self.units.rate_bps)

    def duration(self, key: str, *, positive: bool = False) -> float:
        return self.of(key, POSITIVE_DURATION if positive else DURATION, self.units.duration_ms)


def _kind(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(v), "number")


def _device_spec(r: _Reader, key: str) -> str | Mapping[str, Any]:
    v = r.required(key, "a stored profile or reference device name, a profile object, or "
                        '{"gflops": <device speed>} (a FLOPs roofline)')
    if isinstance(v, str):
        if not v:
            raise RequestError(f"field {key!r} is empty; name a profile", field=key)
        return v
    if not isinstance(v, Mapping):
        raise RequestError(
            f"field {key!r} is a JSON {_kind(v)}; give a profile name, a profile object or "
            f'{{"gflops": ...}}', field=key)
    if "schema" in v:
        return dict(v)
    if v.get("gflops") is None:
        raise RequestError(
            f"field {key}.gflops is missing; a roofline device needs its speed in GFLOP/s, "
            f'e.g. {{"gflops": 5}} (or give a profile object with "schema": "splitinfer.profile/1")',
            field=f"{key}.gflops")
    try:
        sub = _Reader(v, ROOFLINE_KEYS, r.units)
        spec = {"gflops": sub.quantity("gflops", _no_units("gflops"), "GFLOP/s", "5", MIN_GFLOPS, MAX_GFLOPS)}
        for k in ROOFLINE_KEYS[1:]:
            if sub.has(k):
                spec[k] = sub.quantity(k, _no_units(k), "ms" if k == "fixed_ms" else "W", "1", 0.0, 1e9)
    except RequestError as e:
        raise RequestError(f"{key}: {e.message}", field=f"{key}.{e.field}") from None
    return spec


_SCENARIO_FIELDS = (
    "model", "edge", "cloud", "rtt", "loss", "objective", "encoding", "compression",
    "device_memory", "slo", "keep_input_local", "first_k_local", "pinned_device_layers",
)


@dataclass(frozen=True)
class Scenario:
    """What every what-if shares: the model, the two tiers, the link's fixed part, the
    objective, the encodings and the constraints."""

    model: str
    """A zoo short name or a registry model (GET /v1/models)."""
    edge: str | Mapping[str, Any]
    """The device tier; see [Note: device specs] in planner.service."""
    cloud: str | Mapping[str, Any]
    """The cloud tier, same forms as ``edge``."""
    rtt_ms: float = 0.0
    """Round-trip time of the link."""
    loss: float = 0.0
    """Packet loss fraction in [0, 1)."""
    objective: Objective = Objective.LATENCY
    """What to minimise."""
    encoding: str = "fp32"
    """Boundary precision, or 'auto' to try all of fp32, fp16, int8."""
    compression: str = "none"
    """Lossless compression after the cast: none, zstd or lz4."""
    constraints: Constraints = Constraints()
    """Memory, SLO, privacy and pinning constraints."""

    @property
    def encodings(self) -> tuple[Encoding, ...]:
        precisions = PRECISIONS if self.encoding == "auto" else (self.encoding,)
        return tuple(Encoding(p, self.compression) for p in precisions)

    @classmethod
    def read(cls, r: _Reader) -> Scenario:
        loss = 0.0
        if r.has("loss"):
            loss = r.quantity("loss", _no_units("loss"), "(fraction)", "0.01", 0.0, 0.999)
        c = Constraints(
            device_memory_bytes=int(r.of("device_memory", SIZE, r.units.size_bytes))
            if r.has("device_memory") else None,
            pinned_device_layers=frozenset(_layer_list(r)),
            raw_input_stays_on_device=r.boolean("keep_input_local"),
            first_k_local=r.integer("first_k_local", 0, 0, 1_000_000),
            latency_slo_ms=r.duration("slo", positive=True) if r.has("slo") else None,
        )
        return cls(
            model=r.string("model"),
            edge=_device_spec(r, "edge"),
            cloud=_device_spec(r, "cloud"),
            rtt_ms=r.duration("rtt") if r.has("rtt") else 0.0,
            loss=loss,
            objective=Objective(r.string("objective", "latency", tuple(o.value for o in Objective))),
            encoding=r.string("encoding", "fp32", ENCODING_CHOICES),
            compression=r.string("compression", "none", COMPRESSIONS),
            constraints=c,
        )

    def to_dict(self) -> dict[str, Any]:
        c = self.constraints
        d: dict[str, Any] = {
            "model": self.model, "edge": self.edge, "cloud": self.cloud, "rtt": self.rtt_ms,
            "loss": self.loss, "objective": self.objective.value, "encoding": self.encoding,
            "compression": self.compression, "keep_input_local": c.raw_input_stays_on_device,
            "first_k_local": c.first_k_local, "pinned_device_layers": sorted(c.pinned_device_layers),
        }
        if c.device_memory_bytes is not None:
            d["device_memory"] = c.device_memory_bytes
        if c.latency_slo_ms is not None:
            d["slo"] = c.latency_slo_ms
        return d


def _layer_list(r: _Reader) -> list[int]:
    v = r.d.get("pinned_device_layers") or []
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in v):
        raise RequestError(
            f"field 'pinned_device_layers' is {v!r}; give a list of layer ids (integers >= 0)",
            field="pinned_device_layers")
    return v


@dataclass(frozen=True)
class PlanRequest:
    """POST /v1/plan: the best plan on one link."""

    scenario: Scenario
    """Model, tiers, objective, constraints."""
    up_bps: float
    """Uplink rate."""
    down_bps: float
    """Downlink rate (defaults to the uplink rate)."""

    FIELDS = _SCENARIO_FIELDS + ("uplink", "downlink")

    @classmethod
    def from_dict(cls, d: Any, units: UnitParsers = UnitParsers()) -> PlanRequest:
        r = _Reader(d, cls.FIELDS, units)
        r.required("uplink", "the uplink rate, e.g. '18.88mbit' or 18880000 (bits/s)")
        sc = Scenario.read(r)
        up = r.rate("uplink")
        return cls(sc, up, r.rate("downlink") if r.has("downlink") else up)

    def to_dict(self) -> dict[str, Any]:
        return {**self.scenario.to_dict(), "uplink": self.up_bps, "downlink": self.down_bps}


def _range(r: _Reader) -> tuple[float, float]:
    r.required("uplink_lo", "the lowest uplink rate, e.g. '0.1mbit'")
    r.required("uplink_hi", "the highest uplink rate, e.g. '1gbit'")
    lo, hi = r.rate("uplink_lo"), r.rate("uplink_hi")
    if hi < lo:
        raise RequestError(f"uplink_hi ({hi:g} bits/s) is below uplink_lo ({lo:g} bits/s); swap them",
                           field="uplink_hi", status=422)
    return lo, hi


def _ratio(r: _Reader) -> float:
    if not r.has("down_ratio"):
        return 1.0
    return r.quantity("down_ratio", _no_units("down_ratio"), "(downlink/uplink)", "1", 1e-6, 1e6)


@dataclass(frozen=True)
class SweepRequest:
    """POST /v1/sweep: the objective against the uplink rate (log-spaced), for
    edge-only, cloud-only, the chain scan and the DAG optimum."""

    scenario: Scenario
    """Model, tiers, objective, constraints."""
    up_lo_bps: float
    """Lowest uplink rate."""
    up_hi_bps: float
    """Highest uplink rate."""
    points: int = 200
    """How many log-spaced rates."""
    down_ratio: float = 1.0
    """Downlink as a multiple of the uplink (ignored when ``down_bps`` is set)."""
    down_bps: float | None = None
    """A fixed downlink rate; None: down_ratio * uplink."""

    FIELDS = _SCENARIO_FIELDS + ("uplink_lo", "uplink_hi", "points", "down_ratio", "downlink")

    @classmethod
    def from_dict(cls, d: Any, units: UnitParsers = UnitParsers()) -> SweepRequest:
        r = _Reader(d, cls.FIELDS, units)
        lo, hi = _range(r)
        sc = Scenario.read(r)
        return cls(sc, lo, hi, r.integer("points", 200, 2, MAX_SWEEP_POINTS), _ratio(r),
                   r.rate("downlink") if r.has("downlink") else None)

    def to_dict(self) -> dict[str, Any]:
        d = {**self.scenario.to_dict(), "uplink_lo": self.up_lo_bps, "uplink_hi": self.up_hi_bps,
             "points": self.points, "down_ratio": self.down_ratio}
        if self.down_bps is not None:
            d["downlink"] = self.down_bps
        return d


@dataclass(frozen=True)
class FrontierRequest:
    """POST /v1/frontier: the plans optimal somewhere in an uplink range."""

    scenario: Scenario
    """Model, tiers, objective (latency or energy), constraints."""
    up_lo_bps: float
    """Lowest uplink rate."""
    up_hi_bps: float
    """Highest uplink rate."""
    down_ratio: float = 1.0
    """Downlink as a multiple of the uplink."""

    FIELDS = _SCENARIO_FIELDS + ("uplink_lo", "uplink_hi", "down_ratio")

    @classmethod
    def from_dict(cls, d: Any, units: UnitParsers = UnitParsers()) -> FrontierRequest:
        r = _Reader(d, cls.FIELDS, units)
        lo, hi = _range(r)
        sc = Scenario.read(r)
        if sc.objective.value not in FRONTIER_OBJECTIVES:
            raise RequestError(
                "the frontier covers the latency and energy objectives (they are affine in "
                "1/bandwidth); use POST /v1/sweep for throughput", field="objective")
        return cls(sc, lo, hi, _ratio(r))

    def to_dict(self) -> dict[str, Any]:
        return {**self.scenario.to_dict(), "uplink_lo": self.up_lo_bps, "uplink_hi": self.up_hi_bps,
                "down_ratio": self.down_ratio}
