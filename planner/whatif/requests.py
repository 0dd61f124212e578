"""What-if requests: typed, frozen, checked against `planner.whatif.limits`.

A request's JSON form (`to_dict`/`to_json`) is the canonical body of the HTTP API's
POST (docs/planner-api.md): plain numbers in bits/s, ms and bytes. `from_dict` reads
it back to an equal value, and refuses anything else with `InvalidRequestError` naming
the field and the fix. It reads a quantity given as text ('18.88mbit') only through
the ``quantity_text`` hook an edge passes in: the planner parses no unit strings.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Union

from planner.errors import PlannerError, ProfileError
from planner.profile import Profile
from planner.types import COMPRESSIONS, PRECISIONS, Constraints, Encoding, Objective
from planner.whatif.limits import (
    AGREEMENT, DOWN_RATIO, DURATION, ENCODING_CHOICES, FIXED_MS, FRONTIER_OBJECTIVES, GFLOPS, LOSS,
    MAX_FIRST_K_LOCAL,
    MAX_SWEEP_POINTS, POSITIVE_DURATION, POWER, RATE, ROOFLINE_KEYS, SIZE, Limit,
)

__all__ = [
    "InvalidRequestError", "QuantityText", "Roofline", "DeviceSpec", "Scenario", "PlanRequest", "SweepRequest",
    "FrontierRequest", "SCENARIO_FIELDS",
]

QuantityText = Callable[[str, str, Limit], float]
"""(field, text, limit) -> the value in the limit's unit; raises `InvalidRequestError`."""


class InvalidRequestError(PlannerError):
    """A request that breaks its stated form: a missing or unknown field, a wrong type, a
    value outside its limit. (A request of the right form that cannot be served as asked,
    such as uplink_hi below uplink_lo or a profile that does not fit the model, raises
    plain `PlannerError`.)"""

    http_status = 400
    """What the planner API answers it with."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message, field=field)


def _check(key: str, x: float, limit: Limit) -> None:
    if not limit.holds(x):
        raise InvalidRequestError(f"field {key!r} is {x!r} {limit.unit}; it must be {limit.words()}", field=key)


@dataclass(frozen=True)
class Roofline:
    """A device whose per-layer time is the layer's FLOPs / gflops (a roofline without the
    memory roof): an estimate, not a measurement."""

    gflops: float
    """Compute speed in GFLOP/s."""
    fixed_ms: float = 0.0
    """Fixed ms per non-empty segment."""
    compute_w: float = 0.0
    """Power while computing, in W."""
    radio_tx_w: float = 0.0
    """Power while sending, in W."""
    idle_w: float = 0.0
    """Power while waiting, in W."""

    def __post_init__(self) -> None:
        for key in ROOFLINE_KEYS:
            _check(key, getattr(self, key), GFLOPS if key == "gflops" else FIXED_MS if key == "fixed_ms" else POWER)

    @property
    def device(self) -> str:
        """The device name its profile carries."""
        return f"roofline-{self.gflops:g}gflops"

    def to_dict(self) -> dict[str, float]:
        """``gflops`` and the figures that are not 0."""
        return {k: getattr(self, k) for k in ROOFLINE_KEYS if k == "gflops" or getattr(self, k) != 0.0}


DeviceSpec = Union[str, Profile, Roofline]
"""A tier: a stored profile or reference device name, a profile, or a roofline."""


def _device_to_json(d: DeviceSpec) -> Any:
    return d if isinstance(d, str) else d.to_dict()


class _Reader:
    """Reads the fields of one JSON object, naming each bad one."""

    def __init__(self, d: Any, allowed: tuple[str, ...], text: QuantityText | None) -> None:
        if not isinstance(d, Mapping):
            raise InvalidRequestError(
                f"the request body is a JSON {_kind(d)}; send a JSON object (see GET /openapi.json)", field="(body)")
        unknown = sorted(str(k) for k in d if k not in allowed)
        if unknown:
            raise InvalidRequestError(
                f"unknown field {unknown[0]!r}; allowed fields are {', '.join(allowed)} (check the spelling)",
                field=unknown[0])
        self.d, self.text = d, text

    def has(self, key: str) -> bool:
        return self.d.get(key) is not None

    def required(self, key: str, what: str) -> Any:
        if not self.has(key):
            raise InvalidRequestError(f"field {key!r} is missing; give {what}", field=key)
        return self.d[key]

    def string(self, key: str, default: str | None = None, choices: tuple[str, ...] = ()) -> str:
        v = self.d[key] if self.has(key) else default
        if v is None:
            raise InvalidRequestError(f"field {key!r} is missing; give a string", field=key)
        if not isinstance(v, str) or not v:
            raise InvalidRequestError(f"field {key!r} is {v!r}; it must be a non-empty string", field=key)
        if choices and v not in choices:
            raise InvalidRequestError(f"field {key!r} is {v!r}; use one of {', '.join(choices)}", field=key)
        return v

    def boolean(self, key: str) -> bool:
        v = self.d.get(key, False)
        if v is None:
            return False
        if not isinstance(v, bool):
            raise InvalidRequestError(f"field {key!r} is {v!r}; it must be true or false", field=key)
        return v

    def integer(self, key: str, default: int, lo: int, hi: int) -> int:
        v = self.d[key] if self.has(key) else default
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise InvalidRequestError(f"field {key!r} is {v!r}; it must be an integer in [{lo}, {hi}]", field=key)
        return v

    def number(self, key: str, limit: Limit, example: str = "") -> float:
        """A number in the limit's unit and range; text only through the ``quantity_text`` hook."""
        v = self.d[key]
        if isinstance(v, str):
            if self.text is None or not example:
                raise InvalidRequestError(
                    f"field {key!r} is {v!r}; give a number {_in_unit(limit)}" +
                    (" (this reader takes plain numbers only)" if example else ""), field=key)
            x = float(self.text(key, v, limit))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            x = float(v)
        else:
            raise InvalidRequestError(
                f"field {key!r} is {v!r}; give a number {_in_unit(limit)}" +
                (f" or a string such as {example!r}" if example else ""), field=key)
        if not math.isfinite(x) or not limit.holds(x):
            raise InvalidRequestError(f"field {key!r} is {v!r} ({x:g} {limit.unit}); it must be {limit.words()}",
                                      field=key)
        return x

    def maybe(self, key: str, limit: Limit, example: str = "") -> float | None:
        return self.number(key, limit, example) if self.has(key) else None


def _in_unit(limit: Limit) -> str:
    return limit.unit if limit.unit.startswith("(") else f"in {limit.unit}"


def _kind(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(v), "number")


def _device(r: _Reader, key: str) -> DeviceSpec:
    v = r.required(key, "a stored profile or reference device name, a profile object, or "
                        '{"gflops": <device speed>} (a FLOPs roofline)')
    if isinstance(v, str):
        if not v:
            raise InvalidRequestError(f"field {key!r} is empty; name a profile", field=key)
        return v
    if not isinstance(v, Mapping):
        raise InvalidRequestError(
            f"field {key!r} is a JSON {_kind(v)}; give a profile name, a profile object or "
            f'{{"gflops": ...}}', field=key)
    if "schema" in v:
        try:
            return Profile.from_dict(v)
        except ProfileError as e:  # the document admits it; the profile's own rules refuse it
            raise PlannerError(f"{key}: {e.message}", field=f"{key}.{e.field}") from e
    if v.get("gflops") is None:
        raise InvalidRequestError(
            f"field {key}.gflops is missing; a roofline device needs its speed in GFLOP/s, "
            f'e.g. {{"gflops": 5}} (or give a profile object with "schema": "splitinfer.profile/1")',
            field=f"{key}.gflops")
    try:
        sub = _Reader(v, ROOFLINE_KEYS, None)
        return Roofline(**{k: sub.number(k, GFLOPS if k == "gflops" else FIXED_MS if k == "fixed_ms" else POWER)
                           for k in ROOFLINE_KEYS if sub.has(k)})
    except InvalidRequestError as e:
        raise InvalidRequestError(f"{key}: {e.message}", field=f"{key}.{e.field}") from None


SCENARIO_FIELDS = (
    "model", "edge", "cloud", "rtt", "loss", "objective", "encoding", "compression",
    "device_memory", "slo", "keep_input_local", "first_k_local", "pinned_device_layers", "min_agreement",
)
"""The JSON keys every what-if request shares."""


@dataclass(frozen=True)
class Scenario:
    """What every what-if shares: the model, the two tiers, the link's fixed part, the
    objective, the encodings and the constraints."""

    model: str
    """A zoo short name, a registry model ('name' or 'name@version') or a name given to
    `Workspace.add_model`."""
    edge: DeviceSpec
    """The device tier."""
    cloud: DeviceSpec
    """The cloud tier."""
    rtt_ms: float = 0.0
    """Round-trip time of the link (JSON ``rtt``)."""
    loss: float = 0.0
    """Packet loss fraction in [0, 0.999]."""
    objective: Objective = Objective.LATENCY
    """What to minimise."""
    encoding: str = "fp32"
    """Boundary precision, or 'auto' to try all of fp32, fp16, int8."""
    compression: str = "none"
    """Lossless compression after the cast: none, zstd or lz4."""
    constraints: Constraints = Constraints()
    """Memory (JSON ``device_memory``), SLO (``slo``), privacy (``keep_input_local``) and
    pinning (``first_k_local``, ``pinned_device_layers``)."""
    min_agreement: float | None = None
    """Accuracy budget: no plan agrees with the fp32 model less than this (measured by
    ``splitinfer calibrate``; see planner.budget). None: no budget."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise InvalidRequestError(f"field 'model' is {self.model!r}; name a model", field="model")
        object.__setattr__(self, "objective", Objective(self.objective))
        _check("rtt", self.rtt_ms, DURATION)
        _check("loss", self.loss, LOSS)
        if self.encoding not in ENCODING_CHOICES:
            raise InvalidRequestError(f"field 'encoding' is {self.encoding!r}; use one of "
                                      f"{', '.join(ENCODING_CHOICES)}", field="encoding")
        if self.compression not in COMPRESSIONS:
            raise InvalidRequestError(f"field 'compression' is {self.compression!r}; use one of "
                                      f"{', '.join(COMPRESSIONS)}", field="compression")
        if self.min_agreement is not None:
            _check("min_agreement", self.min_agreement, AGREEMENT)
        c = self.constraints
        if c.device_memory_bytes is not None:
            _check("device_memory", c.device_memory_bytes, SIZE)
        if c.latency_slo_ms is not None:
            _check("slo", c.latency_slo_ms, POSITIVE_DURATION)
        if not 0 <= c.first_k_local <= MAX_FIRST_K_LOCAL:
            raise InvalidRequestError(f"field 'first_k_local' is {c.first_k_local!r}; it must be an integer in "
                                      f"[0, {MAX_FIRST_K_LOCAL}]", field="first_k_local")

    @property
    def encodings(self) -> tuple[Encoding, ...]:
        """The encodings the solver may choose from."""
        precisions = PRECISIONS if self.encoding == "auto" else (self.encoding,)
        return tuple(Encoding(p, self.compression) for p in precisions)

    @classmethod
    def read(cls, r: _Reader) -> Scenario:
        pinned = r.d.get("pinned_device_layers") or []
        if not isinstance(pinned, list) or any(isinstance(x, bool) or not isinstance(x, int) or x < 0
                                               for x in pinned):
            raise InvalidRequestError(
                f"field 'pinned_device_layers' is {pinned!r}; give a list of layer ids (integers >= 0)",
                field="pinned_device_layers")
        memory = r.maybe("device_memory", SIZE, "64MiB")
        exact = r.d.get("device_memory")  # an integer above 2**53 stays exact
        c = Constraints(
            device_memory_bytes=None if memory is None else exact if type(exact) is int else int(memory),
            pinned_device_layers=frozenset(pinned),
            raw_input_stays_on_device=r.boolean("keep_input_local"),
            first_k_local=r.integer("first_k_local", 0, 0, MAX_FIRST_K_LOCAL),
            latency_slo_ms=r.maybe("slo", POSITIVE_DURATION, "100ms"),
        )
        return cls(
            model=r.string("model"),
            edge=_device(r, "edge"),
            cloud=_device(r, "cloud"),
            rtt_ms=r.maybe("rtt", DURATION, "20ms") or 0.0,
            loss=r.maybe("loss", LOSS) or 0.0,
            objective=Objective(r.string("objective", "latency", tuple(o.value for o in Objective))),
            encoding=r.string("encoding", "fp32", ENCODING_CHOICES),
            compression=r.string("compression", "none", COMPRESSIONS),
            constraints=c,
            min_agreement=r.maybe("min_agreement", AGREEMENT),
        )

    def to_dict(self) -> dict[str, Any]:
        c = self.constraints
        d: dict[str, Any] = {
            "model": self.model, "edge": _device_to_json(self.edge), "cloud": _device_to_json(self.cloud),
            "rtt": self.rtt_ms, "loss": self.loss, "objective": self.objective.value, "encoding": self.encoding,
            "compression": self.compression, "keep_input_local": c.raw_input_stays_on_device,
            "first_k_local": c.first_k_local, "pinned_device_layers": sorted(c.pinned_device_layers),
        }
        if c.device_memory_bytes is not None:
            d["device_memory"] = c.device_memory_bytes
        if c.latency_slo_ms is not None:
            d["slo"] = c.latency_slo_ms
        if self.min_agreement is not None:
            d["min_agreement"] = self.min_agreement
        return d


class _Json:
    FIELDS: tuple[str, ...] = ()

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), allow_nan=False, **kw)  # type: ignore[attr-defined]

    @classmethod
    def from_json(cls, text: str, quantity_text: QuantityText | None = None) -> Any:
        return cls.from_dict(json.loads(text), quantity_text)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class PlanRequest(_Json):
    """The best plan on one link (POST /v1/plan)."""

    scenario: Scenario
    """Model, tiers, objective, constraints."""
    up_bps: float
    """Uplink rate (JSON ``uplink``)."""
    down_bps: float | None = None
    """Downlink rate (JSON ``downlink``); None: the uplink rate (set at construction)."""

    FIELDS = SCENARIO_FIELDS + ("uplink", "downlink")

    def __post_init__(self) -> None:
        if self.down_bps is None:
            object.__setattr__(self, "down_bps", self.up_bps)
        _check("uplink", self.up_bps, RATE)
        _check("downlink", self.down_bps, RATE)  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, d: Any, quantity_text: QuantityText | None = None) -> PlanRequest:
        r = _Reader(d, cls.FIELDS, quantity_text)
        r.required("uplink", "the uplink rate, e.g. '18.88mbit' or 18880000 (bits/s)")
        sc = Scenario.read(r)
        return cls(sc, r.number("uplink", RATE, "18.88mbit"), r.maybe("downlink", RATE, "18.88mbit"))

    def to_dict(self) -> dict[str, Any]:
        return {**self.scenario.to_dict(), "uplink": self.up_bps, "downlink": self.down_bps}


def _range(r: _Reader) -> tuple[float, float]:
    r.required("uplink_lo", "the lowest uplink rate, e.g. '0.1mbit'")
    r.required("uplink_hi", "the highest uplink rate, e.g. '1gbit'")
    return r.number("uplink_lo", RATE, "0.1mbit"), r.number("uplink_hi", RATE, "1gbit")


def _check_range(lo: float, hi: float) -> None:
    _check("uplink_lo", lo, RATE)
    _check("uplink_hi", hi, RATE)
    if hi < lo:
        raise PlannerError(f"uplink_hi ({hi:g} bits/s) is below uplink_lo ({lo:g} bits/s); swap them",
                           field="uplink_hi")


@dataclass(frozen=True)
class SweepRequest(_Json):
    """The objective against the uplink rate (log-spaced), for edge-only, cloud-only, the
    chain scan and the DAG optimum (POST /v1/sweep)."""

    scenario: Scenario
    """Model, tiers, objective, constraints."""
    up_lo_bps: float
    """Lowest uplink rate (JSON ``uplink_lo``)."""
    up_hi_bps: float
    """Highest uplink rate (JSON ``uplink_hi``); at least ``up_lo_bps``."""
    points: int = 200
    """How many log-spaced rates, 2 to `MAX_SWEEP_POINTS`."""
    down_ratio: float = 1.0
    """Downlink as a multiple of the uplink (ignored when ``down_bps`` is set)."""
    down_bps: float | None = None
    """A fixed downlink rate (JSON ``downlink``); None: down_ratio * uplink."""

    FIELDS = SCENARIO_FIELDS + ("uplink_lo", "uplink_hi", "points", "down_ratio", "downlink")

    def __post_init__(self) -> None:
        if isinstance(self.points, bool) or not isinstance(self.points, int) or \
                not 2 <= self.points <= MAX_SWEEP_POINTS:
            raise InvalidRequestError(f"field 'points' is {self.points!r}; it must be an integer in "
                                      f"[2, {MAX_SWEEP_POINTS}]", field="points")
        _check("down_ratio", self.down_ratio, DOWN_RATIO)
        if self.down_bps is not None:
            _check("downlink", self.down_bps, RATE)
        _check_range(self.up_lo_bps, self.up_hi_bps)

    @classmethod
    def from_dict(cls, d: Any, quantity_text: QuantityText | None = None) -> SweepRequest:
        r = _Reader(d, cls.FIELDS, quantity_text)
        lo, hi = _range(r)
        sc = Scenario.read(r)
        return cls(sc, lo, hi, r.integer("points", 200, 2, MAX_SWEEP_POINTS), r.maybe("down_ratio", DOWN_RATIO) or 1.0,
                   r.maybe("downlink", RATE, "18.88mbit"))

    def to_dict(self) -> dict[str, Any]:
        d = {**self.scenario.to_dict(), "uplink_lo": self.up_lo_bps, "uplink_hi": self.up_hi_bps,
             "points": self.points, "down_ratio": self.down_ratio}
        if self.down_bps is not None:
            d["downlink"] = self.down_bps
        return d


@dataclass(frozen=True)
class FrontierRequest(_Json):
    """The plans optimal somewhere in an uplink range (POST /v1/frontier); latency or
    energy objective only (they are affine in 1/bandwidth)."""

    scenario: Scenario
    """Model, tiers, objective (latency or energy), constraints."""
    up_lo_bps: float
    """Lowest uplink rate (JSON ``uplink_lo``)."""
    up_hi_bps: float
    """Highest uplink rate (JSON ``uplink_hi``); at least ``up_lo_bps``."""
    down_ratio: float = 1.0
    """Downlink as a multiple of the uplink."""

    FIELDS = SCENARIO_FIELDS + ("uplink_lo", "uplink_hi", "down_ratio")

    def __post_init__(self) -> None:
        if self.scenario.objective.value not in FRONTIER_OBJECTIVES:
            raise InvalidRequestError(
                "the frontier covers the latency and energy objectives (they are affine in "
                "1/bandwidth); use POST /v1/sweep for throughput", field="objective")
        _check("down_ratio", self.down_ratio, DOWN_RATIO)
        _check_range(self.up_lo_bps, self.up_hi_bps)

    @classmethod
    def from_dict(cls, d: Any, quantity_text: QuantityText | None = None) -> FrontierRequest:
        r = _Reader(d, cls.FIELDS, quantity_text)
        lo, hi = _range(r)
        sc = Scenario.read(r)
        return cls(sc, lo, hi, r.maybe("down_ratio", DOWN_RATIO) or 1.0)

    def to_dict(self) -> dict[str, Any]:
        return {**self.scenario.to_dict(), "uplink_lo": self.up_lo_bps, "uplink_hi": self.up_hi_bps,
                "down_ratio": self.down_ratio}
