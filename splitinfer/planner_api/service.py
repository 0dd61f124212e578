"""The planner's HTTP API without the socket: routing, JSON bodies to typed requests,
typed answers to JSON, and the one table from errors to HTTP status codes.

`PlannerService.handle(method, path, body)` is the whole HTTP surface as a function;
`splitinfer.planner_http` puts it on a socket. The work is `planner.whatif.Workspace`:
this module only reads bodies into `planner.whatif` requests (with the unit strings of
[Note: service units]) and writes the answers back.

[Note: service units]
The planner parses no unit strings, so the service takes the rate, duration and size
parsers as constructor arguments (`UnitParsers`). Without them a request must give
plain numbers (bits/s, ms, bytes); with them it may also give strings such as
'18.88mbit', '20ms' or '64MiB', each also matched against its pattern in
`splitinfer.planner_api.quantities`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from partitioner import LayerGraph, PartitionError
from planner.errors import InfeasibleError, PlannerError
from planner.profile import PROFILE_SCHEMA, Profile
from planner.types import finite_or_null
from planner.whatif import (
    PROFILE_NAME_RE, FrontierRequest, InvalidRequestError, Limit, NotFoundError, PlanRequest, QuantityText,
    SweepRequest, Workspace, reference_devices,
)
from splitinfer.planner_api.quantities import BY_LIMIT

__all__ = ["PlannerService", "Response", "RequestError", "NotFoundError", "UnitParsers", "status_of",
           "MAX_BODY_BYTES"]

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20
"""Largest request body (a profile of a 10k-layer model is about 1 MB)."""


class RequestError(PlannerError):
    """A request refused before any body is read as a what-if: not JSON (400), a method
    the path does not take (405, ``allow`` lists those it does), a body too large (413)."""

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
    """String parsers for rates, durations and sizes; see [Note: service units]. Each
    raises ValueError with the accepted forms."""

    rate_bps: Callable[[str], float] = _no_units("rates (bits/s)")
    """'18.88mbit' -> 18.88e6."""
    duration_ms: Callable[[str], float] = _no_units("durations (ms)")
    """'20ms' -> 20.0."""
    size_bytes: Callable[[str], float] = _no_units("sizes (bytes)")
    """'64MiB' -> 67108864."""

    def quantity_text(self) -> QuantityText:
        """The reader of a quantity given as text, for the typed requests' `from_dict`."""
        parsers = {"rate": self.rate_bps, "duration": self.duration_ms, "positive_duration": self.duration_ms,
                   "size": self.size_bytes}

        def read(key: str, text: str, limit: Limit) -> float:
            kind = BY_LIMIT.get(limit.name)
            if kind is None:
                raise InvalidRequestError(f"field {key!r} is {text!r}; give a number in {limit.unit}", field=key)
            try:
                x = float(parsers[limit.name](text))
            except ValueError as e:  # the parser's own words first: they name what is wrong
                raise InvalidRequestError(f"field {key!r}: {e}", field=key) from None
            if not re.search(kind.pattern, text):
                raise InvalidRequestError(f"field {key!r} is {text!r}; give {kind.forms}", field=key)
            return x

        return read


@dataclass(frozen=True)
class Response:
    """One reply: an HTTP status and a JSON-ready body."""

    status: int
    """HTTP status code."""
    body: Any
    """JSON-ready value (finite floats only)."""
    headers: tuple[tuple[str, str], ...] = ()
    """Headers beyond the content's own (a 405's ``Allow``)."""

    def to_json(self) -> str:
        return json.dumps(self.body, allow_nan=False)


def status_of(err: BaseException) -> int:
    """The one table from errors to HTTP status codes: 400 for a request that breaks the
    OpenAPI document, 404 for an unknown model or profile, 422 for a request that keeps
    the document but cannot be served as asked."""
    if isinstance(err, NotFoundError):
        return 404
    if isinstance(err, RequestError):
        return err.status
    if isinstance(err, InvalidRequestError):
        return err.http_status
    if isinstance(err, (PlannerError, PartitionError)):
        return 422
    return 500



def _error_body(err: BaseException) -> dict[str, Any]:
    body: dict[str, Any] = {"error": str(getattr(err, "message", None) or err)}
    field = getattr(err, "field", None)
    if field:
        body["field"] = field
    if isinstance(err, InfeasibleError):
        body.update(constraint=err.constraint, required=err.required, limit=err.limit, unit=err.unit)
        if err.required is not None and err.limit is not None:
            body["excess"] = err.required - err.limit
    return finite_or_null(body)  # type: ignore[no-any-return]


def _parse_body(body: bytes | None) -> Any:
    if not body:
        raise RequestError("the request body is empty; send a JSON object (see GET /openapi.json)",
                           field="(body)", status=400)
    try:
        return json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise RequestError(f"the request body is not valid JSON ({e}); send a JSON object",
                           field="(body)", status=400) from e


class PlannerService:
    """The HTTP API over one `Workspace`: JSON bodies in, JSON-ready dicts out. No sockets."""

    def __init__(self, *, registry_models: Callable[[], Mapping[str, str]] | None = None, profiles: Mapping[str, Profile] | None = None,
                 units: UnitParsers | None = None, on_profile_saved: Callable[[str, Profile], None] | None = None,
                 max_cached_graphs: int = 16,
                 graph_builder: Callable[[str, str], LayerGraph] | None = None) -> None:
        self.units = units or UnitParsers()
        self.workspace = Workspace(registry_models=registry_models, profiles=profiles, on_profile_saved=on_profile_saved,
                                   max_cached_graphs=max_cached_graphs, graph_builder=graph_builder)
        """The typed API this service adapts."""
        self._text = self.units.quantity_text()

    @property
    def graph_builds(self) -> int:
        """How many graphs the workspace built (the rest came from its cache)."""
        return self.workspace.graph_builds

    def graph(self, name: str) -> LayerGraph:
        """The layer graph of a model (`Workspace.graph`)."""
        return self.workspace.graph(name)

    # -- the routes' bodies -----------------------------------------------------------
    def plan(self, body: Any) -> dict[str, Any]:
        """POST /v1/plan."""
        return finite_or_null(self.workspace.plan(PlanRequest.from_dict(body, self._text)).to_dict())  # type: ignore[no-any-return]

    def sweep(self, body: Any) -> dict[str, Any]:
        """POST /v1/sweep."""
        return finite_or_null(self.workspace.sweep(SweepRequest.from_dict(body, self._text)).to_dict())  # type: ignore[no-any-return]

    def frontier(self, body: Any) -> dict[str, Any]:
        """POST /v1/frontier."""
        f = self.workspace.frontier(FrontierRequest.from_dict(body, self._text))
        return finite_or_null({**f.to_dict(), "breakpoints_bps": list(f.breakpoints_bps)})  # type: ignore[no-any-return]

    def fleet_plan(self, body: Any) -> dict[str, Any]:
        """POST /v1/fleet/plan: a fleet spec (docs/fleet.md) in, `planner.fleet.FleetPlan` out."""
        from planner.fleet import plan_fleet
        from planner.fleet_spec import FleetSpec

        return plan_fleet(FleetSpec.from_dict(body), self.workspace).to_dict()

    def models(self) -> dict[str, Any]:
        """GET /v1/models."""
        return {"models": [{"name": m.name, "source": m.source} for m in self.workspace.models()]}

    def profiles(self) -> dict[str, Any]:
        """GET /v1/profiles."""
        names, _ = reference_devices()
        stored = [{"name": p.name, "device": p.device, "model": p.model, "layers": p.layers}
                  for p in self.workspace.stored_profiles()]
        return {"profiles": stored, "reference_devices": list(names)}

    def put_profile(self, name: str, body: Any) -> dict[str, Any]:
        """PUT /v1/profiles/{name}."""
        if not PROFILE_NAME_RE.match(name):
            raise RequestError(
                f"profile name {name!r} is not allowed; use 1-64 letters, digits, '.', '_' or '-', "
                f"starting with a letter or digit", field="name")
        if not isinstance(body, Mapping):
            raise RequestError(
                f"the profile body is {type(body).__name__}; send a profile object with schema {PROFILE_SCHEMA!r}",
                field="(body)")
        profile = Profile.from_dict(body)
        created = self.workspace.put_profile(name, profile)
        return {"name": name, "device": profile.device, "model": profile.model, "layers": len(profile.layers),
                "created": created}

    def get_profile(self, name: str) -> dict[str, Any]:
        """GET /v1/profiles/{name}."""
        return self.workspace.get_profile(name).to_dict()

    # -- dispatch ---------------------------------------------------------------------
    def handle(self, method: str, path: str, body: bytes | None = None) -> Response:
        """Route one request; every error becomes a status and ``{error: ...}``."""
        from splitinfer.planner_api.openapi import make_openapi

        path = path.split("?", 1)[0].rstrip("/") or "/"
        try:
            if len(body or b"") > MAX_BODY_BYTES:
                raise RequestError(f"the request body is {len(body or b'')} bytes; the limit is {MAX_BODY_BYTES}",
                                   field="(body)", status=413)
            routes: dict[tuple[str, str], Callable[[], Any]] = {
                ("POST", "/v1/plan"): lambda: self.plan(_parse_body(body)),
                ("POST", "/v1/sweep"): lambda: self.sweep(_parse_body(body)),
                ("POST", "/v1/frontier"): lambda: self.frontier(_parse_body(body)),
                ("POST", "/v1/fleet/plan"): lambda: self.fleet_plan(_parse_body(body)),
                ("GET", "/v1/models"): self.models,
                ("GET", "/v1/profiles"): self.profiles,
                ("GET", "/openapi.json"): make_openapi,
                ("GET", "/healthz"): lambda: {"status": "ok"},
                ("GET", "/readyz"): lambda: {"status": "ready"},
            }
            fn = routes.get((method, path))
            if fn is None and path.startswith("/v1/profiles/"):
                name = path[len("/v1/profiles/"):]
                if method == "PUT":
                    fn = lambda: self.put_profile(name, _parse_body(body))  # noqa: E731
                elif method == "GET":
                    fn = lambda: self.get_profile(name)  # noqa: E731
            if fn is None:
                allowed = sorted(m for m, p in routes if p == path)
                if allowed or path.startswith("/v1/profiles/"):
                    allowed = allowed or ["GET", "PUT"]
                    raise RequestError(f"{method} is not allowed on {path}; use {' or '.join(allowed)}",
                                       field="(method)", status=405, allow=tuple(allowed))
                raise NotFoundError(f"no such path {path!r}; GET /openapi.json lists the API", field="(path)")
            return Response(200, fn())
        except (PlannerError, PartitionError) as e:
            status = status_of(e)
            logger.info("%s %s -> %d: %s", method, path, status, e)
            allow = getattr(e, "allow", ())
            return Response(status, _error_body(e), (("Allow", ", ".join(allow)),) if allow else ())
        except Exception:
            logger.exception("unexpected error on %s %s", method, path)
            return Response(500, {"error": "internal error; the server log has the details"})
