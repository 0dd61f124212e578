"""Each rendered workload of the Helm chart: security, probes, resources,
labels, autoscaling, RBAC, volumes, secrets, Ray, monitoring and the edge agent.

Rendering is real Helm through helm-python-sdk, offline (see test_helm_chart.py).
"""

from __future__ import annotations

import functools
import json
import shlex
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from cluster.auth import TokenTable

pytestmark = pytest.mark.helm

CHART_DIR = Path(__file__).resolve().parents[2] / "helm" / "splitinfer"
RELEASE = "demo"
NAMESPACE = "ml"
FULLNAME = "demo-splitinfer"
KUBE_VERSION = "1.30.0"
VALUE_FILES = {
    "default": None,
    "gpu": "gpu-values.yaml",
    "tls-mtls": "tls-mtls-values.yaml",
    "existing-secrets": "existing-secrets-values.yaml",
    "edge-daemonset": "edge-daemonset-values.yaml",
}
LABEL_KEYS = {
    "app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
    "app.kubernetes.io/component", "app.kubernetes.io/part-of", "app.kubernetes.io/managed-by",
    "helm.sh/chart",
}
SELECTOR_KEYS = {"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component"}


@functools.lru_cache(maxsize=None)
def _render(value_set: str) -> tuple[dict[str, Any], ...]:
    name = VALUE_FILES[value_set]
    values = None if name is None else yaml.safe_load((CHART_DIR / "ci" / name).read_text())
    with helm.Chart.load(CHART_DIR) as chart:
        out = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return tuple(d for path, text in sorted(out.items()) if path.endswith(".yaml")
                 for d in yaml.safe_load_all(text) if d)


def _one(value_set: str, kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in _render(value_set) if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _all(value_set: str, kind: str) -> list[dict[str, Any]]:
    return [d for d in _render(value_set) if d["kind"] == kind]


def _pod_specs(value_set: str) -> dict[str, dict[str, Any]]:
    """Every pod template of the release, keyed by a readable name."""
    specs = {}
    for doc in _render(value_set):
        if doc["kind"] in ("Deployment", "DaemonSet"):
            specs[doc["metadata"]["name"]] = doc["spec"]["template"]
        elif doc["kind"] == "RayCluster":
            specs["ray-head"] = doc["spec"]["headGroupSpec"]["template"]
            for group in doc["spec"]["workerGroupSpecs"]:
                specs[f"ray-{group['groupName']}"] = group["template"]
    return specs


def _container(value_set: str, deployment: str) -> dict[str, Any]:
    (container,) = _one(value_set, "Deployment", deployment)["spec"]["template"]["spec"]["containers"]
    return container


# --- pod security (restricted profile) ---------------------------------------


RESTRICTED_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


@pytest.mark.parametrize("value_set", VALUE_FILES)
def test_every_workload_meets_the_restricted_pod_security_profile(value_set: str) -> None:
    specs = _pod_specs(value_set)
    expected = {f"{FULLNAME}-gateway"}
    if value_set != "edge-daemonset":
        expected.add(f"{FULLNAME}-planner")
    if value_set != "existing-secrets":
        expected |= {"ray-head", "ray-cpu"}
    if value_set == "gpu":
        expected.add("ray-gpu")
    if value_set == "edge-daemonset":
        expected.add(f"{FULLNAME}-edge-agent")
    assert set(specs) == expected
    for name, template in specs.items():
        pod = template["spec"]
        ctx = pod["securityContext"]
        assert ctx["runAsNonRoot"] is True, name
        assert ctx["runAsUser"] > 0, name
        assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for forbidden in ("hostNetwork", "hostPID", "hostIPC"):
            assert not pod.get(forbidden), (name, forbidden)
        assert all("hostPath" not in v for v in pod["volumes"]), name
        tmp = {v["name"]: v for v in pod["volumes"]}["tmp"]
        assert "emptyDir" in tmp, name
        for container in pod["containers"]:
            assert container["securityContext"] == RESTRICTED_CONTAINER, (name, container["name"])
            assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"], name
            assert all("hostPort" not in p for p in container.get("ports", [])), name


def test_the_kuberay_autoscaler_sidecar_gets_the_restricted_context_too() -> None:
    (rc,) = _all("default", "RayCluster")
    options = rc["spec"]["autoscalerOptions"]
    assert options["securityContext"] == RESTRICTED_CONTAINER
    # Its read-only root needs the head pod's /tmp emptyDir.
    assert options["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    head_volumes = {v["name"] for v in rc["spec"]["headGroupSpec"]["template"]["spec"]["volumes"]}
    assert "tmp" in head_volumes


def test_only_the_gateway_mounts_the_service_account_token() -> None:
    specs = _pod_specs("edge-daemonset")
    assert specs[f"{FULLNAME}-gateway"]["spec"]["automountServiceAccountToken"] is True
    assert specs[f"{FULLNAME}-gateway"]["spec"]["serviceAccountName"] == FULLNAME
    assert specs[f"{FULLNAME}-edge-agent"]["spec"]["automountServiceAccountToken"] is False
    assert specs["ray-cpu"]["spec"]["automountServiceAccountToken"] is False
    planner = _pod_specs("default")[f"{FULLNAME}-planner"]["spec"]
    assert planner["automountServiceAccountToken"] is False
    (sa,) = _all("default", "ServiceAccount")
    assert sa["automountServiceAccountToken"] is False


# --- resources -----------------------------------------------------------------


@pytest.mark.parametrize("value_set", VALUE_FILES)
def test_every_container_requests_and_limits_cpu_and_memory(value_set: str) -> None:
    for name, template in _pod_specs(value_set).items():
        for container in template["spec"]["containers"]:
            res = container["resources"]
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(res[part]), (name, part)
    for rc in _all(value_set, "RayCluster"):
        res = rc["spec"]["autoscalerOptions"]["resources"]
        assert {"cpu", "memory"} <= set(res["requests"]) and {"cpu", "memory"} <= set(res["limits"])


def test_gpu_workers_request_gpus_and_land_on_gpu_nodes() -> None:
    (rc,) = _all("gpu", "RayCluster")
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"cpu", "gpu"}
    gpu = groups["gpu"]
    assert (gpu["replicas"], gpu["minReplicas"], gpu["maxReplicas"]) == (1, 0, 8)
    spec = gpu["template"]["spec"]
    (container,) = spec["containers"]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert container["resources"]["requests"]["memory"] == "16Gi"
    assert container["image"] == "splitinfer/splitinfer-gpu:0.1.0-cuda12"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true",
                                    "cloud.google.com/gke-accelerator": "nvidia-l4"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    (cpu_container,) = groups["cpu"]["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in cpu_container["resources"]["limits"]
    assert cpu_container["image"] == "splitinfer/splitinfer:0.1.0"
    assert (groups["cpu"]["replicas"], groups["cpu"]["minReplicas"], groups["cpu"]["maxReplicas"]) == (2, 1, 6)


def test_worker_groups_declare_their_ray_resources_as_kuberay_and_ray_start_read_them() -> None:
    """model.yaml's ray_resources place a model's tail workers on the groups that
    declare them (rayCluster.*Workers.rayResources). The rendered rayStartParams value
    is read here by the parts that read it in a cluster: Ray's own KubeRay autoscaler
    config reader (it must know what a group adds before scaling it up), and a shell
    splitting the ``ray start`` line that KubeRay writes."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _get_custom_resources

    (rc,) = _all("gpu", "RayCluster")
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    want = {"gpu": {"splitinfer-gpu-tier": 1000}, "cpu": {"splitinfer-cpu-tier": 1000}}
    for name, resources in want.items():
        params = groups[name]["rayStartParams"]
        assert all(isinstance(v, str) for v in params.values())
        assert _get_custom_resources({}, params, name) == resources
        (arg,) = shlex.split(f"--resources={params['resources']}")
        assert json.loads(arg.removeprefix("--resources=")) == resources
    (default,) = _all("default", "RayCluster")
    assert [g["rayStartParams"] for g in default["spec"]["workerGroupSpecs"]] == [{}]


@pytest.mark.parametrize(("bad", "error", "needle"), [
    ({"splitinfer-gpu-tier": 0.5}, helm.HelmValuesError, "at '/rayCluster/gpuWorkers/rayResources/splitinfer-gpu-tier'"),
    ({"splitinfer-gpu-tier": 0}, helm.HelmValuesError, "at '/rayCluster/gpuWorkers/rayResources/splitinfer-gpu-tier'"),
    ({"CPU": 4}, helm.HelmRenderError, 'rayCluster.gpuWorkers.rayResources names "CPU", which Ray sets itself'),
])
def test_worker_group_ray_resources_must_be_whole_custom_units(bad: dict[str, Any], error: type, needle: str) -> None:
    values = {"rayCluster": {"gpuWorkers": {"enabled": True, "rayResources": bad}}}
    with pytest.raises(error) as excinfo:
        with helm.Chart.load(CHART_DIR) as chart:
            chart.render(values, name=RELEASE, namespace=NAMESPACE)
    assert needle in str(excinfo.value)


# --- labels and selectors ------------------------------------------------------


@pytest.mark.parametrize("value_set", VALUE_FILES)
def test_labels_follow_app_kubernetes_io_and_selectors_use_only_stable_ones(value_set: str) -> None:
    for doc in _render(value_set):
        labels = doc["metadata"]["labels"]
        assert LABEL_KEYS <= set(labels), (doc["kind"], doc["metadata"]["name"])
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["app.kubernetes.io/part-of"] == "splitinfer"
        assert labels["app.kubernetes.io/version"] == "0.1.0"
        assert labels["helm.sh/chart"] == "splitinfer-0.1.0"
    components = {}
    for kind in ("Deployment", "DaemonSet"):
        for doc in _all(value_set, kind):
            selector = doc["spec"]["selector"]["matchLabels"]
            assert set(selector) == SELECTOR_KEYS
            template_labels = doc["spec"]["template"]["metadata"]["labels"]
            assert selector.items() <= template_labels.items()
            assert LABEL_KEYS <= set(template_labels)
            components[doc["metadata"]["name"]] = selector["app.kubernetes.io/component"]
    assert len(set(components.values())) == len(components), "two workloads share a selector"
    pods = {n: t["metadata"]["labels"] for n, t in _pod_specs(value_set).items()}
    for service in _all(value_set, "Service"):
        selector = service["spec"]["selector"]
        assert set(selector) == SELECTOR_KEYS
        matched = [n for n, labels in pods.items() if selector.items() <= labels.items()]
        assert matched == [service["metadata"]["name"]], (service["metadata"]["name"], matched)
    for pdb in _all(value_set, "PodDisruptionBudget"):
        selector = pdb["spec"]["selector"]["matchLabels"]
        matched = [n for n, labels in pods.items() if selector.items() <= labels.items()]
        assert matched == [pdb["metadata"]["name"]]


# --- gateway: command, ports, probes -------------------------------------------


def test_gateway_runs_the_documented_command_with_grpc_readiness() -> None:
    container = _container("default", f"{FULLNAME}-gateway")
    assert container["command"] == ["splitinfer"]
    assert container["args"] == [
        "gateway", "--port", "50051", "--metrics-port", "9090",
        "--ray-address", f"{FULLNAME}-ray-head-svc.{NAMESPACE}.svc:10001", "--registry", "/models",
        "--pool-start-timeout-s", "300",
        "--policy-dir", "/etc/splitinfer/policies", "--policy-poll-s", "5",
    ]
    # The gateway's own parser takes them; a tail that no node takes is reported
    # before the startup probe gives up.
    from splitinfer.gateway_cmd import make_parser

    assert make_parser().parse_args(container["args"][1:]).pool_start_timeout_s == 300.0 < 600
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": 50051, "metrics": 9090}
    assert container["readinessProbe"]["grpc"] == {"port": 50051}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics", "scheme": "HTTP"}
    startup = container["startupProbe"]
    assert startup["httpGet"] == {"path": "/readyz", "port": "metrics", "scheme": "HTTP"}
    # The startup budget covers the configured model-load time.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    assert startup["periodSeconds"] * (startup["failureThreshold"] - 1) < 600


@pytest.mark.parametrize("value_set", ["default", "tls-mtls", "existing-secrets", "edge-daemonset"])
def test_gateway_mounts_the_registry_configmap_read_only_and_polls_it(value_set: str) -> None:
    pod = _one(value_set, "Deployment", f"{FULLNAME}-gateway")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    # The ConfigMap that `splitinfer cluster rollout` patches, as a whole directory:
    # a subPath mount would never see the kubelet's updates.
    assert volumes["policies"]["configMap"]["name"] == f"{RELEASE}-registry"
    assert "items" not in volumes["policies"]["configMap"]
    assert _one(value_set, "ConfigMap", f"{RELEASE}-registry")["kind"] == "ConfigMap"
    (container,) = pod["containers"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["policies"] == {"name": "policies", "mountPath": "/etc/splitinfer/policies", "readOnly": True}
    args = container["args"]
    assert args[args.index("--policy-dir") + 1] == "/etc/splitinfer/policies"
    assert float(args[args.index("--policy-poll-s") + 1]) == 5.0


def test_policy_sync_can_be_turned_off_and_its_poll_interval_set() -> None:
    with helm.Chart.load(CHART_DIR) as chart:
        off = chart.render({"gateway": {"policySync": {"enabled": False}}}, name=RELEASE, namespace=NAMESPACE)
        fast = chart.render({"gateway": {"policySync": {"pollSeconds": 2.5}}}, name=RELEASE, namespace=NAMESPACE)
    pod = yaml.safe_load(off["splitinfer/templates/gateway-deployment.yaml"])["spec"]["template"]["spec"]
    assert "policies" not in {v["name"] for v in pod["volumes"]}
    assert "--policy-dir" not in pod["containers"][0]["args"]
    args = yaml.safe_load(fast["splitinfer/templates/gateway-deployment.yaml"])["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert args[args.index("--policy-poll-s") + 1] == "2.5"


def test_model_load_time_sets_the_startup_budget() -> None:
    with helm.Chart.load(CHART_DIR) as chart:
        out = chart.render({"gateway": {"probes": {"modelLoadTimeoutSeconds": 1805,
                                                   "startupPeriodSeconds": 15}}},
                           name=RELEASE, namespace=NAMESPACE)
    deployment = yaml.safe_load(out["splitinfer/templates/gateway-deployment.yaml"])
    startup = deployment["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    assert (startup["periodSeconds"], startup["failureThreshold"]) == (15, 121)


def test_tls_gateway_gets_cert_flags_mtls_ca_tokens_and_http_readiness() -> None:
    container = _container("tls-mtls", f"{FULLNAME}-gateway")
    args = container["args"]
    assert args[args.index("--tokens-file") + 1] == "/etc/splitinfer/tokens/tokens.yaml"
    assert args[args.index("--tls-cert") + 1] == "/etc/splitinfer/tls/tls.crt"
    assert args[args.index("--tls-key") + 1] == "/etc/splitinfer/tls/tls.key"
    assert args[args.index("--tls-client-ca") + 1] == "/etc/splitinfer/tls/ca.crt"
    # kubelet's gRPC probe cannot speak TLS, so readiness falls back to HTTP(S); the metrics
    # port is HTTPS with the gateway's certificate, so every probe says so.
    assert "grpc" not in container["readinessProbe"]
    for probe in ("startupProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/readyz", "port": "metrics", "scheme": "HTTPS"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics", "scheme": "HTTPS"}
    pod = _one("tls-mtls", "Deployment", f"{FULLNAME}-gateway")["spec"]["template"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    sources = volumes["tls"]["projected"]["sources"]
    assert sources[0]["secret"] == {"name": "splitinfer-gateway-tls", "items": [
        {"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}]}
    assert sources[1]["secret"] == {"name": "splitinfer-edge-ca", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    assert volumes["tokens"]["secret"]["secretName"] == f"{FULLNAME}-tokens"
    assert pod["metadata"]["annotations"]["checksum/tokens"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["tls"] == {"name": "tls", "mountPath": "/etc/splitinfer/tls", "readOnly": True}
    service = _one("tls-mtls", "Service", f"{FULLNAME}-gateway")
    assert service["spec"]["type"] == "LoadBalancer"
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["metrics"]["appProtocol"] == "https" and "appProtocol" not in ports["grpc"]


def test_token_secret_is_created_from_values() -> None:
    secret = _one("tls-mtls", "Secret", f"{FULLNAME}-tokens")
    tokens = yaml.safe_load(secret["stringData"]["tokens.yaml"])
    assert tokens == {"tokens": [
        {"name": "fleet-a", "token": "ci-only-token-aaaaaaaaaaaaaaaa"},
        {"name": "fleet-b", "token": "ci-only-token-bbbbbbbbbbbbbbbb", "max_priority": 0}]}
    # What the gateway reads: its own parser takes the rendered file.
    table = TokenTable.from_dicts(tokens["tokens"])
    assert table.lookup("ci-only-token-bbbbbbbbbbbbbbbb").max_priority == 0


def test_existing_secrets_claim_and_ray_address_are_referenced_not_created() -> None:
    assert _all("existing-secrets", "Secret") == []
    assert _all("existing-secrets", "PersistentVolumeClaim") == []
    assert _all("existing-secrets", "RayCluster") == []
    deployment = _one("existing-secrets", "Deployment", f"{FULLNAME}-gateway")
    assert deployment["spec"]["replicas"] == 3
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "splitinfer-ops"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "shared-model-store", "readOnly": True}
    assert volumes["tokens"]["secret"]["secretName"] == "splitinfer-tokens-prod"
    # The CA comes from the TLS Secret itself, as cert-manager writes it.
    ca_source = volumes["tls"]["projected"]["sources"][1]["secret"]
    assert ca_source == {"name": "splitinfer-gateway-tls", "items": [{"key": "ca.crt", "path": "ca.crt"}]}
    (container,) = pod["containers"]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in container["volumeMounts"]
    args = container["args"]
    assert args[args.index("--ray-address") + 1] == "ray-head-svc.ray-system.svc:10001"


# --- planner -------------------------------------------------------------------


def test_planner_runs_the_documented_command_with_http_probes() -> None:
    container = _container("default", f"{FULLNAME}-planner")
    assert container["args"] == ["planner", "serve", "--host", "0.0.0.0", "--port", "8080",
                                 "--registry", "/models"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["startupProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    service = _one("default", "Service", f"{FULLNAME}-planner")
    assert service["spec"]["ports"] == [{"name": "http", "port": 8080, "targetPort": "http",
                                         "protocol": "TCP", "appProtocol": "http"}]


# --- models volume -------------------------------------------------------------


def test_model_repository_is_mounted_at_models_in_gateway_planner_and_ray() -> None:
    pvc = _one("default", "PersistentVolumeClaim", f"{FULLNAME}-models")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    specs = _pod_specs("default")
    assert set(specs) == {f"{FULLNAME}-gateway", f"{FULLNAME}-planner", "ray-head", "ray-cpu"}
    for name, template in specs.items():
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["models"]["persistentVolumeClaim"]["claimName"] == f"{FULLNAME}-models", name
        for container in template["spec"]["containers"]:
            assert {"name": "models", "mountPath": "/models", "readOnly": False} in container["volumeMounts"]


def test_without_persistence_models_is_an_empty_dir() -> None:
    template = _pod_specs("edge-daemonset")[f"{FULLNAME}-gateway"]
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert volumes["models"] == {"name": "models", "emptyDir": {}}


# --- autoscaling and disruption budgets ----------------------------------------


def _render_with(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Renders the chart with `values`; the objects keyed by (kind, name), and the notes."""
    with helm.Chart.load(CHART_DIR) as chart:
        out = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    docs = {(d["kind"], d["metadata"]["name"]): d for path, text in out.items() if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d}
    docs[("NOTES", "")] = {"text": out["splitinfer/templates/NOTES.txt"]}
    return docs


def test_gateway_hpa_scales_on_the_queue_depth_pods_metric_by_default() -> None:
    (hpa,) = _all("default", "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": f"{FULLNAME}-gateway"}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 10)
    assert hpa["spec"]["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": "splitinfer_queue_depth"},
        "target": {"type": "AverageValue", "averageValue": "8"}}}]
    # The HPA owns the replica count; a fixed one would fight it on upgrade.
    assert "replicas" not in _one("default", "Deployment", f"{FULLNAME}-gateway")["spec"]


HPA_METRICS = {
    "queueDepth": ({"queueDepth": {"targetAverageValue": "12"}},
                   {"type": "Pods", "pods": {"metric": {"name": "splitinfer_queue_depth"},
                                             "target": {"type": "AverageValue", "averageValue": "12"}}}),
    "predictedWait": ({"predictedWait": {"targetMilliseconds": 80}},
                      {"type": "Pods", "pods": {"metric": {"name": "splitinfer_predicted_wait_seconds"},
                                                "target": {"type": "AverageValue", "averageValue": "80m"}}}),
    "inflight": ({"inflight": {"targetAverageValue": 16}},
                 {"type": "Pods", "pods": {"metric": {"name": "splitinfer_inflight_requests"},
                                           "target": {"type": "AverageValue", "averageValue": "16"}}}),
    "cpu": ({"cpu": {"targetAverageUtilization": 60}},
            {"type": "Resource", "resource": {"name": "cpu",
                                              "target": {"type": "Utilization", "averageUtilization": 60}}}),
}


@pytest.mark.parametrize("metric", HPA_METRICS)
def test_each_autoscaling_metric_renders_its_own_hpa_metric_that_validates(metric: str) -> None:
    targets, want = HPA_METRICS[metric]
    docs = _render_with({"gateway": {"autoscaling": {"metric": metric, **targets}}})
    hpa = docs[("HorizontalPodAutoscaler", f"{FULLNAME}-gateway")]
    assert hpa["spec"]["metrics"] == [want]
    kubernetes_validate.validate(hpa, KUBE_VERSION, strict=True)
    notes = docs[("NOTES", "")]["text"]
    if metric == "cpu":
        assert "scales on CPU use (target 60% of the request); it needs metrics-server" in notes
    else:
        assert f"scales on the Pods metric {want['pods']['metric']['name']} " in notes
        assert "prometheus-adapter" in notes


def test_predicted_wait_milliseconds_become_a_quantity_in_seconds() -> None:
    # The gauge is in seconds: 1500 ms must be 1.5 s, i.e. the quantity 1500m.
    docs = _render_with({"gateway": {"autoscaling": {"metric": "predictedWait",
                                                     "predictedWait": {"targetMilliseconds": 1500}}}})
    (metric,) = docs[("HorizontalPodAutoscaler", f"{FULLNAME}-gateway")]["spec"]["metrics"]
    assert metric["pods"]["target"]["averageValue"] == "1500m"


def _adapter_rules(docs: dict[tuple[str, str], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    config = yaml.safe_load(docs[("ConfigMap", f"{FULLNAME}-adapter-rules")]["data"]["config.yaml"])
    assert set(config) == {"rules"}
    return {rule["name"]["as"]: rule for rule in config["rules"]}


def test_adapter_rules_serve_every_pods_metric_the_hpa_can_ask_for() -> None:
    assert [d for d in _all("default", "ConfigMap") if d["metadata"]["name"].endswith("-adapter-rules")] == []
    docs = _render_with({"metrics": {"adapterRules": {"enabled": True, "namespace": "monitoring",
                                                      "window": "2m"}}})
    configmap = docs[("ConfigMap", f"{FULLNAME}-adapter-rules")]
    assert configmap["metadata"]["namespace"] == "monitoring"
    kubernetes_validate.validate(configmap, KUBE_VERSION, strict=True)
    rules = _adapter_rules(docs)
    served = {spec[1]["pods"]["metric"]["name"] for spec in HPA_METRICS.values() if spec[1]["type"] == "Pods"}
    assert set(rules) == served
    # A pod's queue depth is the sum over its pools, its predicted wait the longest one.
    assert rules["splitinfer_queue_depth"]["metricsQuery"].startswith("sum by (<<.GroupBy>>)")
    assert rules["splitinfer_predicted_wait_seconds"]["metricsQuery"].startswith("max by (<<.GroupBy>>)")
    for name, rule in rules.items():
        assert rule["seriesQuery"] == f'{name}{{namespace!="",pod!=""}}'
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"},
                                                  "pod": {"resource": "pod"}}
        assert "[2m]" in rule["metricsQuery"]


def test_a_renamed_metric_reaches_both_the_hpa_and_the_adapter_rule() -> None:
    docs = _render_with({"gateway": {"autoscaling": {"metric": "predictedWait",
                                                     "predictedWait": {"metricName": "gateway_wait"}}},
                         "metrics": {"adapterRules": {"enabled": True}}})
    (metric,) = docs[("HorizontalPodAutoscaler", f"{FULLNAME}-gateway")]["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "gateway_wait"
    rule = _adapter_rules(docs)["gateway_wait"]
    # The adapter still reads the gateway's own series and serves it under the new name.
    assert rule["seriesQuery"].startswith("splitinfer_predicted_wait_seconds{")


def test_pod_disruption_budgets_cover_gateway_and_planner() -> None:
    pdbs = {p["metadata"]["name"]: p for p in _all("default", "PodDisruptionBudget")}
    assert set(pdbs) == {f"{FULLNAME}-gateway", f"{FULLNAME}-planner"}
    for name, pdb in pdbs.items():
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == name.rsplit("-", 1)[1]


# --- RBAC ----------------------------------------------------------------------


def _grants(value_set: str) -> dict[tuple[str, str], set[str]]:
    grants: dict[tuple[str, str], set[str]] = {}
    for doc in _all(value_set, "Role") + _all(value_set, "ClusterRole"):
        for rule in doc["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    grants.setdefault((group, resource), set()).update(rule["verbs"])
    return grants


def test_rbac_grants_exactly_the_cluster_operation_verbs() -> None:
    assert _grants("default") == {
        ("", "pods"): {"get", "list"},
        ("", "nodes"): {"get", "list"},
        ("ray.io", "rayclusters"): {"get", "list", "patch"},
        ("", "configmaps"): {"get", "list", "patch"},
    }
    (role,) = _all("default", "Role")
    patches = {r["resources"][0]: r.get("resourceNames") for r in role["rules"] if "patch" in r["verbs"]}
    assert patches == {"rayclusters": [f"{FULLNAME}-ray"], "configmaps": [f"{RELEASE}-registry"]}
    assert _one("default", "ConfigMap", f"{RELEASE}-registry").get("data") is None
    (binding,) = _all("default", "RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": FULLNAME, "namespace": NAMESPACE}]
    (cluster_binding,) = _all("default", "ClusterRoleBinding")
    assert cluster_binding["subjects"] == binding["subjects"]


def test_node_access_can_be_turned_off() -> None:
    assert ("", "nodes") not in _grants("edge-daemonset")
    assert _all("edge-daemonset", "ClusterRole") == []


# --- Ray -------------------------------------------------------------------------


def test_raycluster_autoscales_worker_groups_in_tree() -> None:
    (rc,) = _all("default", "RayCluster")
    assert rc["apiVersion"] == "ray.io/v1"
    assert rc["metadata"]["name"] == f"{FULLNAME}-ray"
    spec = rc["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["autoscalerOptions"]["idleTimeoutSeconds"] == 120
    assert all(isinstance(v, str) for v in spec["headGroupSpec"]["rayStartParams"].values())
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {p["name"]: p["containerPort"] for p in head["ports"]}["client"] == 10001
    (cpu,) = spec["workerGroupSpecs"]
    assert (cpu["groupName"], cpu["replicas"], cpu["minReplicas"], cpu["maxReplicas"]) == ("cpu", 1, 1, 4)
    shm = {v["name"]: v for v in cpu["template"]["spec"]["volumes"]}["dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"


def test_ray_autoscaler_reads_each_worker_groups_bounds_from_values() -> None:
    """The rendered RayCluster is read by Ray's own KubeRay autoscaler config reader,
    as the autoscaler sidecar reads it in a cluster: each group's min and max, what
    one pod of it adds (the demand it can meet), the idle timeout and the speed."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    docs = _render_with({"rayCluster": {
        "autoscalerOptions": {"idleTimeoutSeconds": 30, "upscalingMode": "Conservative"},
        "cpuWorkers": {"replicas": 2, "minReplicas": 2, "maxReplicas": 5,
                       "rayResources": {"splitinfer-cpu-tier": 1000}},
        "gpuWorkers": {"enabled": True, "replicas": 0, "minReplicas": 0, "maxReplicas": 3}}})
    rc = docs[("RayCluster", f"{FULLNAME}-ray")]
    assert rc["spec"]["enableInTreeAutoscaling"] is True
    config = _derive_autoscaling_config_from_ray_cr(rc)
    bounds = {name: (node["min_workers"], node["max_workers"])
              for name, node in config["available_node_types"].items() if name != "headgroup"}
    assert bounds == {"cpu": (2, 5), "gpu": (0, 3)}
    assert config["max_workers"] == 8
    assert config["available_node_types"]["cpu"]["resources"]["splitinfer-cpu-tier"] == 1000
    assert config["available_node_types"]["gpu"]["resources"]["GPU"] == 1
    assert config["idle_timeout_minutes"] == 0.5
    assert config["upscaling_speed"] == 1


def test_ray_autoscaling_off_drops_the_autoscaler_sidecar() -> None:
    docs = _render_with({"rayCluster": {"enableInTreeAutoscaling": False}})
    spec = docs[("RayCluster", f"{FULLNAME}-ray")]["spec"]
    assert spec["enableInTreeAutoscaling"] is False
    assert "autoscalerOptions" not in spec
    assert "Ray autoscaling:" not in docs[("NOTES", "")]["text"]


def test_notes_say_cpu_tails_without_ray_resources_never_scale_the_cpu_group() -> None:
    # CPU tail workers ask Ray for no CPU, so only a declared custom resource
    # gives the Ray autoscaler a demand to act on.
    from workers.actors import PoolConfig, worker_asks
    from workers.engine import EngineConfig

    assert worker_asks(EngineConfig(provider="cpu"), num_cpus=PoolConfig().num_cpus) == {"CPU": 0.0, "GPU": 0.0}
    assert worker_asks(EngineConfig(provider="cuda"))["GPU"] == 1.0
    default_notes = _render_with({})[("NOTES", "")]["text"]
    assert "CPU tail workers ask Ray for no resources" in default_notes
    declared = _render_with({"rayCluster": {"cpuWorkers": {"rayResources": {"splitinfer-cpu-tier": 1000}}}})
    assert "Ray autoscaling:" not in declared[("NOTES", "")]["text"]


# --- monitoring -------------------------------------------------------------------


def test_service_monitor_is_gated_and_scrapes_the_gateway_metrics_port() -> None:
    assert _all("default", "ServiceMonitor") == []
    (sm,) = _all("gpu", "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = sm["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics")
    assert "scheme" not in endpoint and "tlsConfig" not in endpoint
    service = _one("gpu", "Service", f"{FULLNAME}-gateway")
    assert sm["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert "metrics" in {p["name"] for p in service["spec"]["ports"]}


def test_service_monitor_scrapes_https_with_its_tls_config_when_the_gateway_has_tls() -> None:
    tls_config = {"ca": {"secret": {"name": "splitinfer-gateway-tls", "key": "ca.crt"}},
                  "serverName": f"{FULLNAME}-gateway"}
    docs = _render_with({"tls": {"enabled": True, "existingSecret": "splitinfer-gateway-tls"},
                         "metrics": {"serviceMonitor": {"enabled": True, "tlsConfig": tls_config}}})
    (endpoint,) = docs[("ServiceMonitor", f"{FULLNAME}-gateway")]["spec"]["endpoints"]
    assert endpoint["scheme"] == "https" and endpoint["tlsConfig"] == tls_config


def test_grafana_dashboard_has_panels_on_every_metric() -> None:
    cm = _one("default", "ConfigMap", f"{FULLNAME}-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["splitinfer-overview.json"])
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in panels}
    every = " ".join(exprs.values())
    for metric in ("splitinfer_requests_total", "splitinfer_stage_latency_seconds_bucket",
                   "splitinfer_batch_size_bucket", "splitinfer_bytes_total",
                   "splitinfer_inflight_requests"):
        assert metric in every, metric
    assert "sum by (model, version, status)" in exprs["Requests by model, version and status"]
    assert "by (direction)" in exprs["Boundary bytes in / out"]
    for stage in ("decode", "queue", "compute", "encode"):
        assert f'stage="{stage}"' in exprs[f"Stage latency: {stage}"]
        assert "histogram_quantile(0.95" in exprs[f"Stage latency: {stage}"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


# --- edge agent ----------------------------------------------------------------------


def test_edge_agent_daemonset_runs_on_edge_nodes_with_its_config() -> None:
    assert _all("default", "DaemonSet") == []
    ds = _one("edge-daemonset", "DaemonSet", f"{FULLNAME}-edge-agent")
    pod = ds["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"node-role.kubernetes.io/edge": ""}
    assert {"key": "node-role.kubernetes.io/edge", "operator": "Exists",
            "effect": "NoSchedule"} in pod["tolerations"]
    (container,) = pod["containers"]
    assert container["command"] == ["splitinfer"]
    assert container["args"] == ["edge", "run", "--config", "/etc/splitinfer/edge.yaml"]
    assert container["ports"] == [{"name": "api", "containerPort": 8500, "protocol": "TCP"}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "api"}
    assert {"name": "config", "mountPath": "/etc/splitinfer/edge.yaml", "subPath": "edge.yaml",
            "readOnly": True} in container["volumeMounts"]
    config = yaml.safe_load(_one("edge-daemonset", "ConfigMap", f"{FULLNAME}-edge-agent")["data"]["edge.yaml"])
    assert config == {"gateway": f"{FULLNAME}-gateway.{NAMESPACE}.svc:50051", "model": "resnet50@1",
                      "objective": "energy", "apiHost": "0.0.0.0", "apiPort": 8500}
    service = _one("edge-daemonset", "Service", f"{FULLNAME}-edge-agent")
    assert service["spec"]["internalTrafficPolicy"] == "Local"


def test_gateway_allow_empty_registry_value_passes_allow_empty() -> None:
    with helm.Chart.load(CHART_DIR) as chart:
        out = chart.render({"gateway": {"allowEmptyRegistry": True}}, name=RELEASE, namespace=NAMESPACE)
    docs = [d for path, text in sorted(out.items()) if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    (gateway,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == f"{FULLNAME}-gateway"]
    args = gateway["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--allow-empty" in args
    # The gateway's own parser takes the flag the chart renders.
    from splitinfer.gateway_cmd import make_parser

    assert make_parser().parse_args(args[1:]).allow_empty is True
    assert "--allow-empty" not in _container("default", f"{FULLNAME}-gateway")["args"]
