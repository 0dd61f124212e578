"""`splitinfer fleet plan`: the tables, the JSON, and exit 2 with one line for a bad spec."""

from __future__ import annotations

import json

import pytest
import yaml

from splitinfer.cli import main
from tests.unit.test_fleet_spec import SPEC


def _write(tmp_path, data, name="fleet.yaml") -> str:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(p)


def test_plan_prints_the_classes_and_the_workers_needed(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", "plan", _write(tmp_path, SPEC)]) == 0
    out = capsys.readouterr().out
    assert "pi " in out and "phone" in out and "workers needed:" in out and "fixed point:" in out


def test_json_is_the_plan_and_workers_overrides_the_spec(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, SPEC)
    assert main(["fleet", "plan", path, "--json", "--workers", "5"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["schema"] == "splitinfer.fleet-plan/1" and d["cloud"]["workers"] == 5
    assert [c["name"] for c in d["classes"]] == ["pi", "phone"] and d["devices"] == 150


@pytest.mark.parametrize("data, words", [
    ({**SPEC, "cloud": {**SPEC["cloud"], "workers": 0}}, "cloud.workers is 0"),
    ({**SPEC, "classes": []}, "classes is empty"),
    ({**SPEC, "cloud": {**SPEC["cloud"], "device": "nope"}}, "cloud.device"),
    ("classes: [unclosed\n", "is not YAML at line"),
])
def test_bad_spec_exits_2_with_one_line(tmp_path, capsys: pytest.CaptureFixture[str], data, words: str) -> None:
    assert main(["fleet", "plan", _write(tmp_path, data)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("splitinfer fleet: error:") and words in err and "\n" not in err


def test_missing_file_and_profiles_dir(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", "plan", str(tmp_path / "none.yaml")]) == 2
    assert "cannot read it" in capsys.readouterr().err
    assert main(["fleet", "plan", _write(tmp_path, SPEC), "--profiles-dir", str(tmp_path / "nodir")]) == 2
    assert "--profiles-dir" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse's usage error
        main(["fleet", "plan", _write(tmp_path, SPEC), "--workers", "0"])
    assert e.value.code == 2 and "--workers: 0 must be >= 1" in capsys.readouterr().err
