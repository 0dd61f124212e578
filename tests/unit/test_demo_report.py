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
