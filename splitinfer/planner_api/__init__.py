"""The planner's HTTP edge: routing, the OpenAPI document, JSON bodies to the typed
what-if API (`planner.whatif`) and back. `splitinfer.planner_http` serves it."""

from splitinfer.planner_api.openapi import API_VERSION, OPENAPI_VERSION, make_openapi
from splitinfer.planner_api.service import (
    MAX_BODY_BYTES, NotFoundError, PlannerService, RequestError, Response, UnitParsers, status_of,
)

__all__ = ["API_VERSION", "MAX_BODY_BYTES", "NotFoundError", "OPENAPI_VERSION", "PlannerService", "RequestError",
           "Response", "UnitParsers", "make_openapi", "status_of"]
