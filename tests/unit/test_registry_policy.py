"""Live policies: parsing a policy file, reading a mounted-ConfigMap directory (the
kubelet's symlink layout, built here on disk), and `Registry.apply_policy` moving a
running registry through canary 0% -> 10% -> rollback with leases held."""

from __future__ import annotations

import logging
import os
import time

import pytest

from cluster._k8s_policy import POLICY_KEY_SUFFIX, compute_rollback, compute_rollout
from cluster.registry import (
    POLICY_FILE_SUFFIX,
    Canary,
    Registry,
    RegistryError,
    VersionPolicy,
    parse_policy,
    read_policy_dir,
    route,
)
from tests.unit.test_registry import make_repo

BASE = "version_policy: {specific: ['1']}\ndefault_version: '1'\n"


def write_configmap_dir(path, data: dict[str, str]) -> None:
    """Writes `data` the way the kubelet's atomic writer updates a ConfigMap volume.

    Each update is a new timestamped directory; `..data` is re-pointed to it by one
    rename, and every key is a link `<key> -> ..data/<key>`. Links of keys no longer in
    `data` are removed afterwards, as the kubelet does.
    """
    path = str(path)
    os.makedirs(path, exist_ok=True)
    stamp = f"..{time.time_ns()}"
    os.mkdir(os.path.join(path, stamp))
    for key, text in data.items():
        with open(os.path.join(path, stamp, key), "w", encoding="utf-8") as fh:
            fh.write(text)
    old = os.readlink(os.path.join(path, "..data")) if os.path.islink(os.path.join(path, "..data")) else None
    os.symlink(stamp, os.path.join(path, "..data_tmp"))
    os.replace(os.path.join(path, "..data_tmp"), os.path.join(path, "..data"))
    for key in data:
        if not os.path.islink(os.path.join(path, key)):
            os.symlink(os.path.join("..data", key), os.path.join(path, key))
    for name in os.listdir(path):
        if not name.startswith(".") and name not in data:
            os.remove(os.path.join(path, name))
    if old is not None:
        for name in os.listdir(os.path.join(path, old)):
            os.remove(os.path.join(path, old, name))
        os.rmdir(os.path.join(path, old))


# -- parsing and the directory ------------------------------------------------------------


def test_the_configmap_key_suffix_is_the_file_suffix_the_registry_reads():
    assert POLICY_KEY_SUFFIX == POLICY_FILE_SUFFIX == ".policy.yaml"


def test_parse_policy_reads_every_field_and_falls_back_for_the_version_policy():
    fallback = VersionPolicy.parse("latest:2")
    text = compute_rollout("m", BASE, "2", 10.0)
    policy, default, canary = parse_policy(text, path="m.policy.yaml", fallback=fallback)
    assert (policy, default, canary) == (VersionPolicy("specific", versions=("1", "2")), "1", Canary("2", 10.0))
    assert parse_policy(b"default_version: 3\n", path="p", fallback=fallback) == (fallback, "3", None)
    assert parse_policy("", path="p", fallback=fallback) == (fallback, None, None)


@pytest.mark.parametrize(("data", "needle"), [
    ("canary: [", "is not a valid policy file"),
    ("- 1\n", "expected a mapping"),
    ("canary: {version: '2'}\n", "is not a valid policy file"),
    ("cannary: {version: '2', percent: 5}\n", "unknown field(s) ['cannary']"),
    ("canary: {version: '2', percent: 150}\n", "canary percent 150.0 must be in [0, 100]"),
    (b"\xff\xfe", "is not a valid policy file"),
    ("version_policy: newest\n", "'newest' is not a version policy"),
])
def test_a_bad_policy_names_its_file_and_the_problem(data, needle):
    with pytest.raises(RegistryError) as excinfo:
        parse_policy(data, path="/p/m.policy.yaml", fallback=VersionPolicy())
    assert excinfo.value.path == "/p/m.policy.yaml"
    assert needle in str(excinfo.value)


def test_read_policy_dir_follows_the_kubelet_layout_across_updates(tmp_path):
    d = tmp_path / "policies"
    write_configmap_dir(d, {"m.policy.yaml": BASE, "notes.txt": "x", "-bad.policy.yaml": BASE})
    assert {n for n in os.listdir(d) if n.startswith("..")} >= {"..data"}
    assert read_policy_dir(str(d)) == {"m": BASE.encode()}
    rollout = compute_rollout("m", BASE, "2", 10.0)
    write_configmap_dir(d, {"m.policy.yaml": rollout, "n.policy.yaml": BASE})
    assert read_policy_dir(str(d)) == {"m": rollout.encode(), "n": BASE.encode()}
    write_configmap_dir(d, {"n.policy.yaml": BASE})
    assert read_policy_dir(str(d)) == {"n": BASE.encode()}
    write_configmap_dir(d, {})
    assert read_policy_dir(str(d)) == {}


# -- load_all with a policy directory ------------------------------------------------------


def test_the_policy_dir_overrides_the_volume_policy_at_load(tmp_path):
    root = make_repo(tmp_path / "repo", versions=("1", "2", "3"))
    with open(os.path.join(root, "m", "policy.yaml"), "w") as fh:
        fh.write("version_policy: all\n")
    d = tmp_path / "policies"
    write_configmap_dir(d, {"m.policy.yaml": compute_rollout("m", BASE, "2", 25.0)})
    reg = Registry(root, policy_dir=str(d))
    reg.load_all()
    assert reg.describe()["m"] == {"versions": ["2", "1"], "default": "1", "canary": {"version": "2", "percent": 25.0}}


def test_a_bad_override_at_load_falls_back_to_the_volume_policy(tmp_path, caplog):
    root = make_repo(tmp_path / "repo", versions=("1", "2"))
    with open(os.path.join(root, "m", "policy.yaml"), "w") as fh:
        fh.write("default_version: '1'\nversion_policy: all\n")
    d = tmp_path / "policies"
    write_configmap_dir(d, {"m.policy.yaml": "canary: ["})
    reg = Registry(root, policy_dir=str(d))
    with caplog.at_level(logging.ERROR, logger="cluster.registry"):
        reg.load_all()
    assert reg.describe()["m"] == {"versions": ["2", "1"], "default": "1", "canary": None}
    assert "m.policy.yaml: is not a valid policy file" in caplog.text


# -- apply_policy ------------------------------------------------------------------------


@pytest.fixture()
def running(tmp_path):
    root = make_repo(tmp_path / "repo", versions=("1", "2", "3"))
    reg = Registry(root)
    reg.apply_policy("m", BASE)
    return reg


def test_canary_0_then_10_percent_then_rollback(running):
    reg = running
    drained = []
    reg.on_drained.append(lambda lv: drained.append(lv.key))
    zero = compute_rollout("m", BASE, "2", 0.0)
    out = reg.apply_policy("m", zero)
    assert out["loaded"] == ["2"] and out["retired"] == [] and out["default"] == "1"
    devices = [f"cam-{i}" for i in range(300)]
    assert {reg.resolve("m", "", d).version for d in devices} == {"1"}

    ten = compute_rollout("m", zero, "2", 10.0)
    assert reg.apply_policy("m", ten)["loaded"] == []
    got = {d: reg.resolve("m", "", d).version for d in devices}
    assert got == {d: route("m", "1", Canary("2", 10.0), d) for d in devices}
    assert 0 < sum(v == "2" for v in got.values()) < len(devices)

    canary_dev = next(d for d, v in got.items() if v == "2")
    back, removed = compute_rollback("m", ten)
    assert removed == "2"
    with reg.lease("m", "", canary_dev) as lv:
        out = reg.apply_policy("m", back)
        # The request already routed finishes on the canary; new ones go to the default.
        assert lv.version == "2" and lv.retired and drained == []
        assert reg.resolve("m", "", canary_dev).version == "1"
    assert out == {"versions": ["1"], "default": "1", "canary": None, "loaded": [], "retired": ["2"]}
    assert drained == ["m@2"] and lv.drained.is_set()
    assert reg.describe()["m"] == {"versions": ["1"], "default": "1", "canary": None}


@pytest.mark.parametrize(("text", "needle"), [
    ("version_policy: {specific: ['1', '9']}\ndefault_version: '1'\ncanary: {version: '9', percent: 10}\n",
     "canary version '9' is not in the registry (on disk: ['3', '2', '1'])"),
    ("version_policy: {specific: ['1']}\ndefault_version: '3'\n", "default_version '3' is not loaded by its"),
    ("version_policy: {specific: ['7']}\n", "version_policy loads no version of 'm'"),
    ("version_policy: {specific: ['2']}\ncanary: {version: '2', percent: 10}\n",
     "canary '2' leaves no other version to fall back to"),
    ("canary: [", "is not a valid policy file"),
])
def test_a_bad_policy_changes_nothing(running, text, needle):
    reg = running
    ten = compute_rollout("m", BASE, "2", 10.0)
    reg.apply_policy("m", ten)
    before = reg.describe()
    with pytest.raises(RegistryError, match="m.policy.yaml") as excinfo:
        reg.apply_policy("m", text, path="m.policy.yaml")
    assert needle in str(excinfo.value)
    assert reg.describe() == before
    assert all(not lv.retired for lv in reg.loaded())


def test_a_canary_without_a_default_keeps_the_current_default(running):
    reg = running
    reg.apply_policy("m", "version_policy: {specific: ['1', '3']}\ncanary: {version: '3', percent: 50}\n")
    assert reg.describe()["m"] == {"versions": ["3", "1"], "default": "1", "canary": {"version": "3", "percent": 50.0}}


def test_none_puts_the_model_back_on_its_volume_policy(running):
    reg = running
    reg.apply_policy("m", compute_rollout("m", BASE, "2", 10.0))
    out = reg.apply_policy("m", None)  # no policy.yaml on the volume: the registry default, latest:1
    assert out["versions"] == ["3"] and out["retired"] == ["1", "2"] and out["canary"] is None
    assert reg.describe()["m"] == {"versions": ["3"], "default": "3", "canary": None}
