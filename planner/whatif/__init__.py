"""The typed what-if API: requests in, answers out.

    from planner.whatif import PlanRequest, Roofline, Scenario, Workspace

    ws = Workspace()
    req = PlanRequest(Scenario("resnet50", edge=Roofline(5.0), cloud="t4", rtt_ms=20.0), up_bps=18.88e6)
    answer = ws.plan(req)            # a PlanAnswer
    answer.plan.edge_layers, answer.gain_vs_cloud_only

Requests (`PlanRequest`, `SweepRequest`, `FrontierRequest`) and answers (`PlanAnswer`,
`SweepAnswer`, and `planner.Frontier`) are frozen dataclasses whose `to_json` is the
HTTP API's body and whose `from_json` reads it back to an equal value. `plan`,
`sweep` and `frontier` are the pure core over a graph and resolved profiles;
`Workspace` resolves model and profile names and calls them. The HTTP edge
(`splitinfer.planner_api`) and the gateway's `Plan` RPC are adapters over these.
"""

from planner.whatif.answers import METRICS, SERIES, Breakpoint, PlanAnswer, PlanInfo, Summary, SweepAnswer
from planner.whatif.core import frontier, metric_of, metric_value, plan
from planner.whatif.limits import (
    ENCODING_CHOICES, FRONTIER_OBJECTIVES, MAX_SWEEP_POINTS, ROOFLINE_KEYS, Limit,
)
from planner.whatif.requests import (
    SCENARIO_FIELDS, DeviceSpec, FrontierRequest, InvalidRequestError, PlanRequest, QuantityText, Roofline,
    Scenario, SweepRequest,
)
from planner.whatif.sweeps import sweep
from planner.whatif.workspace import (
    PROFILE_NAME_RE, ModelInfo, NotFoundError, StoredProfile, Workspace, reference_devices,
)

__all__ = [
    "Breakpoint", "DeviceSpec", "ENCODING_CHOICES", "FRONTIER_OBJECTIVES", "FrontierRequest", "InvalidRequestError",
    "Limit", "MAX_SWEEP_POINTS", "METRICS", "ModelInfo", "NotFoundError", "PROFILE_NAME_RE", "PlanAnswer",
    "PlanInfo", "PlanRequest", "QuantityText", "ROOFLINE_KEYS", "Roofline", "SCENARIO_FIELDS", "SERIES",
    "Scenario", "StoredProfile", "Summary", "SweepAnswer", "SweepRequest", "Workspace", "frontier", "metric_of",
    "metric_value", "plan", "reference_devices", "sweep",
]
