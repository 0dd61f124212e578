"""Unknown sizes and FLOPs are never counted as 0: boundary bytes, memory plans, head
memory, the solver's memory limit and the reference-device rooflines, on a model with
symbolic H and W (tests/unit/_shape_models.py)."""

from __future__ import annotations

import pytest
from onnx import TensorProto, helper

from partitioner import Cut, boundary_bytes, build_graph, plan_memory
from planner import Constraints, Link, solve
from planner.devices import (
    device_from_profile,
    fit_efficiencies,
    get_device,
    layer_bytes,
    reference_profile,
    roofline_ms,
)
from planner.errors import InfeasibleError, PlannerError
from planner.memory import head_memory_bytes, unknown_head_tensors
from planner.profile import LayerTime, Profile
from planner.synthetic import make_flops_profile
from tests.unit import _shape_models as M


@pytest.fixture(scope="module")
def symbolic():
    """conv_resize with x[N,3,H,W]: c1, a, c2 of unknown size; f and y known."""
    return build_graph(M.conv_resize())


@pytest.fixture(scope="module")
def fixed():
    return build_graph(M.conv_resize(), input_shapes={"x": [1, 3, 8, 8]})


def test_boundary_bytes_is_none_where_a_boundary_size_is_unknown(symbolic, fixed):
    assert boundary_bytes(symbolic, Cut(frozenset({0}))) is None
    assert boundary_bytes(symbolic, Cut(frozenset({0, 1, 2, 3}))) == 6 * 4  # f alone
    assert boundary_bytes(fixed, Cut(frozenset({0}))) == 4 * 8 * 8 * 4


def test_memory_plan_names_the_tensors_it_cannot_place(symbolic, fixed):
    plan = plan_memory(symbolic)
    assert set(plan.unknown_tensors) == {"x", "c1", "a", "c2"}
    assert {a.tensor for a in plan.allocations} == {"f", "y"}
    assert plan.peak.unknown == 4 and plan.peak.exact is None and plan.peak.known == plan.peak_bytes
    assert plan.to_dict()["unknown_tensors"] == list(plan.unknown_tensors)
    assert plan.steps == len(symbolic)
    known = plan_memory(fixed)
    assert known.unknown_tensors == () and known.peak.exact == known.peak_bytes > 0


def test_head_memory_is_none_where_the_head_holds_a_tensor_of_unknown_size(symbolic, fixed):
    assert head_memory_bytes(symbolic, [0]) is None
    assert set(unknown_head_tensors(symbolic, [0])) == {"x", "c1"}
    assert head_memory_bytes(symbolic, []) == 0 and unknown_head_tensors(symbolic, []) == ()
    assert head_memory_bytes(fixed, [0]) == 432 + 3 * 8 * 8 * 4 + 4 * 8 * 8 * 4


def test_a_memory_limit_refuses_heads_of_unknown_size_naming_the_tensors(symbolic):
    profiles = [_measured(symbolic, "dev", 1.0), _measured(symbolic, "cloud", 0.01)]
    c = Constraints(device_memory_bytes=1 << 30, pinned_device_layers=frozenset({0}))
    with pytest.raises(InfeasibleError) as e:
        solve(symbolic, profiles, Link(18.88e6, 50e6, 20.0), constraints=c)
    assert e.value.constraint == "device_memory"
    assert "'x'" in e.value.message and "--input-shape" in e.value.message and "--inputs" in e.value.message


def test_the_roofline_refuses_unknown_work_naming_layers_and_the_fix(symbolic, fixed):
    assert layer_bytes(symbolic, symbolic.layers[0]) is None
    with pytest.raises(PlannerError, match=r"layers 0 \(Conv\), 1 \(Resize\), 2 \(Conv\), 3 .*--input-shape") as e:
        reference_profile("rpi4", symbolic)
    assert e.value.field == "input_shapes"
    with pytest.raises(PlannerError, match="unknown FLOPs or activation sizes"):
        roofline_ms(get_device("rpi4"), symbolic, symbolic.layers[2])
    assert roofline_ms(get_device("rpi4"), fixed, fixed.layers[4]) > 0


def test_fits_and_this_hosts_roofline_use_only_layers_of_known_work(symbolic):
    # every layer took 1 ms; only the Gemm's FLOPs (60) are known, and only the pool's
    # output and the Gemm's tensors are of known size
    measured = _measured(symbolic, "host", 1.0)
    assert set(fit_efficiencies(symbolic, measured, 1e9)) == {"Gemm"}
    dev = device_from_profile(symbolic, measured)
    assert dev.peak_flops["fp32"] == pytest.approx(60 / 1e-3)
    assert dev.mem_bw_bytes_per_s == pytest.approx(layer_bytes(symbolic, symbolic.layers[4]) / 1e-3)


def test_a_flops_roofline_refuses_layers_of_unknown_flops(symbolic):
    with pytest.raises(PlannerError, match=r"layers 0 \(Conv\).*unknown size: 'x', 'c1', 'a', 'c2'.*--inputs"):
        make_flops_profile(symbolic, device="dev", gflops=5.0)
    said = make_flops_profile(symbolic, device="dev", gflops=1e-6, unknown_flops_ms=2.5)  # the caller's figure
    assert [said.layer_ms(v) for v in range(5)] == [2.5, 2.5, 2.5, 2.5, pytest.approx(60.0)]


def _measured(graph, device: str, ms: float) -> Profile:
    return Profile(device=device, layers={ly.id: LayerTime(ms=ms) for ly in graph.layers})


def test_the_roofline_refuses_an_op_without_a_flop_count_and_says_to_measure():
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
             helper.make_node("Hardmax", ["a"], ["y"], name="mystery", axis=1)]
    model = helper.make_model(helper.make_graph(
        nodes, "hm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])]), opset_imports=[helper.make_opsetid("", 17)])
    g = build_graph(model)
    with pytest.raises(PlannerError, match=r"layer 1 \(Hardmax\) has unknown FLOPs .*'splitinfer profile'") as e:
        reference_profile("rpi4", g)
    assert e.value.field == "flops" and "--input-shape" not in e.value.message
