"""The model registry: which versions are loaded, which one a device gets, and leases.

The repository on disk is `<root>/<name>/<version>/{model.onnx, model.yaml, profiles/,
segments/, frontier.json}` (see cluster._registry_disk, its layout check in
cluster._registry_layout, and docs/registry.md). A model may add
`<root>/<name>/policy.yaml` with `version_policy`, `default_version` and `canary`
(parsed, and routed, by cluster._registry_policy). A `policy_dir` of `<name>.policy.yaml` files (the registry ConfigMap mounted
into the gateway pod) overrides those; `apply_policy` makes a changed policy take
effect while serving (see [Note: live policy]).

[Note: leases and rollback]
Every request holds a `Lease` on the `LoadedVersion` it was routed to, from routing
until its answer is ready. Routing changes (canary, rollback, promote, unload) only
swap which version *new* requests get; a version taken out of service is *retired*,
and its resources are released by the `on_drained` callbacks only once its last
lease ends. So a rollback never drops an in-flight request: it finishes on the
version it started on.

Routing is pure: `route(...)` and `canary_fraction(...)` take everything they need.

[Note: not ready]
`load_all` first reads the whole directory, then loads. Every model directory and
selected version it found is in `not_ready()` with its reason until it serves:
'queued' (waiting for the versions before it), 'loading' (reading, cutting and starting
the pools of its frontier tails, which can take minutes with Ray), 'failed: <error>'
or 'no versions: ...' (nothing to load). The gateway is ready only when that is empty,
and /readyz shows it, so an operator sees which model holds readiness back and why.
Versions that `apply_policy` loads later are not in it: a bad policy leaves the last
good one serving, and readiness as it was.

[Note: live policy]
`apply_policy(model, text)` validates the whole policy first (its versions on disk and
selected by its version_policy, a default to fall back to), then loads the versions it
adds, then swaps default and canary in one step, and only then retires the versions it
drops, through `unload` and so the lease machinery above. A policy that fails any check
changes nothing: the model keeps the last policy that was applied.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from cluster._registry_disk import (
    NAME_PATTERN,
    CutEntry,
    FrontierConfig,
    ModelConfig,
    RegistryError,
    VersionFiles,
    VersionFrontier,
    compute_frontier,
    set_model_yaml,
    version_sort_key,
)
from cluster._registry_layout import LAYOUT, Survey, survey
from cluster._registry_policy import (
    POLICY_FILE_SUFFIX,
    ROUTED_VERSIONS,
    Canary,
    VersionPolicy,
    canary_fraction,
    parse_policy,
    read_policy_dir,
    route,
)
from cluster.errors import ClusterError, FailedPrecondition, Unavailable, UnknownModelError, UnknownVersionError

__all__ = [
    "LAYOUT",
    "Canary",
    "CutEntry",
    "FrontierConfig",
    "LoadedVersion",
    "ModelConfig",
    "NAME_PATTERN",
    "POLICY_FILE_SUFFIX",
    "Registry",
    "RegistryError",
    "VersionFiles",
    "VersionFrontier",
    "VersionPolicy",
    "ROUTED_VERSIONS",
    "Survey",
    "canary_fraction",
    "compute_frontier",
    "parse_policy",
    "read_policy_dir",
    "route",
    "model_files",
    "set_model_yaml",
    "survey",
    "version_sort_key",
    "versions_on_disk",
]

logger = logging.getLogger(__name__)

def versions_on_disk(root: str) -> dict[str, tuple[str, ...]]:
    """model -> its version directories under `root`, highest first in `version_sort_key`'s
    order; {} when `root` is not a directory."""
    out = {}
    if not os.path.isdir(root):
        return out
    for name in sorted(os.listdir(root)):
        d = os.path.join(root, name)
        if not os.path.isdir(d) or name.startswith(".") or not NAME_PATTERN.match(name):
            continue
        vs = [v for v in os.listdir(d) if os.path.isdir(os.path.join(d, v)) and NAME_PATTERN.match(v)]
        if vs:
            out[name] = tuple(sorted(vs, key=version_sort_key, reverse=True))
    return out


def model_files(root: str) -> dict[str, str]:
    """'model@version' -> the model.onnx path of every version under `root`, and 'model' ->
    that of its highest version: the one a request for '' or 'latest' is routed to unless
    policy.yaml pins a default_version. The planner's `--registry` lists models through this
    (the planner may not import cluster/), so the planner and the registry hold one order."""
    out = {}
    for model, versions in versions_on_disk(root).items():
        for v in versions:
            out[f"{model}@{v}"] = os.path.join(root, model, v, "model.onnx")
        out[model] = out[f"{model}@{versions[0]}"]
    return out


class LoadedVersion:
    """A loaded model version: its files, config and frontier, and the leases on it."""

    def __init__(self, files: VersionFiles, frontier: VersionFrontier) -> None:
        self.files = files
        self.frontier = frontier
        self.model = files.model
        self.version = files.version
        self.config = files.config
        self.in_flight = 0
        self.retired = False
        self.drained = threading.Event()

    @property
    def key(self) -> str:
        return f"{self.model}@{self.version}"

    def __repr__(self) -> str:
        return f"LoadedVersion({self.key}, in_flight={self.in_flight}, retired={self.retired})"


@dataclass(frozen=True)
class _ModelState:
    versions: Mapping[str, LoadedVersion]
    default_version: str | None
    canary: Canary | None


class Registry:
    """The loaded versions of every model and who gets which. Thread-safe.

    `on_loaded(v)` runs after a version loads (the gateway preloads its tails);
    `on_drained(v)` runs once a retired version's last lease ends (the gateway
    closes its pools).
    """

    def __init__(
        self,
        root: str,
        *,
        policy: VersionPolicy | None = None,
        cache_dir: str | None = None,
        policy_dir: str | None = None,
    ) -> None:
        if not os.path.isdir(root):
            raise RegistryError(path=root, reason="is not a directory",
                                fix="point --registry at the directory holding <model>/<version>/model.onnx")
        self.root = root
        self.policy = policy or VersionPolicy()
        self.cache_dir = cache_dir
        self.policy_dir = policy_dir
        """Directory of `<model>.policy.yaml` overriding `<root>/<model>/policy.yaml` (None: none)."""
        self._lock = threading.Lock()
        self._models: dict[str, _ModelState] = {}
        self._pending: dict[str, str] = {}
        self.scanned = False
        """True once `load_all` has read the directory (until then nothing is known to load)."""
        self._stop_loading = threading.Event()
        self.on_loaded: list[Callable[[LoadedVersion], None]] = []
        self.on_drained: list[Callable[[LoadedVersion], None]] = []
        self.on_failed: list[Callable[[str, str, BaseException], None]] = []
        """`on_failed(model, version, error)` runs for each version `load_all` could not load
        ('' for a model whose policy could not be read); the gateway counts them."""

    # -- discovery ----------------------------------------------------------------------

    def available(self) -> dict[str, tuple[str, ...]]:
        """model -> versions on disk, highest first (see `versions_on_disk`)."""
        return versions_on_disk(self.root)

    def _override_path(self, model: str) -> str | None:
        return os.path.join(self.policy_dir, model + POLICY_FILE_SUFFIX) if self.policy_dir else None

    def volume_policy(self, model: str) -> tuple[VersionPolicy, str | None, Canary | None]:
        """`<root>/<model>/policy.yaml`: (version policy, default version, canary); registry defaults else."""
        path = os.path.join(self.root, model, "policy.yaml")
        if not os.path.exists(path):
            return self.policy, None, None
        with open(path, "rb") as fh:
            return parse_policy(fh.read(), path=path, fallback=self.policy)

    def model_policy(self, model: str) -> tuple[VersionPolicy, str | None, Canary | None]:
        """The policy of a model: its file in `policy_dir` if there is one, else `volume_policy`."""
        override = self._override_path(model)
        if override is not None and os.path.exists(override):
            with open(override, "rb") as fh:
                return parse_policy(fh.read(), path=override, fallback=self.policy)
        return self.volume_policy(model)

    def load_all(self, *, keep_going: bool = False) -> list[LoadedVersion]:
        """Loads, for every model on disk, the versions its policy selects; applies policy.yaml.

        Until each is loaded, `not_ready()` says why (see [Note: not ready]). Without
        `keep_going` the first failure is raised; with it, a model that fails is
        recorded there and logged, and the others still load.
        """
        plans = []
        pending: dict[str, str] = {}
        available = self.available()
        for model in self._model_dirs():
            if model not in available:
                pending[model] = (f"no versions: {os.path.join(self.root, model)} holds no <version>/ directory; "
                                  f"put the model in {model}/1/model.onnx")
        for model, versions in available.items():
            try:
                policy, default, canary = self._start_policy(model)
            except RegistryError as e:
                if not keep_going:
                    raise
                pending[model] = f"failed: {e}"
                self._failed(model, [""], e)
                continue
            selected = policy.select(versions)
            if not selected:
                pending[model] = (f"no versions: its version policy {policy.kind} {list(policy.versions)} selects "
                                  f"none of {list(versions)}")
            for v in selected:
                pending[f"{model}@{v}"] = "queued"
            plans.append((model, selected, default, canary))
        with self._lock:
            self._pending = dict(pending)
            self.scanned = True
        for key, why in pending.items():
            if why != "queued":
                logger.error("not serving %s: %s", key, why)
        loaded = []
        for model, selected, default, canary in plans:
            try:
                for v in selected:
                    if self._stop_loading.is_set():
                        logger.info("stopped loading the registry before %s@%s", model, v)
                        return loaded
                    self._set_pending(f"{model}@{v}", "loading")
                    loaded.append(self.load(model, v))
                    self._set_pending(f"{model}@{v}", None)
                if default is not None:
                    self.set_default(model, default)
                if canary is not None:
                    self.set_canary(model, canary.version, canary.percent)
            except Exception as e:
                self._record_failure(model, selected, e)
                if not keep_going:
                    raise
                logger.error("not serving %s: %s", model, e, exc_info=not isinstance(e, ClusterError))
        return loaded

    def _record_failure(self, model: str, selected: Sequence[str], e: BaseException) -> None:
        with self._lock:
            pending = dict(self._pending)
            failed = [v for v in selected if pending.get(f"{model}@{v}") == "loading"]
            for v in selected:
                key = f"{model}@{v}"
                if pending.get(key) == "loading":
                    pending[key] = f"failed: {e}"
                elif pending.get(key) == "queued":
                    pending[key] = f"failed: not loaded, as {model}@{failed[0]} failed first"
            if not failed:  # its default or canary could not be set
                pending[model] = f"failed: {e}"
            self._pending = pending
        self._failed(model, failed or [""], e)

    def _failed(self, model: str, versions: Sequence[str], e: BaseException) -> None:
        for v in versions:
            for hook in self.on_failed:
                try:
                    hook(model, v, e)
                except Exception:  # noqa: BLE001 - a failing hook must not hide the load failure
                    logger.exception("on_failed hook failed for %s@%s", model, v)

    def stop_loading(self) -> None:
        """A running `load_all` loads no further version (the process is shutting down)."""
        self._stop_loading.set()

    def _model_dirs(self) -> list[str]:
        return sorted(n for n in os.listdir(self.root)
                      if NAME_PATTERN.match(n) and os.path.isdir(os.path.join(self.root, n)))

    def _start_policy(self, model: str) -> tuple[VersionPolicy, str | None, Canary | None]:
        try:
            return self.model_policy(model)
        except RegistryError as e:
            if self.policy_dir is None or e.path != self._override_path(model):
                raise
            # The override is someone's half-finished edit of the ConfigMap: serving the
            # volume's policy keeps the gateway up until a good one arrives.
            logger.error("ignoring the policy of %s: %s; using %s/policy.yaml or the defaults", model, e, model)
            return self.volume_policy(model)

    def _set_pending(self, key: str, why: str | None) -> None:
        with self._lock:
            pending = dict(self._pending)
            if why is None:
                pending.pop(key, None)
            else:
                pending[key] = why
            self._pending = pending

    def not_ready(self) -> dict[str, str]:
        """'model@version' or 'model' -> why it is not serving: 'queued', 'loading', 'failed: <error>'
        or 'no versions: ...'. Empty once `load_all` has loaded everything it found."""
        with self._lock:
            return dict(self._pending)

    # -- explicit load and unload -------------------------------------------------------

    def load(self, model: str, version: str) -> LoadedVersion:
        """Loads one version (reading its config and frontier) and runs the on_loaded hooks.

        Blocking (it may cut the model): call it off the event loop. Loading a loaded
        version returns it unchanged.
        """
        with self._lock:
            state = self._models.get(model)
            if state is not None and version in state.versions:
                return state.versions[version]
        files = VersionFiles(self.root, model, version, cache_dir=self.cache_dir)
        files.check_inputs()
        lv = LoadedVersion(files, files.frontier())
        for hook in self.on_loaded:
            hook(lv)
        with self._lock:
            state = self._models.get(model) or _ModelState({}, None, None)
            versions = dict(state.versions)
            versions[version] = lv
            self._models[model] = dataclasses.replace(state, versions=versions)
        logger.info("loaded %s (%d frontier cuts: %s)", lv.key, len(lv.frontier.cuts), ", ".join(lv.frontier.cut_ids))
        return lv

    def unload(self, model: str, version: str) -> LoadedVersion:
        """Takes a version out of service; requests already on it finish (see [Note: leases and rollback])."""
        with self._lock:
            state = self._state(model)
            lv = state.versions.get(version)
            if lv is None:
                raise UnknownVersionError(model=model, version=version, known=self._known(state))
            versions = {k: v for k, v in state.versions.items() if k != version}
            canary = state.canary if state.canary is None or state.canary.version != version else None
            default = state.default_version if state.default_version != version else None
            self._models[model] = _ModelState(versions, default, canary)
            lv.retired = True
            drained = lv.in_flight == 0
        logger.info("unloaded %s (%d requests still in flight finish on it)", lv.key, lv.in_flight)
        if drained:
            self._drain(lv)
        return lv

    def _drain(self, lv: LoadedVersion) -> None:
        lv.drained.set()
        for hook in self.on_drained:
            try:
                hook(lv)
            except Exception:  # noqa: BLE001 - one failing hook must not keep the others from running
                logger.exception("on_drained hook failed for %s", lv.key)

    # -- routing ------------------------------------------------------------------------

    def _state(self, model: str) -> _ModelState:
        state = self._models.get(model)
        if state is None or not state.versions:
            raise UnknownModelError(model=model, known=sorted(m for m, s in self._models.items() if s.versions))
        return state

    @staticmethod
    def _known(state: _ModelState) -> list[str]:
        return sorted(state.versions, key=version_sort_key, reverse=True)

    def _default(self, state: _ModelState) -> str:
        if state.default_version is not None and state.default_version in state.versions:
            return state.default_version
        return self._known(state)[0]

    def set_default(self, model: str, version: str) -> None:
        """Routed requests go to `version` (it must be loaded)."""
        with self._lock:
            state = self._state(model)
            if version not in state.versions:
                raise UnknownVersionError(model=model, version=version, known=self._known(state))
            self._models[model] = dataclasses.replace(state, default_version=version)
        logger.info("default version of %s is now %s", model, version)

    def set_canary(self, model: str, version: str, percent: float) -> None:
        """`percent` of devices, chosen by `canary_fraction`, get `version` (it must be loaded)."""
        try:
            canary = Canary(version, float(percent))
        except ValueError as e:
            raise RegistryError(path=f"{model}/canary", reason=str(e), fix="give a percent from 0 to 100") from e
        with self._lock:
            state = self._state(model)
            if version not in state.versions:
                raise UnknownVersionError(model=model, version=version, known=self._known(state))
            # The default is pinned first, so loading the canary never moves the other devices.
            default = self._default(state) if state.default_version is None else state.default_version
            if default == version:
                others = [v for v in self._known(state) if v != version]
                if not others:
                    raise RegistryError(path=f"{model}/canary", reason=f"{version} is the only loaded version",
                                        fix="load the baseline version first")
                default = others[0]
            self._models[model] = _ModelState(state.versions, default, canary)
        logger.info("canary of %s: %.1f%% of devices get %s, the rest %s", model, canary.percent, version, default)

    def rollback(self, model: str, *, unload: bool = True) -> str | None:
        """Ends the canary in one call: every device goes back to the default version.

        With `unload`, the canary version is retired; its in-flight requests finish on it.
        Returns the version rolled back, or None when there was no canary.
        """
        with self._lock:
            state = self._state(model)
            canary = state.canary
            self._models[model] = dataclasses.replace(state, canary=None)
        if canary is None:
            logger.info("rollback of %s: no canary", model)
            return None
        logger.info("rolled back %s: canary %s (%.1f%%) removed", model, canary.version, canary.percent)
        if unload and canary.version != self.default_version(model):
            self.unload(model, canary.version)
        return canary.version

    def promote(self, model: str) -> str:
        """The canary becomes the default version for every device."""
        with self._lock:
            state = self._state(model)
            if state.canary is None:
                raise RegistryError(path=f"{model}/canary", reason="there is no canary to promote",
                                    fix="start one with set_canary first")
            version = state.canary.version
            self._models[model] = _ModelState(state.versions, version, None)
        logger.info("promoted %s@%s to default", model, version)
        return version

    def apply_policy(self, model: str, data: bytes | str | None = None, *, path: str = "") -> dict[str, Any]:
        """Makes `model` follow a policy now, while serving (see [Note: live policy]).

        `data` is the text of a policy file (`path` names it in errors); None means
        `volume_policy`. Blocking (it may load versions): call it off the event loop.
        Returns what changed: {versions, default, canary, loaded, retired}.
        """
        if data is None:
            policy, default, canary = self.volume_policy(model)
            path = path or os.path.join(self.root, model, "policy.yaml")
        else:
            path = path or f"{model}{POLICY_FILE_SUFFIX}"
            policy, default, canary = parse_policy(data, path=path, fallback=self.policy)
        on_disk = self.available().get(model, ())
        wanted = policy.select(on_disk)
        if not wanted:
            raise RegistryError(path=path, reason=f"version_policy loads no version of {model!r} "
                                                  f"(on disk: {list(on_disk)})",
                                fix=f"copy a version to {os.path.join(self.root, model)}/<version>, "
                                    "or name one that is there")
        for field, v in (("default_version", default), ("canary version", canary and canary.version)):
            if v is not None and v not in wanted:
                where = ("is not loaded by its version_policy" if v in on_disk
                         else f"is not in the registry (on disk: {list(on_disk)})")
                raise RegistryError(path=path, reason=f"{field} {v!r} {where}",
                                    fix=f"list it in version_policy, or copy it to {self.root}/{model}/{v} first")
        with self._lock:
            state = self._models.get(model)
            have = dict(state.versions) if state else {}
            current = self._default(state) if state and state.versions else None
        if canary is not None and default is None:
            # As in set_canary: the devices off the canary stay where they are.
            others = [v for v in wanted if v != canary.version]
            default = current if current in others else (others[0] if others else None)
        if canary is not None and default in (None, canary.version):
            raise RegistryError(path=path, reason=f"canary {canary.version!r} leaves no other version to fall "
                                                  "back to", fix="give a default_version different from the canary")
        # Pinned, so the versions about to retire never become the default in between.
        default = default if default is not None else wanted[0]
        added: list[LoadedVersion] = []
        try:
            for v in wanted:
                if v not in have:
                    added.append(self.load(model, v))
        except Exception:
            for lv in added:
                self.unload(model, lv.version)
            raise
        with self._lock:
            state = self._state(model)
            old_canary = state.canary
            self._models[model] = _ModelState(state.versions, default, canary)
        retired = [v for v in sorted(have, key=version_sort_key) if v not in wanted]
        for v in retired:
            self.unload(model, v)
        out = {"versions": list(wanted), "default": self.default_version(model),
               "canary": dataclasses.asdict(canary) if canary else None,
               "loaded": [lv.version for lv in added], "retired": retired}
        if old_canary is not None and canary is None:
            logger.info("rolled back %s from %s: canary %s (%.1f%%) removed", model, path, old_canary.version,
                        old_canary.percent)
        logger.info("applied the policy of %s from %s: %s", model, path, json.dumps(out, sort_keys=True))
        return out

    def default_version(self, model: str) -> str:
        with self._lock:
            return self._default(self._state(model))

    def canary(self, model: str) -> Canary | None:
        with self._lock:
            return self._state(model).canary

    def resolve(self, model: str, version: str, device_id: str = "") -> LoadedVersion:
        """The loaded version a request for `model@version` from `device_id` goes to."""
        with self._lock:
            return self._resolve(model, version, device_id)

    def _resolve(self, model: str, version: str, device_id: str) -> LoadedVersion:
        try:
            state = self._state(model)
            if version in ROUTED_VERSIONS:
                version = route(model, self._default(state), state.canary, device_id)
            lv = state.versions.get(version)
            if lv is None:
                raise UnknownVersionError(model=model, version=version, known=self._known(state))
        except (UnknownModelError, UnknownVersionError) as e:
            raise self._unserved(model, version) or e from None
        return lv

    def _unserved(self, model: str, version: str) -> ClusterError | None:
        """Why `model@version` (any version when routed) is not served, when `load_all` found it:
        FailedPrecondition naming the cause of a failed load, Unavailable while it loads; else None."""
        pending = self._pending
        if version in ROUTED_VERSIONS:
            found = [(k, why) for k, why in pending.items() if k == model or k.startswith(model + "@")]
        else:
            found = [(k, pending[k]) for k in (f"{model}@{version}", model) if k in pending]
        if not found:
            return None
        key, why = found[0]
        if why in ("queued", "loading"):
            return Unavailable(reason=f"{key} is {why}; retry once GET /readyz lists it among the versions")
        return FailedPrecondition(reason=f"{key} is not served: {why}",
                                  fix="fix it as the cause says and restart the gateway (GET /readyz lists every "
                                      "model that failed and why)")

    @contextmanager
    def lease(self, model: str, version: str, device_id: str = "") -> Iterator[LoadedVersion]:
        """Routes a request and holds its version until the block ends."""
        with self._lock:
            lv = self._resolve(model, version, device_id)
            lv.in_flight += 1
        try:
            yield lv
        finally:
            with self._lock:
                lv.in_flight -= 1
                drained = lv.retired and lv.in_flight == 0
            if drained:
                self._drain(lv)

    def loaded(self) -> list[LoadedVersion]:
        with self._lock:
            return [lv for s in self._models.values() for lv in s.versions.values()]

    def describe(self) -> dict[str, Any]:
        """model -> {versions, default, canary}: what /readyz-style status pages show."""
        with self._lock:
            return {
                m: {
                    "versions": self._known(s),
                    "default": self._default(s) if s.versions else None,
                    "canary": dataclasses.asdict(s.canary) if s.canary else None,
                }
                for m, s in self._models.items()
                if s.versions
            }

    def to_json(self) -> str:
        return json.dumps(self.describe(), sort_keys=True)
