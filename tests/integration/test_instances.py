"""`splitinfer instances`: real engines timed side by side in bracketed rounds."""

from __future__ import annotations

import json

import pytest

from splitinfer.cli import main
from tests.unit._engine_models import make_batch_mixing_model, make_small_cnn
from workers.errors import ActorConfigError
from workers.profile.instances import choose_instances, time_instances


def test_rounds_bracket_every_setting_between_one_engine_slices() -> None:
    lines: list[str] = []
    choice = time_instances(make_small_cnn(), name="cnn", threads=2, batch=4, candidates=(2,), rounds=3,
                            slice_s=0.05, progress=lines.append)
    assert choice.rows == 4 and choice.threads == 2 and choice.provider == "cpu"
    [two] = choice.timings
    assert (two.instances, two.threads_each) == (2, 1)
    # One engine first, then again after every other setting's slice.
    assert len(choice.baseline_per_s) == 1 + 3 and len(two.per_s) == len(two.ratios) == 3
    base = choice.baseline_per_s
    for r in range(3):
        assert two.ratios[r] == pytest.approx(two.per_s[r] / ((base[r] + base[r + 1]) / 2))
    assert all(v > 0 for v in (*base, *two.per_s))
    assert (choice.instances, choice.reason) == choose_instances(choice.timings, margin=choice.margin)
    assert lines[0].startswith("loading cnn") and len(lines) == 1 + 3
    assert json.loads(json.dumps(choice.to_dict()))["timings"][0]["median_ratio"] == pytest.approx(two.median_ratio)


def test_rounds_rotate_through_several_settings() -> None:
    lines: list[str] = []
    choice = time_instances(make_small_cnn(), threads=4, batch=2, candidates=(4, 2, 1), rounds=2, slice_s=0.03,
                            progress=lines.append)
    assert [(t.instances, t.threads_each) for t in choice.timings] == [(2, 2), (4, 1)]
    assert len(choice.baseline_per_s) == 1 + 2 * 2
    assert [line.split(": ")[1].split(" engines")[0] for line in lines[1:]] == ["2", "4", "4", "2"]


def test_a_failing_engine_fails_the_timing(monkeypatch) -> None:
    from workers.engine import Engine
    from workers.errors import EngineRunError

    def broken(self, inputs, **kw):
        raise EngineRunError("out of memory", model=self.name)

    monkeypatch.setattr(Engine, "run", broken)
    with pytest.raises(EngineRunError, match="out of memory"):
        time_instances(make_small_cnn(), threads=2, rounds=1, slice_s=0.02)


def test_a_segment_that_cannot_batch_is_timed_one_row_a_run() -> None:
    choice = time_instances(make_batch_mixing_model(), threads=2, batch=8, candidates=(2,), rounds=1, slice_s=0.03)
    assert choice.rows == 1


@pytest.mark.parametrize("kw, named", [
    ({"threads": 0}, "threads=0"), ({"candidates": (0, 2)}, "candidates=[0, 2]"),
    ({"rounds": 0}, "rounds=0"), ({"slice_s": -1.0}, "slice_s=-1.0"),
])
def test_bad_settings_are_refused_by_name(kw: dict, named: str) -> None:
    args = {"threads": 2, **kw}
    with pytest.raises(ActorConfigError, match=named.replace("[", r"\[").replace("]", r"\]")):
        time_instances(make_small_cnn(), **args)


def test_the_command_prints_the_choice_and_writes_json(tmp_path, capsys) -> None:
    import onnx

    path = tmp_path / "cnn.onnx"
    onnx.save(make_small_cnn(), str(path))
    out = tmp_path / "choice.json"
    assert main(["instances", str(path), "--threads", "2", "--rounds", "2", "--seconds", "0.05",
                 "--json", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert f"choice: instances: {saved['instances']}" in printed
    assert "2 engines of 1 thread(s)" in printed
    assert len(saved["timings"][0]["ratios"]) == 2


def test_the_command_writes_its_choice_into_a_model_yaml(tmp_path, capsys) -> None:
    import onnx

    from cluster.registry import ModelConfig

    path = tmp_path / "cnn.onnx"
    onnx.save(make_small_cnn(), str(path))
    model_yaml = tmp_path / "model.yaml"
    model_yaml.write_text("# serving settings of cnn v1\nmax_batch_size: 4\ninstances: 3  # a guess\n")
    out = tmp_path / "choice.json"
    assert main(["instances", str(path), "--threads", "2", "--rounds", "1", "--seconds", "0.03",
                 "--json", str(out), "--model-yaml", str(model_yaml), "--quiet"]) == 0
    chosen = json.loads(out.read_text())["instances"]
    assert f"wrote instances: {chosen} and intra_op_threads: 2 to {model_yaml}" in capsys.readouterr().out
    lines = model_yaml.read_text().splitlines()
    assert lines == ["# serving settings of cnn v1", "max_batch_size: 4", f"instances: {chosen}", "intra_op_threads: 2"]
    config = ModelConfig.from_yaml_file(str(model_yaml))
    assert (config.instances, config.intra_op_threads, config.max_batch_size) == (chosen, 2, 4)


def test_the_command_times_a_tail_and_refuses_a_cut_with_none(capsys) -> None:
    assert main(["instances", "squeezenet", "--after", "30", "--threads", "2", "--rounds", "1",
                 "--seconds", "0.03", "--quiet"]) == 0
    assert "squeezenet after layer 30 on cpu" in capsys.readouterr().out
    from partitioner import build_graph, load_model, zoo_path

    last = len(build_graph(load_model(zoo_path("squeezenet")), name="squeezenet")) - 1
    assert main(["instances", "squeezenet", "--after", str(last), "--quiet"]) == 2
    assert f"--after {last} leaves no tail of squeezenet: give a layer in 0..{last - 1}" in capsys.readouterr().err
    assert main(["instances", "squeezenet", "--after", "999", "--quiet"]) == 2
    assert f"--after 999 is not a layer of squeezenet: give a layer in 0..{last - 1}" in capsys.readouterr().err


@pytest.mark.parametrize("option, value, says", [("--seconds", "0", "is not a number of seconds above 0"),
                                                 ("--margin", "-1", "is not a fraction from 0 up"),
                                                 ("--candidates", "0,2", "must be >= 1")])
def test_the_command_refuses_bad_options_by_name(option: str, value: str, says: str, capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["instances", "squeezenet", option, value])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert option in err and says in err
