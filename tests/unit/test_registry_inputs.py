"""model.yaml's input_shapes and sample_inputs, and `registry add --input-shape/--inputs`:
what they accept, the clear error for what they do not, and the tail inputs made from samples."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import yaml

from cluster.registry import ModelConfig, Registry, RegistryError
from splitinfer.cli import main
from tests.serving_models import any_hw_model, reshape_by_input_model


def _version(root, yml: str = "", samples: dict | None = None):
    d = root / "hw" / "1"
    d.mkdir(parents=True)
    onnx.save(any_hw_model(), str(d / "model.onnx"))
    (d / "model.yaml").write_text(yml)
    if samples is not None:
        np.savez(d / "inputs.npz", **samples)
    return d


def test_input_shapes_take_lists_or_the_flag_spelling(tmp_path):
    d = _version(tmp_path, "input_shapes: {x: [1, 4, 8, 8]}\n")
    assert ModelConfig.from_yaml_file(str(d / "model.yaml")).input_shapes == {"x": (1, 4, 8, 8)}
    (d / "model.yaml").write_text("input_shapes:\n  x: 1x4x8x8\n")
    config = ModelConfig.from_yaml_file(str(d / "model.yaml"))
    assert config.input_shapes == {"x": (1, 4, 8, 8)} and config.input_shape_specs() == ["x=1x4x8x8"]
    assert ModelConfig.from_json(config.to_json()) == config


@pytest.mark.parametrize("yml, message", [
    ("input_shapes: [1, 4]\n", "input_shapes=[1, 4] must map input names to shapes"),
    ("input_shapes: {x: [1, 0, 8]}\n", "input_shapes['x']=[1, 0, 8] is not a shape"),
    ("input_shapes: {x: 1x4xH}\n", "input_shapes['x']: input shape '1x4xH' is not NAME=D0xD1x..."),
    ("input_shapes: {x: x=1x4}\n", "names an input inside the shape; write x: 1x4"),
    ("sample_inputs: ../other/inputs.npz\n", "must be an .npz file inside the version's directory"),
    ("sample_inputs: /data/inputs.npz\n", "must be an .npz file inside the version's directory"),
    ("sample_inputs: inputs.txt\n", "must be an .npz file inside the version's directory"),
])
def test_bad_fields_are_refused_naming_the_value(tmp_path, yml, message):
    d = _version(tmp_path, yml)
    with pytest.raises(RegistryError) as e:
        ModelConfig.from_yaml_file(str(d / "model.yaml"))
    assert message in str(e.value) and str(d / "model.yaml") in str(e.value)


@pytest.mark.parametrize("yml, samples, message", [
    ("input_shapes: {images: [1, 4, 8, 8]}\n", None, "input_shapes names ['images'], which are not inputs"),
    ("sample_inputs: inputs.npz\n", None, "sample inputs file"),
    ("sample_inputs: inputs.npz\n", {"images": np.zeros((1, 4, 2, 2), np.float32)}, "missing ['x']"),
    ("sample_inputs: inputs.npz\ninput_shapes: {x: 1x4x8x8}\n", {"x": np.zeros((1, 4, 2, 2), np.float32)},
     "input_shapes gives 'x' the shape [1, 4, 8, 8], but sample_inputs has [1, 4, 2, 2]"),
])
def test_fields_that_do_not_fit_the_model_fail_its_load_with_the_cause(tmp_path, yml, samples, message):
    _version(tmp_path, yml, samples)
    with pytest.raises(RegistryError) as e:
        Registry(str(tmp_path)).load("hw", "1")
    assert message in str(e.value)


def test_a_tails_sample_inputs_are_the_head_run_on_the_versions_samples(tmp_path):
    x = np.random.default_rng(0).standard_normal((2, 4, 6, 5)).astype(np.float32)
    _version(tmp_path, "sample_inputs: inputs.npz\nfrontier: {default_cut_count: 1}\n", {"x": x})
    lv = Registry(str(tmp_path)).load("hw", "1")
    whole, later = lv.frontier.cuts
    assert not whole.edge_layers and later.edge_layers
    np.testing.assert_array_equal(lv.files.tail_samples(whole.cut_id)["x"], x)
    boundary = lv.files.tail_samples(later.cut_id)
    assert set(boundary) == set(later.boundary)
    assert all(v.shape[0] == 2 and v.shape[2:] == (6, 5) for v in boundary.values())


def test_without_samples_the_declared_shapes_stand_in_where_random_values_are_valid(tmp_path):
    _version(tmp_path, "input_shapes: {x: [1, 4, 8, 8]}\nfrontier: {default_cut_count: 1}\n")
    lv = Registry(str(tmp_path)).load("hw", "1")
    whole, later = lv.frontier.cuts
    made = lv.files.tail_samples(whole.cut_id)["x"]
    assert made.shape == (1, 4, 8, 8) and made.dtype == np.float32 and np.std(made) > 0
    assert all(v.shape[2:] == (8, 8) for v in lv.files.tail_samples(later.cut_id).values())


def test_no_samples_and_no_shapes_or_a_shape_input_means_no_tail_samples(tmp_path):
    _version(tmp_path / "a", "")
    lv = Registry(str(tmp_path / "a")).load("hw", "1")
    assert lv.files.tail_samples(lv.frontier.cut_ids[0]) is None
    d = tmp_path / "b" / "reshape" / "1"
    d.mkdir(parents=True)
    onnx.save(reshape_by_input_model(), str(d / "model.onnx"))
    (d / "model.yaml").write_text("input_shapes: {x: [1, 6], shape: [2]}\n")
    lv = Registry(str(tmp_path / "b")).load("reshape", "1")
    assert lv.files.tail_samples(lv.frontier.cut_ids[0]) is None  # no value is invented for `shape`


def test_registry_add_writes_input_shapes_and_copies_the_samples(tmp_path, capsys):
    src = tmp_path / "hw.onnx"
    onnx.save(any_hw_model(), str(src))
    x = np.ones((1, 4, 8, 8), np.float32)
    np.savez(tmp_path / "mine.npz", x=x)
    root = tmp_path / "models"
    rc = main(["registry", "add", str(src), str(root), "--input-shape", "1x4x8x8", "--inputs",
               str(tmp_path / "mine.npz")])
    out, _ = capsys.readouterr()
    assert rc == 0 and "inputs.npz" in out
    d = root / "hw" / "1"
    written = yaml.safe_load((d / "model.yaml").read_text())
    assert written["input_shapes"] == {"x": [1, 4, 8, 8]} and written["sample_inputs"] == "inputs.npz"
    np.testing.assert_array_equal(np.load(d / "inputs.npz")["x"], x)
    lv = Registry(str(root)).load("hw", "1")
    assert lv.config.input_shapes == {"x": (1, 4, 8, 8)}
    np.testing.assert_array_equal(lv.files.sample_inputs()["x"], x)


@pytest.mark.parametrize("argv, message", [
    (["--input-shape", "images=1x4x8x8"], "names 'images', which is not a model input"),
    (["--input-shape", "1x4xHxW"], "is not NAME=D0xD1x..."),
    (["--inputs", "missing.npz"], "sample inputs file 'missing.npz' does not exist"),
    (["--input-shape", "x=1x4x8x8", "--inputs", "{npz}"], "--input-shape gives 'x' the shape 1x4x8x8, but --inputs"),
])
def test_registry_add_refuses_bad_shapes_and_samples_in_one_line(tmp_path, capsys, argv, message):
    src = tmp_path / "hw.onnx"
    onnx.save(any_hw_model(), str(src))
    np.savez(tmp_path / "two.npz", x=np.ones((1, 4, 2, 2), np.float32))
    argv = [a.replace("{npz}", str(tmp_path / "two.npz")) for a in argv]
    root = tmp_path / "models"
    rc = main(["registry", "add", str(src), str(root), *argv])
    _, err = capsys.readouterr()
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not root.exists()
