"""The fleet planner on ResNet50 with reference devices: monotone in workers and devices, a fixed
point that converges and moves devices off a loaded cloud, and a minimal workers-needed answer."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from planner.queueing import batch_queue, erlang_c, run_ms_table
from planner.fleet import FleetPlan, plan_fleet, plan_resolved, resolve
from planner.fleet_spec import FleetSpec

SPEC = {
    "models": {"resnet50": {"slo_ms": 150, "target": 0.9}},
    "cloud": {"device": "t4", "workers": 2, "max_batch": 8, "batch_timeout_ms": 2},
    "encodings": ["fp32", "int8"],
    "classes": [
        # local 493 ms: only the cloud meets the SLO
        {"name": "pi4", "count": 400, "device": "rpi4", "model": "resnet50", "fps": 1.0,
         "link": {"up_mbps": [30, 60], "rtt_ms": 30}},
        # local 72 ms: meets it either way, remote faster on an idle cloud
        {"name": "phone", "count": 600, "device": "phone-sd8g2", "model": "resnet50", "fps": 1.0,
         "link": {"up_mbps": [60, 100], "rtt_ms": 30}},
    ],
}


@pytest.fixture(scope="module")
def fleet() -> tuple[FleetSpec, tuple]:
    spec = FleetSpec.from_dict(SPEC)
    return spec, resolve(spec)


def _local_share(plan: FleetPlan, name: str) -> float:
    c = next(c for c in plan.classes if c.name == name)
    return sum(o.share for o in c.options if o.option == "local")


def test_erlang_c_and_the_batch_queue_at_batch_one_are_mmc() -> None:
    rho = 0.7
    assert erlang_c(1, rho) == pytest.approx(rho)  # M/M/1
    assert erlang_c(2, 2 * rho) == pytest.approx(2 * rho**2 / (1 + rho))  # M/M/2 closed form
    table = run_ms_table(np.array([10.0]), 0.0, None, 1)  # 10 ms, no batching
    q = batch_queue(np.array([140.0]), table, 2, 0.0, service_cv2=1.0)  # exponential service
    assert q.utilisation == pytest.approx(0.7)
    assert q.wait_ms == pytest.approx(erlang_c(2, 1.4) * 10.0 / (2 - 1.4))


def test_batching_carries_load_that_batch_one_cannot() -> None:
    table = run_ms_table(np.array([5.0]), 0.4, {1: 5.0, 2: 8.5, 4: 15.3, 8: 28.9}, 8)
    assert table[0, 7] < 8 * table[0, 0]
    assert batch_queue(np.array([220.0]), table[:, :1], 1, 2.0).overloaded  # 220/s x 5.4 ms > 1 worker
    q = batch_queue(np.array([220.0]), table, 1, 2.0)
    assert not q.overloaded and q.batch[0] > 1.0 and q.utilisation < 1.0


def test_more_workers_never_worse(fleet) -> None:
    spec, models = fleet
    within = [plan_resolved(spec, models, workers=c, size_workers=False).within_slo for c in (1, 2, 3, 4, 6, 8)]
    assert all(b >= a - 1e-9 for a, b in zip(within, within[1:])), within
    assert within[-1] > within[0]


def test_more_devices_never_better(fleet) -> None:
    spec, _ = fleet
    within = []
    for scale in (1, 2, 4):
        s = dataclasses.replace(spec, classes=tuple(dataclasses.replace(c, count=c.count * scale)
                                                    for c in spec.classes))
        within.append(plan_resolved(s, resolve(s), size_workers=False).within_slo)
    assert all(b <= a + 1e-9 for a, b in zip(within, within[1:])), within
    assert within[-1] < within[0]


def test_fixed_point_converges_and_moves_devices_off_a_loaded_cloud(fleet) -> None:
    spec, models = fleet
    idle = plan_resolved(spec, models, workers=64, size_workers=False)
    loaded = plan_resolved(spec, models, workers=1, size_workers=False)
    for p in (idle, loaded):
        fp = p.fixed_point
        assert fp.residual_ms < 0.05 * max(1.0, fp.delay_ms), fp
        assert fp.iterations < 120
    # On an idle cloud the phones offload (remote is faster); on a loaded one they run locally,
    # which leaves the cloud to the devices that need it.
    assert _local_share(idle, "phone") < 0.5 < _local_share(loaded, "phone")
    assert loaded.fixed_point.delay_ms > idle.fixed_point.delay_ms
    # the bisection brackets the fixed point: F(W) - W changes sign across the trace
    trace = loaded.fixed_point.trace
    assert trace[0][1] > trace[0][0] and trace[1][1] < trace[1][0]


def test_workers_needed_is_minimal_on_the_model(fleet) -> None:
    spec, models = fleet
    plan = plan_resolved(spec, models)
    n = plan.workers_needed
    assert n is not None and n > 1
    assert all(m.meets for m in plan_resolved(spec, models, workers=n, size_workers=False).models)
    assert not all(m.meets for m in plan_resolved(spec, models, workers=n - 1, size_workers=False).models)
    assert str(n) in plan.workers_needed_note


def test_no_worker_count_helps_when_the_links_miss_the_slo() -> None:
    d = {**SPEC, "models": {"resnet50": {"slo_ms": 40, "target": 0.9}},
         "classes": [SPEC["classes"][0]]}  # rpi4: 493 ms local; remote needs > 40 ms at 30-60 Mbit/s
    plan = plan_fleet(FleetSpec.from_dict(d))
    assert plan.workers_needed is None and "relax" in plan.workers_needed_note


def test_plan_round_trips_and_accounts_for_every_request(fleet) -> None:
    spec, models = fleet
    plan = plan_resolved(spec, models, size_workers=False)
    assert FleetPlan.from_json(plan.to_json()) == plan
    assert plan.rate_rps == pytest.approx(1000.0)
    for c in plan.classes:
        assert sum(o.share for o in c.options) == pytest.approx(1.0)
        assert c.p50_ms <= c.p95_ms and 0 <= c.within_slo <= 1
    assert plan.goodput_rps == pytest.approx(sum(c.goodput_rps for c in plan.classes))
    assert math.isfinite(plan.p95_ms)


def test_the_requests_with_no_local_answer_in_time_are_counted_urgent(fleet) -> None:
    """The Pis' local run (493 ms) cannot meet the 150 ms SLO: every request they send goes with
    priority 1. The phones' tail lands in time from any send: none of theirs does."""
    spec, models = fleet
    plan = plan_resolved(spec, models, size_workers=False)
    pi4, phone = (next(c for c in plan.classes if c.name == n) for n in ("pi4", "phone"))
    assert pi4.urgent_share == pytest.approx(1.0 - _local_share(plan, "pi4")) and pi4.urgent_share > 0.5
    assert phone.urgent_share == 0.0 and _local_share(plan, "phone") < 1.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_more_workers_never_raise_the_cloud_delay_on_random_fleets(seed: int) -> None:
    """The equilibrium's delay W never rises with workers (a parallel network of the cloud and the
    local option has no Braess paradox). The share within the SLO need not be monotone: devices
    choose by mean latency, so near a saturated equilibrium more workers draw more devices into the
    cloud's waiting tail (seed 1: 97.1% within at 1 worker, 94.4% at 2, 100% at 6)."""
    rng = np.random.default_rng(seed)
    devices = ["rpi4", "rpi5", "phone-sd8g2", "jetson-orin-nano"]
    classes = [{"name": f"c{i}", "count": int(rng.integers(50, 500)), "device": devices[int(rng.integers(4))],
                "model": "resnet50", "fps": float(rng.uniform(0.2, 3.0)),
                "link": {"up_mbps": {"median": float(rng.uniform(10, 150)), "sigma": float(rng.uniform(0, 0.8))},
                         "rtt_ms": float(rng.uniform(5, 60))}} for i in range(3)]
    spec = FleetSpec.from_dict({**SPEC, "models": {"resnet50": {"slo_ms": float(rng.uniform(80, 300))}},
                                "classes": classes})
    models = resolve(spec)
    plans = [plan_resolved(spec, models, workers=c, size_workers=False) for c in (1, 2, 4, 8)]
    delay = [p.fixed_point.delay_ms for p in plans]
    assert all(b <= a + 1e-3 for a, b in zip(delay, delay[1:])), delay
    assert all(p.fixed_point.residual_ms < 0.05 * max(1.0, p.fixed_point.delay_ms) for p in plans)
    offloaded = [p.cloud.offered_rps for p in plans]
    assert all(b >= a - 1e-6 for a, b in zip(offloaded, offloaded[1:])), offloaded
