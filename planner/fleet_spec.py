"""A fleet, as a platform engineer describes it: device classes, models with SLOs, the cloud's workers.

Frozen dataclasses with an exact JSON round-trip. `FleetSpec.from_dict` reads the YAML or
JSON form (docs/fleet.md shows one) and refuses anything impossible with `FleetSpecError`:
one line naming the field (``classes[2].fps``) and the fix. Pure: no I/O.

A spread quantity (a class's uplink rate or RTT) is a number, a list of equally likely
values (quantile points, e.g. from a measurement), or a lognormal
``{median: M, sigma: S}``; `Spread.points` discretises it for the planner
([Note: fleet links] in planner/fleet.py) and `Spread.sample` draws from it for the simulator.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from planner.types import Encoding
from planner.whatif.requests import InvalidRequestError

__all__ = [
    "FleetSpecConflict", "FleetSpecError", "Spread", "DeviceClass", "ModelSLO", "CloudSpec", "FleetSpec", "LOGNORMAL_POINTS",
           "MAX_WORKERS"]

LOGNORMAL_POINTS = 9
"""A lognormal spread is planned at this many equally likely points (its quantiles (i + 0.5) / 9)."""
MAX_WORKERS = 4096
"""The most workers a spec may name, and the most the workers-needed search tries."""
_ENCODINGS = {"fp32": Encoding(), "fp16": Encoding("fp16"), "int8": Encoding("int8")}


class FleetSpecError(InvalidRequestError):
    """A fleet spec that cannot describe a real fleet; ``field`` is the path of the bad value."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message, field=field)


class FleetSpecConflict(FleetSpecError):
    """A spec of the right form whose parts do not fit together: a class naming a model
    with no SLO or a device no one knows, an SLO no cloud answer can meet. The planner
    API answers it 422, as it does any request of the right form it cannot serve."""

    http_status = 422


def _number(d: Any, path: str, *, minimum: float = 0.0, strict: bool = True, fix: str = "") -> float:
    if isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d):
        raise FleetSpecError(f"{path} is {d!r}; give a finite number{fix}", field=path)
    if d < minimum or (strict and d == minimum):
        raise FleetSpecError(f"{path} is {d!r}; it must be {'>' if strict else '>='} {minimum:g}{fix}", field=path)
    return float(d)


def _integer(d: Any, path: str, *, minimum: int, fix: str = "", maximum: int | None = None) -> int:
    if isinstance(d, bool) or not isinstance(d, int) or d < minimum or (maximum is not None and d > maximum):
        limit = f">= {minimum}" + ("" if maximum is None else f" and <= {maximum}")
        raise FleetSpecError(f"{path} is {d!r}; it must be an integer {limit}{fix}", field=path)
    return d


def _mapping(d: Any, path: str, known: Sequence[str], required: Sequence[str]) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        raise FleetSpecError(f"{path or 'the spec'} is {type(d).__name__}; give a mapping with {list(known)}",
                             field=path or "(spec)")
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise FleetSpecError(f"{path + '.' if path else ''}{unknown[0]} is not a field; use {list(known)}",
                             field=f"{path + '.' if path else ''}{unknown[0]}")
    for key in required:
        if key not in d:
            raise FleetSpecError(f"{path + '.' if path else ''}{key} is missing; it is required",
                                 field=f"{path + '.' if path else ''}{key}")
    return d


@dataclass(frozen=True)
class Spread:
    """A positive quantity that varies across a class's devices."""

    median: float
    """The median (for a list: its median)."""
    sigma: float = 0.0
    """Lognormal shape (std of the log); 0 with no ``values``: every device has ``median``."""
    values: tuple[float, ...] = ()
    """Equally likely values; when given, they are the distribution."""

    def points(self) -> tuple[np.ndarray, np.ndarray]:
        """(values, probabilities) the planner evaluates."""
        if self.values:
            v = np.array(self.values, dtype=float)
            return v, np.full(len(v), 1.0 / len(v))
        if self.sigma == 0.0:
            return np.array([self.median]), np.array([1.0])
        z = np.array([statistics.NormalDist().inv_cdf((i + 0.5) / LOGNORMAL_POINTS) for i in range(LOGNORMAL_POINTS)])
        return self.median * np.exp(self.sigma * z), np.full(LOGNORMAL_POINTS, 1.0 / LOGNORMAL_POINTS)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` independent draws (the simulator's devices)."""
        if self.values:
            return rng.choice(np.array(self.values, dtype=float), size=n)
        if self.sigma == 0.0:
            return np.full(n, self.median)
        return self.median * np.exp(self.sigma * rng.standard_normal(n))

    @property
    def lowest(self) -> float:
        return float(self.points()[0].min())

    def to_json_value(self) -> Any:
        if self.values:
            return list(self.values)
        return self.median if self.sigma == 0.0 else {"median": self.median, "sigma": self.sigma}

    @classmethod
    def from_json_value(cls, d: Any, path: str, *, minimum: float, strict: bool, unit: str) -> Spread:
        fix = f" ({unit}; or a list of values, or {{median: M, sigma: S}} for a lognormal)"
        if isinstance(d, Mapping):
            _mapping(d, path, ("median", "sigma"), ("median",))
            median = _number(d["median"], f"{path}.median", minimum=minimum, strict=strict, fix=f" ({unit})")
            sigma = _number(d.get("sigma", 0.0), f"{path}.sigma", strict=False, fix=" (0: no spread)")
            if sigma > 3.0:
                raise FleetSpecError(f"{path}.sigma is {sigma!r}; a lognormal sigma above 3 spans over 10^5 "
                                     f"between its 1st and 99th percentiles; give a value in [0, 3]",
                                     field=f"{path}.sigma")
            return cls(median, sigma)
        if isinstance(d, (list, tuple)):
            if not d:
                raise FleetSpecError(f"{path} is an empty list; give at least one value{fix}", field=path)
            vals = tuple(_number(x, f"{path}[{i}]", minimum=minimum, strict=strict, fix=f" ({unit})")
                         for i, x in enumerate(d))
            return cls(float(statistics.median(vals)), 0.0, vals)
        return cls(_number(d, path, minimum=minimum, strict=strict, fix=fix))


@dataclass(frozen=True)
class DeviceClass:
    """Devices alike in hardware, model, frame rate and link."""

    name: str
    """Unique within the spec."""
    count: int
    """How many devices (>= 1)."""
    device: str
    """Reference device (rpi4, phone-sd8g2, ...) or stored profile name."""
    model: str
    """The model they run; must be listed under ``models``."""
    fps: float
    """Requests per second per device (> 0)."""
    up_mbps: Spread
    """Uplink rate, Mbit/s."""
    rtt_ms: Spread
    """Round-trip time to the cloud, ms."""
    down_ratio: float = 1.0
    """Downlink rate as a multiple of the uplink rate."""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "count": self.count, "device": self.device, "model": self.model, "fps": self.fps,
                "link": {"up_mbps": self.up_mbps.to_json_value(), "rtt_ms": self.rtt_ms.to_json_value(),
                         "down_ratio": self.down_ratio}}


@dataclass(frozen=True)
class ModelSLO:
    """A model and what its answers must meet."""

    name: str
    """Zoo short name or registry model."""
    slo_ms: float
    """Deadline of one request, end to end (> 0)."""
    target: float = 0.95
    """Share of requests that must answer within ``slo_ms``, in (0, 1]."""

    def to_dict(self) -> dict[str, Any]:
        return {"slo_ms": self.slo_ms, "target": self.target}


@dataclass(frozen=True)
class CloudSpec:
    """The cloud tier's workers and their batching (workers/batcher.py's knobs)."""

    device: str
    """Reference device (t4, a100, ...) or stored profile name of one worker."""
    workers: int
    """Workers (GPU or CPU replicas), each running one batch at a time (>= 1)."""
    max_batch: int = 8
    """Most requests in one batch (the batcher's max_batch_size)."""
    batch_timeout_ms: float = 2.0
    """Longest a request waits for company (the batcher's max_queue_delay_ms)."""

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "workers": self.workers, "max_batch": self.max_batch,
                "batch_timeout_ms": self.batch_timeout_ms}


@dataclass(frozen=True)
class FleetSpec:
    """Everything `planner.fleet.plan_fleet` plans for."""

    classes: tuple[DeviceClass, ...]
    """The device classes (at least one)."""
    models: tuple[ModelSLO, ...]
    """The models the classes run, with their SLOs."""
    cloud: CloudSpec
    """The shared cloud tier."""
    encodings: tuple[str, ...] = ("fp32",)
    """Boundary encodings the plans may use (fp32, fp16, int8)."""

    def __post_init__(self) -> None:
        if not self.classes:
            raise FleetSpecError("classes is empty; list at least one device class (name, count, device, model, "
                                 "fps, link)", field="classes")
        names = [c.name for c in self.classes]
        for i, c in enumerate(self.classes):
            if names.index(c.name) != i:
                raise FleetSpecConflict(f"classes[{i}].name {c.name!r} repeats classes[{names.index(c.name)}]; "
                                     "give each class its own name", field=f"classes[{i}].name")
        slos = {m.name: m for m in self.models}
        for i, c in enumerate(self.classes):
            m = slos.get(c.model)
            if m is None:
                raise FleetSpecConflict(f"classes[{i}].model {c.model!r} has no entry under models; add "
                                     f"models.{c.model}: {{slo_ms: ...}} or use one of {sorted(slos)}",
                                     field=f"classes[{i}].model")
            if m.slo_ms <= c.rtt_ms.lowest:
                raise FleetSpecConflict(
                    f"models.{m.name}.slo_ms {m.slo_ms:g} ms is not above classes[{i}].link.rtt_ms "
                    f"(lowest {c.rtt_ms.lowest:g} ms): no answer from the cloud can meet it; raise the SLO "
                    f"or check the RTT", field=f"models.{m.name}.slo_ms")
        for e in self.encodings:
            if e not in _ENCODINGS:
                raise FleetSpecError(f"encodings has {e!r}; use some of {list(_ENCODINGS)}", field="encodings")

    def slo(self, model: str) -> ModelSLO:
        return next(m for m in self.models if m.name == model)

    @property
    def devices(self) -> int:
        return sum(c.count for c in self.classes)

    @property
    def encoding_values(self) -> tuple[Encoding, ...]:
        return tuple(_ENCODINGS[e] for e in self.encodings)

    def to_dict(self) -> dict[str, Any]:
        return {"classes": [c.to_dict() for c in self.classes],
                "models": {m.name: m.to_dict() for m in self.models},
                "cloud": self.cloud.to_dict(), "encodings": list(self.encodings)}

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_json(cls, text: str) -> FleetSpec:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, d: Any) -> FleetSpec:
        """Read the spec's JSON/YAML form; `FleetSpecError` names the first bad field."""
        d = _mapping(d, "", ("classes", "models", "cloud", "encodings"), ("classes", "models", "cloud"))
        models = _mapping(d["models"], "models", tuple(d["models"]) if isinstance(d["models"], Mapping) else (), ())
        if not models:
            raise FleetSpecError("models is empty; give each model its SLO, e.g. models: {resnet50: {slo_ms: 200}}",
                                 field="models")
        slos = []
        for name, m in models.items():
            p = f"models.{name}"
            m = _mapping(m, p, ("slo_ms", "target"), ("slo_ms",))
            slo = _number(m["slo_ms"], f"{p}.slo_ms", fix=" ms: the deadline of one request")
            target = _number(m.get("target", 0.95), f"{p}.target", fix=": the share within the SLO, in (0, 1]")
            if target > 1:
                raise FleetSpecError(f"{p}.target is {target!r}; give a share in (0, 1], e.g. 0.95",
                                     field=f"{p}.target")
            slos.append(ModelSLO(str(name), slo, target))
        c = _mapping(d["cloud"], "cloud", ("device", "workers", "max_batch", "batch_timeout_ms"),
                     ("device", "workers"))
        cloud = CloudSpec(
            _name(c["device"], "cloud.device", "a reference device such as t4, or a stored profile name"),
            _integer(c["workers"], "cloud.workers", minimum=1, maximum=MAX_WORKERS,
                     fix="; a cloud tier needs a worker to answer anything"),
            _integer(c.get("max_batch", 8), "cloud.max_batch", minimum=1, maximum=1024, fix="; 1: no batching"),
            _number(c.get("batch_timeout_ms", 2.0), "cloud.batch_timeout_ms", strict=False,
                    fix=" ms; 0 dispatches at once"))
        raw = d["classes"]
        if not isinstance(raw, (list, tuple)):
            raise FleetSpecError(f"classes is {type(raw).__name__}; give a list of device classes", field="classes")
        classes = tuple(_device_class(x, f"classes[{i}]") for i, x in enumerate(raw))
        enc = d.get("encodings", ["fp32"])
        if not isinstance(enc, (list, tuple)) or not enc:
            raise FleetSpecError(f"encodings is {enc!r}; give a non-empty list of {list(_ENCODINGS)}",
                                 field="encodings")
        return cls(classes, tuple(slos), cloud, tuple(str(e) for e in enc))


def _name(d: Any, path: str, what: str) -> str:
    if not isinstance(d, str) or not d:
        raise FleetSpecError(f"{path} is {d!r}; give {what}", field=path)
    return d


def _device_class(d: Any, p: str) -> DeviceClass:
    d = _mapping(d, p, ("name", "count", "device", "model", "fps", "link"),
                 ("name", "count", "device", "model", "fps", "link"))
    link = _mapping(d["link"], f"{p}.link", ("up_mbps", "rtt_ms", "down_ratio"), ("up_mbps", "rtt_ms"))
    return DeviceClass(
        name=_name(d["name"], f"{p}.name", "a name for the class"),
        count=_integer(d["count"], f"{p}.count", minimum=1, fix="; drop a class that has no devices"),
        device=_name(d["device"], f"{p}.device", "a reference device such as rpi4, or a stored profile name"),
        model=_name(d["model"], f"{p}.model", "a model listed under models"),
        fps=_number(d["fps"], f"{p}.fps", fix=": requests per second per device"),
        up_mbps=Spread.from_json_value(link["up_mbps"], f"{p}.link.up_mbps", minimum=0.0, strict=True,
                                       unit="Mbit/s > 0"),
        rtt_ms=Spread.from_json_value(link["rtt_ms"], f"{p}.link.rtt_ms", minimum=0.0, strict=False,
                                      unit="ms >= 0"),
        down_ratio=_number(link.get("down_ratio", 1.0), f"{p}.link.down_ratio",
                           fix=": downlink rate / uplink rate"),
    )
