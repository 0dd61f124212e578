"""CodecModel's measured figures: the model input's own cast rate, the fixed ms per tensor
sent, their JSON round-trip and errors, and the planner's pick between fp16 and fp32."""

from __future__ import annotations

import numpy as np
import pytest

from partitioner.cuts import Cut
from planner import Encoding, Link, solve
from planner.costmodel import evaluate
from planner.devices import reference_profile
from planner.errors import ProfileError
from planner.profile import CodecModel, Profile
from splitinfer.codec_measure import CastTiming, codec_from_timings, time_casts
from tests.unit.test_costmodel import _graph, _profile

MEASURED = CodecModel(encode_ms_per_mb=dict(CodecModel().encode_ms_per_mb) | {"fp16": 1.2, "int8": 0.1},
                      input_encode_ms_per_mb={"fp16": 0.4, "int8": 0.13},
                      encode_fixed_ms=0.003, source="this host: tiny's tensors")


def test_measured_codec_round_trips_through_a_profile() -> None:
    p = _profile("dev", [1.0, 2.0, 3.0, 4.0], 0.5, codec=MEASURED)
    back = Profile.from_json(p.to_json())
    assert back.codec == MEASURED
    assert back.codec.encode_ms_per_mb["zstd"] == CodecModel().encode_ms_per_mb["zstd"]  # defaults fill the rest
    assert CodecModel.from_dict({}) == CodecModel()  # a profile without the fields reads as the defaults
    assert CodecModel.from_dict({}).input_encode_ms_per_mb is None


@pytest.mark.parametrize("codec, field", [
    ({"input_encode_ms_per_mb": {"zstd": 1.0}}, "codec.input_encode_ms_per_mb.zstd"),
    ({"input_encode_ms_per_mb": {"fp16": -0.1}}, "codec.input_encode_ms_per_mb.fp16"),
    ({"input_encode_ms_per_mb": [0.4]}, "codec.input_encode_ms_per_mb"),
    ({"encode_fixed_ms": -1.0}, "codec.encode_fixed_ms"),
    ({"encode_fixed_ms": "3"}, "codec.encode_fixed_ms"),
    ({"source": ""}, "codec.source"),
])
def test_bad_codec_fields_name_the_field(codec: dict, field: str) -> None:
    d = {"schema": "splitinfer.profile/1", "device": "d", "layers": {"0": {"ms": 1.0}}, "codec": codec}
    with pytest.raises(ProfileError) as e:
        Profile.from_dict(d)
    assert e.value.field == field
    assert field.split(".")[-1] in str(e.value)


def test_scaled_stretches_every_time_and_keeps_the_ratios() -> None:
    s = MEASURED.scaled(100.0)
    assert s.cast_ms_per_mb("fp16", model_input=True) == pytest.approx(40.0)
    assert s.cast_ms_per_mb("fp16", model_input=False) == pytest.approx(120.0)
    assert s.encode_fixed_ms == pytest.approx(0.3)
    assert s.ratio == MEASURED.ratio
    ref = reference_profile("rpi4", _graph())
    assert ref.codec.encode_ms_per_mb["fp16"] == pytest.approx(3.0 * CodecModel().encode_ms_per_mb["fp16"])
    assert ref.codec.input_encode_ms_per_mb is None  # reference devices keep the defaults


def test_the_input_casts_at_its_own_rate_and_every_tensor_pays_the_fixed_ms() -> None:
    """input: 1000 bytes, t0 (a feature map): 400 bytes; rates in ms per MB."""
    dev = _profile("dev", [1.0, 2.0, 3.0, 4.0], 0.5, codec=CodecModel(
        encode_ms_per_mb={"fp16": 1000.0}, input_encode_ms_per_mb={"fp16": 100.0}, encode_fixed_ms=0.05))
    cloud = _profile("cloud", [0.1, 0.2, 0.3, 0.4], 0.25, codec=CodecModel(decode_ms_per_mb={"fp16": 0.0}))
    link = Link(8e6, 32e6, 1.0)
    fp16 = Encoding("fp16")
    assert evaluate(_graph(), Cut(frozenset()), [dev, cloud], link, fp16).encode_ms == pytest.approx(0.1 + 0.05)
    assert evaluate(_graph(), Cut(frozenset({0})), [dev, cloud], link, fp16).encode_ms == pytest.approx(0.4 + 0.05)
    assert evaluate(_graph(), Cut(frozenset()), [dev, cloud], link).encode_ms == pytest.approx(0.05)


@pytest.mark.parametrize("over", [0.5, 2.0])
def test_a_slow_measured_fp16_cast_flips_the_pick_to_fp32(over: float) -> None:
    """Cloud-only wins; fp16 saves 500 of the input's 1000 bytes, 0.5 ms at 8 Mbit/s. The
    pick is fp16 while the input's cast costs less than that, fp32 once it costs more,
    whatever the feature maps' rate."""
    cloud = _profile("cloud", [0.1, 0.2, 0.3, 0.4], 0.25, codec=CodecModel(decode_ms_per_mb={"fp16": 0.0}))
    link = Link(8e6, 32e6, 1.0)
    saved_ms = 500 * 8 / 8e6 * 1e3
    rate = over * saved_ms / (1000 / 1e6)  # ms per MB that makes the cast `over` x the saving
    dev = _profile("dev", [100.0] * 4, 0.5, codec=CodecModel(
        encode_ms_per_mb={"fp16": 1e6}, input_encode_ms_per_mb={"fp16": rate}))
    plan = solve(_graph(), [dev, cloud], link, "latency", encodings=(Encoding(), Encoding("fp16")))
    assert not plan.cuts[0].device
    assert plan.encoding.precision == ("fp16" if over < 1 else "fp32")


def test_codec_from_timings_weighs_by_size_and_keeps_the_input_apart() -> None:
    rows = [CastTiming("x", True, 0.6, {"fp32": 0.004, "fp16": 0.24, "int8": 0.08}, {"fp16": 0.1, "int8": 0.02}),
            CastTiming("big", False, 4.0, {"fp32": 0.002, "fp16": 5.0, "int8": 0.4}, {"fp16": 2.0, "int8": 0.2}),
            CastTiming("tiny", False, 0.001, {"fp32": 0.003, "fp16": 0.01, "int8": 0.01}, {"fp16": 0.0, "int8": 0.0})]
    c = codec_from_timings(CodecModel(), rows, "here")
    assert c.cast_ms_per_mb("fp16", model_input=True) == pytest.approx(0.4)
    assert c.cast_ms_per_mb("fp16", model_input=False) == pytest.approx(5.01 / 4.001)  # the tiny map barely counts
    assert c.encode_fixed_ms == pytest.approx(0.003)
    assert c.encode_ms_per_mb["zstd"] == CodecModel().encode_ms_per_mb["zstd"]
    assert c.source == "here"
    with pytest.raises(ValueError, match="no tensor was timed"):
        codec_from_timings(CodecModel(), [], "here")


def test_time_casts_times_every_encoding_of_a_tensor() -> None:
    x = np.maximum(np.random.default_rng(0).standard_normal((1, 8, 16, 16), dtype=np.float32), 0)
    t = time_casts("x", x, model_input=False, repeats=2)
    assert set(t.encode_ms) == {"fp32", "fp16", "int8"} and set(t.decode_ms) == {"fp16", "int8"}
    assert t.mb == pytest.approx(x.nbytes / 1e6)
    assert all(v >= 0 for v in [*t.encode_ms.values(), *t.decode_ms.values()])
