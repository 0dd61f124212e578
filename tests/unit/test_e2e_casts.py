"""The e2e benchmark's device casts, timed on the edge ([Note: casts on the device] in
bench._e2e_codec): the fixed ms per tensor from fp32, each cast's rate beyond it, the
input's apart from the feature maps'."""

from __future__ import annotations

import pytest

from bench._e2e_codec import casts_on_edge
from partitioner import build_graph
from partitioner.zoo import load_zoo
from planner.costmodel import evaluate
from planner.profile import LayerTime, Profile

_GRAPH = build_graph(load_zoo("squeezenet", random_weights=True, seed=0), name="squeezenet")
_MAP = _GRAPH.layers[0].outputs[0]  # 64 x 111 x 111 post-ReLU floats
_MAP2 = _GRAPH.layers[1].outputs[0]
_RATE = {("L", "fp16"): 50.0, ("L", "int8"): 10.0, ("L0", "fp16"): 120.0, ("L0", "int8"): 8.0}


class _Edge:
    """Encodes in 3 ms plus the cast's rate (ms per MB) times the boundary's MB."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def job(self, cand_id: str, precision: str, reps: int) -> dict:
        self.calls.append((cand_id, precision))
        if cand_id == "L0-1":
            return {"error": "not this one: it has more device layers"}
        mb = (_GRAPH.tensor[_GRAPH.inputs[0]] if cand_id == "L" else _GRAPH.tensor[_MAP]).bytes_per_sample / 1e6
        return {"rows": [{"encode_ms": 3.0 + _RATE.get((cand_id, precision), 0.0) * mb}] * reps}


def _cands() -> list[dict]:
    def c(cid: str, boundary: list[str], head: bool, local: bool = False) -> dict:
        return {"id": cid, "cut_key": cid, "local": local, "head_path": "h.onnx" if head else None, "boundary": boundary}

    return [c("L", list(_GRAPH.inputs), False), c("L0-1", [_MAP2], True), c("L0", [_MAP], True),
            c(f"L0-{len(_GRAPH) - 1}", [], False, local=True)]


def _device() -> Profile:
    return Profile("edge", {v: LayerTime(1.0) for v in range(len(_GRAPH))})


def test_casts_are_the_edges_time_beyond_the_fixed_ms_per_tensor() -> None:
    cands = _cands()
    dev, seen = casts_on_edge(_Edge(), _GRAPH, cands, {c["id"] for c in cands}, _device())
    c = dev.codec
    assert c.encode_fixed_ms == pytest.approx(3.0)
    assert c.cast_ms_per_mb("fp16", model_input=True) == pytest.approx(50.0)
    assert c.cast_ms_per_mb("int8", model_input=True) == pytest.approx(10.0)
    assert c.cast_ms_per_mb("fp16", model_input=False) == pytest.approx(120.0)  # the map cut with fewest layers
    assert c.cast_ms_per_mb("int8", model_input=False) == pytest.approx(8.0)
    assert c.encode_ms_per_mb["zstd"] == _device().codec.encode_ms_per_mb["zstd"]
    assert seen["feature_map"]["cut_id"] == "L0" and seen["input"]["n"] == 5
    # the cost model then predicts the edge's time of an fp16 input: 3 + 50 x 0.602 ms
    from partitioner import make_cut
    from planner import Encoding, Link

    cloud = Profile("cloud", {v: LayerTime(0.1) for v in range(len(_GRAPH))})
    b = evaluate(_GRAPH, make_cut(_GRAPH, []), [dev, cloud], Link(1e8, 4e8, 20.0), Encoding("fp16"))
    assert b.encode_ms == pytest.approx(3.0 + 50.0 * 0.602112 + 0.602112 * cloud.codec.decode_ms_per_mb["fp16"])


def test_the_device_keeps_its_codec_where_no_cut_is_served() -> None:
    dev = _device()
    out, seen = casts_on_edge(_Edge(), _GRAPH, _cands(), set(), dev)
    assert out is dev and "note" in seen


def test_an_input_codecs_edge_time_leaves_the_fixed_ms_to_the_cost_model() -> None:
    from bench._e2e_run import _codec_on_edge
    from planner.accuracy import AccuracyEntry, AccuracyTable

    class Timed:
        def job(self, cand_id: str, precision: str, reps: int) -> dict:
            return {"rows": [{"encode_ms": 30.0}] * reps}

    table = AccuracyTable("m", "f", 8, (AccuracyEntry("L", "jpeg@90", 1.0, codec_ms=2.0),))
    priced, seen = _codec_on_edge(Timed(), _GRAPH, _cands(), table, 16.0, fixed_ms=3.0)
    assert priced.entry("L", "jpeg@90").codec_ms == pytest.approx(27.0)  # the cost model adds the 3 ms back
    assert seen["jpeg@90"]["edge_ms"] == pytest.approx(27.0)


def test_the_summary_reports_each_casts_measured_over_predicted_encode() -> None:
    from bench._e2e_report import _encode_ratios

    def cand(enc: str, measured: float, predicted: float) -> dict:
        return {"encoding": enc, "encode_ms": measured, "predicted": {"encode_ms": predicted}}

    links = [{"candidates": [cand("fp16", 40.0, 20.0), cand("fp16", 30.0, 30.0), cand("fp16", 10.0, 20.0),
                             cand("int8", 6.0, 10.0), cand("fp32", 3.0, 0.0), cand("jpeg@90", 80.0, 40.0)]}]
    assert _encode_ratios([{"links": links}]) == {"fp16": {"median": 1.0, "n": 3}, "int8": {"median": 0.6, "n": 1}}
