"""Planner values: exact JSON round trips, validation, and profile errors that name the field."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.cuts import Cut
from partitioner.synthetic import make_random_graph
from planner.errors import InfeasibleError, PlannerError, ProfileError
from planner.profile import CodecModel, Corrections, LayerTime, Profile
from planner.synthetic import make_random_profile
from planner.types import Breakdown, Constraints, Encoding, Link, LinkRange, Objective, Plan
from tests.strategies import graphs, links, profiles_for


def _breakdown() -> Breakdown:
    return Breakdown(1.5, 0.25, 3.0, 20.0, 0.0, 2.0, 0.125, 26.875, 0.01, "uplink", 3.0, 1,
                     (1.5, 2.0), (0.2, 0.05), (3.0,), (0.125,))


def test_link_linkrange_encoding_constraints_round_trip() -> None:
    for v in (Link(18.88e6, 50e6, 20.0, 0.01), LinkRange(1e6, 1e8, 2.0, 5.0, 0.0),
              Encoding("int8", "zstd", True), Constraints(1 << 20, frozenset({1, 3}), True, 2, 50.0)):
        assert type(v).from_json(v.to_json()) == v


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_profile_round_trip_is_exact(data: st.DataObject) -> None:
    g = data.draw(graphs(max_layers=12))
    p = data.draw(profiles_for(g, batching=data.draw(st.booleans())))
    text = p.to_json()
    assert Profile.from_json(text) == p
    assert json.loads(text)["schema"] == "splitinfer.profile/1"


@settings(max_examples=20, deadline=None)
@given(links())
def test_plan_round_trip_and_cli_json(link: Link) -> None:
    plan = Plan("m", (Cut(frozenset({0, 1})),), Encoding("fp16"), Objective.LATENCY, link, _breakdown(),
                ("t1",))
    d = json.loads(plan.to_json())
    assert d["edge_layers"] == [0, 1]
    assert d["boundary"] == ["t1"]
    assert d["encoding"] == {"precision": "fp16", "compression": "none", "per_channel": False}
    assert d["objective"] == "latency"
    p = d["predicted"]
    assert p["edge_ms"] + p["transfer_ms"] + p["queue_ms"] + p["cloud_ms"] == pytest.approx(p["total_ms"])
    assert Plan.from_json(plan.to_json()) == plan


def test_breakdown_derived_figures() -> None:
    b = _breakdown()
    assert b.transfer_ms == 0.25 + 3.0 + 20.0 + 0.125
    assert b.throughput_rps == pytest.approx(1000 / 3.0)


def test_minimal_profile_is_the_additive_model() -> None:
    p = Profile.from_dict({"schema": "splitinfer.profile/1", "device": "d", "layers": {"0": {"ms": 1.0}}})
    assert p.corrections is None and p.scale == 1.0 and p.segment_const_ms == 0.0
    assert p.codec == CodecModel()
    assert p.layers[0] == LayerTime(1.0)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"schema": "other/1"}, "schema"),
        ({"layers": {"0": {"ms": -1.0}}}, "layers.0.ms"),
        ({"layers": {"0": {}}}, "layers.0.ms"),
        ({"layers": {"x": {"ms": 1.0}}}, "layers.x"),
        ({"layers": {"0": {"ms": 1.0, "mss": 2}}}, "layers.0.mss"),
        ({"layers": [1, 2]}, "layers"),
        ({"fixed_ms": "3"}, "profile.fixed_ms"),
        ({"threads": 0}, "profile.threads"),
        ({"device": ""}, "device"),
        ({"batch_ms": {"0": 1.0}}, "batch_ms.0"),
        ({"corrections": {"scale": 1.0, "offset_ms": -5.0}}, "corrections.offset_ms"),
        ({"codec": {"ratio": {"zstd": 1.5}}}, "codec.ratio.zstd"),
        ({"codec": {"encode_ms_per_mb": {"brotli": 1.0}}}, "codec.encode_ms_per_mb.brotli"),
        ({"colour": "red"}, "profile.colour"),
        ({"ep": 3}, "ep"),
    ],
)
def test_malformed_profile_names_the_field(change: dict, field: str) -> None:
    d = {"schema": "splitinfer.profile/1", "device": "d", "layers": {"0": {"ms": 1.0}}}
    d.update(change)
    with pytest.raises(ProfileError) as e:
        Profile.from_dict(d)
    assert e.value.field == field
    assert field.split(".")[-1] in str(e.value)


@pytest.mark.parametrize("missing", ["device", "layers"])
def test_profile_missing_required_field(missing: str) -> None:
    d = {"schema": "splitinfer.profile/1", "device": "d", "layers": {"0": {"ms": 1.0}}}
    del d[missing]
    with pytest.raises(ProfileError, match=missing):
        Profile.from_dict(d)


def test_profile_bad_json_and_missing_layer_and_batch() -> None:
    with pytest.raises(ProfileError, match="not valid JSON"):
        Profile.from_json("{")
    g = make_random_graph(3, seed=0)
    p = make_random_profile(g, 0, device="pi")
    with pytest.raises(ProfileError, match="no time for layer 7") as e:
        p.layer_ms(7)
    assert e.value.layer == 7 and e.value.device == "pi"
    with pytest.raises(ProfileError, match="batch 4"):
        p.batch_factor(4)
    assert make_random_profile(g, 0, batching=True).batch_factor(4) < 1.0


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: Link(0, 1), "up_bps"),
        (lambda: Link(1, float("inf")), "down_bps"),
        (lambda: Link(1, 1, -1), "rtt_ms"),
        (lambda: Link(1, 1, 0, 1.0), "loss"),
        (lambda: LinkRange(10, 1), "up_hi_bps"),
        (lambda: LinkRange(1, 10, 0), "down_ratio"),
        (lambda: Encoding("bf16"), "precision"),
        (lambda: Encoding("fp32", "gzip"), "compression"),
        (lambda: Encoding("fp16", per_channel=True), "per_channel"),
        (lambda: Constraints(device_memory_bytes=-1), "device_memory_bytes"),
        (lambda: Constraints(first_k_local=-1), "first_k_local"),
        (lambda: Constraints(latency_slo_ms=0), "latency_slo_ms"),
        (lambda: Objective.parse("speed"), "objective"),
    ],
)
def test_bad_values_raise_naming_the_field(make, field: str) -> None:
    with pytest.raises(PlannerError) as e:
        make()
    assert e.value.field == field
    assert field in str(e.value)


def test_infeasible_error_fields_are_keyword_only() -> None:
    e = InfeasibleError("x", constraint="device_memory", required=2.0, limit=1.0, unit="bytes")
    assert (e.constraint, e.required, e.limit, e.unit, e.field) == ("device_memory", 2.0, 1.0, "bytes",
                                                                      "device_memory")
    assert isinstance(e, PlannerError)
    with pytest.raises(TypeError):
        InfeasibleError("x", "device_memory")  # type: ignore[misc]


def test_corrections_round_trip() -> None:
    c = Corrections(0.8, 1.25, 6)
    assert Corrections.from_dict(c.to_dict()) == c
