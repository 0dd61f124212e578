"""`Plan` on the gateway: the planner's answer for one device and link, against the cloud
profile that the model version keeps in the registry.

[Note: gateway plan]
The query is the body of the planner service's `POST /v1/plan` (docs/planner-api.md),
with three changes: `model` names a registry model and `version` one of its versions
('' or 'latest' routes like Infer, canary included, by `device_id`); `cloud` is not
accepted, because the cloud tier is the one this gateway runs and its profile is
`profiles/<frontier.cloud_profile>` of that version; and `frontier` (default true) asks
for the plan frontier over the version's `frontier` link range as well. Quantities are
plain numbers (bits/s, ms, bytes): the wire has no unit strings. The accuracy budget is
model.yaml's `min_agreement` where the query names none, and the stricter of the two
where both do: a device may ask for more accuracy than the model's owner set, never
less. Under a budget the plan and frontier keep to the version's accuracy.json.

The work is the typed what-if API, `planner.whatif` (its request validation, device
specs, solve, baselines and frontier), so the gRPC and HTTP answers agree; this module
only maps the query onto a `PlanRequest` and its errors onto cluster errors. Every cut
id the answer names is one the gateway can serve: range ids rebuild from the graph, and
a hashed id (a cut too irregular for ranges) is remembered in the registry before the
answer leaves (`VersionFiles.remember_cut`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cluster.errors import FailedPrecondition, InternalError, InvalidArgument
from cluster.registry import LoadedVersion

if TYPE_CHECKING:
    from planner.whatif import PlanRequest

__all__ = ["PlanQuery", "GatewayPlanner", "QUERY_FIELDS", "read_query"]

logger = logging.getLogger(__name__)

_PLANNER_FIELDS = (
    "edge", "rtt", "loss", "objective", "encoding", "compression", "device_memory", "slo",
    "keep_input_local", "first_k_local", "pinned_device_layers", "uplink", "downlink", "min_agreement",
)
QUERY_FIELDS = ("model", "version", "device_id", "frontier") + _PLANNER_FIELDS
"""Keys a Plan query may carry (see [Note: gateway plan])."""


@dataclass(frozen=True)
class PlanQuery:
    """A Plan query after its gateway-only fields are read; `body` goes to the planner."""

    model: str
    """Registry model name."""
    version: str
    """Registry version; '' routes like Infer."""
    device_id: str = ""
    """The asking device (canary routing and rate limits)."""
    with_frontier: bool = True
    """Also return the frontier over the version's configured link range."""
    body: Mapping[str, Any] | None = None
    """The planner-service fields of the query (everything but model/version/device_id/frontier)."""

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "version": self.version, "device_id": self.device_id,
                "frontier": self.with_frontier, **dict(self.body or {})}

    @classmethod
    def from_dict(cls, d: Any) -> PlanQuery:
        return read_query(d)


def _string(d: Mapping[str, Any], key: str, *, required: bool = False) -> str:
    v = d.get(key)
    if v is None:
        if required:
            raise InvalidArgument(field=key, reason=f"is missing; give the registry {key} name as a string")
        return ""
    if not isinstance(v, str):
        raise InvalidArgument(field=key, reason=f"is {type(v).__name__} {str(v)[:40]!r}; it must be a string")
    return v


def read_query(query: Any) -> PlanQuery:
    """Reads the gateway's fields of a Plan query; raises InvalidArgument naming the field."""
    if not isinstance(query, Mapping):
        raise InvalidArgument(field="query", reason=f"is a {type(query).__name__}; send a map (docs/protocol.md)")
    unknown = sorted(str(k) for k in query if k not in QUERY_FIELDS)
    if unknown:
        hint = ("the gateway plans against its own cloud profile; leave 'cloud' out"
                if unknown[0] == "cloud" else "check the spelling")
        raise InvalidArgument(field=unknown[0][:60],
                              reason=f"is not a Plan query field ({hint}); allowed: {', '.join(QUERY_FIELDS)}")
    model = _string(query, "model", required=True)
    if not model:
        raise InvalidArgument(field="model", reason="is empty; name a registry model")
    frontier = query.get("frontier", True)
    if not isinstance(frontier, bool):
        raise InvalidArgument(field="frontier", reason=f"is {frontier!r}; it must be true or false")
    body = {k: v for k, v in query.items() if k in _PLANNER_FIELDS}
    return PlanQuery(model=model, version=_string(query, "version"), device_id=_string(query, "device_id"),
                     with_frontier=frontier, body=body)


class GatewayPlanner:
    """Plans for registry model versions with a `planner.whatif.Workspace`.

    Blocking (graph builds, solves): call `plan` off the event loop. Thread-safe.
    """

    def __init__(self) -> None:
        from planner.whatif import Workspace

        self._workspace = Workspace()
        self._lock = threading.Lock()
        self._models: dict[str, str] = {}

    def plan(self, lv: LoadedVersion, query: PlanQuery) -> dict[str, Any]:
        """The plan (and frontier) for `query` on `lv`; raises cluster errors only."""
        from partitioner import PartitionError
        from planner.errors import InfeasibleError, PlannerError
        from planner.whatif import PlanRequest
        from planner.whatif import plan as make_plan

        name = self._model(lv)
        cloud = self._cloud_profile(lv)
        body = _with_budget(dict(query.body or {}), lv.config.min_agreement)
        self._check_device(body.get("edge"))
        try:
            request = PlanRequest.from_dict({**body, "model": name, "cloud": cloud})
            accuracy = lv.files.accuracy() if request.scenario.min_agreement is not None else None
            answer = make_plan(request, *self._workspace.tiers(request.scenario), accuracy)
            front = self._frontier(lv, request, name, accuracy) if query.with_frontier else None
        except InfeasibleError as e:
            logger.info("no feasible plan for %s: %s (query %s)", lv.key, e.message, query.to_dict())
            raise InvalidArgument(field=_constraint_field(e.constraint), reason=e.message) from e
        except PlannerError as e:  # a bad field, an unknown name, a profile that does not fit
            raise InvalidArgument(field=e.field or "query", reason=e.message) from e
        except PartitionError as e:
            logger.error("the graph of %s could not be built for planning", lv.key, exc_info=e)
            raise InternalError(detail=f"the graph of {lv.key} could not be built") from e
        plan = answer.to_dict()
        cut_id = self._serve(lv, list(answer.plan.edge_layers), answer.layers)
        out: dict[str, Any] = {
            "model": lv.model,
            "version": lv.version,
            "cut_id": cut_id,
            "offload": len(answer.plan.edge_layers) < answer.layers,
            "preloaded": cut_id in lv.frontier.cut_ids,
            "cloud_profile": f"profiles/{lv.config.frontier.cloud_profile}",
            "plan": plan,
            "frontier": front,
        }
        logger.info("planned %s for %s: cut %s (%s, predicted %.2f ms)", lv.key, query.device_id or "-", cut_id,
                    plan["objective"], plan["predicted"]["total_ms"] or float("nan"))
        return out

    # -- pieces -----------------------------------------------------------------------

    def _model(self, lv: LoadedVersion) -> str:
        name = f"{lv.model}@{lv.version}"
        with self._lock:
            if self._models.get(name) != lv.files.model_path:
                # planned at model.yaml's input_shapes and sample_inputs, as the frontier is
                self._workspace.add_model(name, lv.files.model_path, graph=lv.files.sized_graph())
                self._models[name] = lv.files.model_path
        return name

    @staticmethod
    def _cloud_profile(lv: LoadedVersion) -> dict[str, Any]:
        import json

        fname = lv.config.frontier.cloud_profile
        text = lv.files.profiles().get(fname)
        rel = f"{lv.model}/{lv.version}/profiles/{fname}"
        if text is None:
            raise FailedPrecondition(
                reason=f"{lv.key} keeps no cloud profile: the registry has no {rel}",
                fix=f"profile the cloud workers ('splitinfer profile <model> -o {fname}', docs/profiles.md) "
                    f"and copy the file to {rel}, or ask 'splitinfer planner serve' with a cloud spec")
        try:
            d = json.loads(text)
        except ValueError as e:
            raise FailedPrecondition(reason=f"{rel} is not valid JSON ({e})",
                                     fix="write the profile again with 'splitinfer profile'") from e
        if not isinstance(d, dict) or "schema" not in d:
            raise FailedPrecondition(reason=f"{rel} is not a planner Profile (no 'schema')",
                                     fix="write the profile again with 'splitinfer profile'")
        return d

    @staticmethod
    def _check_device(edge: Any) -> None:
        # The planner's HTTP API also knows profiles stored over HTTP; the gateway stores
        # none, so a name can only be a reference device and the hint says so.
        if not isinstance(edge, str):
            return
        from planner.whatif import reference_devices

        names, _ = reference_devices()
        if edge not in names:
            raise InvalidArgument(
                field="edge",
                reason=f"{edge[:60]!r} is not a reference device; use one of {', '.join(names) or 'none'}, "
                       f"a profile object (schema 'splitinfer.profile/1') or a roofline {{\"gflops\": ...}}")

    def _frontier(self, lv: LoadedVersion, request: PlanRequest, name: str, accuracy: Any) -> dict[str, Any] | None:
        from planner.types import Objective
        from planner.whatif import FrontierRequest, frontier

        if request.scenario.objective is Objective.THROUGHPUT:
            return None  # the frontier covers latency and energy only (they are affine in 1/bandwidth)
        fc = lv.config.frontier
        front = frontier(FrontierRequest(request.scenario, fc.up_lo_bps, fc.up_hi_bps, fc.down_ratio),
                         *self._workspace.tiers(request.scenario), accuracy)
        n = len(self._workspace.graph(name))
        out = {**front.to_dict(), "breakpoints_bps": list(front.breakpoints_bps)}
        for entry in out["entries"]:
            entry["cut_id"] = self._serve(lv, entry["plan"]["edge_layers"], n)
        return out

    @staticmethod
    def _serve(lv: LoadedVersion, edge_layers: list[int], n_layers: int) -> str:
        from partitioner import Cut

        cut = Cut(frozenset(edge_layers))
        if cut.key.startswith("H") and len(edge_layers) < n_layers:
            lv.files.remember_cut(cut)
        return cut.key


def _with_budget(body: dict[str, Any], budget: float | None) -> dict[str, Any]:
    """``body`` with model.yaml's ``budget``: the query's min_agreement where it is stricter,
    else the budget ([Note: gateway plan]). A min_agreement that is not a number is left
    for the planner's validation to name."""
    if budget is None:
        return body
    asked = body.get("min_agreement")
    if asked is None:
        return {**body, "min_agreement": budget}
    if isinstance(asked, (int, float)) and not isinstance(asked, bool) and asked < budget:
        logger.info("min_agreement %g of the query is below model.yaml's %g; planning within %g", asked, budget,
                    budget)
        return {**body, "min_agreement": budget}
    return body


def _constraint_field(constraint: str | None) -> str:
    # The planner names its constraints; the query names the fields that set them.
    return {"latency_slo": "slo", "device_memory": "device_memory", "pinned": "pinned_device_layers"}.get(
        constraint or "", constraint or "query")
