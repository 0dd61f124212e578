"""The fleet simulator: deterministic for a seed, exactly one answer per request, and its cloud
matches the M/M/c closed form at batch 1 with exponential service."""

from __future__ import annotations

import dataclasses

import pytest

from planner.queueing import erlang_c
from planner.fleet import resolve
from planner.fleet_spec import FleetSpec
from splitinfer.fleetsim import SimConfig, simulate

FLEET = {
    "models": {"resnet50": {"slo_ms": 150, "target": 0.9}},
    "cloud": {"device": "t4", "workers": 1, "max_batch": 8, "batch_timeout_ms": 2},
    "encodings": ["fp32", "int8"],
    "classes": [
        {"name": "pi4", "count": 150, "device": "rpi4", "model": "resnet50", "fps": 1.0,
         "link": {"up_mbps": {"median": 50, "sigma": 0.4}, "rtt_ms": 30}},
        {"name": "phone", "count": 150, "device": "phone-sd8g2", "model": "resnet50", "fps": 1.0,
         "link": {"up_mbps": {"median": 80, "sigma": 0.4}, "rtt_ms": 30}},
    ],
}


@pytest.fixture(scope="module")
def fleet():
    spec = FleetSpec.from_dict(FLEET)
    return spec, resolve(spec)


def test_a_seed_gives_the_same_run(fleet) -> None:
    spec, models = fleet
    cfg = SimConfig(seconds=3.0, warmup_s=0.5, seed=7)
    a, b = simulate(spec, models, cfg), simulate(spec, models, cfg)
    assert a == b and a.requests > 500
    assert simulate(spec, models, SimConfig(seconds=3.0, warmup_s=0.5, seed=8)) != a


@pytest.mark.parametrize("strategy", ["ours", "dads", "cloud-only", "edge-only"])
def test_every_request_gets_exactly_one_answer(fleet, strategy: str) -> None:
    spec, models = fleet
    r = simulate(spec, models, SimConfig(strategy=strategy, seconds=2.5, warmup_s=0.5, fps_scale=3.0))
    assert r.lost == 0 and r.doubled == 0 and r.requests > 1000
    if strategy == "edge-only":
        assert r.offloaded == 0 and r.class_within_slo == {"phone": 1.0, "pi4": 0.0}
    if strategy == "cloud-only":  # 900 req/s on one worker: admission refuses, devices answer locally
        assert r.offloaded == 1.0 and r.refused > 0.1


def test_the_agent_moves_devices_off_a_loaded_cloud(fleet) -> None:
    spec, models = fleet
    light = simulate(spec, models, SimConfig(seconds=3.0, warmup_s=1.0, workers=8))
    heavy = simulate(spec, models, SimConfig(seconds=3.0, warmup_s=1.0, workers=1, fps_scale=3.0))
    assert heavy.offloaded < light.offloaded
    assert heavy.worker_wait_ms > light.worker_wait_ms


def test_cloud_matches_mmc_at_batch_one() -> None:
    c, rho = 2, 0.7
    d = {**FLEET, "models": {"resnet50": {"slo_ms": 10_000}},
         "cloud": {"device": "t4", "workers": c, "max_batch": 1, "batch_timeout_ms": 0},
         "classes": [{**FLEET["classes"][0], "count": 100, "link": {"up_mbps": 50, "rtt_ms": 30}}]}
    spec = FleetSpec.from_dict(d)
    models = resolve(spec)
    probe = simulate(spec, models, SimConfig(strategy="cloud-only", seconds=1.0, warmup_s=0.0))
    assert probe.offloaded == 1.0
    # the run time of the whole model on the cloud, from the cost model
    from splitinfer.fleetsim import _cloud_only  # noqa: PLC0415
    service_ms = min(f.entries[0].plan.breakdown.cloud_ms for f in _cloud_only(models[0], spec))
    fps = rho * c / (service_ms / 1e3) / 100
    spec = FleetSpec.from_dict({**d, "classes": [{**d["classes"][0], "fps": fps}]})
    r = simulate(spec, resolve(spec), SimConfig(strategy="cloud-only", seconds=40.0, warmup_s=2.0,
                                                service="exponential", seed=3))
    expected = erlang_c(c, rho * c) * service_ms / (c - rho * c)
    assert r.refused == 0 and r.fallbacks == 0
    assert r.worker_wait_ms == pytest.approx(expected, rel=0.15)
    assert r.cloud_utilisation == pytest.approx(rho, rel=0.1)


@pytest.mark.parametrize("kw, words", [
    ({"strategy": "greedy"}, "strategy='greedy'"),
    ({"service": "gamma"}, "service='gamma'"),
    ({"seconds": 5.0, "warmup_s": 5.0}, "warmup_s=5.0"),
    ({"request_overhead_ms": -1.0}, "request_overhead_ms=-1.0"),
    ({"deadline": "budget"}, "deadline='budget'"),
])
def test_bad_config_is_refused(kw: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace("[", r"\[")):
        SimConfig(**kw)


def test_request_overhead_adds_to_remote_answers(fleet) -> None:
    spec, models = fleet
    cfg = SimConfig(strategy="cloud-only", seconds=2.0, warmup_s=0.5, workers=8)
    a = simulate(spec, models, cfg)
    b = simulate(spec, models, dataclasses.replace(cfg, request_overhead_ms=20.0))
    # Every remote answer takes 20 ms more; those it makes later than the hedge's local tail are
    # answered by the tail, started at the send (the predicted remote time now past its moment).
    assert b.remote_p50_ms >= a.remote_p50_ms + 20.0 - 1e-9
    assert b.hedged > a.hedged and a.p50_ms < b.p50_ms < a.p50_ms + 20.0
    # Tails the hedge started: those that answered, and those the cloud beat.
    assert b.hedge_started > b.hedged and a.hedge_started >= a.hedged


def test_the_clouds_quantiles_leave_the_local_answers_out(fleet) -> None:
    spec, models = fleet
    edge = simulate(spec, models, SimConfig(strategy="edge-only", seconds=2.0, warmup_s=0.5))
    assert edge.remote_p50_ms is None and edge.remote_p95_ms is None and edge.p95_ms > 0
    # Every Pi answering locally takes its own fixed time; the cloud's answers are all faster.
    ours = simulate(spec, models, SimConfig(seconds=2.0, warmup_s=0.5, workers=8))
    assert 0 < ours.remote_p50_ms <= ours.remote_p95_ms < models[0].local_ms


def test_told_the_pool_is_busy_the_phones_leave_it_to_the_pis(fleet) -> None:
    # One worker, 300 devices at 1 fps: DADS offloads every request and the queue builds; the
    # agents read the answers' utilisation and expected wait, and the phones (72 ms locally,
    # within the SLO) leave the worker to the Pis (493 ms locally, no SLO without it).
    spec, models = fleet
    cfg = SimConfig(seconds=8.0, warmup_s=2.0, workers=1)
    ours, dads, fifo = (simulate(spec, models, dataclasses.replace(cfg, strategy=s, priority=p))
                        for s, p in (("ours", True), ("dads", True), ("dads", False)))
    assert dads.offloaded == 1.0 and ours.offloaded < 0.8
    assert ours.within_slo > 0.98 and ours.worker_wait_ms < dads.worker_wait_ms / 3
    # [Note: priority under overload]: the Pis' requests, with no local answer in time, go first,
    # so DADS's Pis meet the SLO too, the phones answering by their hedge; served in arrival
    # order, the queue made the Pis miss.
    assert dads.class_within_slo["pi4"] > 0.98 and fifo.class_within_slo["pi4"] < 0.8
    assert ours.lost == 0 and ours.doubled == 0


def test_the_hedge_lands_refused_and_late_requests_in_time_when_the_local_run_nears_the_slo(monkeypatch) -> None:
    """An rpi4 whose whole model locally takes 0.85 of the SLO, sending everything to one
    overloaded worker: the remote budget's floor (0.3 SLO) alone starts the local run too late
    for every refused or slow call; the runner's hedge starts it beside the call in time."""
    import splitinfer.fleetsim as fleetsim  # noqa: PLC0415

    pi = {**FLEET["classes"][0], "count": 100, "fps": 6.0}
    local_ms = resolve(FleetSpec.from_dict({**FLEET, "classes": [pi]}))[0].local_ms
    spec = FleetSpec.from_dict({**FLEET, "models": {"resnet50": {"slo_ms": local_ms / 0.85}}, "classes": [pi]})
    models = resolve(spec)
    cfg = SimConfig(strategy="cloud-only", seconds=6.0, warmup_s=1.0, seed=2)
    hedged = simulate(spec, models, cfg)
    monkeypatch.setattr(fleetsim, "hedge_delay_s", lambda *a, **k: float("inf"))
    unhedged = simulate(spec, models, cfg)
    assert hedged.lost == unhedged.lost == 0 and hedged.doubled == unhedged.doubled == 0
    assert unhedged.hedged == 0 and hedged.hedged > 0.1
    assert hedged.within_slo > 0.99 and unhedged.within_slo < 0.9


def test_the_runners_deadline_keeps_the_cloud_on_results_no_device_takes(fleet) -> None:
    # Cloud-only at three times one worker's load: held to their SLO, the requests that cannot
    # make it are refused and answered locally; with the runner's deadline (twice the budget, at
    # least a second) they are queued, and the worker computes answers the devices no longer take.
    spec, models = fleet
    cfg = SimConfig(strategy="cloud-only", seconds=3.0, warmup_s=1.0, workers=1, fps_scale=3.0)
    slo, runner = simulate(spec, models, cfg), simulate(spec, models, dataclasses.replace(cfg, deadline="runner"))
    assert runner.refused < slo.refused
    assert runner.worker_wait_ms > 5 * slo.worker_wait_ms
    assert runner.within_slo < slo.within_slo
    assert runner.lost == 0 and runner.doubled == 0
