"""Trace parsing and kernel -> layer attribution (workers.profile._trace), and one real
ONNX Runtime trace of a tiny model."""

from __future__ import annotations

import json

import pytest
from onnx import helper

from partitioner import build_graph
from planner.profile import Profile
from tests.onnx_models import conv_bn_relu_chain, residual_block
from workers.profile import (
    KernelEvent,
    ProfilingError,
    RunTrace,
    attribute_runs,
    load_profile,
    map_nodes,
    measure,
    parse_trace,
    resolve_name,
)


def _run(ts: float, dur: float) -> dict:
    return {"cat": "Session", "name": "model_run", "ts": ts, "dur": dur, "ph": "X"}


def _kernel(name: str, ts: float, dur: float, op: str = "Conv") -> dict:
    return {"cat": "Node", "name": f"{name}_kernel_time", "ts": ts, "dur": dur, "args": {"op_name": op}}


def test_parse_trace_splits_kernels_by_run_and_ignores_other_events():
    events = [
        {"cat": "Session", "name": "session_initialization", "ts": 0, "dur": 50},
        _run(100, 50), _kernel("a", 105, 10), _kernel("b", 120, 20, "Relu"),
        {"cat": "Node", "name": "a_fence_before", "ts": 104, "dur": 0},
        _run(200, 40), _kernel("a", 201, 12),
        _kernel("stray", 500, 99),  # outside every run
    ]
    runs = parse_trace(events)
    assert [r.run_us for r in runs] == [50.0, 40.0]
    assert runs[0].kernels == (KernelEvent("a", "Conv", 10.0), KernelEvent("b", "Relu", 20.0))
    assert runs[1].kernels == (KernelEvent("a", "Conv", 12.0),)
    assert runs[0].kernel_us == 30.0


@pytest.mark.parametrize("events, words", [
    ({"not": "a list"}, "JSON list"),
    ([{"cat": "Node"}], "event 0"),
    ([_kernel("a", 1, 1)], "model_run"),
    ([{"cat": "Session", "name": "model_run", "ts": "x", "dur": 1}], "non-numeric"),
])
def test_parse_trace_rejects_malformed_traces(events, words):
    with pytest.raises(ProfilingError, match=words) as e:
        parse_trace(events)
    assert e.value.setting == "trace"


def test_resolve_name_exact_suffix_prefix_and_tensor_stem():
    nodes = {"conv0": 0, "n38": 3, "r8_bn": 2}
    tensors = {"r1": 1}
    assert resolve_name("conv0", nodes) == 0
    assert resolve_name("conv0_nchwc", nodes) == 0
    assert resolve_name("fused n38", nodes) == 3
    assert resolve_name("r8_bn_nchwc", nodes) == 2
    assert resolve_name("r1_nchwc", nodes, tensors) == 1  # named after the tensor it writes
    assert resolve_name("r1_nchwc", nodes) is None
    assert resolve_name("ReorderInput_token_3", nodes, tensors) is None


def test_map_nodes_places_reorders_by_structure_and_leaves_unknown_ops_out():
    model = conv_bn_relu_chain(2)
    graph = build_graph(model)
    conv_layer = {n: ly.id for ly in graph.layers for n in ly.nodes}
    # What ORT runs at level 'all': reorder in, NCHWc convs named after their anchors,
    # reorder out writing the original tensor r1, and an op it invented.
    optimized = helper.make_graph([
        helper.make_node("ReorderInput", ["x"], ["t0"], name="ReorderInput"),
        helper.make_node("Conv", ["t0", "w0"], ["t1"], name="conv0_nchwc"),
        helper.make_node("Conv", ["t1", "w1"], ["t2"], name="conv1_nchwc"),
        helper.make_node("ReorderOutput", ["t2"], ["r1"], name="ReorderOutput_token_9"),
        helper.make_node("Mystery", ["r1"], ["m"], name="mystery"),
        helper.make_node("GlobalAveragePool", ["m"], ["gap"], name="gap"),
    ], "opt", [], [])
    placed = map_nodes(graph, model, helper.make_model(optimized))
    assert placed["ReorderInput"] == conv_layer["conv0"]
    assert placed["conv0_nchwc"] == conv_layer["conv0"]
    assert placed["conv1_nchwc"] == conv_layer["conv1"]
    assert placed["ReorderOutput_token_9"] == conv_layer["conv1"]
    assert placed["gap"] == conv_layer["gap"]
    assert "mystery" not in placed


def test_attribute_runs_sums_per_layer_and_reports_the_unplaced_share():
    graph = build_graph(residual_block())
    lid = {n: ly.id for ly in graph.layers for n in ly.nodes}
    runs = [
        RunTrace(100.0, (KernelEvent("conv_a", "Conv", 30.0), KernelEvent("conv_b", "Conv", 50.0),
                         KernelEvent("memcpy", "X", 20.0))),
        RunTrace(100.0, (KernelEvent("conv_a", "Conv", 34.0), KernelEvent("conv_b", "Conv", 46.0),
                         KernelEvent("memcpy", "X", 20.0))),
    ]
    names = {"conv_a": lid["conv_a"], "conv_b": lid["conv_b"]}
    a = attribute_runs(runs, graph, names)
    assert a.attributed_fraction == pytest.approx(160 / 200)
    assert a.unattributed_us == {"memcpy": 20.0}
    assert a.median_ms(lid["conv_a"]) == pytest.approx(0.032)
    assert a.min_ms(lid["conv_a"]) == pytest.approx(0.030)
    assert a.kernel_us == (100.0, 100.0)
    assert set(a.layer_us) == set(range(len(graph)))
    with pytest.raises(ProfilingError, match="no runs"):
        attribute_runs([], graph, names)


def test_real_trace_of_a_fused_model_is_fully_attributed():
    model = conv_bn_relu_chain(3)
    graph = build_graph(model, name="chain")
    m = measure(model, graph, threads=1, warmup=1, runs=3, progress=False)
    p = m.profile
    assert m.attributed_fraction == pytest.approx(1.0)
    assert set(p.layers) == set(range(len(graph)))
    for ly in graph.layers:
        if ly.ops[0] == "Conv":  # BN and Relu fused into it: its layer carries the time
            assert p.layers[ly.id].ms > 0
        assert p.layers[ly.id].samples == 3
    assert p.threads == 1 and p.batch == 1 and p.ep == "CPUExecutionProvider" and p.ort_version
    assert p.fixed_ms >= 0 and len(m.run_ms) == 3
    assert Profile.from_json(p.to_json()) == p
    assert json.loads(m.to_json())["attributed_fraction"] == pytest.approx(1.0)


@pytest.mark.parametrize("kw, setting", [
    ({"threads": 0}, "threads"),
    ({"threads": 1, "runs": 0}, "runs"),
    ({"threads": 1, "warmup": -1}, "warmup"),
    ({"threads": 1, "ep": "tpu"}, "ep"),
    ({"threads": 1, "batch": 0}, "batch"),
    ({"threads": 2, "clock": "thread"}, "clock"),
    ({"threads": 1, "layer_stat": "mean"}, "layer_stat"),
])
def test_measure_rejects_bad_settings_before_running(kw, setting):
    model = residual_block()
    with pytest.raises(ProfilingError) as e:
        measure(model, build_graph(model), progress=False, **kw)
    assert e.value.setting == setting
    assert "invalid" in str(e.value) or "use" in str(e.value)


def test_load_profile_errors_name_the_file_and_the_field(tmp_path):
    from planner.errors import ProfileError

    with pytest.raises(ProfilingError, match="cannot be read"):
        load_profile(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="not valid JSON"):
        load_profile(bad)
    bad.write_text(json.dumps({"schema": "splitinfer.profile/1", "device": "x", "layers": {"0": {"ms": -1}}}))
    with pytest.raises(ProfileError, match=r"layers\.0\.ms"):
        load_profile(bad)
    good = tmp_path / "good.json"
    p = Profile(device="x", layers={})
    good.write_text(p.to_json())
    assert load_profile(good) == p


def test_cuda_without_a_cuda_build_says_what_to_install():
    import onnxruntime as ort

    from workers.errors import WorkerError

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime build has CUDA")
    model = residual_block()
    with pytest.raises(WorkerError, match="onnxruntime-gpu"):
        measure(model, build_graph(model), threads=1, ep="cuda", runs=1, progress=False)
