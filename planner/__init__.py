"""The planner: profiles and the cost model, exact solvers, and the plan frontier.

Pure: no I/O, no clocks, no ONNX Runtime, Ray, gRPC or Kubernetes in the core. The
typed what-if API (`planner.whatif`) asks these questions by model and device name;
the HTTP API, the command line and the gateway's `Plan` are adapters over it.

    plan = solve(graph, [device_profile, cloud_profile], Link(18.88e6, 50e6, 20.0))
    front = frontier(graph, profiles, LinkRange(1e6, 1e9, down_ratio=2.0, rtt_ms=20.0))
    front.plan_at(measured_up_bps)
"""

from planner.costmodel import evaluate
from planner.errors import InfeasibleError, PlannerError, ProfileError
from planner.frontier import Frontier, FrontierEntry, frontier
from planner.memory import head_memory_bytes
from planner.profile import PROFILE_SCHEMA, CodecModel, Corrections, LayerTime, Profile
from planner.solvers import DEFAULT_EXACT_LIMIT, solve, solve_chain_scan
from planner.synthetic import make_flops_profile, make_random_profile
from planner.types import Breakdown, Constraints, Encoding, Link, LinkRange, Objective, Plan

__all__ = [
    "Breakdown",
    "CodecModel",
    "Constraints",
    "Corrections",
    "DEFAULT_EXACT_LIMIT",
    "Encoding",
    "Frontier",
    "FrontierEntry",
    "InfeasibleError",
    "LayerTime",
    "Link",
    "LinkRange",
    "Objective",
    "PROFILE_SCHEMA",
    "Plan",
    "PlannerError",
    "Profile",
    "ProfileError",
    "evaluate",
    "frontier",
    "head_memory_bytes",
    "make_flops_profile",
    "make_random_profile",
    "solve",
    "solve_chain_scan",
]
