"""Reference devices: the roofline arithmetic, the fit of efficiencies, and every error."""

from __future__ import annotations

import dataclasses

import pytest

from partitioner.graph import BATCH, Layer, LayerGraph, TensorInfo
from planner.devices import (
    DEVICES,
    THIS_HOST,
    Device,
    UnknownDeviceError,
    anchor_op,
    device_from_profile,
    device_names,
    fit_efficiencies,
    get_device,
    layer_bytes,
    reference_profile,
    roofline_ms,
)
from planner.errors import PlannerError
from planner.profile import LayerTime, Profile

EXPECTED = ("rpi4", "rpi5", "jetson-orin-nano", "phone-sd8g2", "t4", "a100", "h100")


def _graph(specs: list[tuple[str, int, int, int]]) -> LayerGraph:
    """A chain; each layer (op, flops, out_bytes, param_bytes) reads the previous output."""
    tensors = [TensorInfo("x", "float32", (BATCH, 1000), 4000, None, (0,))]
    layers = []
    prev = "x"
    for i, (op, flops, out_b, par_b) in enumerate(specs):
        out = f"t{i}"
        last = i == len(specs) - 1
        tensors.append(TensorInfo(out, "float32", (BATCH, out_b // 4), out_b, i, () if last else (i + 1,),
                                  is_output=last))
        layers.append(Layer(id=i, name=f"n{i}", nodes=(f"n{i}", f"r{i}"), ops=(op, "Relu"), flops=flops,
                            param_bytes=par_b, inputs=(prev,), outputs=(out,)))
        prev = out
    return LayerGraph(model="syn", inputs=("x",), outputs=(prev,), layers=tuple(layers), tensors=tuple(tensors))


TOY = Device(name="toy", description="toy", peak_flops={"fp32": 1e9, "fp16": 2e9, "int8": 4e9},
             mem_bw_bytes_per_s=1e8, efficiency={"Conv": 0.5, "Gemm": 0.25}, default_efficiency=0.1,
             layer_overhead_ms=0.01, fixed_ms=0.2, compute_w=5.0, idle_w=1.0, radio_tx_w=0.5)


def test_every_named_device_exists_is_an_estimate_and_has_sources():
    assert set(EXPECTED) <= set(DEVICES)
    assert device_names()[-1] == THIS_HOST
    for name in EXPECTED:
        d = get_device(name)
        assert d.estimate and d.sources and d.description
        assert d.peak_flops["fp16"] >= d.peak_flops["fp32"]
        assert Device.from_json(d.to_json()) == d
    assert get_device(" RPI4 ") is DEVICES["rpi4"]


def test_unknown_device_lists_the_known_ones():
    with pytest.raises(UnknownDeviceError) as e:
        get_device("rpi3")
    for name in EXPECTED + (THIS_HOST,):
        assert name in str(e.value)
    assert e.value.name == "rpi3" and e.value.known == device_names()
    assert isinstance(e.value, PlannerError) and e.value.field == "device"


def test_this_host_points_at_a_measured_profile():
    with pytest.raises(UnknownDeviceError, match="splitinfer profile"):
        get_device(THIS_HOST)


def test_roofline_is_the_max_of_compute_and_memory_plus_overhead():
    g = _graph([("Conv", 10_000_000, 400, 0), ("MaxPool", 1000, 4_000_000, 0)])
    conv, pool = g.layers
    # compute: 1e7 / (1e9 * 0.5) = 20 ms; memory: (4000 + 400) / 1e8 = 0.044 ms
    assert roofline_ms(TOY, g, conv) == pytest.approx(20.0 + 0.01)
    # compute: 1e3 / (1e9 * 0.1) = 0.01 ms; memory: (400 + 4e6) / 1e8 s = 40.004 ms
    assert roofline_ms(TOY, g, pool) == pytest.approx(40.004 + 0.01)
    assert roofline_ms(TOY, g, conv, batch=4) == pytest.approx(80.0 + 0.01)
    assert roofline_ms(TOY, g, conv, precision="fp16") == pytest.approx(10.0 + 0.01)
    assert layer_bytes(g, pool, batch=2) == 2 * (400 + 4_000_000)
    assert anchor_op(conv) == "Conv"
    with pytest.raises(PlannerError, match="precision"):
        roofline_ms(TOY, g, conv, precision="fp8")


def test_reference_profile_carries_the_device_and_round_trips():
    g = _graph([("Conv", 10_000_000, 400, 4000), ("Gemm", 2_000_000, 40, 800_000)])
    p = reference_profile(TOY, g, batch_sizes=(1, 8))
    assert p.device == "toy" and p.fixed_ms == 0.2 and p.compute_w == 5.0 and p.radio_tx_w == 0.5
    assert p.ort_version == "roofline-estimate"
    assert p.layers[0].ms == pytest.approx(roofline_ms(TOY, g, g.layers[0]))
    assert sorted(p.batch_ms) == [1, 8]
    assert p.batch_factor(8) <= 1.0  # weights are read once per batch
    assert Profile.from_json(p.to_json()) == p
    with pytest.raises(PlannerError, match="batch"):
        reference_profile(TOY, g, batch=0)
    with pytest.raises(UnknownDeviceError):
        reference_profile("nope", g)


def test_gpus_beat_boards_on_a_compute_heavy_model():
    g = _graph([("Conv", 4_000_000_000, 800_000, 10_000_000)] * 1)
    ms = {n: sum(t.ms for t in reference_profile(n, g).layers.values()) for n in EXPECTED}
    assert ms["h100"] < ms["a100"] < ms["t4"] < ms["jetson-orin-nano"] < ms["rpi5"] < ms["rpi4"]
    assert ms["phone-sd8g2"] < ms["rpi5"]


def test_fit_efficiencies_recovers_known_efficiencies_on_synthetic_data():
    truth = {"Conv": 0.42, "Gemm": 0.17, "MatMul": 0.6}
    dev = dataclasses.replace(TOY, efficiency=truth, layer_overhead_ms=0.0, mem_bw_bytes_per_s=1e15)
    g = _graph([("Conv", 5_000_000, 400, 0), ("Gemm", 3_000_000, 400, 0), ("Conv", 9_000_000, 400, 0),
                ("MatMul", 1_000_000, 400, 0), ("Identity", 0, 400, 0)])
    measured = reference_profile(dev, g)
    fitted = fit_efficiencies(g, measured, dev.peak_flops["fp32"])
    assert fitted == pytest.approx(truth, rel=1e-9)


def test_fit_efficiencies_subtracts_overhead_and_rejects_a_bad_peak():
    dev = dataclasses.replace(TOY, mem_bw_bytes_per_s=1e15, layer_overhead_ms=0.05)
    g = _graph([("Conv", 5_000_000, 400, 0), ("Gemm", 3_000_000, 400, 0)])
    fitted = fit_efficiencies(g, reference_profile(dev, g), 1e9, layer_overhead_ms=0.05)
    assert fitted == pytest.approx({"Conv": 0.5, "Gemm": 0.25})
    with pytest.raises(PlannerError, match="peak"):
        fit_efficiencies(g, reference_profile(dev, g), 0.0)


def test_device_from_profile_is_a_fitted_roofline_that_reproduces_the_profile():
    g = _graph([("Conv", 8_000_000, 400, 0), ("Gemm", 2_000_000, 400, 0), ("Conv", 4_000_000, 400, 0)])
    measured = Profile(device="host", layers={0: LayerTime(2.0), 1: LayerTime(2.0), 2: LayerTime(1.0)},
                       fixed_ms=0.3, threads=2)
    d = device_from_profile(g, measured)
    assert d.name == THIS_HOST and not d.estimate and d.fixed_ms == 0.3
    assert d.peak_flops["fp32"] == pytest.approx(4e9)  # the fastest layer's rate
    assert d.efficiency["Conv"] == pytest.approx(12e6 / (4e9 * 3e-3))
    est = reference_profile(d, g)
    assert est.ort_version == "roofline-fitted"
    assert sum(t.ms for t in est.layers.values()) == pytest.approx(5.0, rel=0.01)
    with pytest.raises(PlannerError, match="no timed layer"):
        device_from_profile(g, Profile(device="h", layers={i: LayerTime(0.0) for i in range(3)}))


@pytest.mark.parametrize("change, words", [
    ({"peak_flops": {"fp32": 1e9, "fp16": 1e9}}, "int8"),
    ({"mem_bw_bytes_per_s": 0.0}, "mem_bw"),
    ({"efficiency": {"Conv": 1.5}}, "efficiency of Conv"),
    ({"default_efficiency": 0.0}, "efficiency of default"),
    ({"fixed_ms": -1.0}, "fixed_ms"),
    ({"codec_scale": 0.0}, "codec_scale"),
])
def test_invalid_devices_are_rejected_with_the_field(change, words):
    with pytest.raises(PlannerError, match=words):
        dataclasses.replace(TOY, **change)


def test_malformed_device_description_is_a_planner_error():
    with pytest.raises(PlannerError, match="malformed"):
        Device.from_dict({"name": "x", "bogus": 1})
