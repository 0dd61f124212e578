"""Fleet specs: the exact JSON round-trip, and every impossible number refused in one line naming the field."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from planner.fleet import plan_fleet
from planner.fleet_spec import FleetSpec, FleetSpecError, Spread
from planner.whatif import InvalidRequestError

SPEC: dict[str, Any] = {
    "models": {"resnet50": {"slo_ms": 200, "target": 0.9}},
    "cloud": {"device": "t4", "workers": 2, "max_batch": 8, "batch_timeout_ms": 2},
    "encodings": ["fp32", "int8"],
    "classes": [
        {"name": "pi", "count": 100, "device": "rpi4", "model": "resnet50", "fps": 1.0,
         "link": {"up_mbps": {"median": 40, "sigma": 0.5}, "rtt_ms": 30}},
        {"name": "phone", "count": 50, "device": "phone-sd8g2", "model": "resnet50", "fps": 2.0,
         "link": {"up_mbps": [10, 40, 80], "rtt_ms": {"median": 40, "sigma": 0.2}, "down_ratio": 2}},
    ],
}


def _with(path: str, value: Any) -> dict[str, Any]:
    d = copy.deepcopy(SPEC)
    keys = path.replace("]", "").replace("[", ".").split(".")
    node: Any = d
    for k in keys[:-1]:
        node = node[int(k)] if k.isdigit() else node[k]
    last = keys[-1]
    if value is _DROP:
        del node[last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return d


_DROP = object()


def test_round_trip_is_exact() -> None:
    spec = FleetSpec.from_dict(SPEC)
    assert FleetSpec.from_json(spec.to_json()) == spec
    assert spec.devices == 150 and spec.classes[1].up_mbps.values == (10.0, 40.0, 80.0)


def test_spreads_are_planned_at_their_points() -> None:
    v, p = Spread(40.0, 0.5).points()
    assert len(v) == 9 and abs(p.sum() - 1) < 1e-12 and abs(float(v[4]) - 40.0) < 1e-9  # the median is a point
    assert list(Spread(5.0, 0.0, (1.0, 9.0)).points()[0]) == [1.0, 9.0]


@pytest.mark.parametrize("path, value, field, words", [
    ("classes[0].fps", -1, "classes[0].fps", "must be > 0"),
    ("classes[0].fps", float("nan"), "classes[0].fps", "finite number"),
    ("classes[0].count", 0, "classes[0].count", "drop a class"),
    ("classes[0].link.up_mbps", -5, "classes[0].link.up_mbps", "must be > 0"),
    ("classes[0].link.up_mbps", [], "classes[0].link.up_mbps", "empty list"),
    ("classes[0].link.rtt_ms", -1, "classes[0].link.rtt_ms", ">= 0"),
    ("classes[1].link.rtt_ms.sigma", 9, "classes[1].link.rtt_ms.sigma", "[0, 3]"),
    ("classes[0].link.rtt_ms", 250, "models.resnet50.slo_ms", "raise the SLO"),
    ("cloud.workers", 0, "cloud.workers", "needs a worker"),
    ("cloud.workers", 2.5, "cloud.workers", "integer"),
    ("cloud.max_batch", 0, "cloud.max_batch", "1: no batching"),
    ("cloud.batch_timeout_ms", -2, "cloud.batch_timeout_ms", ">= 0"),
    ("models.resnet50.target", 1.5, "models.resnet50.target", "(0, 1]"),
    ("models.resnet50.slo_ms", 0, "models.resnet50.slo_ms", "> 0"),
    ("classes", [], "classes", "at least one device class"),
    ("classes[0].model", "vgg19", "classes[0].model", "no entry under models"),
    ("classes[1].name", "pi", "classes[1].name", "its own name"),
    ("classes[0].colour", "red", "classes[0].colour", "not a field"),
    ("cloud", _DROP, "cloud", "missing"),
    ("encodings", ["fp8"], "encodings", "fp32"),
])
def test_impossible_numbers_name_the_field_and_the_fix(path: str, value: Any, field: str, words: str) -> None:
    with pytest.raises(FleetSpecError) as e:
        FleetSpec.from_dict(_with(path, value))
    assert e.value.field == field
    assert words in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, InvalidRequestError)  # HTTP 400


@pytest.mark.parametrize("path, value, field", [
    ("classes[0].device", "rpi9", "classes[0].device"),
    ("cloud.device", "tpu", "cloud.device"),
])
def test_unknown_device_names_the_field(path: str, value: str, field: str) -> None:
    with pytest.raises(FleetSpecError) as e:
        plan_fleet(FleetSpec.from_dict(_with(path, value)), size_workers=False)
    assert e.value.field == field and value in str(e.value) and "rpi4" in str(e.value)


def test_unknown_model_names_the_field() -> None:
    d = _with("classes[0].model", "nomodel")
    d["models"]["nomodel"] = {"slo_ms": 200}
    with pytest.raises(FleetSpecError) as e:
        plan_fleet(FleetSpec.from_dict(d), size_workers=False)
    assert e.value.field == "classes[0].model" and "resnet50" in str(e.value)
