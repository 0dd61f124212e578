"""The cost model against hand-computed figures; see [Note: cost model] in planner.costmodel."""

from __future__ import annotations

import pytest

from partitioner.cuts import Cut
from partitioner.graph import Layer, LayerGraph, TensorInfo
from planner.costmodel import evaluate
from planner.errors import PlannerError, ProfileError
from planner.profile import Corrections, LayerTime, Profile
from planner.types import Encoding, Link


def _graph(t1_dtype: str = "float32") -> LayerGraph:
    """input -> L0 -> t0 -> L1 -> t1 -> {L2, L3}; L2 -> t2 -> L3 -> out."""
    tensors = (
        TensorInfo("input", "float32", ("N", 250), 1000, None, (0,)),
        TensorInfo("t0", "float32", ("N", 100), 400, 0, (1,)),
        TensorInfo("t1", t1_dtype, ("N", 5, 10), 200, 1, (2, 3)),
        TensorInfo("t2", "float32", ("N", 25), 100, 2, (3,)),
        TensorInfo("out", "float32", ("N", 10), 40, 3, (), True),
    )
    ins = (("input",), ("t0",), ("t1",), ("t1", "t2"))
    outs = (("t0",), ("t1",), ("t2",), ("out",))
    layers = tuple(Layer(i, f"l{i}", (f"l{i}",), ("Conv",), 100, 10 * (i + 1), ins[i], outs[i]) for i in range(4))
    return LayerGraph("tiny", ("input",), ("out",), layers, tensors)


def _profile(name: str, ms: list[float], fixed_ms: float, **kw) -> Profile:
    return Profile(device=name, layers={i: LayerTime(m) for i, m in enumerate(ms)}, fixed_ms=fixed_ms, **kw)


DEV = _profile("dev", [1.0, 2.0, 3.0, 4.0], 0.5, compute_w=2.0, radio_tx_w=1.0, idle_w=0.5)
CLOUD = _profile("cloud", [0.1, 0.2, 0.3, 0.4], 0.25, batch_ms={1: 1.0, 4: 2.0})
SERVER = _profile("server", [0.5, 0.6, 0.7, 0.8], 0.1)
LINK = Link(8000.0, 16000.0, 10.0)  # 1 ms per byte up, 0.5 ms per byte down


def _cut(*ids: int) -> Cut:
    return Cut(frozenset(ids))


def test_interior_cut_charges_a_fanned_out_tensor_once() -> None:
    b = evaluate(_graph(), _cut(0, 1), [DEV, CLOUD], LINK)
    assert b.edge_ms == pytest.approx(3.5)
    assert b.uplink_ms == pytest.approx(200.0)  # t1 once, though L2 and L3 both read it
    assert b.rtt_ms == 10.0
    assert b.cloud_ms == pytest.approx(0.95)
    assert b.downlink_ms == pytest.approx(20.0)
    assert b.encode_ms == 0.0 and b.queue_ms == 0.0
    assert b.total_ms == pytest.approx(234.45)
    assert b.energy_j == pytest.approx((2.0 * 3.5 + 1.0 * 200.0 + 0.5 * (234.45 - 203.5)) / 1000)
    assert (b.bottleneck, b.period_ms) == ("uplink", pytest.approx(200.0))


def test_two_boundary_tensors_add() -> None:
    b = evaluate(_graph(), _cut(0, 1, 2), [DEV, CLOUD], LINK)
    assert b.uplink_ms == pytest.approx(300.0)
    assert b.total_ms == pytest.approx(6.5 + 300 + 10 + 0.65 + 20)


def test_edge_only_has_no_network_and_cloud_only_sends_the_input() -> None:
    g = _graph()
    edge = evaluate(g, _cut(0, 1, 2, 3), [DEV, CLOUD], LINK)
    assert edge.total_ms == pytest.approx(10.5)
    assert (edge.rtt_ms, edge.uplink_ms, edge.downlink_ms, edge.cloud_ms) == (0.0, 0.0, 0.0, 0.0)
    assert edge.energy_j == pytest.approx(2.0 * 10.5 / 1000)
    cloud = evaluate(g, _cut(), [DEV, CLOUD], LINK)
    assert cloud.edge_ms == 0.0  # the device's fixed cost is not paid when it runs nothing
    assert cloud.uplink_ms == pytest.approx(1000.0)
    assert cloud.total_ms == pytest.approx(1000 + 10 + 1.25 + 20)


@pytest.mark.parametrize(
    "enc, up_ms, codec_ms",
    [
        (Encoding("fp16"), 100.0, 200e-6 * (0.35 + 0.3)),
        (Encoding("int8"), 58.0, 200e-6 * (0.9 + 0.5)),
        (Encoding("int8", per_channel=True), 90.0, 200e-6 * (0.9 + 0.5)),
        (Encoding("fp32", "zstd"), 160.0, 200e-6 * (2.5 + 1.0)),
        (Encoding("fp16", "lz4"), 90.0, 200e-6 * (0.35 + 0.3) + 100e-6 * (0.8 + 0.3)),
    ],
)
def test_encodings_scale_bytes_and_add_codec_time(enc: Encoding, up_ms: float, codec_ms: float) -> None:
    b = evaluate(_graph(), _cut(0, 1), [DEV, CLOUD], LINK, enc)
    assert b.uplink_ms == pytest.approx(up_ms)
    assert b.encode_ms == pytest.approx(codec_ms)
    assert b.total_ms == pytest.approx(234.45 - 200.0 + up_ms + codec_ms)
    assert b.downlink_ms == pytest.approx(20.0)  # outputs come back as computed


def test_only_float_tensors_are_cast() -> None:
    b = evaluate(_graph("int64"), _cut(0, 1), [DEV, CLOUD], LINK, Encoding("fp16"))
    assert b.uplink_ms == pytest.approx(200.0) and b.encode_ms == 0.0


def test_corrections_apply_once_per_non_empty_segment() -> None:
    dev = Profile(device="dev", layers=DEV.layers, fixed_ms=0.5, corrections=Corrections(0.5, 1.0))
    g = _graph()
    assert evaluate(g, _cut(0, 1), [dev, CLOUD], LINK).edge_ms == pytest.approx(0.5 * 3 + 1.0 + 0.5)
    assert evaluate(g, _cut(), [dev, CLOUD], LINK).edge_ms == 0.0


def test_loss_slows_transfers() -> None:
    b = evaluate(_graph(), _cut(0, 1), [DEV, CLOUD], Link(8000.0, 16000.0, 10.0, loss=0.5))
    assert b.uplink_ms == pytest.approx(400.0) and b.downlink_ms == pytest.approx(40.0)


def test_cloud_batching_amortises_and_queues() -> None:
    b = evaluate(_graph(), _cut(0, 1), [DEV, CLOUD], LINK, batch=4)
    assert b.batch == 4
    assert b.cloud_ms == pytest.approx(4 * 0.5 * 0.7 + 0.25)
    assert b.queue_ms == pytest.approx(3 * 200.0)
    assert b.tier_ms[1] == pytest.approx(0.95)
    assert b.period_ms == pytest.approx(200.0)


def test_three_tiers_nested_cuts_and_relay() -> None:
    g = _graph()
    hop2 = Link(80000.0, 160000.0, 2.0)
    b = evaluate(g, [_cut(0), _cut(0, 1, 2)], [DEV, SERVER, CLOUD], [LINK, hop2])
    assert b.tier_ms == pytest.approx((1.5, 1.4, 0.65))
    assert b.hop_up_ms == pytest.approx((400.0, 30.0))
    assert b.hop_down_ms == pytest.approx((20.0, 2.0))
    assert b.rtt_ms == 12.0
    assert b.total_ms == pytest.approx(467.55)
    # an empty server tier still relays (its fixed cost is not paid)
    r = evaluate(g, [_cut(0), _cut(0)], [DEV, SERVER, CLOUD], [LINK, hop2])
    assert r.tier_ms[1] == 0.0 and r.hop_up_ms == pytest.approx((400.0, 40.0))
    assert r.total_ms == pytest.approx(476.65)
    assert b.bottleneck == "uplink"


def test_evaluate_a_plan_uses_its_own_link_and_encoding() -> None:
    from planner.solvers import solve

    g = _graph()
    plan = solve(g, [DEV, CLOUD], LINK, encodings=(Encoding("int8"),))
    assert evaluate(g, plan, [DEV, CLOUD]) == plan.breakdown


def test_evaluate_raises() -> None:
    g = _graph()
    with pytest.raises(PlannerError, match="not down-closed"):
        evaluate(g, _cut(1), [DEV, CLOUD], LINK)
    with pytest.raises(PlannerError, match="need 1 nested cut"):
        evaluate(g, [_cut(0), _cut(0, 1)], [DEV, CLOUD], LINK)
    with pytest.raises(PlannerError, match="need 2 link"):
        evaluate(g, [_cut(0), _cut(0, 1)], [DEV, SERVER, CLOUD], LINK)
    with pytest.raises(PlannerError, match="at least two"):
        evaluate(g, [], [DEV], LINK)
    with pytest.raises(PlannerError, match="needs a link"):
        evaluate(g, _cut(0), [DEV, CLOUD])
    with pytest.raises(PlannerError, match="must be nested"):
        evaluate(g, [_cut(0, 1), _cut(0)], [DEV, SERVER, CLOUD], [LINK, LINK])
    short = Profile(device="short", layers={0: DEV.layers[0]})
    with pytest.raises(ProfileError, match="no time for layer 1") as e:
        evaluate(g, _cut(0), [short, CLOUD], LINK)
    assert e.value.device == "short" and e.value.layer == 1


def test_an_accelerator_tier_pays_its_host_copies() -> None:
    """CodecModel.host_copy_ms_per_mb: the cloud copies t1 (200 bytes) in and `out` (40) back."""
    from planner.profile import CodecModel

    gpu = _profile("gpu", [0.1, 0.2, 0.3, 0.4], 0.25, codec=CodecModel(host_copy_ms_per_mb=1000.0))  # 1 ms per kB
    plain = evaluate(_graph(), _cut(0, 1), [DEV, CLOUD], LINK)
    b = evaluate(_graph(), _cut(0, 1), [DEV, gpu], LINK)
    assert b.encode_ms == pytest.approx(plain.encode_ms + 0.2)  # with the receiver's decode
    assert b.cloud_ms == pytest.approx(plain.cloud_ms + 0.04)
    assert b.total_ms == pytest.approx(plain.total_ms + 0.24)
    # edge-only: the device (no host copy) computes everything, nothing changes
    assert evaluate(_graph(), _cut(0, 1, 2, 3), [DEV, gpu], LINK).total_ms == pytest.approx(
        evaluate(_graph(), _cut(0, 1, 2, 3), [DEV, CLOUD], LINK).total_ms)


def test_a_host_copy_below_zero_is_refused() -> None:
    from planner.profile import CodecModel

    with pytest.raises(ProfileError, match="host_copy_ms_per_mb is -1"):
        CodecModel(host_copy_ms_per_mb=-1)
    c = CodecModel(host_copy_ms_per_mb=0.064)
    assert CodecModel.from_dict(c.to_dict()) == c
    assert CodecModel.from_dict({}).host_copy_ms_per_mb == 0.0  # profiles written before it read as a CPU
