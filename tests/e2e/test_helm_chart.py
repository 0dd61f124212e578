"""The Helm chart as a whole: lint, rendering, Kubernetes 1.30 schemas, values schema.

Everything here runs real Helm (Helm's Go SDK, embedded by the helm-python-sdk
package) offline: no cluster and no helm binary. Per-workload checks live in
test_helm_workloads.py.

[Note: kuberay-operator dependency] Chart.yaml declares the kuberay-operator
chart as an optional dependency but does not vendor it under charts/.
Rendering does not need it (the condition is false by default), but Helm's
lint always reports "chart directory is missing these dependencies". The lint
test therefore asserts that this exact warning is the only finding, and a
second test lints a copy with the declaration removed, which must be spotless
even under --strict. Helm's install goes further and refuses the chart until
the dependency is fetched (`helm dependency build`), even with its condition
off; a test asserts that refusal and installs (client-side dry run) the copy.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

pytestmark = pytest.mark.helm

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "helm" / "splitinfer"
RELEASE = "demo"
NAMESPACE = "ml"
KUBE_VERSION = "1.30.0"

# The four CI value sets (Helm's ci/ convention) plus the defaults.
VALUE_SETS = {
    "default": None,
    "gpu": "gpu-values.yaml",
    "tls-mtls": "tls-mtls-values.yaml",
    "existing-secrets": "existing-secrets-values.yaml",
    "edge-daemonset": "edge-daemonset-values.yaml",
}

# Kinds from CRDs: kubernetes-validate ships only the built-in API schemas.
# They are skipped by this explicit list, never silently (see the test).
CRD_KINDS = frozenset({("ray.io/v1", "RayCluster"), ("monitoring.coreos.com/v1", "ServiceMonitor")})

MISSING_DEPENDENCY = "chart directory is missing these dependencies: kuberay-operator"
WARNING = 2


def _values(value_set: str) -> dict[str, Any] | None:
    name = VALUE_SETS[value_set]
    if name is None:
        return None
    return yaml.safe_load((CHART_DIR / "ci" / name).read_text())


@functools.lru_cache(maxsize=None)
def _render(value_set: str) -> tuple[dict[str, Any], ...]:
    with helm.Chart.load(CHART_DIR) as chart:
        out = chart.render(_values(value_set), name=RELEASE, namespace=NAMESPACE)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith(".yaml"):
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return tuple(docs)


def _render_with(values: dict[str, Any]) -> dict[str, str]:
    with helm.Chart.load(CHART_DIR) as chart:
        return chart.render(values, name=RELEASE, namespace=NAMESPACE)


def _copy_without_dependencies(tmp_path: Path) -> Path:
    """The chart as it behaves once its dependency is resolved (or dropped)."""
    chart_copy = tmp_path / "splitinfer"
    shutil.copytree(CHART_DIR, chart_copy)
    meta = yaml.safe_load((chart_copy / "Chart.yaml").read_text())
    del meta["dependencies"]
    (chart_copy / "Chart.yaml").write_text(yaml.safe_dump(meta))
    return chart_copy


# --- lint -------------------------------------------------------------------


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_lint_reports_only_the_unfetched_optional_dependency(value_set: str) -> None:
    report = helm.lint(
        CHART_DIR, _values(value_set), strict=True, kube_version=f"v{KUBE_VERSION}"
    )
    assert report["total_charts_linted"] == 1
    findings = [(m["severity"], m["error"]) for m in report["messages"]]
    assert findings == [(WARNING, MISSING_DEPENDENCY)]


def test_lint_is_spotless_without_the_dependency_declaration(tmp_path: Path) -> None:
    chart_copy = _copy_without_dependencies(tmp_path)
    for value_set in VALUE_SETS:
        report = helm.lint(
            chart_copy, _values(value_set), strict=True, kube_version=f"v{KUBE_VERSION}"
        )
        assert report["messages"] == [], (value_set, report)
        assert report["errors"] == [], (value_set, report)


# A kubeconfig that is never contacted: a client-side dry run renders without
# a cluster. Its server is a closed loopback port, so a stray call fails fast.
_UNUSED_KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{name: none, cluster: {server: "https://127.0.0.1:1"}}]
contexts: [{name: none, context: {cluster: none, user: none}}]
current-context: none
users: [{name: none, user: {}}]
"""


def _dry_run_install(chart_dir: Path) -> dict[str, Any]:
    with helm.Config(namespace=NAMESPACE, storage_driver="memory",
                     kubeconfig_content=_UNUSED_KUBECONFIG) as cfg:
        return cfg.install(chart_dir, RELEASE, _values("edge-daemonset"),
                           dry_run="client", namespace=NAMESPACE)


def test_install_needs_the_declared_dependency_fetched_even_when_disabled() -> None:
    # Helm's install checks declared dependencies regardless of their
    # condition; docs/deploy-kubernetes.md tells users to run
    # `helm dependency build` first.
    with pytest.raises(helm.HelmChartInvalidError) as excinfo:
        _dry_run_install(CHART_DIR)
    assert "missing in charts/ directory: kuberay-operator" in str(excinfo.value)


def test_client_side_install_succeeds_once_the_dependency_is_resolved(tmp_path: Path) -> None:
    chart_copy = _copy_without_dependencies(tmp_path)
    release = _dry_run_install(chart_copy)
    assert (release["name"], release["namespace"], release["chart_name"]) == (RELEASE, NAMESPACE, "splitinfer")
    kinds = {d["kind"] for d in yaml.safe_load_all(release["manifest"]) if d}
    assert {"Deployment", "DaemonSet", "RayCluster", "HorizontalPodAutoscaler"} <= kinds
    assert "demo-splitinfer-gateway.ml.svc:50051" in release["notes"]


def test_kuberay_operator_is_an_optional_dependency_that_is_not_vendored() -> None:
    meta = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    assert meta["apiVersion"] == "v2"
    assert meta["appVersion"] == "0.1.0"
    (dep,) = meta["dependencies"]
    assert dep["name"] == "kuberay-operator"
    assert dep["repository"] == "https://ray-project.github.io/kuberay-helm/"
    assert dep["condition"] == "kuberay-operator.enabled"
    assert not (CHART_DIR / "charts").exists(), (
        "helm/splitinfer/charts/ exists (output of `helm dependency build`): the "
        "kuberay-operator chart must not be vendored; delete that directory"
    )
    statuses = {d["name"]: d["status"] for d in helm.dependency_list(CHART_DIR)}
    assert statuses == {"kuberay-operator": "missing"}
    with helm.Chart.load(CHART_DIR) as chart:
        assert chart.values["kuberay-operator"]["enabled"] is False
        assert chart.dependencies == []


# --- rendering and the Kubernetes schemas -----------------------------------


EXPECTED_KINDS = {
    "default": {"ConfigMap": 2, "Deployment": 2, "HorizontalPodAutoscaler": 1,
                "PodDisruptionBudget": 2, "Service": 2, "PersistentVolumeClaim": 1,
                "RayCluster": 1, "Role": 1, "RoleBinding": 1, "ClusterRole": 1,
                "ClusterRoleBinding": 1, "ServiceAccount": 1},
    "gpu": {"ServiceMonitor": 1, "ConfigMap": 3},
    "tls-mtls": {"Secret": 1},
    "existing-secrets": {"RayCluster": 0, "HorizontalPodAutoscaler": 0,
                         "PersistentVolumeClaim": 0, "Secret": 0},
    "edge-daemonset": {"DaemonSet": 1, "ConfigMap": 3, "Service": 2, "Deployment": 1,
                       "PodDisruptionBudget": 1, "PersistentVolumeClaim": 0,
                       "ClusterRole": 0, "ClusterRoleBinding": 0},
}


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_renders_the_expected_objects(value_set: str) -> None:
    docs = _render(value_set)
    counts: dict[str, int] = {}
    for doc in docs:
        counts[doc["kind"]] = counts.get(doc["kind"], 0) + 1
    expected = dict(EXPECTED_KINDS["default"], **EXPECTED_KINDS[value_set])
    assert counts == {kind: n for kind, n in expected.items() if n}
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), "two objects share a kind and name"
    for doc in docs:
        if doc["kind"] not in ("ClusterRole", "ClusterRoleBinding"):
            assert doc["metadata"]["namespace"] == NAMESPACE, doc["metadata"]["name"]


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_every_manifest_validates_against_kubernetes_1_30(value_set: str) -> None:
    skipped = set()
    for doc in _render(value_set):
        kind = (doc["apiVersion"], doc["kind"])
        if kind in CRD_KINDS:
            # The skip is justified only while the validator really has no
            # schema for the kind; if it ever gains one, validate instead.
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
            skipped.add(kind)
            continue
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {list(e.path)}: {e.message}")
    expected = {("ray.io/v1", "RayCluster")} if value_set != "existing-secrets" else set()
    if value_set == "gpu":
        expected.add(("monitoring.coreos.com/v1", "ServiceMonitor"))
    assert skipped == expected


@pytest.mark.parametrize("value_set", ["default", "gpu", "tls-mtls", "edge-daemonset"])
def test_raycluster_pod_templates_validate_as_kubernetes_pod_templates(value_set: str) -> None:
    # RayCluster has no schema in the validator, but its head and worker
    # templates are core PodTemplateSpecs, which can be checked as such.
    (rc,) = [d for d in _render(value_set) if d["kind"] == "RayCluster"]
    templates = [rc["spec"]["headGroupSpec"]["template"]]
    templates += [g["template"] for g in rc["spec"]["workerGroupSpecs"]]
    assert len(templates) == (3 if value_set == "gpu" else 2)
    for template in templates:
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate",
                        "metadata": {"name": "ray"}, "template": template}
        kubernetes_validate.validate(pod_template, KUBE_VERSION, strict=True)


def test_the_kubernetes_validator_rejects_a_misspelled_field() -> None:
    # Proves the strict validation above has teeth.
    (gateway,) = [d for d in _render("default")
                  if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-gateway")]
    broken = json.loads(json.dumps(gateway))
    broken["spec"]["template"]["spec"]["containers"][0]["readynessProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBE_VERSION, strict=True)


# --- values.yaml and values.schema.json -------------------------------------


def _schema() -> dict[str, Any]:
    return json.loads((CHART_DIR / "values.schema.json").read_text())


def test_values_schema_is_draft07_and_accepts_every_value_set() -> None:
    schema = _schema()
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)
    with helm.Chart.load(CHART_DIR) as chart:
        assert chart.schema == schema
        for value_set in VALUE_SETS:
            chart.validate_schema(_values(value_set))


@pytest.mark.parametrize(
    ("values", "path", "constraint"),
    [
        ({"gateway": {"replicas": -1}}, "/gateway/replicas", "minimum: got -1, want 0"),
        ({"rayCluster": {"gpuWorkers": {"maxReplicas": -2}}}, "/rayCluster/gpuWorkers/maxReplicas",
         "minimum: got -2, want 0"),
        ({"gateway": {"replica": 3}}, "/gateway", "additional properties 'replica' not allowed"),
        ({"podSecurityContext": {"runAsUser": 0}}, "/podSecurityContext/runAsUser",
         "minimum: got 0, want 1"),
        ({"gateway": {"probes": {"readinessType": "tcp"}}}, "/gateway/probes/readinessType",
         "value must be one of"),
        ({"gateway": {"grpcPort": 70000}}, "/gateway/grpcPort", "maximum: got 70,000, want 65,535"),
        ({"gateway": {"poolStartTimeoutSeconds": 0}}, "/gateway/poolStartTimeoutSeconds", "exclusiveMinimum"),
        ({"gateway": {"autoscaling": {"metric": "latency"}}}, "/gateway/autoscaling/metric",
         "value must be one of 'queueDepth', 'predictedWait', 'inflight', 'cpu'"),
        ({"gateway": {"autoscaling": {"queueDepth": {"targetAverageValue": "0"}}}},
         "/gateway/autoscaling/queueDepth/targetAverageValue", "'0' does not match pattern"),
        ({"gateway": {"autoscaling": {"inflight": {"targetAverageValue": -3}}}},
         "/gateway/autoscaling/inflight/targetAverageValue", "exclusiveMinimum: got -3, want 0"),
        ({"gateway": {"autoscaling": {"predictedWait": {"targetMilliseconds": 0}}}},
         "/gateway/autoscaling/predictedWait/targetMilliseconds", "minimum: got 0, want 1"),
        ({"gateway": {"autoscaling": {"predictedWait": {"targetMilliseconds": 0.5}}}},
         "/gateway/autoscaling/predictedWait/targetMilliseconds", "got number, want integer"),
        ({"gateway": {"autoscaling": {"cpu": {"targetAverageUtilization": 0}}}},
         "/gateway/autoscaling/cpu/targetAverageUtilization", "minimum: got 0, want 1"),
        ({"gateway": {"autoscaling": {"queueDepth": {"metricName": "queue-depth"}}}},
         "/gateway/autoscaling/queueDepth/metricName", "does not match pattern"),
        ({"gateway": {"autoscaling": {"metricName": "splitinfer_inflight_requests"}}}, "/gateway/autoscaling",
         "additional properties 'metricName' not allowed"),
        ({"metrics": {"adapterRules": {"window": "1 minute"}}}, "/metrics/adapterRules/window",
         "does not match pattern"),
        ({"metrics": {"adapterRules": {"namespace": "Monitoring"}}}, "/metrics/adapterRules/namespace",
         "does not match pattern"),
        ({"auth": {"tokens": {"enabled": True, "entries": [{"name": "cam", "token": "t" * 16, "max_priority": 4}]}}},
         "/auth/tokens/entries/0/max_priority", "maximum: got 4, want 3"),
        ({"auth": {"tokens": {"enabled": True, "entries": [{"name": "cam", "token": "t" * 16, "rate_limit_rps": 0}]}}},
         "/auth/tokens/entries/0/rate_limit_rps", "exclusiveMinimum"),
    ],
)
def test_values_schema_rejects_a_bad_value_naming_it(
    values: dict[str, Any], path: str, constraint: str
) -> None:
    with pytest.raises(helm.HelmValuesError) as excinfo:
        _render_with(values)
    message = str(excinfo.value)
    assert f"at '{path}'" in message
    assert constraint in message


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
    return node


def _undocumented(schema, sub, mapping, lines, prefix):
    missing = []
    for key_node, value_node in mapping.value:
        key = key_node.value
        where = f"{prefix}{key}"
        if not lines[key_node.start_mark.line - 1].strip().startswith("#"):
            missing.append(where)
        props = _resolve(schema, sub).get("properties", {})
        assert key in props, f"{where} is in values.yaml but not in values.schema.json"
        child = _resolve(schema, props[key])
        if isinstance(value_node, yaml.MappingNode) and child.get("additionalProperties") is False:
            missing += _undocumented(schema, child, value_node, lines, where + ".")
    return missing


def test_every_value_in_values_yaml_carries_a_comment_and_a_schema_entry() -> None:
    text = (CHART_DIR / "values.yaml").read_text()
    missing = _undocumented(_schema(), _schema(), yaml.compose(text), text.splitlines(), "")
    assert missing == []


def _leaf_paths(schema, sub, mapping, prefix):
    paths = []
    for key_node, value_node in mapping.value:
        child = _resolve(schema, _resolve(schema, sub)["properties"][key_node.value])
        path = f"{prefix}{key_node.value}"
        if isinstance(value_node, yaml.MappingNode) and child.get("additionalProperties") is False:
            paths += _leaf_paths(schema, child, value_node, path + ".")
        else:
            paths.append(path)
    return paths


def test_the_deployment_guide_lists_every_value() -> None:
    guide = (REPO_ROOT / "docs" / "deploy-kubernetes.md").read_text()
    table = guide[guide.index("## Values reference"):]
    text = (CHART_DIR / "values.yaml").read_text()
    paths = _leaf_paths(_schema(), _schema(), yaml.compose(text), "")
    assert len(paths) > 100
    assert [p for p in paths if f"| `{p}` |" not in table] == []


def test_the_adapter_rules_in_the_guide_are_the_ones_the_chart_renders() -> None:
    guide = (REPO_ROOT / "docs" / "deploy-kubernetes.md").read_text()
    section = guide[guide.index("## Autoscaling"):guide.index("## Upgrading")]
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", section, flags=re.S) if "seriesQuery" in b]
    documented = yaml.safe_load(block)["rules"]["custom"]
    out = _render_with({"metrics": {"adapterRules": {"enabled": True}}})
    (configmap,) = yaml.safe_load_all(out["splitinfer/templates/adapter-rules-configmap.yaml"])
    assert yaml.safe_load(configmap["data"]["config.yaml"])["rules"] == documented


# --- template guards: bad combinations fail with the fix in the message -----


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"tls": {"enabled": True}}, "tls.existingSecret is required when tls.enabled=true"),
        ({"tls": {"clientCA": {"enabled": True}}}, "tls.clientCA.enabled=true needs tls.enabled=true"),
        ({"tls": {"enabled": True, "existingSecret": "t"}, "gateway": {"probes": {"readinessType": "grpc"}}},
         "kubelet's gRPC probe does not speak TLS"),
        ({"rayCluster": {"enabled": False}}, "rayCluster.address is required"),
        ({"rayCluster": {"cpuWorkers": {"minReplicas": 3, "replicas": 1}}},
         'worker group "cpu" needs minReplicas (3) <= replicas (1) <= maxReplicas (4)'),
        ({"gateway": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}},
         "minReplicas (5) is larger than maxReplicas (2)"),
        ({"auth": {"tokens": {"enabled": True}}}, "auth.tokens.entries"),
    ],
)
def test_an_unworkable_combination_fails_with_the_fix(values: dict[str, Any], needle: str) -> None:
    with pytest.raises(helm.HelmRenderError) as excinfo:
        _render_with(values)
    assert needle in str(excinfo.value)


# --- the image the chart runs ----------------------------------------------


def test_dockerfile_builds_the_non_root_image_the_chart_expects() -> None:
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    froms = re.findall(r"^FROM (\S+)", dockerfile, flags=re.M)
    assert froms and all(f == "python:3.11-slim" for f in froms)
    assert re.search(r'^RUN pip install [^\n]*"\.\[cloud\]"$', dockerfile, flags=re.M)
    # KubeRay runs `bash -lc`, whose /etc/profile resets PATH: the `ray` and
    # `splitinfer` scripts must land on the default PATH, not in a venv.
    assert "COPY --from=build /install /usr/local" in dockerfile
    assert "-m venv" not in dockerfile and "PATH=" not in dockerfile
    assert re.search(r'^ENTRYPOINT \["splitinfer"\]$', dockerfile, flags=re.M)
    (user,) = re.findall(r"^USER (\d+):(\d+)$", dockerfile, flags=re.M)
    with helm.Chart.load(CHART_DIR) as chart:
        pod = chart.values["podSecurityContext"]
    assert int(user[0]) == pod["runAsUser"] == 10001
    assert int(user[1]) == pod["runAsGroup"]
