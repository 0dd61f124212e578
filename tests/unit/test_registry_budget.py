"""model.yaml's min_agreement: the registry's frontier keeps to it on accuracy.json, places
the measured lossy codecs where they meet it, preloads their tails, and is computed
again when the budget or the table changes."""

from __future__ import annotations

import os

import onnx
import pytest


from cluster.registry import ModelConfig, Registry, RegistryError
from partitioner import build_graph
from planner import Frontier, make_flops_profile
from planner.accuracy import AccuracyEntry, AccuracyTable
from tests.unit.test_registry import make_repo

YAML = "frontier: {up_lo_bps: 10000, up_hi_bps: 1000000000}\n"


def _version(tmp_path, yaml_text: str, agreement: float = 0.995) -> str:
    root = make_repo(tmp_path, versions=("1",), blocks=3, yaml_text=yaml_text)
    d = os.path.join(root, "m", "1")
    graph = build_graph(onnx.load(os.path.join(d, "model.onnx")))
    os.makedirs(os.path.join(d, "profiles"))
    with open(os.path.join(d, "profiles", "device.json"), "w") as fh:
        fh.write(make_flops_profile(graph, device="slow", gflops=1e-3).to_json())
    with open(os.path.join(d, "profiles", "cloud.json"), "w") as fh:
        fh.write(make_flops_profile(graph, device="fast", gflops=100.0).to_json())
    x_bytes = graph.tensor["x"].bytes_per_sample
    table = AccuracyTable("m", "f", 4, (AccuracyEntry("L", "bits@4", agreement, "y", "rel_l2", 4, x_bytes / 20, 0.01),))
    with open(os.path.join(d, "accuracy.json"), "w") as fh:
        fh.write(table.to_json())
    return root


def _keys(lv) -> list[str]:
    return [e.plan.encoding.key for e in Frontier.from_dict(lv.frontier.planner).entries]


def test_the_frontier_keeps_to_model_yaml_budget_and_preloads_the_codec_tail(tmp_path) -> None:
    root = _version(tmp_path, YAML + "min_agreement: 0.99\n")
    lv = Registry(root).load("m", "1")
    assert lv.frontier.min_agreement == 0.99
    front = Frontier.from_dict(lv.frontier.planner)
    assert "bits@4" in _keys(lv)
    assert all(e.plan.agreement is not None and e.plan.agreement >= 0.99 for e in front.entries)
    held = [e.plan for e in front.entries if e.plan.encoding.key == "bits@4"]
    assert {p.cut.key for p in held} <= set(lv.frontier.cut_ids)  # its tail is preloaded
    assert held[0].encoding.ratio == pytest.approx(1 / 20)


def test_a_budget_above_the_measured_agreement_leaves_the_codec_out(tmp_path) -> None:
    root = _version(tmp_path, YAML + "min_agreement: 0.999\n")
    lv = Registry(root).load("m", "1")
    assert "bits@4" not in _keys(lv) and lv.frontier.min_agreement == 0.999


def test_without_a_budget_the_frontier_is_lossless(tmp_path) -> None:
    root = _version(tmp_path, YAML)
    lv = Registry(root).load("m", "1")
    assert set(_keys(lv)) == {"fp32"} and lv.frontier.min_agreement is None


def test_a_frontier_of_another_budget_is_computed_again(tmp_path) -> None:
    root = _version(tmp_path, YAML)
    assert Registry(root).load("m", "1").frontier.min_agreement is None
    with open(os.path.join(root, "m", "1", "model.yaml"), "a") as fh:
        fh.write("min_agreement: 0.99\n")
    lv = Registry(root).load("m", "1")
    assert lv.frontier.min_agreement == 0.99 and "bits@4" in _keys(lv)


@pytest.mark.parametrize("value", ["1.5", "0", "-0.2", "true", "'high'"])
def test_a_bad_budget_in_model_yaml_is_a_clear_error(tmp_path, value) -> None:
    path = tmp_path / "model.yaml"
    path.write_text(f"min_agreement: {value}\n")
    with pytest.raises(RegistryError, match=r"min_agreement=.* must be a fraction in \(0, 1\], such as 0.99"):
        ModelConfig.from_yaml_file(str(path))


def test_the_budget_round_trips_through_the_config_json() -> None:
    c = ModelConfig(min_agreement=0.98)
    assert ModelConfig.from_json(c.to_json()) == c
