"""`splitinfer calibrate` on a model file and on a registry entry: the table is written,
a second run measures nothing, and bad options stop in one line."""

from __future__ import annotations

import numpy as np
import pytest

from planner.accuracy import AccuracyTable
from splitinfer.calibrate_cmd import calibrate_main
from tests.unit._accuracy_models import conv_model, images

FAST = ["--no-progress", "--max-chain-points", "1", "--encodings", "fp16,int8", "--input-encodings", "jpeg@90"]


def test_calibrate_writes_the_table_beside_the_model_and_reuses_it(tmp_path, capsys) -> None:
    path = conv_model(str(tmp_path / "conv.onnx"))
    np.savez(tmp_path / "x.npz", x=images(3))
    assert calibrate_main([path, "--inputs", str(tmp_path / "x.npz"), "--image-norm", "imagenet", *FAST]) == 0
    out = capsys.readouterr().out
    assert "measured 5 (cut, encoding) pairs, reused 0" in out and "jpeg@90" in out
    table = AccuracyTable.from_json((tmp_path / "conv.accuracy.json").read_text())
    assert table.num_samples == 3 and table.sample_source == "x.npz"
    assert calibrate_main([path, "--inputs", str(tmp_path / "x.npz"), "--image-norm", "imagenet", *FAST]) == 0
    assert "measured 0 (cut, encoding) pairs, reused 5" in capsys.readouterr().out


def test_calibrate_generates_samples_when_none_are_given(tmp_path, capsys) -> None:
    path = conv_model(str(tmp_path / "conv.onnx"))
    out = tmp_path / "t.json"
    assert calibrate_main([path, "--input-shape", "x=1x3x16x16", "--samples", "2", "-o", str(out), "--json",
                           *FAST]) == 0
    table = AccuracyTable.from_json(out.read_text())
    assert table.sample_source == "generated" and table.num_samples == 2
    assert AccuracyTable.from_dict(__import__("json").loads(capsys.readouterr().out)) == table


def test_calibrate_a_registry_entry_stores_accuracy_json(tmp_path, capsys) -> None:
    from cluster.registry import VersionFiles

    vdir = tmp_path / "reg" / "m" / "2"
    vdir.mkdir(parents=True)
    conv_model(str(vdir / "model.onnx"))
    np.savez(vdir / "samples.npz", x=images(2))
    (vdir / "model.yaml").write_text("sample_inputs: samples.npz\n")
    assert calibrate_main(["m", "--registry", str(tmp_path / "reg"), *FAST]) == 0
    assert "wrote" in capsys.readouterr().out
    table = VersionFiles(str(tmp_path / "reg"), "m", "2").accuracy()
    assert table is not None and table.sample_source == "model.yaml" and table.num_samples == 2
    assert table.model == "m@2"


@pytest.mark.parametrize("argv,match", [
    (["--encodings", "fp8"], "encoding 'fp8' is unknown"),
    (["--input-encodings", "jpeg@0"], "quality 0, outside 1..100"),
    (["--image-mean", "a,b"], "not a comma-separated list of numbers"),
])
def test_bad_options_stop_with_a_usage_error(tmp_path, capsys, argv, match) -> None:
    path = conv_model(str(tmp_path / "conv.onnx"))
    with pytest.raises(SystemExit) as e:
        calibrate_main([path, *argv])
    assert e.value.code == 2
    assert match in capsys.readouterr().err


def test_an_unknown_registry_model_names_the_fix(tmp_path) -> None:
    from cluster.registry import RegistryError

    (tmp_path / "reg").mkdir()
    with pytest.raises(RegistryError, match="is no model of the registry.*registry add"):
        calibrate_main(["nope", "--registry", str(tmp_path / "reg"), "--no-progress"])


def test_progress_is_shown_on_stderr_unless_turned_off(tmp_path, capsys) -> None:
    path = conv_model(str(tmp_path / "conv.onnx"))
    argv = [path, "--input-shape", "x=1x3x16x16", "--samples", "2", "--max-chain-points", "1",
            "--encodings", "fp16", "--input-encodings", ""]
    assert calibrate_main(argv) == 0
    assert "calibrate conv: 2/2" in capsys.readouterr().err  # off a terminal: one line when it ends
    (tmp_path / "conv.accuracy.json").unlink()
    assert calibrate_main([*argv, "--no-progress"]) == 0
    assert "calibrate conv" not in capsys.readouterr().err
