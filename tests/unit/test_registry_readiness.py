"""A registry that cannot be served is said at start, and each model not ready yet is named with why."""

from __future__ import annotations

import os

import onnx
import pytest

from cluster.registry import Registry, RegistryError, survey
from splitinfer.cli import main
from tests.onnx_models import conv_bn_relu_chain


def _model(root, name: str = "m", version: str = "1") -> None:
    d = os.path.join(root, name, version)
    os.makedirs(d)
    onnx.save(conv_bn_relu_chain(2), os.path.join(d, "model.onnx"))


def _gateway(capsys, registry: str, *extra: str) -> tuple[int, str]:
    rc = main(["gateway", "--registry", registry, "--port", "0", "--metrics-port", "-1", "--log-format", "text",
               *extra])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("layout, found", [
    (None, "does not exist"),
    ([], "is empty"),
    (["notes.txt"], "holds no model directory (found: notes.txt)"),
    (["resnet50/model.onnx"], "resnet50/model.onnx: not in a version directory; move it to resnet50/1/model.onnx"),
    (["resnet50/1/weights.bin"], "resnet50/1/: no model.onnx"),
    (["resnet50/"], "resnet50/: no version directories"),
    (["model.onnx"], "model.onnx: a model outside any <name>/<version>/ directory"),
])
def test_gateway_refuses_a_registry_it_cannot_serve_in_one_line(tmp_path, capsys, layout, found):
    root = tmp_path / "models"
    if layout is not None:
        root.mkdir()
        for rel in layout:
            p = root / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            if not rel.endswith("/"):
                p.write_bytes(b"x")
            else:
                p.mkdir(exist_ok=True)
    rc, err = _gateway(capsys, str(root))
    lines = [x for x in err.splitlines() if x.startswith("splitinfer gateway: error:")]
    assert rc == 2 and len(lines) == 1, err
    assert f"--registry '{root}'" in lines[0] and found in lines[0]
    assert "<name>/<version>/model.onnx + model.yaml" in lines[0]
    assert f"splitinfer registry add MODEL {root}" in lines[0]
    assert "Traceback" not in err


def test_allow_empty_lets_an_empty_registry_pass_the_check_but_not_a_missing_one(tmp_path):
    from splitinfer.gateway_cmd import check_registry

    assert check_registry(str(tmp_path), allow_empty=True) == (None, ())
    assert "does not exist" in check_registry(str(tmp_path / "nope"), allow_empty=True)[0]
    assert "or start with --allow-empty" in check_registry(str(tmp_path), allow_empty=False)[0]
    _model(str(tmp_path), "m")
    os.makedirs(tmp_path / "n")
    assert check_registry(str(tmp_path), allow_empty=False) == (
        None, ("n/: no version directories; put the model in n/1/model.onnx",))


def test_survey_separates_servable_versions_from_the_rest(tmp_path):
    root = str(tmp_path)
    _model(root, "a", "1")
    _model(root, "a", "10")
    os.makedirs(tmp_path / "a" / "2")  # no model.onnx
    os.makedirs(tmp_path / "bad name")
    (tmp_path / ".hidden").mkdir()
    s = survey(root)
    assert s.models == {"a": ("10", "1")}
    assert s.problems == ("a/2/: no model.onnx; copy the model there as model.onnx",
                          "bad name/: not a valid model name; rename it to letters, digits, '.', '_', '-'")
    with pytest.raises(RegistryError, match="is a file, not a directory"):
        survey(os.path.join(root, "a", "1", "model.onnx"))


def test_not_ready_names_each_model_with_its_reason(tmp_path):
    root = str(tmp_path)
    _model(root, "good")
    _model(root, "broken")
    (tmp_path / "broken" / "1" / "model.onnx").write_bytes(b"not onnx")
    (tmp_path / "empty").mkdir()
    reg = Registry(root)
    assert not reg.scanned and reg.not_ready() == {}
    seen = []
    reg.on_loaded.append(lambda lv: seen.append(reg.not_ready()))
    loaded = reg.load_all(keep_going=True)
    assert [lv.key for lv in loaded] == ["good@1"]
    assert seen[0]["good@1"] == "loading"  # while its hooks (the gateway's preload) run
    why = reg.not_ready()
    assert set(why) == {"broken@1", "empty"}
    assert why["broken@1"].startswith("failed: ") and "broken/1/model.onnx" in why["broken@1"]
    assert why["empty"].startswith("no versions: ") and "empty/1/model.onnx" in why["empty"]


def test_load_all_without_keep_going_raises_the_first_failure_and_records_it(tmp_path):
    root = str(tmp_path)
    _model(root, "broken")
    _model(root, "later")
    (tmp_path / "broken" / "1" / "model.onnx").write_bytes(b"not onnx")
    reg = Registry(root)
    with pytest.raises(RegistryError, match="is not a model the partitioner can read"):
        reg.load_all()
    assert reg.not_ready()["broken@1"].startswith("failed: ")
    assert reg.not_ready()["later@1"] == "queued"


def test_a_policy_that_selects_no_version_is_named(tmp_path):
    root = str(tmp_path)
    _model(root, "m", "1")
    (tmp_path / "m" / "policy.yaml").write_text("version_policy: {specific: [3]}\n")
    reg = Registry(root)
    reg.load_all(keep_going=True)
    assert reg.not_ready() == {"m": "no versions: its version policy specific ['3'] selects none of ['1']"}
