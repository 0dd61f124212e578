"""`splitinfer bench wild` runs bench.wild with the rest of the command line."""

from __future__ import annotations

import json

import pytest

from splitinfer.cli import main

_EMPTY_RESULTS = {"config": {"models": []}, "models": {}}


def test_bench_lists_wild(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--help"]) == 0
    assert "  wild " in capsys.readouterr().out


def test_bench_wild_passes_its_arguments_to_bench_wild(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "wild.json"
    path.write_text(json.dumps(_EMPTY_RESULTS), encoding="utf-8")
    assert main(["bench", "wild", "--markdown", str(path)]) == 0
    assert capsys.readouterr().out.startswith("| model | package | inspect |")


def test_bench_wild_refuses_an_unknown_model_naming_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "wild", "--models", "nope"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "['nope']" in err and "pick from" in err
