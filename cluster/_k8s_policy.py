"""The registry ConfigMap's policy keys and the errors of the Kubernetes operations.

Pure and free of the `kubernetes` client, so a gateway can turn the ConfigMap into policy
files (`make_policy_files`) without it; `cluster.k8s` re-exports everything here and does
the I/O. See [Note: registry ConfigMap] in cluster/k8s.py.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from cluster.errors import ClusterError
from cluster.registry import POLICY_FILE_SUFFIX, Canary, RegistryError, VersionPolicy, version_sort_key

__all__ = [
    "KubernetesError",
    "KubeForbidden",
    "KubeNotFound",
    "KubeConflict",
    "ReplicasOutOfRange",
    "ModelRollout",
    "POLICY_KEY_SUFFIX",
    "compute_rollout",
    "compute_rollback",
    "compute_promote",
    "make_policy_files",
    "parse_percent",
    "rollout_of",
]

# The gateway reads the keys, mounted as files, under these same names (Registry.policy_dir).
POLICY_KEY_SUFFIX = POLICY_FILE_SUFFIX
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_RBAC_GRANTS = "get/list pods,nodes; get/list/patch rayclusters, configmaps"


# ---------------------------------------------------------------------------- errors


class KubernetesError(ClusterError):
    """A Kubernetes operation that failed; the message names the object and the fix."""

    def __init__(self, *, reason: str, fix: str) -> None:
        self.reason = reason
        self.fix = fix
        super().__init__(f"{reason}; {fix}")


class KubeForbidden(KubernetesError):
    """403: the credentials in use lack an RBAC verb on a resource."""

    def __init__(self, *, verb: str, resource: str, namespace: str = "", name: str = "") -> None:
        where = f" in namespace {namespace!r}" if namespace else " (cluster-scoped)"
        obj = f" {name!r}" if name else ""
        super().__init__(
            reason=f"forbidden: the credentials in use may not {verb} {resource}{obj}{where}",
            fix=f"grant '{verb}' on '{resource}' to them; the chart's RBAC (rbac.create=true, and "
                f"rbac.nodeAccess=true for nodes) grants exactly {_RBAC_GRANTS}",
        )
        self.verb, self.resource, self.namespace, self.name = verb, resource, namespace, name

    def fields(self) -> dict[str, Any]:
        return {"verb": self.verb, "resource": self.resource, "namespace": self.namespace, "name": self.name}


class KubeNotFound(KubernetesError):
    """404: the object does not exist where it was looked for."""

    def __init__(self, *, resource: str, name: str, namespace: str) -> None:
        super().__init__(
            reason=f"{resource} {name!r} not found in namespace {namespace!r}",
            fix="check --namespace and --release (or --raycluster/--configmap) against "
                "'helm list -A', and that the chart is installed with this object enabled",
        )
        self.resource, self.name, self.namespace = resource, name, namespace

    def fields(self) -> dict[str, Any]:
        return {"resource": self.resource, "name": self.name, "namespace": self.namespace}


class KubeConflict(KubernetesError):
    """409 on every try: other writers kept changing the object."""

    def __init__(self, *, resource: str, name: str, namespace: str, attempts: int) -> None:
        super().__init__(
            reason=f"{resource} {name!r} in namespace {namespace!r} kept changing under us: "
                   f"{attempts} patches in a row got 409 Conflict",
            fix="find the other writer (another rollout, a controller, a CI job) and run the command again",
        )
        self.resource, self.name, self.namespace, self.attempts = resource, name, namespace, attempts

    def fields(self) -> dict[str, Any]:
        return {"resource": self.resource, "name": self.name, "namespace": self.namespace,
                "attempts": self.attempts}


class ReplicasOutOfRange(KubernetesError):
    """A replica count outside the worker group's [minReplicas, maxReplicas]."""

    def __init__(self, *, group: str, replicas: int, min_replicas: int, max_replicas: int) -> None:
        super().__init__(
            reason=f"worker group {group!r} needs minReplicas ({min_replicas}) <= replicas <= "
                   f"maxReplicas ({max_replicas}), got replicas={replicas}",
            fix=f"pick a count from {min_replicas} to {max_replicas}, or change "
                f"rayCluster.{group}Workers.minReplicas/maxReplicas with 'helm upgrade'",
        )
        self.group, self.replicas = group, replicas
        self.min_replicas, self.max_replicas = min_replicas, max_replicas

    def fields(self) -> dict[str, Any]:
        return {"group": self.group, "replicas": self.replicas,
                "min_replicas": self.min_replicas, "max_replicas": self.max_replicas}


# ---------------------------------------------------------------------------- rollout state


@dataclass(frozen=True)
class ModelRollout:
    """One model's rollout state as the registry ConfigMap records it."""

    model: str
    default_version: str | None
    canary_version: str | None = None
    canary_percent: float = 0.0
    version_policy: Any = None
    """The `version_policy` value of the policy file, or None for the gateway's default."""




# ---------------------------------------------------------------------------- pure helpers


def parse_percent(text: str) -> float:
    """'10%' or '10' -> 10.0, in (0, 100]."""
    raw = str(text).strip().rstrip("%").strip()
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0.0 < value <= 100.0:
        raise KubernetesError(reason=f"canary share {text!r} is not a percentage in (0, 100]",
                              fix="give it like --canary 10%")
    return value


def _check_model(model: str) -> None:
    if not _MODEL_NAME.match(model):
        raise KubernetesError(reason=f"model name {model!r} is not a registry name",
                              fix="use letters, digits, '.', '_' and '-' (first a letter or digit)")


def _load_policy(model: str, text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        d = yaml.safe_load(text) or {}
        if not isinstance(d, dict):
            raise ValueError("expected a mapping")
    except (yaml.YAMLError, ValueError) as e:
        raise KubernetesError(reason=f"key {model + POLICY_KEY_SUFFIX!r} of the registry ConfigMap is not "
                                     f"a policy file ({e})",
                              fix="fix or remove it with 'kubectl edit configmap'") from e
    return d


def _dump_policy(model: str, d: Mapping[str, Any]) -> str:
    """YAML text of a policy, checked with the registry's own parsers so the gateway accepts it."""
    try:
        if "version_policy" in d:
            VersionPolicy.parse(d["version_policy"])
        if d.get("canary"):
            Canary(str(d["canary"]["version"]), float(d["canary"]["percent"]))
    except (RegistryError, ValueError) as e:
        raise KubernetesError(reason=f"the new policy of {model!r} would be invalid ({e})",
                              fix="see docs/registry.md for version_policy, default_version and canary") from e
    return yaml.safe_dump(dict(d), sort_keys=True)


def _parse_version_policy(model: str, policy: Any) -> VersionPolicy:
    try:
        return VersionPolicy.parse(policy)
    except RegistryError as e:
        raise KubernetesError(reason=f"the recorded version_policy of {model!r} would be invalid ({e})",
                              fix="fix it with 'kubectl edit configmap' (see docs/registry.md)") from e


def _with_versions(model: str, policy: Any, versions: list[str]) -> Any:
    """A `specific` policy widened to load `versions` too; other kinds are left alone."""
    if policy is None:
        return {"specific": sorted(set(versions), key=version_sort_key)}
    parsed = _parse_version_policy(model, policy)
    if parsed.kind != "specific":
        return policy
    return {"specific": sorted(set(parsed.versions) | set(versions), key=version_sort_key)}


def compute_rollout(model: str, current: str | None, version: str, percent: float,
                    default_version: str | None = None) -> str:
    """New policy text: `percent` of devices get `version`, the rest the default version.

    The default is the one recorded, else `default_version`; a canary needs one to fall
    back to. Without a version policy the gateway would load only the highest version,
    so the result pins `{specific: [default, canary]}`; a `specific` policy is widened.
    """
    _check_model(model)
    d = _load_policy(model, current)
    recorded = d.get("default_version")
    if recorded is not None and default_version is not None and str(recorded) != str(default_version):
        raise KubernetesError(
            reason=f"{model!r} records default version {str(recorded)!r}, not {default_version!r}",
            fix="drop --default (it only seeds the first rollout), or promote/roll back first")
    default = recorded if recorded is not None else default_version
    if default is None:
        raise KubernetesError(
            reason=f"no default version is recorded for {model!r}, so the devices off the canary "
                   "would have nowhere to go",
            fix=f"pass --default VERSION (the version {model} serves now) on the first rollout")
    default = str(default)
    if default == version:
        raise KubernetesError(reason=f"{model}@{version} is already the default version",
                              fix="roll out a different version, or roll back the canary")
    d["default_version"] = default
    d["canary"] = {"version": str(version), "percent": float(percent)}
    d["version_policy"] = _with_versions(model, d.get("version_policy"), [default, str(version)])
    return _dump_policy(model, d)


def compute_rollback(model: str, current: str | None) -> tuple[str, str | None]:
    """(new policy text, the canary version removed or None). The canary's version stops loading."""
    _check_model(model)
    d = _load_policy(model, current)
    canary = d.pop("canary", None)
    removed = str(canary["version"]) if canary else None
    vp = d.get("version_policy")
    if removed and vp is not None and removed != str(d.get("default_version")):
        parsed = _parse_version_policy(model, vp)
        if parsed.kind == "specific" and len(parsed.versions) > 1:
            d["version_policy"] = {"specific": [v for v in parsed.versions if v != removed]}
    return _dump_policy(model, d), removed


def compute_promote(model: str, current: str | None) -> tuple[str, str]:
    """(new policy text, the promoted version): the canary becomes every device's default."""
    _check_model(model)
    d = _load_policy(model, current)
    canary = d.pop("canary", None)
    if not canary:
        raise KubernetesError(reason=f"{model!r} has no canary to promote",
                              fix="start one with 'splitinfer cluster rollout MODEL@VERSION --canary 10%'")
    d["default_version"] = str(canary["version"])
    return _dump_policy(model, d), str(canary["version"])


def make_policy_files(data: Mapping[str, str] | None) -> dict[str, str]:
    """ConfigMap data -> {"<model>/policy.yaml": text}: where the registry reads each policy."""
    out = {}
    for key, text in (data or {}).items():
        model = key[: -len(POLICY_KEY_SUFFIX)]
        if key.endswith(POLICY_KEY_SUFFIX) and _MODEL_NAME.match(model):
            out[f"{model}/policy.yaml"] = text
    return out


def rollout_of(model: str, text: str) -> ModelRollout:
    d = _load_policy(model, text)
    c = d.get("canary") or {}
    dv = d.get("default_version")
    return ModelRollout(model=model, default_version=None if dv is None else str(dv),
                        canary_version=str(c["version"]) if c else None,
                        canary_percent=float(c.get("percent", 0.0)) if c else 0.0,
                        version_policy=d.get("version_policy"))
