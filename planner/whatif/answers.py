"""What-if answers: frozen values whose JSON form (`to_dict`/`to_json`) is the HTTP
API's answer body, and which `from_dict`/`from_json` read back to an equal value.

Every number in an answer is finite, except where a field says what inf means
(a plan's ``predicted.throughput_rps`` is null when nothing limits the rate);
a sweep's series hold None where no plan is feasible.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from planner.types import Breakdown, Objective, Plan, _Json
from planner.whatif.requests import SweepRequest

__all__ = ["Summary", "PlanAnswer", "PlanInfo", "Breakpoint", "SweepAnswer", "SERIES", "METRICS"]

SERIES = ("edge_only", "cloud_only", "chain", "dag")
"""A sweep's series, in plotting order."""
METRICS = ("total_ms", "period_ms", "energy_mj")
"""The numbers an objective minimises (latency, throughput, energy)."""


@dataclass(frozen=True)
class Summary(_Json):
    """A baseline placement's cost: the headline figures of a `Breakdown`."""

    edge_ms: float
    """Device compute."""
    transfer_ms: float
    """Encode, uplink, round trips and downlink."""
    cloud_ms: float
    """Cloud compute."""
    total_ms: float
    """End-to-end latency of one request."""
    energy_j: float
    """Device energy per request."""
    period_ms: float
    """The slowest stage's ms per sample."""
    bottleneck: str
    """The slowest stage."""

    @classmethod
    def of(cls, b: Breakdown) -> Summary:
        return cls(b.edge_ms, b.transfer_ms, b.cloud_ms, b.total_ms, b.energy_j, b.period_ms, b.bottleneck)

    def to_dict(self) -> dict[str, Any]:
        return {"edge_ms": self.edge_ms, "transfer_ms": self.transfer_ms, "cloud_ms": self.cloud_ms,
                "total_ms": self.total_ms, "energy_j": self.energy_j, "period_ms": self.period_ms,
                "bottleneck": self.bottleneck}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Summary:
        return cls(d["edge_ms"], d["transfer_ms"], d["cloud_ms"], d["total_ms"], d["energy_j"], d["period_ms"],
                   d["bottleneck"])


@dataclass(frozen=True)
class PlanAnswer(_Json):
    """The best plan on one link, and what it gains over running on one tier."""

    plan: Plan
    """The plan: cut, encoding, link and predicted breakdown."""
    edge_only: Summary
    """Everything on the device, same link and encoding."""
    cloud_only: Summary
    """Everything in the cloud, same link and encoding."""
    metric: str
    """What the objective minimises: total_ms, period_ms or energy_mj."""
    gain_vs_edge_only: float | None
    """Edge-only metric / the plan's (> 1: the plan is better); None when the plan's is 0."""
    gain_vs_cloud_only: float | None
    """Cloud-only metric / the plan's; None when the plan's is 0."""
    edge_device: str
    """The device tier's profile name."""
    cloud_device: str
    """The cloud tier's profile name."""
    layers: int
    """Layers in the model."""
    boundary_bytes: int
    """fp32 bytes per sample crossing the cut."""
    cloud_only_image: Summary | None = None
    """Under an accuracy budget: the frame sent as an image (JPEG or WebP) at the quality
    that meets the budget, priced with its measured bytes and codec time
    (planner.budget.best_codec); None without a budget or a measured image codec."""
    cloud_only_image_encoding: str | None = None
    """That image codec's key, e.g. 'jpeg@90'."""
    cloud_only_image_agreement: float | None = None
    """Its measured agreement with the fp32 model."""
    gain_vs_cloud_only_image: float | None = None
    """Its metric / the plan's."""

    def to_dict(self) -> dict[str, Any]:
        baselines = {"edge_only": self.edge_only.to_dict(), "cloud_only": self.cloud_only.to_dict()}
        gain = {"edge_only": self.gain_vs_edge_only, "cloud_only": self.gain_vs_cloud_only}
        if self.cloud_only_image is not None:
            baselines["cloud_only_image"] = self.cloud_only_image.to_dict() | {
                "encoding": self.cloud_only_image_encoding, "agreement": self.cloud_only_image_agreement}
            gain["cloud_only_image"] = self.gain_vs_cloud_only_image
        return {
            **self.plan.to_dict(),
            "baselines": baselines,
            "metric": self.metric,
            "gain": gain,
            "edge_device": self.edge_device, "cloud_device": self.cloud_device,
            "layers": self.layers, "boundary_bytes": self.boundary_bytes,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PlanAnswer:
        image = d["baselines"].get("cloud_only_image")
        return cls(
            plan=Plan.from_dict(d), edge_only=Summary.from_dict(d["baselines"]["edge_only"]),
            cloud_only=Summary.from_dict(d["baselines"]["cloud_only"]), metric=d["metric"],
            gain_vs_edge_only=d["gain"]["edge_only"], gain_vs_cloud_only=d["gain"]["cloud_only"],
            edge_device=d["edge_device"], cloud_device=d["cloud_device"], layers=d["layers"],
            boundary_bytes=d["boundary_bytes"],
            cloud_only_image=None if image is None else Summary.from_dict(image),
            cloud_only_image_encoding=None if image is None else image["encoding"],
            cloud_only_image_agreement=None if image is None else image["agreement"],
            gain_vs_cloud_only_image=d["gain"].get("cloud_only_image"),
        )


@dataclass(frozen=True)
class PlanInfo(_Json):
    """A plan named briefly, for a sweep's breakpoints."""

    key: str
    """The plan's stable id (`Plan.key`)."""
    edge_layers: int
    """How many layers run on the device."""
    boundary: tuple[str, ...]
    """Tensors crossing the cut."""
    encoding: str
    """The encoding's key ('fp32', 'int8+zstd')."""

    @classmethod
    def of(cls, plan: Plan) -> PlanInfo:
        return cls(plan.key, len(plan.edge_layers), tuple(plan.boundary), plan.encoding.key)

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "edge_layers": self.edge_layers, "boundary": list(self.boundary),
                "encoding": self.encoding}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PlanInfo:
        return cls(d["key"], d["edge_layers"], tuple(d["boundary"]), d["encoding"])


@dataclass(frozen=True)
class Breakpoint(_Json):
    """An uplink rate where the DAG optimum changes plan."""

    up_bps: float
    """The rate: exact from the frontier, else the geometric mean of the two samples around it."""
    below: PlanInfo
    """The plan just below the rate."""
    above: PlanInfo
    """The plan from the rate up."""
    exact: bool
    """True when the rate comes from the frontier, False when it lies between samples."""

    def to_dict(self) -> dict[str, Any]:
        return {"up_bps": self.up_bps, "below": self.below.to_dict(), "above": self.above.to_dict(),
                "exact": self.exact}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Breakpoint:
        return cls(d["up_bps"], PlanInfo.from_dict(d["below"]), PlanInfo.from_dict(d["above"]), d["exact"])


@dataclass(frozen=True)
class SweepAnswer(_Json):
    """The objective's metric against the uplink rate for four placements."""

    request: SweepRequest
    """The request this answers."""
    model: str
    """The model's name."""
    objective: Objective
    """What the plans minimise."""
    metric: str
    """The number each series holds: total_ms, period_ms or energy_mj."""
    edge_device: str
    """The device tier's profile name."""
    cloud_device: str
    """The cloud tier's profile name."""
    rtt_ms: float
    """The link's round-trip time."""
    uplink_bps: tuple[float, ...]
    """The sampled uplink rates, ascending."""
    downlink_bps: tuple[float, ...]
    """The downlink rate at each sample."""
    edge_only: tuple[float, ...]
    """The metric with everything on the device."""
    cloud_only: tuple[float, ...]
    """The metric with everything in the cloud (best encoding per sample)."""
    chain: tuple[float, ...]
    """The metric of the best topological prefix (Neurosurgeon's chain scan)."""
    dag: tuple[float | None, ...]
    """The metric of the DAG optimum; None where no plan meets the constraints."""
    dag_edge_layers: tuple[int | None, ...]
    """Device layers of the DAG optimum at each sample."""
    breakpoints: tuple[Breakpoint, ...]
    """Where the DAG optimum changes plan, ascending."""
    method: str
    """How the DAG optimum was found: 'frontier' (exact) or 'per-point'."""
    solves: int
    """Solver calls it took."""
    max_gain_vs_chain: float | None
    """The largest chain / DAG metric ratio over the samples."""
    max_gain_vs_best_single_tier: float | None
    """The largest min(edge-only, cloud-only) / DAG metric ratio over the samples."""

    def series(self, name: str) -> tuple[float | None, ...]:
        """One of `SERIES` by name."""
        if name not in SERIES:
            raise KeyError(f"{name!r} is not a series; use one of {', '.join(SERIES)}")
        return getattr(self, name)  # type: ignore[no-any-return]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "splitinfer.sweep/1",
            "model": self.model,
            "objective": self.objective.value,
            "metric": self.metric,
            "edge_device": self.edge_device,
            "cloud_device": self.cloud_device,
            "rtt_ms": self.rtt_ms,
            "uplink_bps": list(self.uplink_bps),
            "downlink_bps": list(self.downlink_bps),
            "series": {name: list(self.series(name)) for name in SERIES},
            "dag_edge_layers": list(self.dag_edge_layers),
            "breakpoints": [b.to_dict() for b in self.breakpoints],
            "method": self.method,
            "solves": self.solves,
            "max_gain": {"vs_chain": self.max_gain_vs_chain,
                         "vs_best_single_tier": self.max_gain_vs_best_single_tier},
            "request": self.request.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SweepAnswer:
        s = d["series"]
        return cls(
            request=SweepRequest.from_dict(d["request"]), model=d["model"], objective=Objective(d["objective"]),
            metric=d["metric"], edge_device=d["edge_device"], cloud_device=d["cloud_device"], rtt_ms=d["rtt_ms"],
            uplink_bps=tuple(d["uplink_bps"]), downlink_bps=tuple(d["downlink_bps"]),
            edge_only=tuple(s["edge_only"]), cloud_only=tuple(s["cloud_only"]), chain=tuple(s["chain"]),
            dag=tuple(s["dag"]), dag_edge_layers=tuple(d["dag_edge_layers"]),
            breakpoints=tuple(Breakpoint.from_dict(b) for b in d["breakpoints"]), method=d["method"],
            solves=d["solves"], max_gain_vs_chain=d["max_gain"]["vs_chain"],
            max_gain_vs_best_single_tier=d["max_gain"]["vs_best_single_tier"],
        )
