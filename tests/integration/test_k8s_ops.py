"""`splitinfer cluster status|scale|rollout|rollback|promote` through the official
`kubernetes` client against a FAKE API server (tests/integration/_fake_k8s.py) on
127.0.0.1, reached with a generated kubeconfig over plain HTTP: no real Kubernetes runs here.
"""

from __future__ import annotations

import json

import pytest
import yaml

from cluster.k8s import (
    ClusterStatus,
    ClusterTarget,
    KubeConflict,
    KubeForbidden,
    KubeNotFound,
    KubeOps,
    KubernetesError,
    ReplicasOutOfRange,
    connect,
)
from splitinfer.cluster_cmd import cluster_main
from tests.integration._fake_k8s import FakeKubeApi, write_kubeconfig

NS = "splitinfer"
RELEASE = "splitinfer"
CM_PATH = f"/api/v1/namespaces/{NS}/configmaps/{RELEASE}-registry"
RC_PATH = f"/apis/ray.io/v1/namespaces/{NS}/rayclusters/{RELEASE}-ray"


def _chart_labels(component: str, release: str = RELEASE) -> dict[str, str]:
    return {"app.kubernetes.io/name": "splitinfer", "app.kubernetes.io/instance": release,
            "app.kubernetes.io/component": component}


@pytest.fixture()
def fake():
    api = FakeKubeApi().start()
    api.add_pod(NS, "splitinfer-gateway-7d9-abcde", _chart_labels("gateway"), node="cpu-1")
    api.add_pod(NS, "splitinfer-planner-5f8-xyz12", _chart_labels("planner"), node="cpu-1", ready=False, restarts=2)
    api.add_pod(NS, "splitinfer-ray-head-q7w2x", _chart_labels("ray") | {
        "ray.io/cluster": "splitinfer-ray", "ray.io/node-type": "head", "ray.io/group": "headgroup"}, node="cpu-1")
    # KubeRay's own labels only: found through ray.io/cluster.
    api.add_pod(NS, "splitinfer-ray-gpu-worker-h4k9p", {
        "ray.io/cluster": "splitinfer-ray", "ray.io/node-type": "worker", "ray.io/group": "gpu"}, node="gpu-1")
    api.add_pod(NS, "other-gateway-1", _chart_labels("gateway", release="other"))
    api.add_node("cpu-1")
    api.add_node("gpu-1", gpus=4)
    api.add_configmap(NS, f"{RELEASE}-registry")  # the chart creates it with no data
    api.add_raycluster(NS, f"{RELEASE}-ray", [
        {"groupName": "cpu", "replicas": 1, "minReplicas": 1, "maxReplicas": 4, "rayStartParams": {}},
        {"groupName": "gpu", "replicas": 0, "minReplicas": 0, "maxReplicas": 8, "rayStartParams": {}},
    ])
    yield api
    api.stop()


@pytest.fixture()
def kubeconfig(fake, tmp_path, monkeypatch):
    for var in ("KUBERNETES_SERVICE_HOST", "POD_NAMESPACE", "SPLITINFER_RELEASE", "SPLITINFER_REGISTRY_CONFIGMAP"):
        monkeypatch.delenv(var, raising=False)
    return write_kubeconfig(str(tmp_path / "kubeconfig"), fake.url, namespace=NS)


def _ops(kubeconfig: str, **kw) -> KubeOps:
    api = connect("kubeconfig", kubeconfig=kubeconfig)
    return KubeOps(api, ClusterTarget(namespace=NS, release=RELEASE), sleep=lambda s: None, **kw)


def _policy(fake, model: str) -> dict:
    return yaml.safe_load(fake.objects[CM_PATH]["data"][f"{model}.policy.yaml"])


# ---- status


def test_status_lists_release_pods_gpus_groups_and_models(fake, kubeconfig, capsys):
    assert cluster_main(["rollout", "resnet50@2", "--canary", "10%", "--default", "1",
                         "--kubeconfig", kubeconfig]) == 0
    capsys.readouterr()
    assert cluster_main(["status", "--json", "--kubeconfig", kubeconfig]) == 0
    st = ClusterStatus.from_json(capsys.readouterr().out)
    assert st.namespace == NS  # from the kubeconfig context
    assert ClusterStatus.from_json(st.to_json()) == st
    by_name = {p.name: p for p in st.pods}
    assert set(by_name) == {"splitinfer-gateway-7d9-abcde", "splitinfer-planner-5f8-xyz12",
                            "splitinfer-ray-head-q7w2x", "splitinfer-ray-gpu-worker-h4k9p"}
    assert [p.component for p in st.pods] == ["gateway", "planner", "ray-head", "ray-worker"]
    assert by_name["splitinfer-planner-5f8-xyz12"].ready is False
    assert by_name["splitinfer-planner-5f8-xyz12"].restarts == 2
    assert by_name["splitinfer-ray-gpu-worker-h4k9p"].group == "gpu"
    assert {(n.node, n.gpus_allocatable) for n in st.nodes} == {("cpu-1", 0), ("gpu-1", 4)}
    assert [(g.name, g.replicas, g.min_replicas, g.max_replicas) for g in st.worker_groups] == [
        ("cpu", 1, 1, 4), ("gpu", 0, 0, 8)]
    (m,) = st.models
    assert (m.model, m.default_version, m.canary_version, m.canary_percent) == ("resnet50", "1", "2", 10.0)
    assert st.notes == ()
    # The pod lists are filtered server-side by the chart's and KubeRay's labels.
    selectors = [p for meth, p, _, _ in fake.requests if p.endswith("/pods")]
    assert len(selectors) == 2


def test_status_table_names_everything(fake, kubeconfig, capsys):
    assert cluster_main(["status", "--kubeconfig", kubeconfig]) == 0
    out = capsys.readouterr().out
    for text in ("splitinfer-gateway-7d9-abcde", "ray-worker", "gpu-1", "4 / 4", "replicas 1 (min 1, max 4)",
                 "(none recorded)"):
        assert text in out
    assert "other-gateway-1" not in out


def test_status_without_node_rights_reports_a_note(fake, kubeconfig):
    fake.deny.add(("list", "nodes"))
    st = _ops(kubeconfig).status()
    assert st.nodes == ()
    assert len(st.pods) == 4
    assert any("may not list nodes" in n and "rbac.nodeAccess=true" in n for n in st.notes)


def test_status_forbidden_on_pods_is_a_clear_error(fake, kubeconfig):
    fake.deny.add(("list", "pods"))
    with pytest.raises(KubeForbidden, match=r"may not list pods in namespace 'splitinfer'") as e:
        _ops(kubeconfig).status()
    assert "grants exactly get/list pods,nodes; get/list/patch rayclusters, configmaps" in str(e.value)
    assert (e.value.verb, e.value.resource) == ("list", "pods")


# ---- scale


def test_scale_patches_only_the_group_with_resource_version(fake, kubeconfig, capsys):
    rv = fake.objects[RC_PATH]["metadata"]["resourceVersion"]
    assert cluster_main(["scale", "--group", "gpu", "--replicas", "3", "--kubeconfig", kubeconfig]) == 0
    assert "replicas 3 (min 0, max 8)" in capsys.readouterr().out
    groups = {g["groupName"]: g for g in fake.objects[RC_PATH]["spec"]["workerGroupSpecs"]}
    assert groups["gpu"]["replicas"] == 3
    assert groups["cpu"] == {"groupName": "cpu", "replicas": 1, "minReplicas": 1, "maxReplicas": 4,
                             "rayStartParams": {}}
    assert fake.objects[RC_PATH]["spec"]["rayVersion"] == "2.40.0"
    ((ctype, body),) = fake.patches(RC_PATH)
    assert ctype == "application/merge-patch+json"
    assert body["metadata"]["resourceVersion"] == rv


@pytest.mark.parametrize("replicas", [0, 5])
def test_scale_outside_bounds_names_them_and_sends_nothing(fake, kubeconfig, replicas):
    with pytest.raises(ReplicasOutOfRange) as e:
        cluster_main(["scale", "--group", "cpu", "--replicas", str(replicas), "--kubeconfig", kubeconfig])
    msg = str(e.value)
    assert f"minReplicas (1) <= replicas <= maxReplicas (4), got replicas={replicas}" in msg
    assert "pick a count from 1 to 4" in msg and "rayCluster.cpuWorkers" in msg
    assert fake.patches(RC_PATH) == []


def test_scale_unknown_group_lists_the_groups(fake, kubeconfig):
    with pytest.raises(KubernetesError, match=r"no worker group 'tpu' \(it has \['cpu', 'gpu'\]\)"):
        _ops(kubeconfig).scale("tpu", 1)


def test_scale_missing_raycluster_names_object_and_namespace(fake, kubeconfig):
    with pytest.raises(KubeNotFound, match=r"rayclusters.ray.io 'other-splitinfer-ray' not found in namespace "
                                           r"'splitinfer'"):
        cluster_main(["scale", "--group", "gpu", "--replicas", "1", "--release", "other",
                      "--kubeconfig", kubeconfig])


def test_scale_forbidden_names_verb_and_resource(fake, kubeconfig):
    fake.deny.add(("patch", "rayclusters"))
    with pytest.raises(KubeForbidden, match=r"may not patch rayclusters.ray.io 'splitinfer-ray' in namespace"):
        _ops(kubeconfig).scale("gpu", 2)


def test_other_api_failures_name_the_status(fake, kubeconfig):
    fake.faults[("PATCH", RC_PATH)] = 500
    with pytest.raises(KubernetesError, match=r"patch rayclusters.ray.io 'splitinfer-ray' .* HTTP 500 injected"):
        _ops(kubeconfig).scale("gpu", 2)


# ---- rollout, rollback, promote


def test_rollout_writes_a_registry_policy_file(fake, kubeconfig, capsys):
    assert cluster_main(["rollout", "resnet50@2", "--canary", "10%", "--default", "1",
                         "--kubeconfig", kubeconfig]) == 0
    assert "resnet50@2 now goes to 10% of devices" in capsys.readouterr().out
    assert _policy(fake, "resnet50") == {"default_version": "1", "canary": {"version": "2", "percent": 10.0},
                                         "version_policy": {"specific": ["1", "2"]}}
    ((ctype, body),) = fake.patches(CM_PATH)
    assert ctype == "application/strategic-merge-patch+json"
    assert set(body) == {"metadata", "data"} and list(body["data"]) == ["resnet50.policy.yaml"]
    # Raising the share later keeps the recorded default; --default is not needed again.
    assert cluster_main(["rollout", "resnet50@2", "--canary", "50", "--kubeconfig", kubeconfig]) == 0
    assert _policy(fake, "resnet50")["canary"] == {"version": "2", "percent": 50.0}


def test_rollout_leaves_other_models_keys_alone(fake, kubeconfig):
    fake.objects[CM_PATH]["data"] = {"bert.policy.yaml": "default_version: '7'\n", "notes.txt": "keep me"}
    _ops(kubeconfig).rollout("resnet50", "2", 10.0, default_version="1")
    data = fake.objects[CM_PATH]["data"]
    assert data["bert.policy.yaml"] == "default_version: '7'\n" and data["notes.txt"] == "keep me"


def test_first_rollout_without_default_asks_for_it(fake, kubeconfig):
    with pytest.raises(KubernetesError, match=r"no default version is recorded for 'resnet50'.*--default VERSION"):
        cluster_main(["rollout", "resnet50@2", "--canary", "10%", "--kubeconfig", kubeconfig])
    assert fake.patches(CM_PATH) == []


def test_rollout_bad_target_is_a_usage_error(fake, kubeconfig, capsys):
    assert cluster_main(["rollout", "resnet50", "--canary", "10%", "--kubeconfig", kubeconfig]) == 2
    assert "is not MODEL@VERSION" in capsys.readouterr().err


def test_rollback_removes_the_canary_and_its_version(fake, kubeconfig, capsys):
    ops = _ops(kubeconfig)
    ops.rollout("resnet50", "2", 10.0, default_version="1")
    assert cluster_main(["rollback", "resnet50", "--kubeconfig", kubeconfig]) == 0
    assert "canary 2 rolled back" in capsys.readouterr().out
    assert _policy(fake, "resnet50") == {"default_version": "1", "version_policy": {"specific": ["1"]}}
    assert ops.rollback("resnet50") is None


def test_promote_makes_the_canary_the_default(fake, kubeconfig):
    ops = _ops(kubeconfig)
    ops.rollout("resnet50", "2", 10.0, default_version="1")
    assert ops.promote("resnet50") == "2"
    assert _policy(fake, "resnet50") == {"default_version": "2", "version_policy": {"specific": ["1", "2"]}}
    with pytest.raises(KubernetesError, match="has no canary to promote"):
        ops.promote("resnet50")


def test_rollout_missing_configmap_names_it(fake, kubeconfig):
    del fake.objects[CM_PATH]
    with pytest.raises(KubeNotFound, match=r"configmaps 'splitinfer-registry' not found in namespace 'splitinfer'"):
        _ops(kubeconfig).rollout("resnet50", "2", 10.0, default_version="1")


def test_rollout_forbidden_names_verb_and_rbac(fake, kubeconfig):
    fake.deny.add(("patch", "configmaps"))
    with pytest.raises(KubeForbidden) as e:
        _ops(kubeconfig).rollout("resnet50", "2", 10.0, default_version="1")
    assert "may not patch configmaps 'splitinfer-registry' in namespace 'splitinfer'" in str(e.value)
    assert "rbac.create=true" in str(e.value)


# ---- 409 Conflict


def test_conflict_once_rereads_and_retries(fake, kubeconfig):
    fake.concurrent_writes[CM_PATH] = 1
    _ops(kubeconfig).rollout("resnet50", "2", 10.0, default_version="1")
    (first, _), (second, body) = [(b["metadata"]["resourceVersion"], b) for _, b in fake.patches(CM_PATH)]
    assert first != second  # the retry carries the fresh resourceVersion
    assert _policy(fake, "resnet50")["canary"] == {"version": "2", "percent": 10.0}
    gets = [p for m, p, _, _ in fake.requests if m == "GET" and p == CM_PATH]
    assert len(gets) == 2


def test_conflict_on_scale_retries_too(fake, kubeconfig):
    fake.concurrent_writes[RC_PATH] = 2
    assert _ops(kubeconfig).scale("gpu", 2).replicas == 2
    assert len(fake.patches(RC_PATH)) == 3


def test_persistent_conflict_gives_up_with_a_clear_error(fake, kubeconfig):
    fake.concurrent_writes[CM_PATH] = 1000
    with pytest.raises(KubeConflict) as e:
        _ops(kubeconfig, max_attempts=4).rollout("resnet50", "2", 10.0, default_version="1")
    assert e.value.attempts == 4
    assert "4 patches in a row got 409 Conflict" in str(e.value) and "find the other writer" in str(e.value)
    assert len(fake.patches(CM_PATH)) == 4
    assert "data" not in fake.objects[CM_PATH]


# ---- connection


def test_unreachable_api_server_is_a_clear_error(tmp_path, monkeypatch):
    import socket

    with socket.socket() as s:  # a port that nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kc = write_kubeconfig(str(tmp_path / "kc"), f"http://127.0.0.1:{port}")
    ops = KubeOps(connect("kubeconfig", kubeconfig=kc), ClusterTarget(namespace=NS, release=RELEASE),
                  request_timeout_s=2.0)
    with pytest.raises(KubernetesError, match="cannot reach the Kubernetes API server"):
        ops.status()


def test_context_flag_picks_the_namespace(fake, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    kc = tmp_path / "kc"
    write_kubeconfig(str(kc), fake.url, namespace="elsewhere", context="a")
    cfg = json.loads(kc.read_text())
    cfg["contexts"].append({"name": "b", "context": {"cluster": "fake", "user": "fake", "namespace": NS}})
    kc.write_text(json.dumps(cfg))
    assert cluster_main(["status", "--json", "--kubeconfig", str(kc), "--context", "b"]) == 0
    assert ClusterStatus.from_json(capsys.readouterr().out).namespace == NS


def test_conflict_on_a_read_is_not_retried(fake, kubeconfig):
    fake.faults[("GET", CM_PATH)] = 409
    with pytest.raises(KubernetesError, match=r"get configmaps 'splitinfer-registry' .* HTTP 409") as e:
        _ops(kubeconfig).rollout("resnet50", "2", 10.0, default_version="1")
    assert not isinstance(e.value, KubeConflict)


def test_errors_reach_the_command_line_as_one_line(fake, kubeconfig, monkeypatch, capsys):
    from splitinfer import cli

    # The lead wires `cluster` into cli.COMMANDS; until then the test adds it.
    monkeypatch.setitem(cli.COMMANDS, "cluster", ("splitinfer.cluster_cmd", "cluster_main", "operate the cloud tier"))
    fake.deny.add(("patch", "configmaps"))
    assert cli.main(["cluster", "rollback", "resnet50", "--kubeconfig", kubeconfig]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("splitinfer cluster: error: forbidden:")


def test_status_notes_missing_raycluster_and_configmap(fake, kubeconfig):
    del fake.objects[RC_PATH], fake.objects[CM_PATH]
    st = _ops(kubeconfig).status()
    assert st.worker_groups == () and st.models == ()
    assert any("rayclusters.ray.io 'splitinfer-ray' not found in namespace 'splitinfer'" in n for n in st.notes)
    assert any("configmaps 'splitinfer-registry' not found" in n for n in st.notes)
    assert len(st.pods) == 4 and len(st.nodes) == 2
