"""The artifact cache: atomic store, checked load, clear errors for corruption."""

import os

import pytest

from edge_agent.cache import ArtifactCache
from edge_agent.errors import ArtifactError

FILES = {"model.onnx": b"\x08\x07model-bytes", "profiles/cloud.json": b"{}", "frontier.json": b"{}"}


def test_store_and_load_round_trip(tmp_path):
    c = ArtifactCache(str(tmp_path))
    d = c.store("m", "2", FILES)
    assert os.path.isfile(os.path.join(d, "profiles", "cloud.json"))
    assert c.load("m", "2") == FILES
    assert c.current_version("m") == "2" and c.current_version("other") is None


def test_store_replaces_a_version_whole(tmp_path):
    c = ArtifactCache(str(tmp_path))
    c.store("m", "1", FILES)
    c.store("m", "1", {"model.onnx": b"new"})
    assert c.load("m", "1") == {"model.onnx": b"new"}
    assert not os.path.exists(os.path.join(c.version_dir("m", "1"), "frontier.json"))


def test_corrupt_file_is_reported_with_the_fix(tmp_path):
    c = ArtifactCache(str(tmp_path))
    d = c.store("m", "1", FILES)
    with open(os.path.join(d, "model.onnx"), "r+b") as fh:
        fh.write(b"XX")
    with pytest.raises(ArtifactError) as e:
        c.load("m", "1")
    assert "SHA-256" in str(e.value) and "delete" in e.value.fix and e.value.path.endswith("model.onnx")


def test_missing_file_manifest_and_bad_manifest(tmp_path):
    c = ArtifactCache(str(tmp_path))
    with pytest.raises(ArtifactError, match="no cached copy"):
        c.load("m", "1")
    d = c.store("m", "1", FILES)
    os.remove(os.path.join(d, "frontier.json"))
    with pytest.raises(ArtifactError, match="missing from the cache"):
        c.load("m", "1")
    with open(os.path.join(d, "manifest.json"), "w") as fh:
        fh.write("{not json")
    with pytest.raises(ArtifactError, match="corrupt"):
        c.load("m", "1")


@pytest.mark.parametrize("name", ["../evil", "/abs", "a//b", "ok/../../x", ""])
def test_unsafe_names_are_refused(tmp_path, name):
    with pytest.raises(ArtifactError, match="safe relative"):
        ArtifactCache(str(tmp_path)).store("m", "1", {"model.onnx": b"x", name: b"y"})
    assert not os.path.exists(os.path.join(str(tmp_path), "evil"))


def test_store_needs_the_model_and_good_names(tmp_path):
    c = ArtifactCache(str(tmp_path))
    with pytest.raises(ArtifactError, match="without model.onnx"):
        c.store("m", "1", {"frontier.json": b"{}"})
    with pytest.raises(ArtifactError, match="valid model@version"):
        c.store("m/x", "1", FILES)
