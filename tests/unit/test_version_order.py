"""One version order: the registry's. Versions 2 and 10, v2 and v10: the registry serves
10 and v10 as latest, and every planner entry point plans that same version."""

from __future__ import annotations

import json
import os

import onnx
import pytest

from cluster.registry import Registry, model_files, version_sort_key, versions_on_disk
from partitioner import build_graph
from planner import make_flops_profile
from splitinfer.plan_cmd import make_service, plan_main
from tests.onnx_models import conv_bn_relu_chain

#: model -> its versions, lowest first. The higher version has one block more, so the
#: layer count of a plan names the version it was made for.
MODELS = {"num": ("2", "10"), "named": ("v2", "v10")}


def make_versions(root: str) -> dict[str, int]:
    """Writes MODELS (each version with a cloud profile); returns 'model@version' -> layers."""
    layers = {}
    for model, versions in MODELS.items():
        for blocks, version in enumerate(versions, start=2):
            d = os.path.join(root, model, version)
            os.makedirs(os.path.join(d, "profiles"))
            path = os.path.join(d, "model.onnx")
            onnx.save(conv_bn_relu_chain(blocks), path)
            graph = build_graph(path)
            with open(os.path.join(d, "profiles", "cloud.json"), "w") as fh:
                json.dump(make_flops_profile(graph, device="cloud", gflops=50.0).to_dict(), fh)
            layers[f"{model}@{version}"] = len(graph)
    assert len(set(layers.values())) == 2, "each version of a model must have its own layer count"
    return layers


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, int]]:
    root = str(tmp_path_factory.mktemp("registry"))
    return root, make_versions(root)


@pytest.mark.parametrize("low, high", [("2", "10"), ("v2", "v10"), ("1.2", "1.10"), ("9", "v1"), ("01", "1")])
def test_versions_compare_naturally(low: str, high: str) -> None:
    assert version_sort_key(low) < version_sort_key(high)
    assert sorted([high, low], key=version_sort_key) == [low, high]


def test_the_registry_serves_10_and_v10_as_latest(repo: tuple[str, dict[str, int]], tmp_path) -> None:
    root, _ = repo
    assert versions_on_disk(root) == {"named": ("v10", "v2"), "num": ("10", "2")}
    registry = Registry(root, cache_dir=str(tmp_path))
    registry.load_all()
    for model, versions in MODELS.items():
        for asked in ("", "latest"):
            assert registry.resolve(model, asked).version == versions[-1]


def test_every_planner_entry_point_plans_the_registrys_latest(repo: tuple[str, dict[str, int]],
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    root, layers = repo
    service = make_service(registry_dir=root)
    files = model_files(root)
    for model, versions in MODELS.items():
        latest = f"{model}@{versions[-1]}"
        assert files[model] == files[latest]
        # the planner service (behind `planner serve --registry`) and its model list
        assert len(service.graph(model)) == layers[latest]
        listed = {m["name"] for m in service.models()["models"] if m["source"] == "registry"}
        assert {model, latest, f"{model}@{versions[0]}"} <= listed
        # `splitinfer plan MODEL --registry DIR`
        assert plan_main([model, "--registry", root, "--edge", "1gflops", "--cloud", "100gflops",
                          "--uplink", "1gbit", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["layers"] == layers[latest]


def test_a_flat_onnx_file_in_the_registry_dir_is_one_more_model(tmp_path) -> None:
    onnx.save(conv_bn_relu_chain(2), str(tmp_path / "solo.onnx"))
    service = make_service(registry_dir=str(tmp_path))
    assert {m["name"] for m in service.models()["models"] if m["source"] == "registry"} == {"solo"}
    assert len(service.graph("solo")) == len(build_graph(str(tmp_path / "solo.onnx")))
