"""The fleet plan's result types: frozen dataclasses with an exact JSON round-trip (schema
splitinfer.fleet-plan/1). `planner.fleet` computes them and re-exports them."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

from planner.types import finite_or_null

__all__ = ["ClassPlan", "CloudPlan", "FixedPoint", "FleetPlan", "ModelPlan", "OptionShare", "PoolPlan"]


@dataclass(frozen=True)
class OptionShare:
    """How much of a class's traffic one option takes."""

    option: str
    """'local', or the plan key (cut id and encoding)."""
    edge_layers: int
    """Layers on the device (all of them for local)."""
    encoding: str
    """Boundary encoding ('' for local)."""
    share: float
    """Share of the class's requests."""


@dataclass(frozen=True)
class ClassPlan:
    """One device class in the plan."""

    name: str
    model: str
    devices: int
    rate_rps: float
    """Requests per second of the whole class."""
    options: tuple[OptionShare, ...]
    """Options with a share above 0, largest first."""
    p50_ms: float
    p95_ms: float
    within_slo: float
    """Share of requests answered within the model's SLO."""
    goodput_rps: float
    """Requests per second answered within the SLO."""
    refused_share: float
    """Share refused by admission control and answered locally."""
    urgent_share: float = 0.0
    """Share sent to the cloud with no local answer in time, which the agent sends with priority 1
    and the gateway serves first ([Note: priority under overload] in edge_agent/hedge.py)."""


@dataclass(frozen=True)
class ModelPlan:
    name: str
    slo_ms: float
    target: float
    within_slo: float
    """Share of the model's requests (all classes) answered within the SLO."""
    meets: bool
    """within_slo >= target."""


@dataclass(frozen=True)
class PoolPlan:
    """One model@cut pool of the cloud."""

    pool: str
    rate_rps: float
    batch: float
    """Mean batch size."""
    run_ms: float
    """Run time of that batch."""
    wait_ms: float
    """Mean wait before the batch starts: its fill plus the wait for a worker."""


@dataclass(frozen=True)
class CloudPlan:
    workers: int
    utilisation: float
    capacity_rps: float
    """Requests per second the workers answer at full batches, at this pool mix."""
    offered_rps: float
    """Requests the devices send to the cloud."""
    admitted_share: float
    """Share of them admitted (the rest are refused for load)."""
    worker_wait_ms: float
    """Mean wait for a free worker."""
    pools: tuple[PoolPlan, ...]


@dataclass(frozen=True)
class FixedPoint:
    """How the load-aware choice converged; see [Note: fleet fixed point]."""

    delay_ms: float
    """W: the cloud's delay beyond the idle plans' figures at the fixed point."""
    residual_ms: float
    """|F(W) - W| after mixing."""
    iterations: int
    mixed_share: float
    """theta: share of the switching groups that moved."""
    trace: tuple[tuple[float, float], ...]
    """(W, F(W)) at each bisection step."""


@dataclass(frozen=True)
class FleetPlan:
    """The plan for a fleet: per class, per model, the cloud, and the workers needed."""

    devices: int
    rate_rps: float
    goodput_rps: float
    within_slo: float
    p50_ms: float
    p95_ms: float
    classes: tuple[ClassPlan, ...]
    models: tuple[ModelPlan, ...]
    cloud: CloudPlan
    fixed_point: FixedPoint
    workers_needed: int | None
    """Fewest workers with which every model meets its target (on this model); None: none up to
    the search's limit does."""
    workers_needed_note: str

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["schema"] = "splitinfer.fleet-plan/1"
        d["fixed_point"]["trace"] = [list(t) for t in self.fixed_point.trace]
        return finite_or_null(d)  # type: ignore[no-any-return]

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), allow_nan=False, **kw)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FleetPlan:
        d = {k: v for k, v in d.items() if k != "schema"}
        num = (lambda x: math.inf if x is None else x)
        classes = tuple(ClassPlan(**{**c, "options": tuple(OptionShare(**o) for o in c["options"]),
                                     "p50_ms": num(c["p50_ms"]), "p95_ms": num(c["p95_ms"])})
                        for c in d["classes"])
        cloud = CloudPlan(**{**d["cloud"], "worker_wait_ms": num(d["cloud"]["worker_wait_ms"]),
                             "pools": tuple(PoolPlan(**p) for p in d["cloud"]["pools"])})
        fp = FixedPoint(**{**d["fixed_point"], "trace": tuple(tuple(t) for t in d["fixed_point"]["trace"])})
        return cls(**{**d, "classes": classes, "models": tuple(ModelPlan(**m) for m in d["models"]),
                      "cloud": cloud, "fixed_point": fp, "p50_ms": num(d["p50_ms"]), "p95_ms": num(d["p95_ms"])})

    @classmethod
    def from_json(cls, text: str) -> FleetPlan:
        return cls.from_dict(json.loads(text))

