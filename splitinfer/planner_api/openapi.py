"""The planner HTTP API's OpenAPI 3.0 document, written by hand.

Request schemas list exactly the fields the typed requests in `planner.whatif` read
(a unit test holds them equal); the limits here are the limits those requests
enforce (`planner.whatif.limits`) and the unit strings the body reader takes
(`splitinfer.planner_api.quantities`).
"""

from __future__ import annotations

import copy
from typing import Any

from planner.types import COMPRESSIONS, LOSSY_CODECS, Objective
from planner.whatif import (
    ENCODING_CHOICES, FRONTIER_OBJECTIVES, MAX_SWEEP_POINTS, ROOFLINE_KEYS, FrontierRequest, PlanRequest, SweepRequest,
)
from planner.whatif import PROFILE_NAME_RE, limits
from splitinfer.planner_api.quantities import DURATION, MAX_GFLOPS, MIN_GFLOPS, POSITIVE_DURATION, RATE, SIZE, Quantity

__all__ = ["make_openapi", "OPENAPI_VERSION", "API_VERSION"]

OPENAPI_VERSION = "3.0.3"
API_VERSION = "1.0.0"

def _quantity(desc: str, kind: Quantity) -> dict[str, Any]:
    num: dict[str, Any] = {"type": "number", "minimum": kind.lo, "maximum": kind.hi, "description": f"in {kind.unit}"}
    if kind.lo_open:
        num["exclusiveMinimum"] = True
    return {
        "description": f"{desc}: a number in {kind.unit}, or a string with a unit ({kind.forms})",
        "oneOf": [num, {"type": "string", "pattern": kind.pattern}],
        "example": kind.example,
    }


def _rate(desc: str) -> dict[str, Any]:
    return _quantity(desc, RATE)


_ROOFLINE = {
    "type": "object",
    "description": "A device whose per-layer time is the layer's FLOPs / gflops (a roofline without "
                   "the memory roof); not a measurement",
    "required": ["gflops"],
    "additionalProperties": False,
    "properties": {
        "gflops": {"type": "number", "minimum": MIN_GFLOPS, "maximum": MAX_GFLOPS,
                   "description": "Compute speed in GFLOP/s"},
        **{k: {"type": "number", "minimum": limits.POWER.lo, "maximum": limits.POWER.hi,
               "description": "Fixed ms per non-empty segment" if k == "fixed_ms" else "Power in W"}
           for k in ROOFLINE_KEYS[1:]},
    },
}

_PROFILE = {
    "type": "object",
    "description": "A profile (schema splitinfer.profile/1): per-layer ms of one model on one tier",
    "required": ["schema", "device", "layers"],
    "properties": {
        "schema": {"type": "string", "enum": ["splitinfer.profile/1"]},
        "model": {"type": "string"},
        "device": {"type": "string", "minLength": 1},
        "ep": {"type": "string"},
        "ort_version": {"type": "string"},
        "threads": {"type": "integer", "minimum": 1},
        "batch": {"type": "integer", "minimum": 1},
        "fixed_ms": {"type": "number", "minimum": 0},
        "layers": {
            "type": "object",
            "description": "Layer id (a decimal string) -> time at batch 1",
            "additionalProperties": {
                "type": "object", "required": ["ms"], "additionalProperties": False,
                "properties": {"ms": {"type": "number", "minimum": 0},
                               "p90_ms": {"type": "number", "minimum": 0, "nullable": True},
                               "samples": {"type": "integer", "minimum": 0, "nullable": True}},
            },
        },
        "batch_ms": {"type": "object", "nullable": True,
                     "additionalProperties": {"type": "number", "minimum": 0}},
        "corrections": {"type": "object", "nullable": True},
        "compute_w": {"type": "number", "minimum": 0},
        "radio_tx_w": {"type": "number", "minimum": 0},
        "idle_w": {"type": "number", "minimum": 0},
        "memory_bytes": {"type": "integer", "minimum": 0, "nullable": True},
        "codec": {"type": "object"},
    },
    "additionalProperties": False,
}

_DEVICE = {
    "description": "A stored profile or reference device name, a profile object, or a roofline",
    "anyOf": [{"type": "string", "minLength": 1}, {"$ref": "#/components/schemas/Profile"},
              {"$ref": "#/components/schemas/Roofline"}],
}

_SCENARIO_PROPS: dict[str, Any] = {
    "model": {"type": "string", "minLength": 1, "description": "Zoo short name or registry model",
              "example": "resnet50"},
    "edge": _DEVICE,
    "cloud": _DEVICE,
    "rtt": _quantity("Round-trip time", DURATION),
    "loss": {"type": "number", "minimum": limits.LOSS.lo, "maximum": limits.LOSS.hi, "description": "Packet loss fraction"},
    "objective": {"type": "string", "enum": [o.value for o in Objective], "default": "latency"},
    "encoding": {"type": "string", "enum": list(ENCODING_CHOICES), "default": "fp32",
                 "description": "Boundary precision; auto tries each"},
    "compression": {"type": "string", "enum": list(COMPRESSIONS), "default": "none"},
    "device_memory": _quantity("Memory the head may use on the device", SIZE),
    "slo": _quantity("Latency SLO (throughput and energy objectives)", POSITIVE_DURATION),
    "min_agreement": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1,
                      "description": "Accuracy budget: no plan agrees with the fp32 model less"},
    "keep_input_local": {"type": "boolean", "default": False,
                         "description": "Privacy: the raw input never crosses the link"},
    "first_k_local": {"type": "integer", "minimum": 0, "maximum": limits.MAX_FIRST_K_LOCAL, "default": 0,
                      "description": "The first k layers (topological order) run on the device"},
    "pinned_device_layers": {"type": "array", "items": {"type": "integer", "minimum": 0},
                             "description": "Layers that must run on the device"},
}
_RATIO = {"type": "number", "minimum": limits.DOWN_RATIO.lo, "maximum": limits.DOWN_RATIO.hi, "default": 1.0,
          "description": "Downlink rate as a multiple of the uplink rate"}


def _request(fields: tuple[str, ...], extra: dict[str, Any], required: list[str], desc: str) -> dict[str, Any]:
    props = {**_SCENARIO_PROPS, **extra}
    assert set(props) == set(fields), sorted(set(props) ^ set(fields))
    required = ["model", "edge", "cloud"] + required
    # The service reads an optional field given as null as left out (its default).
    return {"type": "object", "description": desc, "additionalProperties": False, "required": required,
            "properties": {k: props[k] if k in required else {**props[k], "nullable": True} for k in fields}}


_PREDICTED = {
    "type": "object",
    "required": ["edge_ms", "transfer_ms", "cloud_ms", "total_ms"],
    "properties": {k: {"type": "number", "nullable": k == "throughput_rps"} for k in
                   ("edge_ms", "transfer_ms", "queue_ms", "cloud_ms", "total_ms", "energy_j",
                    "throughput_rps")} | {"bottleneck": {"type": "string"}},
}
_SUMMARY = {"type": "object", "required": ["edge_ms", "transfer_ms", "cloud_ms", "total_ms"],
            "properties": {k: {"type": "number"} for k in
                           ("edge_ms", "transfer_ms", "cloud_ms", "total_ms", "energy_j", "period_ms")}
            | {"bottleneck": {"type": "string"}}}
_PLAN = {
    "type": "object",
    "required": ["schema", "model", "edge_layers", "cuts", "boundary", "encoding", "objective",
                 "link", "predicted", "breakdown"],
    "properties": {
        "schema": {"type": "string", "enum": ["splitinfer.plan/1"]},
        "model": {"type": "string"},
        "edge_layers": {"type": "array", "items": {"type": "integer"}},
        "cuts": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
        "boundary": {"type": "array", "items": {"type": "string"}},
        "encoding": {"type": "object", "required": ["precision", "compression", "per_channel"], "properties": {
            "precision": {"type": "string"}, "compression": {"type": "string"},
            "per_channel": {"type": "boolean"},
            "codec": {"type": "string", "enum": ["none", *LOSSY_CODECS],
                      "description": "A lossy codec the boundary goes through instead of a cast; only when one does"},
            "level": {"type": "integer", "minimum": 0,
                      "description": "The codec's quality (1..100) or bit depth ('bits', 2..8)"},
            "ratio": {"type": "number", "nullable": True,
                      "description": "Measured wire bytes per byte of float32 the codec encodes"},
            "codec_ms_per_mb": {"type": "number", "nullable": True,
                                "description": "Measured encode + decode ms per MB of float32"}}},
        "objective": {"type": "string", "enum": [o.value for o in Objective]},
        "link": {"type": "object"},
        "predicted": _PREDICTED,
        "breakdown": {"type": "object"},
        "agreement": {"type": "number", "minimum": 0, "maximum": 1,
                      "description": "Predicted agreement with the fp32 model; only under min_agreement"},
    },
}
_PLAN_RESPONSE = copy.deepcopy(_PLAN)
_PLAN_RESPONSE["required"] = _PLAN["required"] + ["baselines", "metric", "gain"]
_PLAN_RESPONSE["properties"].update({
    "baselines": {"type": "object", "required": ["edge_only", "cloud_only"],
                  "properties": {"edge_only": _SUMMARY, "cloud_only": _SUMMARY}},
    "metric": {"type": "string", "enum": ["total_ms", "period_ms", "energy_mj"]},
    "gain": {"type": "object", "description": "baseline metric / plan metric (> 1: the plan is better)",
             "additionalProperties": {"type": "number", "nullable": True}},
    "edge_device": {"type": "string"}, "cloud_device": {"type": "string"},
    "layers": {"type": "integer"},
    "boundary_bytes": {"type": "integer", "description": "fp32 bytes per sample crossing the cut"},
})
_NUM_LIST = {"type": "array", "items": {"type": "number", "nullable": True}}
_PLAN_INFO = {"type": "object", "properties": {"key": {"type": "string"}, "edge_layers": {"type": "integer"},
                                              "boundary": {"type": "array", "items": {"type": "string"}},
                                              "encoding": {"type": "string"}}}
_SWEEP = {
    "type": "object",
    "required": ["schema", "model", "objective", "metric", "uplink_bps", "series", "breakpoints", "method"],
    "properties": {
        "schema": {"type": "string", "enum": ["splitinfer.sweep/1"]},
        "model": {"type": "string"},
        "objective": {"type": "string"},
        "metric": {"type": "string", "enum": ["total_ms", "period_ms", "energy_mj"]},
        "uplink_bps": _NUM_LIST, "downlink_bps": _NUM_LIST,
        "series": {"type": "object", "required": ["edge_only", "cloud_only", "chain", "dag"],
                   "properties": {k: _NUM_LIST for k in ("edge_only", "cloud_only", "chain", "dag")},
                   "description": "Objective metric per uplink rate; null where infeasible"},
        "dag_edge_layers": {"type": "array", "items": {"type": "integer", "nullable": True}},
        "breakpoints": {"type": "array", "items": {
            "type": "object", "required": ["up_bps", "below", "above", "exact"],
            "properties": {"up_bps": {"type": "number"}, "below": _PLAN_INFO, "above": _PLAN_INFO,
                           "exact": {"type": "boolean"}}}},
        "method": {"type": "string", "enum": ["frontier", "per-point"]},
        "solves": {"type": "integer"},
        "max_gain": {"type": "object", "additionalProperties": {"type": "number", "nullable": True}},
    },
}
_FRONTIER = {
    "type": "object",
    "required": ["schema", "model", "objective", "link_range", "entries", "breakpoints_bps"],
    "properties": {
        "schema": {"type": "string", "enum": ["splitinfer.frontier/1"]},
        "model": {"type": "string"},
        "objective": {"type": "string"},
        "link_range": {"type": "object"},
        "entries": {"type": "array", "items": {
            "type": "object", "required": ["up_lo_bps", "up_hi_bps", "plan"],
            "properties": {"up_lo_bps": {"type": "number"}, "up_hi_bps": {"type": "number"},
                           "plan": {"$ref": "#/components/schemas/Plan"}}}},
        "breakpoints_bps": {"type": "array", "items": {"type": "number"}},
        "solves": {"type": "integer"},
    },
}
_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {
        "error": {"type": "string", "description": "What is wrong and how to fix it"},
        "field": {"type": "string", "description": "The request field at fault"},
        "constraint": {"type": "string", "description": "Infeasible: the constraint that cannot be met"},
        "required": {"type": "number", "nullable": True, "description": "Infeasible: the least it needs"},
        "limit": {"type": "number", "nullable": True, "description": "Infeasible: what it allows"},
        "excess": {"type": "number", "description": "Infeasible: required - limit"},
        "unit": {"type": "string"},
    },
}


def _spread(positive: bool) -> dict[str, Any]:
    """A value that varies across a class's devices; ``positive``: > 0 (a rate), else >= 0 (a delay)."""
    value = {"type": "number", "minimum": 0} | ({"exclusiveMinimum": True} if positive else {})
    return {
        "description": "A value that varies across a class's devices: a number, a list of equally likely "
                       "values, or a lognormal {median, sigma}",
        "oneOf": [value, {"type": "array", "minItems": 1, "items": value},
                  {"type": "object", "required": ["median"], "additionalProperties": False,
                   "properties": {"median": value,
                                  "sigma": {"type": "number", "minimum": 0, "maximum": 3, "default": 0}}}],
    }


_FLEET_SPEC = {
    "type": "object", "additionalProperties": False, "required": ["classes", "models", "cloud"],
    "description": "A fleet: device classes, models with SLOs, the shared cloud tier (docs/fleet.md)",
    "properties": {
        "classes": {"type": "array", "minItems": 1, "items": {
            "type": "object", "additionalProperties": False,
            "required": ["name", "count", "device", "model", "fps", "link"],
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "count": {"type": "integer", "minimum": 1},
                "device": {"type": "string", "minLength": 1, "description": "Reference device or stored profile"},
                "model": {"type": "string", "minLength": 1, "description": "A model listed under models"},
                "fps": {"type": "number", "exclusiveMinimum": True, "minimum": 0,
                        "description": "Requests per second per device"},
                "link": {"type": "object", "additionalProperties": False, "required": ["up_mbps", "rtt_ms"],
                         "properties": {"up_mbps": _spread(True), "rtt_ms": _spread(False),
                                        "down_ratio": {"type": "number", "exclusiveMinimum": True, "minimum": 0,
                                                       "default": 1.0}}}}}},
        "models": {"type": "object", "minProperties": 1, "additionalProperties": {
            "type": "object", "additionalProperties": False, "required": ["slo_ms"],
            "properties": {"slo_ms": {"type": "number", "exclusiveMinimum": True, "minimum": 0,
                                      "description": "Deadline of one request; above every class's RTT"},
                           "target": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1,
                                      "default": 0.95, "description": "Share that must answer within it"}}}},
        "cloud": {"type": "object", "additionalProperties": False, "required": ["device", "workers"],
                  "properties": {"device": {"type": "string", "minLength": 1},
                                 "workers": {"type": "integer", "minimum": 1, "maximum": 4096},
                                 "max_batch": {"type": "integer", "minimum": 1, "maximum": 1024, "default": 8},
                                 "batch_timeout_ms": {"type": "number", "minimum": 0, "default": 2.0}}},
        "encodings": {"type": "array", "minItems": 1,
                      "items": {"type": "string", "enum": ["fp32", "fp16", "int8"]}, "default": ["fp32"]},
    },
}
_NUM = {"type": "number"}
_NUM_OR_NULL = {"type": "number", "nullable": True}
_FLEET_PLAN = {
    "type": "object",
    "required": ["schema", "devices", "rate_rps", "goodput_rps", "within_slo", "p50_ms", "p95_ms", "classes",
                 "models", "cloud", "fixed_point", "workers_needed", "workers_needed_note"],
    "properties": {
        "schema": {"type": "string", "enum": ["splitinfer.fleet-plan/1"]},
        "devices": {"type": "integer"}, "rate_rps": _NUM, "goodput_rps": _NUM, "within_slo": _NUM,
        "p50_ms": _NUM_OR_NULL, "p95_ms": _NUM_OR_NULL,
        "classes": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "model": {"type": "string"}, "devices": {"type": "integer"},
            "rate_rps": _NUM, "p50_ms": _NUM_OR_NULL, "p95_ms": _NUM_OR_NULL, "within_slo": _NUM,
            "goodput_rps": _NUM, "refused_share": _NUM, "urgent_share": _NUM,
            "options": {"type": "array", "items": {"type": "object", "properties": {
                "option": {"type": "string"}, "edge_layers": {"type": "integer"}, "encoding": {"type": "string"},
                "share": _NUM}}}}}},
        "models": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "slo_ms": _NUM, "target": _NUM, "within_slo": _NUM,
            "meets": {"type": "boolean"}}}},
        "cloud": {"type": "object", "properties": {
            "workers": {"type": "integer"}, "utilisation": _NUM, "capacity_rps": _NUM_OR_NULL, "offered_rps": _NUM,
            "admitted_share": _NUM, "worker_wait_ms": _NUM_OR_NULL,
            "pools": {"type": "array", "items": {"type": "object", "properties": {
                "pool": {"type": "string"}, "rate_rps": _NUM, "batch": _NUM, "run_ms": _NUM, "wait_ms": _NUM}}}}},
        "fixed_point": {"type": "object", "properties": {
            "delay_ms": _NUM, "residual_ms": _NUM, "iterations": {"type": "integer"}, "mixed_share": _NUM,
            "trace": {"type": "array", "items": {"type": "array", "items": _NUM_OR_NULL}}}},
        "workers_needed": {"type": "integer", "nullable": True,
                           "description": "Fewest workers meeting every model's target; null: none up to 4096"},
        "workers_needed_note": {"type": "string"},
    },
}


def _json(ref: str, desc: str = "OK") -> dict[str, Any]:
    return {"description": desc, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}}


def _errors(*codes: int) -> dict[str, Any]:
    text = {400: "The request breaks this document: not JSON, a missing or unknown field, a wrong type, "
                 "a value outside its stated range or pattern",
            404: "Unknown model or profile", 405: "Method not allowed", 413: "Body too large",
            422: "The request keeps this document but cannot be served as asked: no plan meets the "
                 "constraints, uplink_hi is below uplink_lo, a profile does not fit the model",
            500: "Internal error"}
    return {str(c): _json("Error", text[c]) for c in codes}


def _post(op: str, summary: str, req: str, resp: str) -> dict[str, Any]:
    return {"post": {
        "operationId": op, "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{req}"}}}},
        "responses": {"200": _json(resp), **_errors(400, 404, 413, 422)},
    }}


def _get(op: str, summary: str, resp: dict[str, Any]) -> dict[str, Any]:
    return {"get": {"operationId": op, "summary": summary, "responses": {
        "200": {"description": "OK", "content": {"application/json": {"schema": resp}}}}}}


def make_openapi() -> dict[str, Any]:
    """The OpenAPI document served at GET /openapi.json (a fresh copy each call)."""
    health = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}
    models = {"type": "object", "required": ["models"], "properties": {"models": {"type": "array", "items": {
        "type": "object", "required": ["name", "source"],
        "properties": {"name": {"type": "string"}, "source": {"type": "string", "enum": ["zoo", "registry"]}}}}}}
    stored = {"type": "object", "required": ["name", "device", "layers"], "properties": {
        "name": {"type": "string"}, "device": {"type": "string"}, "model": {"type": "string"},
        "layers": {"type": "integer"}, "created": {"type": "boolean"}}}
    profiles = {"type": "object", "required": ["profiles", "reference_devices"], "properties": {
        "profiles": {"type": "array", "items": stored},
        "reference_devices": {"type": "array", "items": {"type": "string"}}}}
    name_param = {"name": "name", "in": "path", "required": True,
                  "schema": {"type": "string", "pattern": PROFILE_NAME_RE.pattern}}
    doc = {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "splitinfer planner", "version": API_VERSION,
                 "description": "What-if planning for edge-cloud split inference: the best cut and "
                                "encoding for a device, a link and an objective."},
        "paths": {
            "/v1/plan": _post("plan", "The best plan on one link", "PlanRequest", "PlanResponse"),
            "/v1/sweep": _post("sweep", "The objective against uplink rate: edge-only, cloud-only, "
                               "chain scan and DAG optimum", "SweepRequest", "SweepResponse"),
            "/v1/frontier": _post("frontier", "The plans optimal somewhere in an uplink range",
                                  "FrontierRequest", "FrontierResponse"),
            "/v1/fleet/plan": _post("fleetPlan", "A fleet's per-class plans, latency, goodput at the SLO, "
                                    "cloud utilisation and the workers it needs", "FleetSpec", "FleetPlan"),
            "/v1/models": _get("listModels", "Zoo models and models in the registry", models),
            "/v1/profiles": _get("listProfiles", "Stored profiles and reference devices", profiles),
            "/v1/profiles/{name}": {
                "parameters": [name_param],
                "get": {"operationId": "getProfile", "summary": "One stored profile",
                        "responses": {"200": _json("Profile"), **_errors(404)}},
                "put": {"operationId": "putProfile", "summary": "Store a profile under a name",
                        "requestBody": {"required": True, "content": {"application/json": {
                            "schema": {"$ref": "#/components/schemas/Profile"}}}},
                        "responses": {"200": {"description": "Stored", "content": {"application/json": {
                            "schema": stored}}}, **_errors(400, 413, 422)}},
            },
            "/openapi.json": _get("openapi", "This document", {"type": "object"}),
            "/healthz": _get("healthz", "Liveness", health),
            "/readyz": _get("readyz", "Readiness", health),
        },
        "components": {"schemas": {
            "PlanRequest": _request(PlanRequest.FIELDS, {"uplink": _rate("Uplink rate"),
                                                         "downlink": _rate("Downlink rate (default: uplink)")},
                                    ["uplink"], "One link: the best plan"),
            "SweepRequest": _request(SweepRequest.FIELDS, {
                "uplink_lo": _rate("Lowest uplink rate"), "uplink_hi": _rate("Highest uplink rate"),
                "points": {"type": "integer", "minimum": 2, "maximum": MAX_SWEEP_POINTS, "default": 200},
                "down_ratio": _RATIO, "downlink": _rate("A fixed downlink rate (overrides down_ratio)"),
            }, ["uplink_lo", "uplink_hi"], "Log-spaced uplink rates"),
            "FrontierRequest": _request(FrontierRequest.FIELDS, {
                "uplink_lo": _rate("Lowest uplink rate"), "uplink_hi": _rate("Highest uplink rate"),
                "down_ratio": _RATIO,
                "objective": {"type": "string", "enum": list(FRONTIER_OBJECTIVES), "default": "latency",
                              "description": "Latency or energy: they are affine in 1/bandwidth"},
            }, ["uplink_lo", "uplink_hi"], "An uplink range (latency or energy objective)"),
            "PlanResponse": _PLAN_RESPONSE,
            "Plan": _PLAN,
            "SweepResponse": _SWEEP,
            "FrontierResponse": _FRONTIER,
            "Profile": _PROFILE,
            "Roofline": _ROOFLINE,
            "Error": _ERROR,
            "FleetSpec": _FLEET_SPEC,
            "FleetPlan": _FLEET_PLAN,
        }},
    }
    return copy.deepcopy(doc)
