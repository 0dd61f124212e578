"""The demo report's accounting: how an answer counts (split, remote, local, fallback), why a
frame was skipped, and the device/cloud ratio the demo emulates."""

from __future__ import annotations

import math

import pytest

from partitioner import Cut, build_graph
from partitioner.zoo import load_zoo
from splitinfer.demo.setup import CLOUD_DEVICE, DEFAULT_MODEL, EDGE_DEVICE, reference_ratio
from splitinfer.demo.stream import Record, StreamResult, served_as, skip_reasons

N_LAYERS = 39


@pytest.mark.parametrize(("served_by", "device_layers", "want"), [
    ("remote", 0, "remote"),  # cloud-only: nothing ran on the device
    ("remote", 3, "split"),
    ("remote", 21, "split"),
    ("local", N_LAYERS, "local"),
    ("local_tail", 21, "local_tail"),  # the cloud failed: the device finished it, not a split
    ("error", 0, "error"),
])
def test_served_as_counts_a_remote_answer_with_a_head_on_the_device_as_split(served_by, device_layers, want):
    cut_id = Cut(frozenset(range(device_layers))).key
    assert served_as(served_by, cut_id, N_LAYERS) == want


def test_served_as_a_remote_answer_without_a_cut_id_is_remote():
    assert served_as("remote", "", N_LAYERS) == "remote"


def _record(rid: str, served: str) -> Record:
    return Record(rid, 0, 0.0, 0.1, "local" if served == "local" else "remote", "", 100.0, 90.0, 1e6, "", 0.0,
                  served=served)


def test_skip_reasons_name_what_held_the_window():
    records = [_record("a", "local"), _record("b", "split"), _record("c", "remote"), _record("d", "split")]
    skips = [(1.0, ["a", "b"]), (1.2, ["b", "c"]), (1.4, ["c", "d"]), (1.6, ["a"])]
    res = StreamResult(records, [], sent=4, skipped_ticks=len(skips), answers_per_id={}, duration_s=2.0, skips=skips)
    reasons = skip_reasons(res)
    assert reasons == {"device busy (local run in the window)": 2,
                       "waiting on the cloud (remote or split in the window)": 2}
    assert sum(reasons.values()) == res.skipped_ticks


def test_the_demo_ratio_is_the_reference_devices_for_its_model():
    graph = build_graph(load_zoo(DEFAULT_MODEL), name=DEFAULT_MODEL)
    ref = reference_ratio(graph)
    assert (ref["edge_device"], ref["cloud_device"]) == (EDGE_DEVICE, CLOUD_DEVICE) == ("rpi4", "t4")
    assert math.isclose(ref["ratio"], ref["edge_ms"] / ref["cloud_ms"], rel_tol=1e-2)
    assert ref["ratio"] > 10  # an rpi4 is far slower than a t4: the device must be emulated much slower


def test_encoding_errors_are_measured_at_the_cuts_and_set_the_tolerance(tmp_path):
    import onnx

    from partitioner import make_inputs
    from splitinfer.demo.stream import FP32_REL_TOL, make_tolerances, measure_encoding_errors, reference_outputs

    model = load_zoo(DEFAULT_MODEL, random_weights=True, seed=0)
    graph = build_graph(model, name=DEFAULT_MODEL)
    path = str(tmp_path / "model.onnx")
    onnx.save_model(model, path)
    inputs = [make_inputs(model, graph, seed=100 + k) for k in range(2)]
    refs = reference_outputs(path, inputs)
    cuts = [Cut(frozenset()), Cut(frozenset(range(21)))]
    errs = measure_encoding_errors(model, graph, cuts, ("fp32", "fp16"), inputs, refs)
    assert set(errs) == {"fp16"}  # fp32 crosses as it is: nothing to measure
    assert 0 < errs["fp16"] < FP32_REL_TOL  # fp16 rounds (relative 4.9e-4 per value), and SqueezeNet keeps it small
    tol = make_tolerances(errs)
    assert tol["fp32"] == FP32_REL_TOL and tol["fp16"] == errs["fp16"] + FP32_REL_TOL


def test_the_device_is_stretched_to_the_reference_ratio_of_the_cloud_side():
    from planner import LayerTime, Profile
    from splitinfer.demo.setup import emulate_device

    dev = Profile(device="edge-1-thread", layers={0: LayerTime(3.0), 1: LayerTime(1.0)})
    ref = {"edge_device": "rpi4", "cloud_device": "t4", "edge_ms": 47.0, "cloud_ms": 1.9, "ratio": 24.6}
    slow, ms, how = emulate_device(dev, 4.0, 2.0, ref, None, say=lambda _: None)
    assert ms == pytest.approx(24.6 * 2.0)  # the ratio times the cloud side's time
    assert how["slowdown"] == pytest.approx(24.6 * 2.0 / 4.0, rel=1e-3) and how["slowdown_from"] == "reference ratio"
    assert slow.layers[0].ms == pytest.approx(3.0 * 24.6 * 2.0 / 4.0)
    # a host slower than the device it plays is not sped up; a given slowdown is taken as it is
    assert emulate_device(dev, 100.0, 2.0, ref, None, say=lambda _: None)[1] == 100.0
    assert emulate_device(dev, 4.0, 2.0, ref, 3.0, say=lambda _: None)[1:] == (
        12.0, {"one_thread_ms": 4.0, "slowdown": 3.0, "slowdown_from": "--slowdown"})


def test_the_demo_runs_the_model_its_ratio_was_chosen_for():
    from splitinfer.demo import make_parser

    assert make_parser().parse_args([]).model == DEFAULT_MODEL
    assert make_parser().parse_args([]).slowdown is None  # the slowdown comes from the reference ratio
