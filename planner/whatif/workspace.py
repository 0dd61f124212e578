"""The names a what-if request uses, resolved: models to layer graphs (built once and
cached) and device specs to profiles (stored, reference or roofline).

`Workspace.plan`, `sweep` and `frontier` resolve a typed request's names and call the
pure core (`planner.whatif.plan` and friends). Its side effects are the graph cache,
the in-memory profile store and reading model files; nothing here parses JSON or knows
HTTP.

[Note: device specs]
A request's ``edge`` and ``cloud`` name a tier's profile in one of three ways:
a string (a profile stored with `put_profile`, or a built-in reference device when
`planner.devices` provides them), a `Profile`, or a `Roofline` whose per-layer times
come from FLOPs (`planner.synthetic.make_flops_profile`).
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from partitioner import ZOO_MODELS, LayerGraph, PartitionError, build_graph, zoo_path
from planner.accuracy import AccuracyTable
from planner.errors import PlannerError
from planner.frontier import Frontier
from planner.profile import Profile
from planner.synthetic import make_flops_profile
from planner.whatif.answers import PlanAnswer, SweepAnswer
from planner.whatif.core import frontier, plan
from planner.whatif.requests import DeviceSpec, FrontierRequest, PlanRequest, Roofline, Scenario, SweepRequest
from planner.whatif.sweeps import sweep

__all__ = ["Workspace", "NotFoundError", "ModelInfo", "StoredProfile", "PROFILE_NAME_RE", "reference_devices"]

logger = logging.getLogger(__name__)

PROFILE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
"""Names a stored profile may have (they become file names where profiles are kept)."""


class NotFoundError(PlannerError):
    """A model or profile that is not known."""

    def __init__(self, message: str, *, field: str | None = None, model: str | None = None) -> None:
        super().__init__(message, field=field, model=model)


@dataclass(frozen=True)
class ModelInfo:
    """A model a request may name."""

    name: str
    """The name to use in a request."""
    source: str
    """'zoo' or 'registry'."""


@dataclass(frozen=True)
class StoredProfile:
    """A profile stored under a name."""

    name: str
    """The name requests use."""
    device: str
    """The profile's device."""
    model: str
    """The model it was measured on ('' when not recorded)."""
    layers: int
    """How many layers it times."""


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


class Workspace:
    """Models, profiles and the typed what-if calls over them.

    Thread-safe: the graph cache and the profile store are guarded by one lock; the
    core is pure.
    """

    def __init__(
        self,
        *,
        registry_models: Callable[[], Mapping[str, str]] | None = None,
        profiles: Mapping[str, Profile] | None = None,
        on_profile_saved: Callable[[str, Profile], None] | None = None,
        max_cached_graphs: int = 16,
        graph_builder: Callable[[str, str], LayerGraph] | None = None,
    ) -> None:
        self._build_graph = graph_builder or (lambda name, path: build_graph(path, name=name))
        """Builds the layer graph of model ``name`` from its file ``path``: the caller may
        build it at the input shapes a registry declares (the planner reads no registry)."""
        self._list_registry = registry_models
        """Lists the registry's models as name -> model path: 'name@version', and 'name' for
        the version the registry serves as latest. The caller asks the registry (the planner
        may not import cluster/), so the planner keeps no version order of its own."""
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

    # -- the typed what-if calls ------------------------------------------------------
    def plan(self, request: PlanRequest) -> PlanAnswer:
        """The best plan on one link; raises `PlannerError` (`NotFoundError`, `InfeasibleError`)."""
        sc = request.scenario
        return plan(request, *self.tiers(sc), self.accuracy(sc.model) if sc.min_agreement is not None else None)

    def sweep(self, request: SweepRequest) -> SweepAnswer:
        """The objective against the uplink rate for four placements."""
        sc = request.scenario
        return sweep(request, *self.tiers(sc), self.accuracy(sc.model) if sc.min_agreement is not None else None)

    def accuracy(self, name: str) -> AccuracyTable | None:
        """The model's accuracy table (``splitinfer calibrate``): a registry version's
        accuracy.json, or MODEL.accuracy.json beside a model file; None when there is none."""
        path = self.model_path(name)
        folder, file = os.path.split(path)
        stem = os.path.splitext(file)[0]
        candidates = [os.path.join(folder, f"{stem}.accuracy.json")]
        if file == "model.onnx":  # a registry version's
            candidates.append(os.path.join(folder, "accuracy.json"))
        for candidate in candidates:
            if os.path.isfile(candidate):
                with open(candidate, encoding="utf-8") as fh:
                    return AccuracyTable.from_json(fh.read())
        return None

    def frontier(self, request: FrontierRequest) -> Frontier:
        """The plans optimal somewhere in the request's uplink range."""
        sc = request.scenario
        return frontier(request, *self.tiers(sc), self.accuracy(sc.model) if sc.min_agreement is not None else None)

    def tiers(self, sc: Scenario) -> tuple[LayerGraph, list[Profile]]:
        """The scenario's graph and its [device, cloud] profiles."""
        g = self.graph(sc.model)
        return g, [self.profile(g, sc.edge, "edge"), self.profile(g, sc.cloud, "cloud")]

    # -- models -----------------------------------------------------------------------
    def models(self) -> list[ModelInfo]:
        """The zoo models, then the registry's."""
        return ([ModelInfo(m, "zoo") for m in ZOO_MODELS]
                + [ModelInfo(n, "registry") for n in self._registry_models()])

    def _registry_models(self) -> dict[str, str]:
        return dict(self._list_registry()) if self._list_registry else {}

    def add_model(self, name: str, path: str, graph: LayerGraph | None = None) -> None:
        """Make a model file known under ``name`` (the CLI's MODEL given as a path);
        ``graph``: its layer graph, built by the caller (with the input shapes it was given)."""
        with self._lock:
            self._extra_models[name] = path
            self._graphs.pop(name, None)
            if graph is not None:
                self._graphs[name] = graph

    def model_path(self, name: str) -> str:
        """The file of the model ``name``; raises `NotFoundError` listing the known ones."""
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
            path = self.model_path(name)
            g = self._build_graph(name, path)
            with self._lock:
                self.graph_builds += 1
                self._graphs[name] = g
                while len(self._graphs) > self._max_graphs:
                    self._graphs.popitem(last=False)
                self._building.pop(name, None)
        logger.info("built the graph of %s (%d layers) from %s", name, len(g), path)
        return g

    # -- profiles ---------------------------------------------------------------------
    def stored_profiles(self) -> list[StoredProfile]:
        """The stored profiles, by name."""
        with self._lock:
            return [StoredProfile(n, p.device, p.model, len(p.layers)) for n, p in sorted(self._profiles.items())]

    def get_profile(self, name: str) -> Profile:
        """A stored profile; raises `NotFoundError`."""
        with self._lock:
            p = self._profiles.get(name)
        if p is None:
            raise NotFoundError(f"no stored profile {name!r}; GET /v1/profiles lists them", field="name")
        return p

    def put_profile(self, name: str, profile: Profile) -> bool:
        """Store ``profile`` under ``name``; True when the name is new."""
        if not PROFILE_NAME_RE.match(name):
            raise PlannerError(
                f"profile name {name!r} is not allowed; use 1-64 letters, digits, '.', '_' or '-', "
                f"starting with a letter or digit", field="name")
        with self._lock:
            created = name not in self._profiles
            self._profiles[name] = profile
            for key in [k for k in self._derived if k[1] == f"name:{name}"]:
                del self._derived[key]
        if self._on_profile_saved is not None:
            self._on_profile_saved(name, profile)
        logger.info("stored profile %s (device %s, %d layers)", name, profile.device, len(profile.layers))
        return created

    def profile(self, graph: LayerGraph, spec: DeviceSpec, field: str) -> Profile:
        """The profile a device spec names, checked against the graph; see [Note: device specs]."""
        if isinstance(spec, str):
            key = f"name:{spec}"
        elif isinstance(spec, Profile):
            key = "profile:" + spec.to_json(sort_keys=True)
        else:
            key = f"roofline:{spec!r}"
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
        elif isinstance(spec, Profile):
            profile = spec
        else:
            profile = _roofline_profile(graph, spec)
        _check_covers(graph, profile, field)
        with self._lock:
            self._derived[(graph.model, key)] = profile
            while len(self._derived) > 64:
                self._derived.popitem(last=False)
        return profile


def _roofline_profile(graph: LayerGraph, spec: Roofline) -> Profile:
    return make_flops_profile(graph, device=spec.device, gflops=spec.gflops, fixed_ms=spec.fixed_ms,
                              compute_w=spec.compute_w, radio_tx_w=spec.radio_tx_w, idle_w=spec.idle_w)


def _check_covers(graph: LayerGraph, profile: Profile, field: str) -> None:
    missing = [v for v in range(len(graph)) if v not in profile.layers]
    if missing:
        of = f" (a profile of {profile.model!r})" if profile.model else ""
        raise PlannerError(
            f"{field} profile {profile.device!r}{of} has no time for layer {missing[0]} of "
            f"{graph.model} ({len(missing)} of {len(graph)} layers missing); profile "
            f"{graph.model} on that device, or use a roofline {{\"gflops\": ...}}",
            field=field,
        )
