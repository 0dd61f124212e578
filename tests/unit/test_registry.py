"""The model registry: canary routing, rollback with requests in flight, version policy,
frontier.json, tail segments and the errors of bad model directories."""

from __future__ import annotations

import contextlib
import json
import os

import onnx
import pytest

from cluster.errors import UnknownCutError, UnknownModelError, UnknownVersionError
from cluster.registry import (
    Canary,
    ModelConfig,
    Registry,
    RegistryError,
    VersionFrontier,
    VersionPolicy,
    canary_fraction,
    route,
    set_model_yaml,
    version_sort_key,
)
from tests.onnx_models import conv_bn_relu_chain


def make_repo(root, versions=("1", "2"), model="m", blocks=4, yaml_text=None) -> str:
    for i, v in enumerate(versions):
        d = os.path.join(root, model, v)
        os.makedirs(d, exist_ok=True)
        onnx.save(conv_bn_relu_chain(blocks, seed=i), os.path.join(d, "model.onnx"))
        if yaml_text is not None:
            with open(os.path.join(d, "model.yaml"), "w") as fh:
                fh.write(yaml_text)
    return str(root)


# -- canary routing ----------------------------------------------------------------------


def test_canary_sends_ten_percent_of_devices_and_always_the_same_ones():
    ids = [f"device-{i:04d}" for i in range(1000)]
    canary = Canary("2", 10.0)
    first = [d for d in ids if route("m", "1", canary, d) == "2"]
    again = [d for d in ids if route("m", "1", canary, d) == "2"]
    assert 70 <= len(first) <= 130  # 10% +- 3%
    assert first == again
    # Raising the percentage only adds devices: those already on the canary stay on it.
    wider = {d for d in ids if route("m", "1", Canary("2", 30.0), d) == "2"}
    assert set(first) <= wider


def test_canary_fraction_is_uniform_stable_and_salted_by_model():
    xs = [canary_fraction("m", f"d{i}") for i in range(2000)]
    assert all(0.0 <= x < 1.0 for x in xs)
    assert 0.45 < sum(xs) / len(xs) < 0.55
    assert canary_fraction("m", "d1") == canary_fraction("m", "d1")
    assert canary_fraction("m", "d1") != canary_fraction("other", "d1")


def test_devices_without_id_never_get_the_canary():
    assert route("m", "1", Canary("2", 100.0), "") == "1"
    assert route("m", "1", Canary("2", 100.0), "x") == "2"
    assert route("m", "1", None, "x") == "1"


def test_canary_percent_out_of_range_is_refused(tmp_path):
    reg = Registry(make_repo(tmp_path))
    reg.load("m", "1")
    reg.load("m", "2")
    with pytest.raises(RegistryError, match="percent"):
        reg.set_canary("m", "2", 150)
    with pytest.raises(UnknownVersionError):
        reg.set_canary("m", "9", 10)


# -- version policy ----------------------------------------------------------------------


def test_version_policy_selects_latest_all_and_specific():
    avail = ["1", "2", "10", "3"]
    assert VersionPolicy.parse("latest").select(avail) == ("10",)
    assert VersionPolicy.parse("latest:2").select(avail) == ("10", "3")
    assert VersionPolicy.parse("all").select(avail) == ("10", "3", "2", "1")
    assert VersionPolicy.parse("specific:1,3,7").select(avail) == ("3", "1")
    assert VersionPolicy.parse({"latest": 3}).select(avail) == ("10", "3", "2")
    assert VersionPolicy.parse({"specific": [2, "10"]}).select(avail) == ("10", "2")
    assert version_sort_key("1.10") > version_sort_key("1.2")


@pytest.mark.parametrize("spec", ["newest", "latest:0", "specific:", "latest:x", {"latest": 1, "all": True}])
def test_bad_version_policy_names_the_fix(spec):
    with pytest.raises(RegistryError, match="latest, latest:N, all or specific"):
        VersionPolicy.parse(spec)


def test_load_all_follows_the_policy_and_policy_yaml(tmp_path):
    root = make_repo(tmp_path, versions=("1", "2", "3"))
    make_repo(tmp_path, versions=("1", "2"), model="n")
    with open(os.path.join(root, "n", "policy.yaml"), "w") as fh:
        fh.write("version_policy: all\ndefault_version: '1'\ncanary: {version: '2', percent: 25}\n")
    reg = Registry(root, policy=VersionPolicy.parse("latest:2"))
    reg.load_all()
    desc = reg.describe()
    assert desc["m"]["versions"] == ["3", "2"]
    assert desc["m"]["default"] == "3"
    assert desc["n"] == {"versions": ["2", "1"], "default": "1", "canary": {"version": "2", "percent": 25.0}}


def test_explicit_load_unload_and_unknown_names(tmp_path):
    reg = Registry(make_repo(tmp_path))
    with pytest.raises(UnknownModelError):
        reg.resolve("m", "1")
    reg.load("m", "1")
    assert reg.resolve("m", "").version == "1"
    assert reg.resolve("m", "latest", "any").version == "1"
    with pytest.raises(UnknownVersionError, match="known versions: '1'"):
        reg.resolve("m", "2")
    reg.load("m", "2")
    assert reg.resolve("m", "").version == "2"  # the highest loaded version is the default
    reg.unload("m", "2")
    assert reg.resolve("m", "").version == "1"
    with pytest.raises(UnknownVersionError):
        reg.unload("m", "2")
    with pytest.raises(UnknownModelError, match="'nope'"):
        reg.resolve("nope", "1")


# -- rollback with requests in flight -------------------------------------------------------


def test_rollback_while_50_requests_are_in_flight_loses_none(tmp_path):
    reg = Registry(make_repo(tmp_path))
    reg.load("m", "1")
    reg.load("m", "2")
    reg.set_canary("m", "2", 100.0)
    drained = []
    reg.on_drained.append(lambda lv: drained.append((lv.key, lv.in_flight)))
    finished = []
    with contextlib.ExitStack() as stack:
        held = [stack.enter_context(reg.lease("m", "", f"dev{i}")) for i in range(50)]
        assert {lv.version for lv in held} == {"2"}
        assert reg.rollback("m") == "2"
        # New requests go to the baseline at once; v2 may not be released yet.
        assert reg.resolve("m", "", "dev1").version == "1"
        assert drained == []
        for lv in held:
            assert not lv.drained.is_set()
            finished.append(lv.key)
    assert finished == ["m@2"] * 50
    assert drained == [("m@2", 0)]
    assert held[0].drained.is_set()
    assert reg.describe()["m"]["versions"] == ["1"]


def test_promote_makes_the_canary_the_default(tmp_path):
    reg = Registry(make_repo(tmp_path))
    reg.load("m", "1")
    reg.load("m", "2")
    reg.set_canary("m", "2", 10)
    # Loading the canary pinned the default to the old version for everyone else.
    assert reg.default_version("m") == "1"
    assert reg.promote("m") == "2"
    assert reg.default_version("m") == "2" and reg.canary("m") is None
    assert reg.rollback("m") is None
    with pytest.raises(RegistryError, match="no canary"):
        reg.promote("m")


# -- frontier and segments ---------------------------------------------------------------------


def test_default_frontier_is_written_and_reused(tmp_path):
    root = make_repo(tmp_path, versions=("1",))
    lv = Registry(root).load("m", "1")
    assert lv.frontier.source == "default"
    assert lv.frontier.cuts[0].edge_layers == ()  # the cloud-only cut: the device sends the input
    assert 2 <= len(lv.frontier.cuts) <= 4
    path = os.path.join(root, "m", "1", "frontier.json")
    text = open(path).read()
    assert VersionFrontier.from_json(text) == lv.frontier
    assert json.loads(text)["schema"] == "splitinfer.registry-frontier/1"
    # A second registry reads it back instead of computing it: an edit to it is kept.
    edited = json.loads(text)
    edited["cuts"] = edited["cuts"][:1]
    with open(path, "w") as fh:
        json.dump(edited, fh)
    assert Registry(root).load("m", "1").frontier.cut_ids == lv.frontier.cut_ids[:1]


def test_a_frontier_is_computed_again_when_model_yaml_changes(tmp_path):
    # [Note: frontier inputs]: model.onnx is unchanged and older than frontier.json.
    root = make_repo(tmp_path, versions=("1",), yaml_text="frontier: {default_cut_count: 1}\n")
    assert len(Registry(root).load("m", "1").frontier.cuts) == 2  # the cloud-only cut and one chain point
    with open(os.path.join(root, "m", "1", "model.yaml"), "w") as fh:
        fh.write("frontier: {default_cut_count: 3}\n")
    assert len(Registry(root).load("m", "1").frontier.cuts) == 4


def test_a_frontier_is_computed_again_when_a_profile_changes(tmp_path):
    root = make_repo(tmp_path, versions=("1",))
    first = Registry(root).load("m", "1").frontier
    path = os.path.join(root, "m", "1", "frontier.json")
    edited = json.loads(open(path).read())
    edited["cuts"] = edited["cuts"][:1]
    with open(path, "w") as fh:
        json.dump(edited, fh)
    os.makedirs(os.path.join(root, "m", "1", "profiles"))
    with open(os.path.join(root, "m", "1", "profiles", "notes.json"), "w") as fh:
        fh.write("{}")
    assert Registry(root).load("m", "1").frontier.cut_ids == first.cut_ids


def test_planner_frontier_when_profiles_exist(tmp_path):
    from partitioner import build_graph
    from planner import make_flops_profile

    root = make_repo(tmp_path, versions=("1",), blocks=3)
    model_path = os.path.join(root, "m", "1", "model.onnx")
    graph = build_graph(onnx.load(model_path))
    prof = os.path.join(root, "m", "1", "profiles")
    os.makedirs(prof)
    with open(os.path.join(prof, "device.json"), "w") as fh:
        fh.write(make_flops_profile(graph, device="slow", gflops=1e-5).to_json())
    with open(os.path.join(prof, "cloud.json"), "w") as fh:
        fh.write(make_flops_profile(graph, device="fast", gflops=100.0).to_json())
    lv = Registry(root).load("m", "1")
    assert lv.frontier.source == "planner"
    assert lv.frontier.planner is not None and lv.frontier.planner["schema"] == "splitinfer.frontier/1"
    assert lv.frontier.cuts
    files = lv.files.artifact_files()
    assert set(files) == {"model.onnx", "frontier.json", "profiles/device.json", "profiles/cloud.json"}


def test_tails_are_cut_on_demand_and_cached(tmp_path):
    root = make_repo(tmp_path, versions=("1",))
    lv = Registry(root).load("m", "1")
    cut = lv.frontier.cuts[-1]
    path = lv.files.tail_path(cut.cut_id)
    assert path == os.path.join(root, "m", "1", "segments", cut.cut_id, "tail.onnx")
    tail = onnx.load(path)
    assert [i.name for i in tail.graph.input] == list(cut.boundary)
    meta = json.load(open(os.path.join(os.path.dirname(path), "cut.json")))
    assert meta["edge_layers"] == list(cut.edge_layers)
    assert lv.files.tail_path(cut.cut_id) == path
    with pytest.raises(UnknownCutError, match="'nocut'"):
        lv.files.tail_path("nocut", known=lv.frontier.cut_ids)


def test_read_only_registry_writes_to_the_cache_dir(tmp_path):
    root = make_repo(tmp_path / "repo", versions=("1",))
    # A file where the segments directory would go makes the registry unwritable there.
    open(os.path.join(root, "m", "1", "segments"), "w").close()
    lv = Registry(root, cache_dir=str(tmp_path / "cache")).load("m", "1")
    path = lv.files.tail_path(lv.frontier.cuts[0].cut_id)
    assert path.startswith(str(tmp_path / "cache"))


# -- bad model directories -------------------------------------------------------------------


def test_missing_or_empty_or_corrupt_model_is_a_clear_error(tmp_path):
    root = make_repo(tmp_path, versions=("1",))
    os.makedirs(os.path.join(root, "m", "2"))
    reg = Registry(root)
    with pytest.raises(RegistryError, match="has no model.onnx; copy the model there"):
        reg.load("m", "2")
    open(os.path.join(root, "m", "2", "model.onnx"), "w").close()
    with pytest.raises(RegistryError, match="is empty"):
        reg.load("m", "2")
    with open(os.path.join(root, "m", "2", "model.onnx"), "wb") as fh:
        fh.write(b"\x00not an onnx model at all" * 10)
    with pytest.raises(RegistryError, match="model.onnx.*(cannot be parsed|is not a model)"):
        reg.load("m", "2")
    with pytest.raises(RegistryError, match="is not a directory"):
        reg.load("m", "7")
    with pytest.raises(RegistryError, match="is not a directory"):
        Registry(str(tmp_path / "nowhere"))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("max_batch_size: many\n", r"model.yaml.max_batch_size must be an integer, got 'many'"),
        ("max_batch_size: 0\n", r"max_batch_size=0 must be >= 1"),
        ("instances: 0\n", r"instances=0 must be >= 1"),
        ("max_batch_size: true\n", r"must be an integer, got True"),
        ("frontier: {include_cloud_only: 3}\n", r"frontier.include_cloud_only must be true or false"),
        ("batch: 4\n", r"unknown field\(s\) \['batch'\]"),
        ("frontier: {objective: speed}\n", r"objective 'speed'"),
        ("name: other\n", r"does not match the directory 'm'"),
        ("max_batch_size: [\n", r"is not valid YAML"),
        ("- 1\n- 2\n", r"must be a mapping"),
        ("ray_resources: gpu\n", r"ray_resources='gpu' must be a mapping"),
        ("ray_resources: {GPU: 1}\n", r"ray_resources names 'GPU'; name a custom resource"),
        ("ray_resources: {tier: 0}\n", r"ray_resources\['tier'\]=0 must be a number > 0"),
        ("ray_resources: {tier: yes}\n", r"ray_resources\['tier'\]=True must be a number > 0"),
    ],
)
def test_bad_model_yaml_names_the_field(tmp_path, text, match):
    root = make_repo(tmp_path, versions=("1",), yaml_text=text)
    with pytest.raises(RegistryError, match=match):
        Registry(root).load("m", "1")


def test_model_yaml_fields_round_trip(tmp_path):
    root = make_repo(tmp_path, versions=("1",), yaml_text="max_batch_size: 4\nmax_queue_delay_ms: 1\ninstances: 2\n"
                     "ray_resources: {splitinfer-gpu-tier: 0.5}\n"
                     "frontier: {default_cut_count: 1, include_cloud_only: false}\n")
    lv = Registry(root).load("m", "1")
    assert lv.config.max_batch_size == 4 and lv.config.max_queue_delay_ms == 1.0 and lv.config.instances == 2
    assert lv.config.ray_resources == {"splitinfer-gpu-tier": 0.5}
    assert len(lv.frontier.cuts) == 1 and lv.frontier.cuts[0].edge_layers
    assert ModelConfig.from_json(lv.config.to_json()) == lv.config


def test_model_config_is_hashable_and_keeps_its_own_ray_resources():
    asked = {"splitinfer-gpu-tier": 1}
    config = ModelConfig(ray_resources=asked)
    asked["splitinfer-gpu-tier"] = 5  # the caller's dict, changed later
    assert config.ray_resources == {"splitinfer-gpu-tier": 1}
    same = ModelConfig(ray_resources={"splitinfer-gpu-tier": 1})
    assert {config: "a"}[same] == "a" and hash(ModelConfig()) == hash(ModelConfig())
    assert config != ModelConfig(ray_resources={"splitinfer-cpu-tier": 1})  # compared, if not hashed


def test_set_model_yaml_keeps_other_lines_and_refuses_what_would_not_load(tmp_path):
    path = tmp_path / "model.yaml"
    assert set_model_yaml(str(path), instances=2).instances == 2  # created
    path.write_text("# ours\nreplicas: 2\ninstances: 1\nfrontier:\n  default_cut_count: 1\n")
    config = set_model_yaml(str(path), instances=4, intra_op_threads=8)
    assert (config.instances, config.intra_op_threads, config.replicas, config.frontier.default_cut_count) == (4, 8, 2, 1)
    assert path.read_text() == "# ours\nreplicas: 2\ninstances: 4\nfrontier:\n  default_cut_count: 1\nintra_op_threads: 8\n"
    before = path.read_text()
    with pytest.raises(RegistryError, match=r"would not load with \{'instances': 0\} set: model.yaml: instances=0 must be >= 1"):
        set_model_yaml(str(path), instances=0)
    with pytest.raises(RegistryError, match=r"cannot set \['frontier', 'threads'\]"):
        set_model_yaml(str(path), threads=2, frontier=1)
    path.write_text(before + "instances: 5\n")
    with pytest.raises(RegistryError, match="sets instances on 2 lines"):
        set_model_yaml(str(path), instances=1)
    assert path.read_text() == before + "instances: 5\n"
    assert sorted(os.listdir(tmp_path)) == ["model.yaml"]  # no temporary file left behind


def test_bad_policy_yaml(tmp_path):
    root = make_repo(tmp_path, versions=("1",))
    with open(os.path.join(root, "m", "policy.yaml"), "w") as fh:
        fh.write("canary: {version: '1'}\n")
    with pytest.raises(RegistryError, match="policy.yaml: is not a valid policy file"):
        Registry(root).load_all()
