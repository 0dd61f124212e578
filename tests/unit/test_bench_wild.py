"""bench.wild's pure helpers, and its sample inputs against the real models where the
`wild` extra is installed (those cases skip with the install hint otherwise)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest

from bench._wild_models import (
    INSTALL_HINT,
    WILD_MODELS,
    locate,
    magika_features,
    make_sample_inputs,
    render_text,
    speech_like,
)
from bench._wild_steps import first_line, summarize_int8
from bench._wild_report import markdown_cell, summarize_step
from bench.wild import (
    CommandResult,
    describe_choice,
    pick_cuts,
    reason_of,
    scrub_paths,
    step_record,
    unknown_tensors,
)


def test_magika_features_strip_and_pad_a_short_file():
    row = magika_features(b"  \n{\"a\": 1}\n\n", beg_size=8, end_size=8, block_size=64)
    assert row.dtype == np.int32 and row.shape == (16,)
    assert list(row[:8]) == list(b'{"a": 1}')
    assert list(row[8:]) == list(b'{"a": 1}')
    row = magika_features(b"ab", beg_size=4, end_size=4, block_size=64)
    assert list(row) == [97, 98, 256, 256, 256, 256, 97, 98]


def test_magika_features_take_the_head_and_tail_of_a_long_file():
    data = b"H" * 10 + b"." * 200 + b"T" * 10
    row = magika_features(data, beg_size=10, end_size=10, block_size=50)
    assert list(row[:10]) == [ord("H")] * 10 and list(row[10:]) == [ord("T")] * 10


def test_pick_cuts_are_distinct_valid_prefixes():
    rng = np.random.default_rng(0)
    ks = pick_cuts(10, 3, rng)
    assert len(ks) == 3 and len(set(ks)) == 3 and ks == sorted(ks)
    assert all(0 <= k <= 8 for k in ks)  # the tail keeps at least one layer
    assert pick_cuts(2, 3, rng) == [0]
    assert pick_cuts(1, 3, rng) == []


def test_describe_choice():
    assert describe_choice(0, 10) == "cloud-only"
    assert describe_choice(10, 10) == "edge-only"
    assert describe_choice(4, 10) == "split: 4 of 10 layers on the device"


def test_reason_of_a_traceback_usage_error_and_timeout():
    tb = CommandResult(1, "", "Traceback (most recent call last):\n  File \"x\", line 1\nKeyError: 'x'\n", 0.1)
    assert reason_of(tb) == ("traceback: KeyError: 'x'", True)
    usage = CommandResult(2, "", "usage: splitinfer split ...\nsplitinfer split: error: unrecognized arguments: --inputs\n", 0.1)
    assert reason_of(usage) == ("splitinfer split: error: unrecognized arguments: --inputs", False)
    killed = CommandResult(None, "", "", 12.0)
    record = step_record(killed)
    assert record["status"] == "timeout" and "12 s" in record["reason"]
    assert step_record(CommandResult(0, "", "", 0.5))["status"] == "ok"


def test_first_line_names_the_error_type():
    assert first_line(ValueError("bad shape\nmore")) == "ValueError: bad shape"
    assert first_line("\n  one line \n") == "one line"


def test_scrub_paths_replaces_longest_prefix_first():
    tree = {"a": ["/w/x/samples.npz", 3], "b": {"c": "/w/model.onnx"}}
    assert scrub_paths(tree, [("/w/", ""), ("/w/x/", "")]) == {"a": ["samples.npz", 3], "b": {"c": "model.onnx"}}
    assert scrub_paths("Load model from /t/eng-1/a/stage.onnx failed", [], "/t") == "Load model from <tmp>/stage.onnx failed"


def test_unknown_tensors_and_step_summaries():
    data = {"tensors": [{"name": "a", "bytes_per_sample": None}, {"name": "b", "bytes_per_sample": 4}]}
    assert unknown_tensors(data) == ["a"]
    rec = {"status": "refused", "reason": "no flag", "flags": "missing",
           "without_flags": {"status": "ok", "reason": ""}, "layers": 5, "unknown_tensors": ["a"],
           "unknown_without_inputs": ["a", "b"]}
    line = summarize_step("inspect", rec)
    assert "5 layers, 1 unknown sizes (2 without --inputs)" in line
    assert "without --inputs: ok" in line and "reason: no flag" in line


def test_summarize_int8_names_the_worst_output_and_its_metric():
    report = {"kind": "int8_qdq", "per_channel": True, "note": None, "size_fp32_bytes": 100,
              "size_after_bytes": 30, "calibration": None,
              "evaluation": {"agreement": 0.75, "worst_output": "y", "outputs": [
                  {"output_name": "x", "metric": "top1", "value": 1.0, "max_abs_error": 0.1},
                  {"output_name": "y", "metric": "iou", "value": 0.75, "max_abs_error": 0.2}]}}
    s = summarize_int8(report)
    assert s["agreement"] == 0.75 and s["metric"] == "iou" and s["worst_output"] == "y"
    assert s["size_ratio"] == pytest.approx(0.3) and s["metrics"] == {"x": "top1", "y": "iou"}


def test_render_text_and_speech_like_are_deterministic_and_in_range():
    a = render_text("Total: $1", 32, 128, np.random.default_rng(1))
    b = render_text("Total: $1", 32, 128, np.random.default_rng(1))
    assert a.shape == (32, 128, 3) and a.dtype == np.uint8 and np.array_equal(a, b)
    assert a.min() < 100 < a.max()  # ink on paper
    x = speech_like(512, 16000, np.random.default_rng(2))
    assert x.shape == (512,) and x.dtype == np.float32 and 0.1 < np.abs(x).max() <= 0.5


def test_locate_is_none_for_a_missing_package():
    missing = dataclasses.replace(WILD_MODELS[0], package="no_such_package_for_splitinfer")
    assert locate(missing) is None


@pytest.mark.parametrize("model", WILD_MODELS, ids=lambda m: m.key)
def test_sample_inputs_match_the_installed_model(model):
    path = locate(model)
    if path is None:
        pytest.skip(f"{model.distribution}=={model.version} not installed ({INSTALL_HINT})")
    graph = onnx.load(path, load_external_data=False).graph
    inits = {i.name for i in graph.initializer}
    declared = {i.name: i.type.tensor_type for i in graph.input if i.name not in inits}
    feeds = make_sample_inputs(model)
    assert set(feeds) == set(declared)
    for name, tt in declared.items():
        assert feeds[name].dtype == onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type), name
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
        assert feeds[name].ndim == len(dims), name
        assert all(want is None or want <= 0 or want == got for want, got in zip(dims, feeds[name].shape)), name


def test_the_wild_extra_pins_every_model_package_and_stays_out_of_all_and_test():
    import os
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml"), "rb") as fh:
        extras = tomllib.load(fh)["project"]["optional-dependencies"]
    pins = set(extras["wild"])
    assert {f"{m.distribution}=={m.version}" for m in WILD_MODELS} <= pins
    assert not any("wild" in req for name in ("all", "test") for req in extras[name])


def test_the_int8_cell_shows_a_better_alternative():
    rec = {"status": "ok", "summary": {"metric": "top1", "value": 0.25, "agreement": 0.25},
           "alternatives": [{"settings": {"op_types_to_quantize": ["Conv"]}, "status": "ok", "agreement": 1.0,
                             "size_ratio": 0.38},
                            {"settings": {"op_types_to_quantize": ["Gemm"]}, "status": "ok", "agreement": 1.0,
                             "size_ratio": 1.0},  # nothing quantised: no alternative
                            {"settings": {"method": "percentile"}, "status": "refused", "reason": "x"}]}
    assert markdown_cell("int8", rec) == "top1 0.25; op_types_to_quantize=[Conv]: 1 (size x0.38)"
    assert markdown_cell("serve", {"status": "refused"}) == "**refused**"


def test_the_plan_cell_counts_mid_network_cuts_of_the_sweep():
    rec = {"status": "ok", "choice": "edge-only", "predicted": {"total_ms": 12.5},
           "sweep": {"status": "ok", "choices": ["edge-only", "split: 3 of 9 layers on the device", "cloud-only"],
                     "mid_network_points": 1}}
    assert markdown_cell("plan", rec) == "edge-only, 12.5 ms; mid-network at 1/3 uplinks"
    assert "mid-network cut at 1 of 3 uplinks" in summarize_step("plan", rec)
