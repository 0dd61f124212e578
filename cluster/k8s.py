"""Kubernetes operations on an installed cloud tier: status, scale, canary rollout, rollback.

The only module of the project that imports `kubernetes`. It works on the objects the Helm
chart (helm/splitinfer) creates:

- pods labelled `app.kubernetes.io/instance=<release>` (component gateway, planner, ray)
  and KubeRay's `ray.io/cluster=<raycluster>` pods;
- nodes, for their allocatable `nvidia.com/gpu`;
- the RayCluster `<fullname>-ray` (ray.io/v1), whose worker groups `scale` patches;
- the ConfigMap `<release>-registry`, which holds the registry's rollout state.

[Note: registry ConfigMap]
Each model's rollout state is one data key, `<model>.policy.yaml`, whose text is exactly a
registry `policy.yaml` (`version_policy`, `default_version`, `canary`; see docs/registry.md
and `cluster.registry.Registry.model_policy`). The chart mounts the ConfigMap into the
gateway pods, and `splitinfer gateway --policy-dir` polls the mounted files and applies
a changed policy live (docs/cluster-ops.md); `make_policy_files` maps the keys to the
registry's own `<model>/policy.yaml` paths for tools that copy them instead.
Model names are valid ConfigMap keys as they are ([A-Za-z0-9][A-Za-z0-9._-]*).

[Note: optimistic concurrency]
Every patch carries the `metadata.resourceVersion` it was computed from, so the API server
refuses it with 409 Conflict when someone else wrote the object in between. On a conflict
the object is read again, the change recomputed from the fresh copy and sent again, a
bounded number of times; then `KubeConflict`. Nothing is ever written blind.

The pure parts (the policy keys, the errors) live in cluster._k8s_policy, which does not
need the `kubernetes` client; everything public there is re-exported here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import kubernetes
import urllib3
from kubernetes.client.exceptions import ApiException

from cluster._k8s_policy import (
    POLICY_KEY_SUFFIX,
    KubeConflict,
    KubeForbidden,
    KubeNotFound,
    KubernetesError,
    ModelRollout,
    ReplicasOutOfRange,
    compute_promote,
    compute_rollback,
    compute_rollout,
    make_policy_files,
    parse_percent,
    rollout_of,
)

__all__ = [
    "ClusterTarget",
    "KubeOps",
    "KubernetesError",
    "KubeForbidden",
    "KubeNotFound",
    "KubeConflict",
    "ReplicasOutOfRange",
    "PodInfo",
    "NodeGpus",
    "WorkerGroup",
    "ModelRollout",
    "ClusterStatus",
    "POLICY_KEY_SUFFIX",
    "connect",
    "choose_config_source",
    "compute_rollout",
    "compute_rollback",
    "compute_promote",
    "default_namespace",
    "make_policy_files",
    "parse_percent",
]

logger = logging.getLogger(__name__)

GPU_RESOURCE = "nvidia.com/gpu"
_RAY_GROUP, _RAY_VERSION, _RAY_PLURAL = "ray.io", "v1", "rayclusters"
_INCLUSTER_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


# ---------------------------------------------------------------------------- values


@dataclass(frozen=True)
class ClusterTarget:
    """Which release's objects the operations touch."""

    namespace: str
    """Namespace the chart was installed in."""
    release: str
    """Helm release name."""
    raycluster: str = ""
    """RayCluster name; empty means the chart's default `<fullname>-ray`."""
    configmap: str = ""
    """Registry ConfigMap name; empty means the chart's `<release>-registry`."""

    @property
    def raycluster_name(self) -> str:
        if self.raycluster:
            return self.raycluster
        # Mirrors splitinfer.fullname in the chart's _helpers.tpl (without nameOverride).
        full = self.release if "splitinfer" in self.release else f"{self.release}-splitinfer"
        return f"{full[:63].rstrip('-')}-ray"[:50].rstrip("-")

    @property
    def configmap_name(self) -> str:
        return self.configmap or f"{self.release}-registry"[:63].rstrip("-")


@dataclass(frozen=True)
class PodInfo:
    name: str
    component: str
    """gateway, planner, ray-head, ray-worker or the pod's app.kubernetes.io/component."""
    phase: str
    ready: bool
    node: str
    restarts: int
    group: str = ""
    """KubeRay worker group, for Ray pods."""


@dataclass(frozen=True)
class NodeGpus:
    node: str
    gpus_allocatable: int
    gpus_capacity: int


@dataclass(frozen=True)
class WorkerGroup:
    name: str
    replicas: int
    min_replicas: int
    max_replicas: int


@dataclass(frozen=True)
class ClusterStatus:
    namespace: str
    release: str
    pods: tuple[PodInfo, ...]
    nodes: tuple[NodeGpus, ...]
    worker_groups: tuple[WorkerGroup, ...]
    models: tuple[ModelRollout, ...]
    notes: tuple[str, ...] = ()
    """What could not be read, and why (e.g. no RBAC on nodes)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ClusterStatus:
        d = json.loads(text)
        return cls(
            namespace=d["namespace"], release=d["release"],
            pods=tuple(PodInfo(**p) for p in d["pods"]),
            nodes=tuple(NodeGpus(**n) for n in d["nodes"]),
            worker_groups=tuple(WorkerGroup(**g) for g in d["worker_groups"]),
            models=tuple(ModelRollout(**m) for m in d["models"]),
            notes=tuple(d["notes"]),
        )


# ---------------------------------------------------------------------------- connecting


def choose_config_source(mode: str, environ: Mapping[str, str]) -> str:
    """'in-cluster' or 'kubeconfig' for mode 'auto' (in a pod: in-cluster), or the mode forced."""
    if mode not in ("auto", "in-cluster", "kubeconfig"):
        raise KubernetesError(reason=f"config source {mode!r} is unknown", fix="use auto, in-cluster or kubeconfig")
    if mode != "auto":
        return mode
    return "in-cluster" if environ.get("KUBERNETES_SERVICE_HOST") else "kubeconfig"


def default_namespace(source: str, kubeconfig: str | None, context: str | None,
                      environ: Mapping[str, str]) -> str:
    """POD_NAMESPACE (set by the chart), the pod's own namespace, the context's, else 'default'."""
    if environ.get("POD_NAMESPACE"):
        return environ["POD_NAMESPACE"]
    if source == "in-cluster":
        try:
            with open(_INCLUSTER_NAMESPACE_FILE, encoding="utf-8") as fh:
                return fh.read().strip() or "default"
        except OSError:
            return "default"
    try:
        contexts, active = kubernetes.config.list_kube_config_contexts(config_file=kubeconfig)
    except (kubernetes.config.ConfigException, OSError):
        return "default"
    ctx = next((c for c in contexts if c["name"] == context), active) if context else active
    return ((ctx or {}).get("context") or {}).get("namespace") or "default"


def connect(source: str = "auto", *, kubeconfig: str | None = None, context: str | None = None,
            environ: Mapping[str, str] | None = None) -> kubernetes.client.ApiClient:
    """An API client from the pod's service account or from a kubeconfig (see choose_config_source)."""
    env = os.environ if environ is None else environ
    chosen = choose_config_source(source, env)
    try:
        if chosen == "in-cluster":
            cfg = kubernetes.client.Configuration()
            kubernetes.config.load_incluster_config(client_configuration=cfg)
            return kubernetes.client.ApiClient(cfg)
        return kubernetes.config.new_client_from_config(config_file=kubeconfig, context=context,
                                                        persist_config=False)
    except (kubernetes.config.ConfigException, OSError) as e:
        path = kubeconfig or env.get("KUBECONFIG") or "~/.kube/config"
        where = ("the pod's service account (KUBERNETES_SERVICE_HOST and the mounted token)"
                 if chosen == "in-cluster" else f"kubeconfig {path!r}")
        raise KubernetesError(reason=f"cannot load Kubernetes credentials from {where}: {e}",
                              fix="pass --kubeconfig/--context, or --config-source in-cluster inside a pod") from e


# ---------------------------------------------------------------------------- operations


def _api_message(e: ApiException) -> str:
    try:
        return str(json.loads(e.body or "{}").get("message") or e.reason)
    except (ValueError, AttributeError):
        return str(e.reason)


class KubeOps:
    """The `splitinfer cluster` operations on one release, over one API client."""

    def __init__(self, api: kubernetes.client.ApiClient, target: ClusterTarget, *,
                 max_attempts: int = 5, backoff_s: float = 0.05,
                 sleep: Callable[[float], None] = time.sleep, request_timeout_s: float = 15.0) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts {max_attempts} must be >= 1")
        self.target = target
        self.core = kubernetes.client.CoreV1Api(api)
        self.custom = kubernetes.client.CustomObjectsApi(api)
        self.max_attempts = max_attempts
        self._backoff_s = backoff_s
        self._sleep = sleep
        self._timeout_s = request_timeout_s

    def _call(self, verb: str, resource: str, name: str, namespace: str, fn: Callable[[], Any], *,
              pass_conflict: bool = False) -> Any:
        """Runs one API call; maps its failures to KubernetesError (409 passes through if asked)."""
        try:
            return fn()
        except ApiException as e:
            if e.status == 403:
                raise KubeForbidden(verb=verb, resource=resource, namespace=namespace, name=name) from e
            if e.status == 404:
                raise KubeNotFound(resource=resource, name=name, namespace=namespace) from e
            if e.status == 409 and pass_conflict:
                raise  # the retry loop handles it
            raise KubernetesError(reason=f"{verb} {resource} {name!r} in namespace {namespace!r} failed: "
                                         f"HTTP {e.status} {_api_message(e)}",
                                  fix="check the API server and the object, then run the command again") from e
        except (OSError, urllib3.exceptions.HTTPError) as e:
            raise KubernetesError(reason=f"cannot reach the Kubernetes API server ({e})",
                                  fix="check --kubeconfig/--context and that the cluster is up") from e

    def _patch_retrying(self, resource: str, name: str, read: Callable[[], Any],
                        build: Callable[[Any], Any], patch: Callable[[Any], Any]) -> Any:
        """Read, build a patch with the read resourceVersion, send; on 409 start over (see the Note)."""
        ns = self.target.namespace
        for attempt in range(1, self.max_attempts + 1):
            obj = self._call("get", resource, name, ns, read)
            body = build(obj)
            try:
                return self._call("patch", resource, name, ns, lambda: patch(body), pass_conflict=True)
            except ApiException as e:  # only 409 gets here
                logger.info("patch of %s %s/%s: 409 Conflict on attempt %d of %d (%s); re-reading",
                            resource, ns, name, attempt, self.max_attempts, _api_message(e))
                if attempt < self.max_attempts:
                    self._sleep(self._backoff_s * attempt)
        raise KubeConflict(resource=resource, name=name, namespace=ns, attempts=self.max_attempts)

    # ---- registry ConfigMap

    def _read_configmap(self) -> Any:
        t = self.target
        return self.core.read_namespaced_config_map(t.configmap_name, t.namespace, _request_timeout=self._timeout_s)

    def _patch_model_policy(self, model: str, change: Callable[[str | None], str]) -> None:
        t = self.target
        key = model + POLICY_KEY_SUFFIX

        def build(cm: Any) -> dict[str, Any]:
            text = change((cm.data or {}).get(key))
            return {"metadata": {"resourceVersion": cm.metadata.resource_version}, "data": {key: text}}

        self._patch_retrying(
            "configmaps", t.configmap_name, self._read_configmap, build,
            lambda body: self.core.patch_namespaced_config_map(
                t.configmap_name, t.namespace, body, _request_timeout=self._timeout_s,
                _content_type="application/strategic-merge-patch+json"))

    def rollout(self, model: str, version: str, percent: float, *, default_version: str | None = None) -> None:
        """`percent`% of devices get model@version; the rest keep the default version."""
        self._patch_model_policy(model, lambda cur: compute_rollout(model, cur, version, percent, default_version))
        logger.info("rollout of %s@%s to %.1f%% of devices recorded in configmap %s/%s",
                    model, version, percent, self.target.namespace, self.target.configmap_name)

    def rollback(self, model: str) -> str | None:
        """Ends the canary; returns the version rolled back (None: there was none)."""
        removed: list[str | None] = []

        def change(cur: str | None) -> str:
            text, gone = compute_rollback(model, cur)
            removed[:] = [gone]
            return text

        self._patch_model_policy(model, change)
        logger.info("rollback of %s: canary %s removed", model, removed[0])
        return removed[0]

    def promote(self, model: str) -> str:
        """The canary becomes every device's default; returns its version."""
        promoted: list[str] = []

        def change(cur: str | None) -> str:
            text, version = compute_promote(model, cur)
            promoted[:] = [version]
            return text

        self._patch_model_policy(model, change)
        logger.info("promoted %s@%s to default", model, promoted[0])
        return promoted[0]

    # ---- RayCluster

    def _read_raycluster(self) -> dict[str, Any]:
        t = self.target
        return self.custom.get_namespaced_custom_object(_RAY_GROUP, _RAY_VERSION, t.namespace, _RAY_PLURAL,
                                                        t.raycluster_name, _request_timeout=self._timeout_s)

    def scale(self, group: str, replicas: int) -> WorkerGroup:
        """Sets a worker group's replicas, within its [minReplicas, maxReplicas]."""
        t = self.target
        result: list[WorkerGroup] = []

        def build(rc: dict[str, Any]) -> dict[str, Any]:
            specs = [dict(s) for s in rc.get("spec", {}).get("workerGroupSpecs") or []]
            match = [s for s in specs if s.get("groupName") == group]
            if not match:
                known = [s.get("groupName") for s in specs]
                raise KubernetesError(
                    reason=f"RayCluster {t.raycluster_name!r} has no worker group {group!r} (it has {known})",
                    fix="enable it with rayCluster.gpuWorkers.enabled=true / cpuWorkers, or pick a listed group")
            spec = match[0]
            lo, hi = int(spec.get("minReplicas", 0)), int(spec.get("maxReplicas", 2**31 - 1))
            if not lo <= replicas <= hi:
                raise ReplicasOutOfRange(group=group, replicas=replicas, min_replicas=lo, max_replicas=hi)
            spec["replicas"] = replicas
            result[:] = [WorkerGroup(group, replicas, lo, hi)]
            # A merge patch replaces the list whole; resourceVersion makes that safe.
            return {"metadata": {"resourceVersion": rc["metadata"]["resourceVersion"]},
                    "spec": {"workerGroupSpecs": specs}}

        self._patch_retrying(
            "rayclusters.ray.io", t.raycluster_name, self._read_raycluster, build,
            lambda body: self.custom.patch_namespaced_custom_object(
                _RAY_GROUP, _RAY_VERSION, t.namespace, _RAY_PLURAL, t.raycluster_name, body,
                _request_timeout=self._timeout_s, _content_type="application/merge-patch+json"))
        logger.info("scaled worker group %s of %s/%s to %d replicas", group, t.namespace, t.raycluster_name, replicas)
        return result[0]

    # ---- status

    def _pods(self, selector: str) -> list[Any]:
        ns = self.target.namespace
        return self._call("list", "pods", "", ns, lambda: self.core.list_namespaced_pod(
            ns, label_selector=selector, _request_timeout=self._timeout_s)).items

    def status(self) -> ClusterStatus:
        """Pods of the release and its RayCluster, GPUs per node, worker groups, model rollouts."""
        t = self.target
        notes: list[str] = []
        pods: dict[str, PodInfo] = {}
        for selector in (f"app.kubernetes.io/instance={t.release}", f"ray.io/cluster={t.raycluster_name}"):
            for p in self._pods(selector):
                pods.setdefault(p.metadata.name, _pod_info(p))
        try:
            items = self._call("list", "nodes", "", "", lambda: self.core.list_node(
                _request_timeout=self._timeout_s)).items
            nodes = tuple(NodeGpus(n.metadata.name, _gpus(n.status.allocatable), _gpus(n.status.capacity))
                          for n in items)
        except KubeForbidden as e:
            nodes = ()
            notes.append(f"GPUs per node unknown: {e} (the chart grants it with rbac.nodeAccess=true)")
        try:
            rc = self._call("get", "rayclusters.ray.io", t.raycluster_name, t.namespace, self._read_raycluster)
            groups = tuple(WorkerGroup(str(s.get("groupName")), int(s.get("replicas", 0)),
                                       int(s.get("minReplicas", 0)), int(s.get("maxReplicas", 0)))
                           for s in rc.get("spec", {}).get("workerGroupSpecs") or [])
        except KubeNotFound as e:
            groups = ()
            notes.append(str(e))
        try:
            cm = self._call("get", "configmaps", t.configmap_name, t.namespace, self._read_configmap)
            models = tuple(rollout_of(path.split("/")[0], text)
                           for path, text in sorted(make_policy_files(cm.data).items()))
        except KubeNotFound as e:
            models = ()
            notes.append(str(e))
        order = {"gateway": 0, "planner": 1, "ray-head": 2, "ray-worker": 3}
        ordered = tuple(sorted(pods.values(), key=lambda p: (order.get(p.component, 9), p.component, p.name)))
        return ClusterStatus(t.namespace, t.release, ordered, nodes, groups, models, tuple(notes))


def _gpus(resources: Mapping[str, str] | None) -> int:
    raw = (resources or {}).get(GPU_RESOURCE, "0")
    try:
        return int(raw)
    except ValueError:  # quantities like "1k" never happen for GPUs; keep status readable anyway
        logger.warning("unexpected %s quantity %r; counted as 0", GPU_RESOURCE, raw)
        return 0


def _pod_info(p: Any) -> PodInfo:
    labels = p.metadata.labels or {}
    node_type = labels.get("ray.io/node-type")
    component = f"ray-{node_type}" if node_type else labels.get("app.kubernetes.io/component", "unknown")
    statuses = (p.status.container_statuses if p.status else None) or []
    return PodInfo(
        name=p.metadata.name, component=component,
        phase=(p.status.phase if p.status else None) or "Unknown",
        ready=bool(statuses) and all(c.ready for c in statuses),
        node=(p.spec.node_name if p.spec else None) or "",
        restarts=sum(int(c.restart_count or 0) for c in statuses),
        group=labels.get("ray.io/group", ""),
    )
