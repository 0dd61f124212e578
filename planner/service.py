"""The planner's what-if service: JSON requests in, JSON-ready dicts out. No sockets.

`PlannerService.handle(method, path, body)` is the whole HTTP surface as a pure-ish
function (its only side effects are the graph cache, the in-memory profile store and
reading model files); `splitinfer.planner_http` puts it on a socket and the
`splitinfer plan` / `sweep` commands call `plan` and `sweep` directly.

[Note: service units]
The planner may not import `splitinfer`, where the rate and duration parsers live, so
the service takes them as constructor arguments. Without them a request must give
plain numbers (bits/s, ms, bytes); with them it may also give strings such as
'18.88mbit', '20ms' or '64MiB'.

[Note: device specs]
A request's ``edge`` and ``cloud`` name a tier's profile in one of three ways:
a string (a profile stored with PUT /v1/profiles/{name}, or a built-in reference
device when `planner.devices` provides them), a profile object (schema
'splitinfer.profile/1'), or a roofline object ``{"gflops": 5, "fixed_ms": 1}`` whose
per-layer times come from FLOPs (`planner.synthetic.make_flops_profile`).
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from partitioner import ZOO_MODELS, Cut, LayerGraph, PartitionError, build_graph, zoo_path
from planner.costmodel import evaluate
from planner.errors import InfeasibleError, PlannerError, ProfileError
from planner.profile import PROFILE_SCHEMA, Profile
from planner.frontier import frontier
from planner.service_requests import (
    FrontierRequest, PlanRequest, RequestError, Scenario, SweepRequest, UnitParsers,
)
from planner.service_sweep import compute_sweep, metric_of, metric_value
from planner.solvers import solve
from planner.synthetic import make_flops_profile
from planner.types import Link, LinkRange

__all__ = [
    "PlannerService", "Response", "NotFoundError", "RequestError", "PlanRequest",
    "SweepRequest", "FrontierRequest", "Scenario", "UnitParsers", "status_of",
    "PROFILE_NAME_RE", "metric_of", "reference_devices",
]

logger = logging.getLogger(__name__)

PROFILE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
"""Names a stored profile may have (they become file names under --profiles-dir)."""

_MAX_BODY_BYTES = 16 << 20


class NotFoundError(PlannerError):
    """A model, profile or path that does not exist (HTTP 404)."""

    def __init__(self, message: str, *, field: str | None = None, model: str | None = None) -> None:
        super().__init__(message, field=field, model=model)


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
    """The one table from errors to HTTP status codes."""
    if isinstance(err, NotFoundError):
        return 404
    if isinstance(err, RequestError):
        return err.status
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
    return _finite(body)


_MAY_BE_INFINITE = frozenset({"throughput_rps"})
"""Answer fields where inf means something (nothing limits the rate) and null says it."""


def _non_finite(x: Any, path: str = "") -> str | None:
    """The path of the first inf or NaN in ``x`` outside `_MAY_BE_INFINITE`, or None."""
    if isinstance(x, float):
        return None if math.isfinite(x) else path
    items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, (list, tuple)) else ()
    for k, v in items:
        if k in _MAY_BE_INFINITE:
            continue
        hit = _non_finite(v, f"{path}.{k}" if path else str(k))
        if hit is not None:
            return hit
    return None


def _require_finite(out: dict[str, Any]) -> None:
    """A plan is numbers: profiles whose times, corrections or watts add up past a float
    would answer null where the document promises a number (a 422, not a 200 of nulls)."""
    where = _non_finite(out)
    if where is not None:
        raise RequestError(
            f"the answer's {where} is not a finite number: the tiers' profiles have times, corrections "
            "or watts too large to add up; check the edge and cloud profiles", field="(profiles)", status=422)


def _finite(x: Any) -> Any:
    """JSON has no inf or NaN: they become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _summary(b: Any) -> dict[str, Any]:
    return {"edge_ms": b.edge_ms, "transfer_ms": b.transfer_ms, "cloud_ms": b.cloud_ms,
            "total_ms": b.total_ms, "energy_j": b.energy_j, "period_ms": b.period_ms,
            "bottleneck": b.bottleneck}


def reference_devices() -> tuple[tuple[str, ...], Callable[[LayerGraph, str], Profile] | None]:
    """Names of the built-in reference devices (`planner.devices`) and the function making
    one's roofline profile for a graph; ((), None) where that module is not installed."""
    try:
        devices = importlib.import_module("planner.devices")
    except ImportError:
        return (), None

    def make(graph: LayerGraph, name: str) -> Profile:
        return devices.reference_profile(name, graph)

    return tuple(devices.DEVICES), make


class PlannerService:
    """The what-if service: plans, sweeps and frontiers over cached graphs.

    Thread-safe: the graph cache and the profile store are guarded by one lock; the
    solvers are pure.
    """

    def __init__(
        self,
        *,
        registry_models: Callable[[], Mapping[str, str]] | None = None,
        profiles: Mapping[str, Profile] | None = None,
        units: UnitParsers | None = None,
        on_profile_saved: Callable[[str, Profile], None] | None = None,
        max_cached_graphs: int = 16,
    ) -> None:
        self._list_registry = registry_models
        """Lists the registry's models as name -> model path: 'name@version', and 'name' for
        the version the registry serves as latest. The caller asks the registry (the planner
        may not import cluster/), so the planner keeps no version order of its own."""
        self.units = units or UnitParsers()
        self._on_profile_saved = on_profile_saved
        self._profiles: dict[str, Profile] = dict(profiles or {})
        self._extra_models: dict[str, str] = {}
        self._graphs: OrderedDict[str, LayerGraph] = OrderedDict()
        self._derived: OrderedDict[tuple[str, str], Profile] = OrderedDict()
        self._max_graphs = max_cached_graphs
        self._lock = threading.Lock()
        self._building: dict[str, threading.Lock] = {}
        self.graph_builds = 0
        """How many graphs were built (the rest came from the cache)."""

    # -- models ---------------------------------------------------------------
    def _registry_models(self) -> dict[str, str]:
        """name -> model path of the registry's models (see `registry_models`)."""
        return dict(self._list_registry()) if self._list_registry else {}

    def models(self) -> dict[str, Any]:
        zoo = [{"name": m, "source": "zoo"} for m in ZOO_MODELS]
        reg = [{"name": n, "source": "registry"} for n in self._registry_models()]
        return {"models": zoo + reg}

    def add_model(self, name: str, path: str) -> None:
        """Make a model file known under ``name`` (the CLI's MODEL given as a path)."""
        with self._lock:
            self._extra_models[name] = path
            self._graphs.pop(name, None)

    def _model_path(self, name: str) -> str:
        with self._lock:
            extra = self._extra_models.get(name)
        if extra is not None:
            return extra
        reg = self._registry_models()
        if name in reg:
            return reg[name]
        try:
            return zoo_path(name)
        except PartitionError:
            known = list(ZOO_MODELS) + sorted(reg)
            raise NotFoundError(
                f"model {name!r} is not known; use one of {', '.join(known)} (GET /v1/models lists them)",
                field="model", model=name,
            ) from None

    def graph(self, name: str) -> LayerGraph:
        """The layer graph of a model, built once and cached (least recently used).

        Concurrent first requests for one model wait for a single build.
        """
        with self._lock:
            g = self._graphs.get(name)
            if g is not None:
                self._graphs.move_to_end(name)
                return g
            building = self._building.setdefault(name, threading.Lock())
        with building:
            with self._lock:
                g = self._graphs.get(name)
            if g is not None:
                return g
            path = self._model_path(name)
            g = build_graph(path, name=name)
            with self._lock:
                self.graph_builds += 1
                self._graphs[name] = g
                while len(self._graphs) > self._max_graphs:
                    self._graphs.popitem(last=False)
                self._building.pop(name, None)
        logger.info("built the graph of %s (%d layers) from %s", name, len(g), path)
        return g

    # -- profiles -------------------------------------------------------------
    def profiles(self) -> dict[str, Any]:
        names, _ = reference_devices()
        with self._lock:
            stored = [{"name": n, "device": p.device, "model": p.model, "layers": len(p.layers)}
                      for n, p in sorted(self._profiles.items())]
        return {"profiles": stored, "reference_devices": list(names)}

    def put_profile(self, name: str, body: Any) -> dict[str, Any]:
        if not PROFILE_NAME_RE.match(name):
            raise RequestError(
                f"profile name {name!r} is not allowed; use 1-64 letters, digits, '.', '_' or '-', "
                f"starting with a letter or digit",
                field="name",
            )
        if not isinstance(body, Mapping):
            raise RequestError(
                f"the profile body is {type(body).__name__}; send a profile object with "
                f"schema {PROFILE_SCHEMA!r}",
                field="(body)",
            )
        profile = Profile.from_dict(body)
        with self._lock:
            created = name not in self._profiles
            self._profiles[name] = profile
            for key in [k for k in self._derived if k[1].startswith(f"name:{name}")]:
                del self._derived[key]
        if self._on_profile_saved is not None:
            self._on_profile_saved(name, profile)
        logger.info("stored profile %s (device %s, %d layers)", name, profile.device, len(profile.layers))
        return {"name": name, "device": profile.device, "model": profile.model,
                "layers": len(profile.layers), "created": created}

    def _profile(self, graph: LayerGraph, spec: Any, field: str) -> Profile:
        """The profile a device spec names, checked against the graph; see [Note: device specs]."""
        if isinstance(spec, str):
            key = f"name:{spec}"
        else:
            key = "obj:" + json.dumps(spec, sort_keys=True)
        with self._lock:
            hit = self._derived.get((graph.model, key))
            if hit is not None:
                return hit
            stored = self._profiles.get(spec) if isinstance(spec, str) else None
        if isinstance(spec, str):
            if stored is not None:
                profile = stored
            else:
                names, make = reference_devices()
                if spec not in names or make is None:
                    with self._lock:
                        have = sorted(self._profiles)
                    raise NotFoundError(
                        f"{field} names profile {spec!r}, which is not stored or a reference device; "
                        f"stored profiles: {have or 'none'}; reference devices: {list(names) or 'none'}. "
                        f"PUT /v1/profiles/{{name}} a profile, or give a profile object or "
                        f'{{"gflops": ...}} inline',
                        field=field,
                    )
                profile = make(graph, spec)
        elif "schema" in spec:
            try:
                profile = Profile.from_dict(spec)
            except ProfileError as e:
                raise RequestError(f"{field}: {e.message}", field=f"{field}.{e.field}", status=422) from e
        else:
            profile = make_flops_profile(graph, device=f"roofline-{spec['gflops']:g}gflops", **spec)
        self._check_covers(graph, profile, field)
        with self._lock:
            self._derived[(graph.model, key)] = profile
            while len(self._derived) > 64:
                self._derived.popitem(last=False)
        return profile

    @staticmethod
    def _check_covers(graph: LayerGraph, profile: Profile, field: str) -> None:
        missing = [v for v in range(len(graph)) if v not in profile.layers]
        if missing:
            of = f" (a profile of {profile.model!r})" if profile.model else ""
            raise RequestError(
                f"{field} profile {profile.device!r}{of} has no time for layer {missing[0]} of "
                f"{graph.model} ({len(missing)} of {len(graph)} layers missing); profile "
                f"{graph.model} on that device, or use a roofline {{\"gflops\": ...}}",
                field=field, status=422,
            )

    def _tiers(self, sc: Scenario) -> tuple[LayerGraph, list[Profile]]:
        g = self.graph(sc.model)
        return g, [self._profile(g, sc.edge, "edge"), self._profile(g, sc.cloud, "cloud")]

    # -- what-if --------------------------------------------------------------
    def plan(self, body: Any) -> dict[str, Any]:
        req = PlanRequest.from_dict(body, self.units)
        sc = req.scenario
        g, profs = self._tiers(sc)
        link = Link(req.up_bps, req.down_bps, sc.rtt_ms, sc.loss)
        try:
            plan = solve(g, profs, link, sc.objective, sc.constraints, sc.encodings)
        except InfeasibleError:
            logger.info("no feasible plan for %s", req.to_dict())
            raise
        out = plan.to_dict()
        base = {}
        for name, cut in (("edge_only", Cut(frozenset(range(len(g))))), ("cloud_only", Cut(frozenset()))):
            b = evaluate(g, cut, profs, link, plan.encoding)
            base[name] = _summary(b)
        ours = metric_value(sc.objective, plan.breakdown)
        out["baselines"] = base
        out["metric"] = metric_of(sc.objective)
        out["gain"] = {
            name: (metric_value(sc.objective, v) / ours if ours > 0 else None) for name, v in base.items()
        }
        out["edge_device"], out["cloud_device"] = profs[0].device, profs[1].device
        out["layers"] = len(g)
        out["boundary_bytes"] = sum(g.tensor[t].bytes_per_sample or 0 for t in plan.boundary)
        _require_finite(out)
        return _finite(out)

    def frontier(self, body: Any) -> dict[str, Any]:
        req = FrontierRequest.from_dict(body, self.units)
        sc = req.scenario
        g, profs = self._tiers(sc)
        rng = LinkRange(req.up_lo_bps, req.up_hi_bps, req.down_ratio, sc.rtt_ms, sc.loss)
        f = frontier(g, profs, rng, sc.objective, sc.constraints, sc.encodings)
        out = f.to_dict()
        out["breakpoints_bps"] = list(f.breakpoints_bps)
        _require_finite(out)
        return _finite(out)

    def sweep(self, body: Any) -> dict[str, Any]:
        req = SweepRequest.from_dict(body, self.units)
        sc = req.scenario
        g, profs = self._tiers(sc)
        return _finite(compute_sweep(g, profs, req))

    # -- dispatch -------------------------------------------------------------
    def handle(self, method: str, path: str, body: bytes | None = None) -> Response:
        """Route one request; every error becomes a status and ``{error: ...}``."""
        from planner.service_openapi import make_openapi

        path = path.split("?", 1)[0].rstrip("/") or "/"
        try:
            if len(body or b"") > _MAX_BODY_BYTES:
                raise RequestError(
                    f"the request body is {len(body or b'')} bytes; the limit is {_MAX_BODY_BYTES}",
                    field="(body)", status=413,
                )
            routes: dict[tuple[str, str], Callable[[], Any]] = {
                ("POST", "/v1/plan"): lambda: self.plan(_parse_body(body)),
                ("POST", "/v1/sweep"): lambda: self.sweep(_parse_body(body)),
                ("POST", "/v1/frontier"): lambda: self.frontier(_parse_body(body)),
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
                    fn = lambda: self._get_profile(name)  # noqa: E731
            if fn is None:
                allowed = sorted(m for m, p in routes if p == path)
                if allowed or path.startswith("/v1/profiles/"):
                    allowed = allowed or ["GET", "PUT"]
                    raise RequestError(f"{method} is not allowed on {path}; use {' or '.join(allowed)}",
                                       field="(method)", status=405, allow=tuple(allowed))
                raise NotFoundError(
                    f"no such path {path!r}; GET /openapi.json lists the API", field="(path)")
            return Response(200, fn())
        except (PlannerError, PartitionError) as e:
            status = status_of(e)
            logger.info("%s %s -> %d: %s", method, path, status, e)
            allow = getattr(e, "allow", ())
            return Response(status, _error_body(e), (("Allow", ", ".join(allow)),) if allow else ())
        except Exception:
            logger.exception("unexpected error on %s %s", method, path)
            return Response(500, {"error": "internal error; the server log has the details"})

    def _get_profile(self, name: str) -> dict[str, Any]:
        with self._lock:
            p = self._profiles.get(name)
        if p is None:
            raise NotFoundError(f"no stored profile {name!r}; GET /v1/profiles lists them", field="name")
        return p.to_dict()


def _parse_body(body: bytes | None) -> Any:
    if not body:
        raise RequestError("the request body is empty; send a JSON object (see GET /openapi.json)",
                           field="(body)", status=400)
    try:
        return json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise RequestError(f"the request body is not valid JSON ({e}); send a JSON object",
                           field="(body)", status=400) from e
