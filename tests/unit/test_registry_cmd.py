"""`splitinfer registry add` and `registry list`: the layout the gateway's registry reads, and refusals."""

from __future__ import annotations

import json
import os

import onnx
import pytest

from cluster.registry import Registry, survey
from splitinfer.cli import main
from splitinfer.registry_cmd import AddOptions, add_model, next_version


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["registry", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_add_a_zoo_model_writes_the_layout_the_registry_loads(tmp_path, capsys):
    root = str(tmp_path / "models")
    rc, out, _ = _run(capsys, "add", "squeezenet", root)
    assert rc == 0 and "added squeezenet@1" in out and f"splitinfer gateway --registry {root}" in out
    assert sorted(os.listdir(tmp_path / "models" / "squeezenet" / "1")) == ["model.onnx", "model.yaml"]
    assert os.listdir(root) == ["squeezenet"]  # no staging directory left
    lv = Registry(root).load("squeezenet", "1")
    assert lv.config.name == "squeezenet" and "zoo" in lv.config.description
    assert lv.frontier.source == "default"  # no profiles: the gateway's chain cuts


def test_the_default_version_is_one_above_the_highest_number(tmp_path, capsys):
    root = str(tmp_path)
    assert next_version(root, "squeezenet") == "1"
    assert _run(capsys, "add", "squeezenet", root, "--version", "7")[0] == 0
    os.makedirs(tmp_path / "squeezenet" / "beta")  # not a number: never the next one
    assert next_version(root, "squeezenet") == "8"
    assert _run(capsys, "add", "squeezenet", root)[0] == 0
    assert survey(root).models == {"squeezenet": ("8", "7")}


def test_an_onnx_path_is_named_by_its_stem(tmp_path, capsys):
    from partitioner import zoo_path

    src = tmp_path / "my-net.onnx"
    src.write_bytes(open(zoo_path("squeezenet"), "rb").read())
    rc, out, _ = _run(capsys, "add", str(src), str(tmp_path / "reg"), "--name", "net", "--version", "2.1")
    assert rc == 0
    assert os.path.isfile(tmp_path / "reg" / "net" / "2.1" / "model.onnx")
    assert _run(capsys, "add", str(src), str(tmp_path / "reg"))[0] == 0
    assert os.path.isfile(tmp_path / "reg" / "my-net" / "1" / "model.onnx")


def test_an_existing_version_is_refused_unless_forced(tmp_path, capsys):
    root = str(tmp_path)
    _run(capsys, "add", "squeezenet", root, "--description", "first")
    rc, _, err = _run(capsys, "add", "squeezenet", root, "--version", "1", "--description", "second")
    assert rc == 2 and "squeezenet/1 already exists; give --version 2 for a new version, or --force" in err
    assert "first" in (tmp_path / "squeezenet" / "1" / "model.yaml").read_text()
    rc, _, _ = _run(capsys, "add", "squeezenet", root, "--version", "1", "--description", "second", "--force")
    assert rc == 0 and "second" in (tmp_path / "squeezenet" / "1" / "model.yaml").read_text()
    assert sorted(os.listdir(tmp_path)) == ["squeezenet"] and os.listdir(tmp_path / "squeezenet") == ["1"]


@pytest.mark.parametrize("argv, message", [
    (["--name", "bad name"], "--name 'bad name' is not a valid registry name"),
    (["--version", "../1"], "--version '../1' is not a valid registry name"),
    (["--edge", "rpi"], "--edge 'rpi' is not a reference device; choose one of rpi4"),
])
def test_bad_names_are_refused_in_one_line_and_nothing_is_made(tmp_path, capsys, argv, message):
    root = tmp_path / "models"
    rc, _, err = _run(capsys, "add", "squeezenet", str(root), *argv)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not root.exists()


def test_a_model_that_does_not_load_is_refused_and_nothing_is_made(tmp_path, capsys):
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(b"not a protobuf")
    root = tmp_path / "models"
    rc, _, err = _run(capsys, "add", str(bad), str(root))
    assert rc == 2 and "is not a readable ONNX model" in err and "Traceback" not in err
    rc, _, err = _run(capsys, "add", "nosuchnet", str(root))
    assert rc == 2 and "unknown zoo model 'nosuchnet'" in err
    assert not root.exists()


def test_an_interrupt_midway_leaves_the_registry_as_it_was(tmp_path):
    root = tmp_path / "models"
    root.mkdir()
    (root / "keep.txt").write_text("x")

    def say(line: str) -> None:
        if "writing" in line or "tail 2/" in line:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        add_model("squeezenet", str(root), say=say)
    assert sorted(os.listdir(root)) == ["keep.txt"]
    fresh = tmp_path / "fresh"
    with pytest.raises(KeyboardInterrupt):
        add_model("squeezenet", str(fresh), AddOptions(edge="rpi4", cloud="t4", frontier=True),
                  say=lambda line: say(line) if "tail" in line else None)
    assert not fresh.exists()


def test_reference_profiles_and_the_frontier_are_what_the_gateway_reuses(tmp_path, capsys):
    root = str(tmp_path)
    rc, out, _ = _run(capsys, "add", "squeezenet", root, "--edge", "rpi4", "--cloud", "t4", "--frontier")
    assert rc == 0
    vdir = tmp_path / "squeezenet" / "1"
    assert sorted(os.listdir(vdir / "profiles")) == ["cloud.json", "device.json"]
    assert json.loads((vdir / "profiles" / "device.json").read_text())["device"] == "rpi4"
    written = json.loads((vdir / "frontier.json").read_text())
    assert written["source"] == "planner" and written["cuts"]
    tails = sorted(os.listdir(vdir / "segments"))
    assert tails == sorted(c["cut_id"] for c in written["cuts"])
    mtime = os.path.getmtime(vdir / "frontier.json")
    lv = Registry(root).load("squeezenet", "1")
    assert lv.frontier.source == "planner" and set(lv.frontier.cut_ids) == set(tails)
    assert os.path.getmtime(vdir / "frontier.json") == mtime  # reused, not computed again
    for cut in tails:
        onnx.checker.check_model(str(vdir / "segments" / cut / "tail.onnx"))


def test_measured_profiles_with_a_slower_reference_edge(tmp_path, capsys):
    rc, out, _ = _run(capsys, "add", "squeezenet", str(tmp_path), "--profile", "--runs", "1", "--edge", "rpi4")
    assert rc == 0
    prof = tmp_path / "squeezenet" / "1" / "profiles"
    assert json.loads((prof / "device.json").read_text())["device"] == "rpi4"
    assert json.loads((prof / "cloud.json").read_text())["device"].startswith("cloud-")


def test_list_shows_versions_and_what_does_not_fit(tmp_path, capsys):
    root = str(tmp_path)
    assert _run(capsys, "list", root)[1].startswith(f"{root}: is empty; expected <name>/<version>/model.onnx")
    _run(capsys, "add", "squeezenet", root)
    (tmp_path / "resnet50").mkdir()
    (tmp_path / "resnet50" / "model.onnx").write_bytes(b"x")
    rc, out, _ = _run(capsys, "list", root)
    assert rc == 0 and "squeezenet@1  model.onnx" in out
    assert "not served: resnet50/model.onnx: not in a version directory; move it to resnet50/1/model.onnx" in out
    rc, _, err = _run(capsys, "list", str(tmp_path / "nope"))
    assert rc == 2 and "does not exist" in err


def test_a_registry_that_cannot_be_written_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    rc, _, err = _run(capsys, "add", "squeezenet", str(tmp_path / "file"))
    assert rc == 2 and "is a file; give a directory" in err
    rc, _, err = _run(capsys, "add", "squeezenet", str(tmp_path / "file" / "models"))
    assert rc == 2 and "cannot write to REGISTRY" in err and "Traceback" not in err
