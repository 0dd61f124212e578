"""The registry ConfigMap's policy keys (read back by the real `cluster.registry.Registry`),
the pure rollout helpers, and choosing in-cluster or kubeconfig credentials (the in-cluster
path against the FAKE API server of _fake_k8s.py, served over HTTPS)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl

import onnx
import pytest

from cluster import k8s
from cluster.k8s import (
    ClusterTarget,
    KubeOps,
    KubernetesError,
    choose_config_source,
    compute_promote,
    compute_rollback,
    compute_rollout,
    connect,
    make_policy_files,
    parse_percent,
)
from cluster.registry import Canary, Registry, route
from tests.integration._fake_k8s import FakeKubeApi
from tests.onnx_models import conv_bn_relu_chain


def _registry_with(tmp_path, data: dict[str, str], versions=("1", "2", "3")) -> Registry:
    root = tmp_path / "registry"
    for i, v in enumerate(versions):
        d = root / "resnet50" / v
        d.mkdir(parents=True)
        onnx.save(conv_bn_relu_chain(2, seed=i), str(d / "model.onnx"))
    for rel, text in make_policy_files(data).items():
        (root / rel).write_text(text)
    return Registry(str(root), cache_dir=str(tmp_path / "cache"))


def test_rollout_policy_is_what_the_registry_loads_and_routes(tmp_path):
    text = compute_rollout("resnet50", None, "2", 25.0, default_version="1")
    reg = _registry_with(tmp_path, {"resnet50.policy.yaml": text, "unrelated": "x"})
    reg.load_all()
    assert reg.describe()["resnet50"] == {"versions": ["2", "1"], "default": "1",
                                          "canary": {"version": "2", "percent": 25.0}}
    devices = [f"dev-{i}" for i in range(400)]
    on_canary = [d for d in devices if reg.resolve("resnet50", "", d).version == "2"]
    assert on_canary == [d for d in devices if route("resnet50", "1", Canary("2", 25.0), d) == "2"]
    assert 0 < len(on_canary) < len(devices)


def test_rollback_policy_loads_only_the_default(tmp_path):
    text, removed = compute_rollback("resnet50", compute_rollout("resnet50", None, "3", 10.0, "1"))
    assert removed == "3"
    reg = _registry_with(tmp_path, {"resnet50.policy.yaml": text})
    reg.load_all()
    assert reg.describe()["resnet50"] == {"versions": ["1"], "default": "1", "canary": None}


def test_promote_policy_routes_everyone_to_the_canary(tmp_path):
    text, version = compute_promote("resnet50", compute_rollout("resnet50", None, "2", 10.0, "1"))
    assert version == "2"
    reg = _registry_with(tmp_path, {"resnet50.policy.yaml": text})
    reg.load_all()
    assert reg.describe()["resnet50"]["default"] == "2"
    assert reg.describe()["resnet50"]["canary"] is None


def test_rollout_keeps_a_latest_policy_and_widens_a_specific_one():
    kept = compute_rollout("m", "version_policy: {latest: 2}\ndefault_version: '1'\n", "2", 10.0)
    assert "latest: 2" in kept
    widened = compute_rollout("m", "version_policy: {specific: ['1', '10']}\ndefault_version: '1'\n", "2", 10.0)
    assert "- '1'\n  - '2'\n  - '10'" in widened  # natural version order


def test_make_policy_files_ignores_other_keys():
    assert make_policy_files({"a.policy.yaml": "x", "b.yaml": "y", ".policy.yaml": "z"}) == {"a/policy.yaml": "x"}
    assert make_policy_files(None) == {}


@pytest.mark.parametrize("bad", ["0%", "150%", "ten", "-5", ""])
def test_bad_canary_share_is_refused(bad):
    with pytest.raises(KubernetesError, match=r"is not a percentage in \(0, 100\]; give it like --canary 10%"):
        parse_percent(bad)


def test_percent_forms():
    assert parse_percent("10%") == parse_percent("10") == parse_percent(" 10 % ") == 10.0


def test_bad_rollout_inputs_name_the_fix():
    with pytest.raises(KubernetesError, match="is not a registry name"):
        compute_rollout("../etc", None, "2", 10.0, "1")
    with pytest.raises(KubernetesError, match=r"records default version '1', not '3'; drop --default"):
        compute_rollout("m", "default_version: '1'\n", "2", 10.0, "3")
    with pytest.raises(KubernetesError, match="is already the default version"):
        compute_rollout("m", None, "1", 10.0, "1")
    with pytest.raises(KubernetesError, match=r"key 'm.policy.yaml' of the registry ConfigMap is not a policy file"):
        compute_rollout("m", "- a list\n", "2", 10.0, "1")
    with pytest.raises(KubernetesError, match="would be invalid"):
        compute_rollout("m", "version_policy: {sometimes: 1}\ndefault_version: '1'\n", "2", 10.0)


def test_target_names_follow_the_chart():
    assert ClusterTarget("ns", "splitinfer").raycluster_name == "splitinfer-ray"
    assert ClusterTarget("ns", "prod").raycluster_name == "prod-splitinfer-ray"
    assert ClusterTarget("ns", "prod").configmap_name == "prod-registry"
    assert ClusterTarget("ns", "prod", raycluster="rc", configmap="cm").raycluster_name == "rc"


def test_config_source_is_automatic_with_a_flag_to_force():
    assert choose_config_source("auto", {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}) == "in-cluster"
    assert choose_config_source("auto", {}) == "kubeconfig"
    assert choose_config_source("kubeconfig", {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}) == "kubeconfig"
    assert choose_config_source("in-cluster", {}) == "in-cluster"
    with pytest.raises(KubernetesError, match="use auto, in-cluster or kubeconfig"):
        choose_config_source("magic", {})


def test_missing_credentials_are_a_clear_error(tmp_path):
    with pytest.raises(KubernetesError, match="cannot load Kubernetes credentials from the pod's service account"):
        connect("in-cluster", environ={})
    with pytest.raises(KubernetesError, match=r"cannot load Kubernetes credentials from kubeconfig .*nope"):
        connect("kubeconfig", kubeconfig=str(tmp_path / "nope"))


def _self_signed(tmp_path) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fake-kube-apiserver")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = str(tmp_path / "ca.crt"), str(tmp_path / "tls.key")
    with open(cert_path, "wb") as fh:
        fh.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as fh:
        fh.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                   serialization.NoEncryption()))
    return cert_path, key_path


def test_in_cluster_service_account_reaches_the_api_over_tls(tmp_path, monkeypatch):
    cert_path, key_path = _self_signed(tmp_path)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert_path, key_path)
    fake = FakeKubeApi(tls=tls).start()
    try:
        fake.add_configmap("splitinfer", "splitinfer-registry")
        token = tmp_path / "token"
        token.write_text("sa-token-123")
        # Where a pod finds its service account; the loader reads these module constants.
        monkeypatch.setattr(k8s.kubernetes.config.incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
        monkeypatch.setattr(k8s.kubernetes.config.incluster_config, "SERVICE_CERT_FILENAME", cert_path)
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", fake.url.rsplit(":", 1)[1])
        api = connect()  # auto: KUBERNETES_SERVICE_HOST is set, so in-cluster
        assert api.configuration.host == fake.url and fake.url.startswith("https://")
        ops = KubeOps(api, ClusterTarget("splitinfer", "splitinfer"), sleep=lambda s: None)
        ops.rollout("resnet50", "2", 10.0, default_version="1")
        assert fake.authorizations and all(a.lower() == "bearer sa-token-123" for a in fake.authorizations)
        assert "resnet50.policy.yaml" in fake.objects[
            "/api/v1/namespaces/splitinfer/configmaps/splitinfer-registry"]["data"]
    finally:
        fake.stop()


def test_namespace_defaults(tmp_path, monkeypatch):
    assert k8s.default_namespace("kubeconfig", None, None, {"POD_NAMESPACE": "from-env"}) == "from-env"
    assert k8s.default_namespace("kubeconfig", str(tmp_path / "missing"), None, {}) == "default"
    ns_file = tmp_path / "namespace"
    ns_file.write_text("team-a\n")
    monkeypatch.setattr(k8s, "_INCLUSTER_NAMESPACE_FILE", str(ns_file))
    assert k8s.default_namespace("in-cluster", None, None, {}) == "team-a"
    monkeypatch.setattr(k8s, "_INCLUSTER_NAMESPACE_FILE", os.path.join(str(tmp_path), "absent"))
    assert k8s.default_namespace("in-cluster", None, None, {}) == "default"
