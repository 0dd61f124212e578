"""The agent on fast-varying links, with time passed in: the held rate does not chase 1-second
dips, plans are priced over the rate distribution (least chance of an SLO miss, then mean), a
switch must pay for itself, and the hedge starts the local run early enough for one answer."""

import dataclasses
import math
import random

import pytest

from edge_agent.flow import RequestFlow
from edge_agent.monitor import LinkEstimate, LinkMonitor, MonitorConfig
from edge_agent.policy import LOCAL, Action, Health, PolicyConfig, PolicyState, arrival_rps, hedge_delay_s, policy
from partitioner import Cut
from planner import Breakdown, Encoding, Frontier, FrontierEntry, Link, LinkRange, Objective, Plan

REF = Link(10e6, 40e6, 20.0)
HZ = 10.0


def _plan(layers, boundary_bytes, edge_ms, cloud_ms):
    up_ms = boundary_bytes * 8 / REF.up_bps * 1e3
    total = edge_ms + up_ms + REF.rtt_ms + cloud_ms
    b = Breakdown(edge_ms=edge_ms, encode_ms=0.0, uplink_ms=up_ms, rtt_ms=REF.rtt_ms, queue_ms=0.0,
                  cloud_ms=cloud_ms, downlink_ms=0.0, total_ms=total, energy_j=0.0, bottleneck="uplink",
                  tier_ms=(edge_ms, cloud_ms), tier_codec_ms=(0.0, 0.0), hop_up_ms=(up_ms,), hop_down_ms=(0.0,))
    return Plan("m", (Cut(frozenset(layers)),), Encoding(), Objective.LATENCY, REF, b, ("t",))


# A: cloud-only, 150 kB boundary (120 ms of uplink at 10 Mbit/s); B: 2 layers here, 30 kB boundary.
A = _plan([], 150_000, 0.0, 10.0)
B = _plan([0, 1], 30_000, 100.0, 8.0)
FRONT = Frontier("m", Objective.LATENCY, LinkRange(0.5e6, 1e9, 4.0, 20.0),
                 (FrontierEntry(0.5e6, 8e6, B), FrontierEntry(8e6, 1e9, A)), compute_w=2.0, radio_tx_w=1.0)


def _jittered(mean_bps, n, rng, sigma=0.3):
    return [mean_bps * rng.lognormvariate(0, sigma) for _ in range(n)]


def _with_dips(rng, seconds, mean_bps=5.85e6, dip_bps=0.5e6, every_s=5.0, dip_s=1.0):
    """10 Hz rate samples: lognormal jitter around `mean_bps`, and a 1-second dip every `every_s`."""
    out = []
    for i in range(int(seconds * HZ)):
        t = i / HZ
        in_dip = (t % every_s) >= every_s - dip_s
        out.append((t, (dip_bps if in_dip else mean_bps) * rng.lognormvariate(0, 0.3)))
    return out


def test_the_held_rate_does_not_chase_one_second_dips_but_the_level_does():
    mon, rng = LinkMonitor(), random.Random(4)
    held, level, holding = [], [], []
    for t, r in _with_dips(rng, 30.0):
        mon.observe_rate(r, t)
        est = mon.estimate(t)
        if t >= 2.0:
            held.append(est.up_hold_bps)
            level.append(est.up_bps)
            holding.append(est.holding)
    assert holding == [lv < h for lv, h in zip(level, held)] and any(holding)
    assert min(level) < 0.2 * 5.85e6  # the level follows each dip within a sample or two
    assert min(held) > 0.5 * 5.85e6 and max(held) < 2.0 * 5.85e6  # the rate plans use does not


def test_a_drop_that_lasts_is_planned_for_hold_s_after_it_is_seen():
    mon, rng = LinkMonitor(), random.Random(5)
    for i, r in enumerate(_jittered(5.85e6, 50, rng)):
        mon.observe_rate(r, i / HZ)
    seen = planned = None
    for i, r in enumerate(_jittered(0.5e6, 40, rng)):
        t = 5.0 + i / HZ
        if mon.observe_rate(r, t) and seen is None:
            seen = t
        if planned is None and mon.estimate(t).up_hold_bps < 1e6:
            planned = t
    hold_s = mon.config.hold_s
    assert seen is not None and seen <= 5.2
    assert planned is not None and seen + hold_s - 1e-9 <= planned <= seen + hold_s + 0.2
    # and a rise is planned for at once
    assert mon.observe_rate(20e6, 9.0) or True
    for i in range(3):
        mon.observe_rate(20e6, 9.0 + i / HZ)
    assert mon.estimate(9.2).up_hold_bps > 10e6


def test_the_transfer_time_comes_from_the_delivery_record():
    mon, rng = LinkMonitor(), random.Random(6)
    mon.observe_rtt(20.0, 0.0)
    for i, r in enumerate(_jittered(5.85e6, 60, rng)):
        mon.observe_rate(r, i / HZ)
    est = mon.estimate(6.0)
    assert len(est.spread) == mon.config.window_samples
    p50, p90 = mon.transfer_s(100_000, within=0.5), mon.transfer_s(100_000, within=0.9)
    assert p50 is not None and p90 is not None and p90 > 1.2 * p50
    assert 0.3 < (p50 - 0.020) / (0.8e6 / 5.85e6) < 3.0
    assert est.up_low_bps < est.up_hold_bps
    # transfers older than window_s leave the record
    assert mon.estimate(6.0 + mon.config.window_s + 1).spread == ()
    assert LinkEstimate.from_json(est.to_json()) == est
    with pytest.raises(ValueError, match="within"):
        mon.transfer_s(1, within=1.5)


def _replay(samples, mcfg, pcfg, *, spread=True, rps=5.0, local_ms=400.0):
    """Monitor and policy over (t, rate) samples with time passed in; returns the switches after the first plan."""
    mon, state = LinkMonitor(mcfg), PolicyState()
    health = Health(local_ms=local_ms, arrival_rps=rps)
    for t, r in samples:
        mon.observe_rate(r, t)
        est = mon.estimate(t)
        if not spread:
            est = dataclasses.replace(est, spread=(), up_hold_bps=None)
        _, state = policy(est, FRONT, health, state, t, config=pcfg)
    return state.switches


def test_no_flip_flop_on_a_steady_link_with_jitter_and_short_outages():
    # A and B cost the same near 7.4 Mbit/s (A: 10 + 20 + 1.2e9/r ms; B: 108 + 20 + 0.24e9/r ms).
    rng = random.Random(8)
    samples = []
    for t, r in _with_dips(rng, 60.0, mean_bps=7.4e6, dip_bps=1e6, every_s=7.0):
        if 20.0 <= t < 20.8:  # a short outage: nothing delivered
            continue
        samples.append((t, r))
    old = _replay(samples, MonitorConfig(hold_s=0.0), PolicyConfig(switch_cost_ms=0.0, hysteresis=0.0),
                  spread=False)
    ours = _replay(samples, MonitorConfig(), PolicyConfig())
    assert old >= 6 and ours <= 1, (old, ours)  # old: the level at each sample, no switch cost


def _est(rates_bps, rtt_ms=20.0):
    """An estimate whose rate distribution is `rates_bps` (median as the held rate)."""
    mid = sorted(rates_bps)[len(rates_bps) // 2]
    return LinkEstimate(mid, mid * 4, rtt_ms, len(rates_bps), 0.0, None, up_hold_bps=mid,
                        spread=tuple(math.log(r / mid) for r in rates_bps))


def test_the_deadline_aware_choice_takes_the_safer_plan_when_the_mean_favours_a_risky_one():
    # Mostly 20 Mbit/s, with a quarter of the transfers at 1.5: A is faster on average
    # (A ~ 0.75*90 + 0.25*830 = 275 ms, B ~ 0.75*140 + 0.25*288 = 177 ms... see below), so
    # make A win on the mean and lose on the chance of meeting 300 ms.
    rates = [30e6] * 17 + [2.5e6] * 3
    est = _est(rates)
    health = Health(local_ms=1000.0)
    a_ms = [10 + 20 + 1.2e9 / r for r in rates]
    b_ms = [108 + 20 + 0.24e9 / r for r in rates]
    assert sum(a_ms) / 20 < sum(b_ms) / 20  # the mean favours A
    assert sum(t > 300 for t in a_ms) == 3 and sum(t > 300 for t in b_ms) == 0
    act, _ = policy(est, FRONT, health, PolicyState(), 0.0, config=PolicyConfig(slo_ms=300.0))
    assert act.plan_key == B.key and act.miss == 0.0
    no_slo, _ = policy(est, FRONT, health, PolicyState(), 0.0, config=PolicyConfig())
    assert no_slo.plan_key == A.key  # without a deadline the mean decides
    # Ties on risk go to the mean: at 300 ms both meet always, and A is the faster.
    act, _ = policy(_est([30e6] * 20), FRONT, health, PolicyState(), 0.0, config=PolicyConfig(slo_ms=300.0))
    assert act.plan_key == A.key
    # A plan already in use that now misses often is left for the safer one at once, dwell or not.
    st = PolicyState(current=A.key, switched_s=0.0)
    act, st = policy(est, FRONT, health, st, 0.1, config=PolicyConfig(slo_ms=300.0, dwell_s=5.0, switch_cost_ms=0.0))
    assert act.switched and act.plan_key == B.key and "15% of the time" in act.reason


def test_a_switch_must_pay_for_itself_over_one_dwell_and_recent_switches_make_it_dearer():
    # At 11 Mbit/s and 0.5 requests/s: A = 30 + 109 + 3 (uplink queue) = 142 ms, B = 150 ms; in B,
    # A saves 8 ms a request.
    est = LinkEstimate(11e6, 44e6, 20.0, 10, 0.0, None)
    in_b = PolicyState(current=B.key, switched_s=-100.0)
    health = Health(local_ms=1000.0, arrival_rps=0.5)
    short = PolicyConfig(hysteresis=0.0, switch_cost_ms=50.0, dwell_s=1.0)
    one, _ = policy(est, FRONT, health, in_b, 0.0, config=short)
    assert not one.switched and "saves less than a switch costs" in one.reason  # 8 ms x 1 request < 50
    long = dataclasses.replace(short, dwell_s=40.0)
    many, st = policy(est, FRONT, health, in_b, 0.0, config=long)
    assert many.switched and many.plan_key == A.key  # 8 ms x 20 requests > 50
    # After four recent switches the next costs 5 x 50 ms: the same gain no longer pays.
    busy = dataclasses.replace(in_b, recent_s=(-4.0, -3.0, -2.0, -1.5))
    held, _ = policy(est, FRONT, health, busy, 0.0, config=long)
    assert not held.switched
    assert st.recent_s == (0.0,) and PolicyState.from_json(st.to_json()) == st
    _, first = policy(est, FRONT, health, PolicyState(), 0.0, config=long)
    assert first.recent_s == () and first.switches == 0  # the first plan is no switch
    # Switches are remembered for `switch_window_s` (a minute): four 30 s ago still count, 61 s ago not.
    older = dataclasses.replace(in_b, recent_s=(-30.0,) * 4)
    assert not policy(est, FRONT, health, older, 0.0, config=long)[0].switched
    assert policy(est, FRONT, health, dataclasses.replace(in_b, recent_s=(-61.0,) * 4), 0.0, config=long)[0].switched


def test_hedge_starts_at_once_when_the_remote_time_nears_the_deadline_else_at_the_last_safe_moment():
    cfg = PolicyConfig(slo_ms=300.0)
    risky = Action("offload", "c", predicted_ms=200.0, hi_ms=280.0)
    safe = Action("offload", "c", predicted_ms=80.0, hi_ms=100.0)  # under the local tail started now (110 ms)
    # local tail 100 ms (+25 % margin): the last safe start is at 175 ms
    assert hedge_delay_s(risky, elapsed_ms=10.0, deadline_ms=300.0, local_ms=100.0, config=cfg) == 0.0
    assert hedge_delay_s(safe, elapsed_ms=10.0, deadline_ms=300.0, local_ms=100.0, config=cfg) == pytest.approx(0.165)
    # the plan's recent answers disagree with the prediction: no race, the last safe moment
    assert hedge_delay_s(risky, elapsed_ms=10.0, deadline_ms=300.0, local_ms=100.0, record_ms=[90.0] * 5,
                         config=cfg) == pytest.approx(0.165)
    # 250 ms lands by 300 but not with its 25 % margin: the margin is what is left (start by 50 ms)
    assert hedge_delay_s(risky, elapsed_ms=10.0, deadline_ms=300.0, local_ms=250.0, config=cfg) == 0.0
    fast = Action("offload", "c", predicted_ms=30.0, hi_ms=40.0)
    assert hedge_delay_s(fast, elapsed_ms=10.0, deadline_ms=300.0, local_ms=250.0, config=cfg) == pytest.approx(0.04)
    # the local run cannot land in time even started now: no hedge, the remote budget decides
    assert hedge_delay_s(risky, elapsed_ms=60.0, deadline_ms=300.0, local_ms=250.0, config=cfg) == math.inf
    # without an SLO the deadline is a timeout: the whole margin or no hedge
    assert hedge_delay_s(risky, elapsed_ms=10.0, deadline_ms=300.0, local_ms=250.0, config=PolicyConfig()) == math.inf


def test_a_request_that_only_the_cloud_can_answer_in_time_asks_for_priority():
    from edge_agent.hedge import URGENT, urgent_priority

    cfg = PolicyConfig(slo_ms=300.0)
    risky = Action("offload", "c", predicted_ms=200.0, hi_ms=280.0)
    late = hedge_delay_s(risky, elapsed_ms=60.0, deadline_ms=300.0, local_ms=250.0, config=cfg)  # no hedge
    covered = hedge_delay_s(risky, elapsed_ms=10.0, deadline_ms=300.0, local_ms=250.0, config=cfg)  # at once
    assert urgent_priority(300.0, late) == URGENT == 1
    assert urgent_priority(300.0, covered) == 0
    assert urgent_priority(None, math.inf) == 0  # a timeout is no promise: no priority


def test_a_request_sent_into_a_held_drop_races_at_once_when_the_level_makes_it_later_than_local():
    """No SLO, a 1500 ms remote budget, a 220 ms local tail: normally the hedge waits for the last
    safe moment (1225 ms), and the plan's fast record (before the drop) would veto a race. While a
    drop is held, the rest of the request priced at the link's level decides: past the local
    tail's time it races at once; under it, nothing changes."""
    act = Action("offload", "c", predicted_ms=120.0, hi_ms=150.0)
    kw = dict(elapsed_ms=10.0, deadline_ms=1500.0, local_ms=220.0, record_ms=[110.0] * 5, config=PolicyConfig())
    assert hedge_delay_s(act, **kw) == pytest.approx(1.215)
    assert hedge_delay_s(act, held_ms=1100.0, **kw) == 0.0
    assert hedge_delay_s(act, held_ms=150.0, **kw) == pytest.approx(1.215)


def test_a_hedged_request_is_answered_once_before_its_deadline_whichever_answer_comes_first():
    """A slow transfer (a dip) with time passed in: the hedge fires before the deadline, the local
    tail answers in time, and the remote answer that comes later is dropped and counted."""
    rng = random.Random(11)
    mon = LinkMonitor()
    mon.observe_rtt(20.0, 0.0)
    for i, r in enumerate(_jittered(5.85e6, 40, rng)):
        mon.observe_rate(r, i / HZ)
    cfg = PolicyConfig(slo_ms=400.0)
    act, _ = policy(mon.estimate(4.0), FRONT, Health(local_ms=1000.0), PolicyState(), 4.0, config=cfg)
    assert act.kind != LOCAL and act.hi_ms < cfg.slo_ms
    for remote_ms, local_tail_ms, winner in ((900.0, 150.0, "local_done"), (120.0, 150.0, "remote_ok")):
        flow = RequestFlow("r")
        flow.fire("offload")
        flow.fire("head_done")
        hedge_ms = 1e3 * hedge_delay_s(act, elapsed_ms=0.0, deadline_ms=cfg.slo_ms, local_ms=local_tail_ms,
                                       config=cfg)
        assert hedge_ms < cfg.slo_ms - local_tail_ms
        events = [(remote_ms, "remote_ok")]
        if hedge_ms < remote_ms:
            events += [(hedge_ms, "hedge"), (hedge_ms + local_tail_ms, "local_done")]
        delivered, dropped = [], 0
        for at_ms, event in sorted(events):
            if event == "hedge":
                flow.fire("remote_timeout")  # the runner's hedge: late by its own prediction
                continue
            step = flow.fire(event)
            if step.delivers:
                delivered.append((at_ms, event))
            dropped += step.late
        assert [e for _, e in delivered] == [winner] and delivered[0][0] <= cfg.slo_ms
        assert dropped == (1 if hedge_ms < remote_ms else 0)


@pytest.mark.parametrize("knob, value", [("switch_cost_ms", -1.0), ("risk_tie", 1.0), ("hedge_tail", 0.6),
                                         ("hedge_margin", -0.1)])
def test_bad_policy_knobs_are_refused(knob, value):
    with pytest.raises(ValueError, match=knob):
        PolicyConfig(**{knob: value})


@pytest.mark.parametrize("knob, value", [("hold_s", -1.0), ("window_s", 0.0), ("window_samples", 0),
                                         ("low_quantile", 0.7)])
def test_bad_monitor_knobs_are_refused(knob, value):
    with pytest.raises(ValueError, match=knob):
        MonitorConfig(**{knob: value})


def test_the_load_figure_rises_within_two_seconds_and_falls_over_ten():
    steady = [i / 5 for i in range(50)]  # 5/s for 10 s
    assert arrival_rps(steady, 10.0) == pytest.approx(5.0, rel=0.1)
    assert arrival_rps([*steady, 10.1, 10.2, 10.3, 10.4, 10.5], 10.5) > 5.0  # a rise shows at once
    # The app slows to 1/s (local answers hold it back): the figure falls over 10 s, not 2.
    slow = [*steady, *(10.0 + i for i in range(1, 6))]
    assert arrival_rps(slow, 15.0) > 2.5
    assert arrival_rps(slow, 21.0) < 1.0
    assert arrival_rps([1.0, 1.1, 1.2, 1.3, 1.4], 1.4) == 2.5  # a burst of five over the whole window


def test_a_window_bounds_the_uplink_queue_so_a_full_uplink_stays_an_option():
    # A's 150 kB take 205 ms at 5.85 Mbit/s: at 5 requests/s the uplink is full (util 1.03).
    est = LinkEstimate(5.85e6, 23.4e6, 20.0, 10, 0.0, None)
    full = Health(local_ms=2000.0, arrival_rps=5.0)
    act, _ = policy(est, FRONT, full, PolicyState(), 0.0, config=PolicyConfig())
    assert act.kind == "offload" and act.plan_key == B.key  # A is ruled out; B's 41 ms fit
    only_a = dataclasses.replace(FRONT, entries=(FRONT.entries[1],))
    act, _ = policy(est, only_a, full, PolicyState(), 0.0, config=PolicyConfig())
    assert act.kind == LOCAL and "cannot carry" in act.reason  # no window known: no bound on the queue
    act, _ = policy(est, only_a, dataclasses.replace(full, inflight=2), PolicyState(), 0.0, config=PolicyConfig())
    # two in flight: one upload ahead at most, 235 + 205 ms, against 2 s here
    assert act.kind == "offload" and act.predicted_ms == pytest.approx(235 + 205, rel=0.02)


def test_a_busy_device_prices_the_cloud_at_the_load_it_would_draw():
    """Locally at 0.9 requests/s (busy 0.9 of the time at 1 s each): priced at that rate A (330 ms
    at 4 Mbit/s) looks better, but offloaded the app would send about 2.7/s, and A's uplink, 82 %
    busy, would queue each request for 0.7 s."""
    only_a = dataclasses.replace(FRONT, entries=(FRONT.entries[1],))
    est = LinkEstimate(4e6, 16e6, 20.0, 10, 0.0, None)
    local_now = PolicyState(current=LOCAL, switched_s=-100.0)
    health = Health(local_ms=1000.0, arrival_rps=0.9)
    act, _ = policy(est, only_a, health, local_now, 0.0, config=PolicyConfig())
    assert act.kind == LOCAL and not act.switched
    # At the same rate from an idle device (busy 0.45 of the time at 0.5 s each), the rate is taken as it is.
    idle = dataclasses.replace(health, local_ms=500.0)
    act, _ = policy(est, only_a, idle, local_now, 0.0, config=PolicyConfig())
    assert act.kind == "offload" and act.switched


def test_probes_back_off_while_the_agent_stays_local_by_choice_but_not_in_an_outage_nor_after_a_rise():
    import concurrent.futures
    import time

    from edge_agent import breaker as B
    from edge_agent.config import config_from_dict
    from edge_agent.runner import Runner

    cfg = config_from_dict({"gateway": "127.0.0.1:1", "model": "m@1", "probe_interval_s": 2.0})
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        r = Runner(None, None, None, cfg, executor=pool, local_ms=5.0)  # type: ignore[arg-type]
        reevaluated = []
        r.reevaluate = lambda: reevaluated.append(r.monitor.estimate().changes)  # no models to plan with here
        r.last_action = Action(LOCAL)
        r.last_remote_s = time.monotonic() - 1.5  # quiet for 1.5 s: past half the interval (1 s)
        assert r.link_idle()
        r._quiet_probes = 1  # one probe left the plan local: now 2 s
        assert not r.link_idle()
        r.last_remote_s = time.monotonic() - 7.0
        r._quiet_probes = 10  # at most 8 x 1 s
        assert not r.link_idle()
        r.last_remote_s = time.monotonic() - 8.5
        assert r.link_idle()
        r.last_remote_s = time.monotonic() - 1.5
        r.breaker = dataclasses.replace(r.breaker, state=B.OPEN)  # an outage: no back-off
        assert r.link_idle()
        r._unreachable()  # a check that gets no answer starts again from the shortest wait
        assert r._quiet_probes == 0
        assert reevaluated == [1]  # the silence began (the estimate is the floor): a re-plan at once
        r.breaker = dataclasses.replace(r.breaker, state=B.CLOSED)
        for i in range(10):
            r.monitor.observe_rate(2e6, i * 0.1)
        r._probed()  # a probe at the level: the plan stays local, the wait doubles
        assert r._quiet_probes == 1
        r.monitor.observe_rate(16e6, 1.0)  # a probe 8x above the level: a rise the next sample confirms
        r._probed()
        assert r._quiet_probes == 0


def test_after_a_step_the_spread_is_taken_against_the_new_level():
    """1 Mbit/s, then 8: the samples that revealed the step are no +2 (log 8) errors of the old
    level afterwards, so the distribution the policy prices sits around the new level."""
    mon = LinkMonitor()
    t = 0.0
    for _ in range(10):
        mon.observe_rate(1e6, t)
        t += 0.3
    steps = 0
    for _ in range(5):
        steps += mon.observe_rate(8e6, t)
        t += 0.3
    assert steps == 1
    est = mon.estimate(t)
    assert est.up_bps == pytest.approx(8e6)
    assert max(est.spread) == pytest.approx(0.0, abs=1e-9)  # no error above the new level
    assert est.up_low_bps == pytest.approx(8e6, rel=0.01)


def test_a_remote_plan_is_priced_with_its_hedge_under_the_latency_objective():
    """10 Mbit/s four transfers in five, 1 Mbit/s the fifth: cloud-only takes ~150 ms or ~1.2 s,
    past the 1000 ms SLO a fifth of the time. But its hedge races the 400 ms local run at once
    (the pessimistic time is past the local one), so no request misses and the mean is ~200 ms:
    the plan beats local. Priced without the hedge (hedge_tail 0: none starts early) it misses
    a fifth of the SLOs and the request runs locally."""
    est = LinkEstimate(up_bps=10e6, down_bps=40e6, rtt_ms=20.0, samples=10, last_sample_s=0.0, last_change_s=None,
                       up_hold_bps=10e6, spread=(0.0,) * 8 + (math.log(0.1),) * 2)
    health = Health(local_ms=400.0)
    front = dataclasses.replace(FRONT, entries=(FrontierEntry(0.5e6, 1e9, A),))
    act, _ = policy(est, front, health, PolicyState(), 0.0, config=PolicyConfig(slo_ms=1000.0))
    assert act.plan_key == A.key and act.miss == 0.0
    assert act.predicted_ms > 300.0  # the remote call's own mean
    assert act.model_ms == pytest.approx(act.predicted_ms)  # what the runner's correction compares with
    bare, _ = policy(est, front, health, PolicyState(), 0.0, config=PolicyConfig(slo_ms=1000.0, hedge_tail=0.0))
    assert bare.kind == LOCAL


def test_a_hedged_plan_in_use_is_left_for_local_once_it_no_longer_beats_local_by_the_margin():
    """Hedged, a remote plan is never dearer than local (no answer later than the local run the
    hedge starts), so were local held to the usual hysteresis against it, an agent on the plan
    would never leave: through a dip to 3.6 Mbit/s (cloud-only 554 ms, its uplink queue included,
    against 400 ms local) it would race every request, the device running each one anyway. Against a hedged plan, local
    counts at the margin by which the plan had to beat it to be chosen."""
    front = dataclasses.replace(FRONT, entries=(FrontierEntry(0.5e6, 1e9, A),))
    health = Health(local_ms=400.0, arrival_rps=1.6)
    cfg = PolicyConfig(slo_ms=1000.0)
    on_a = PolicyState(current=A.key, switched_s=-100.0)
    dip = LinkEstimate(up_bps=3.6e6, down_bps=4e6, rtt_ms=20.0, samples=10, last_sample_s=0.0, last_change_s=None,
                       up_hold_bps=3.6e6, spread=(0.0,) * 10)
    act, st = policy(dip, front, health, on_a, 0.0, config=cfg)
    assert act.switched and act.kind == LOCAL
    # Leaving it still pays a switch: after two switches this minute, 60 ms a request does not pay a third.
    busy = dataclasses.replace(on_a, recent_s=(-20.0, -10.0))
    held, _ = policy(dip, front, health, busy, 0.0, config=cfg)
    assert held.plan_key == A.key and "saves less than a switch costs" in held.reason
    # The margin both ways, and no flapping: at 10 Mbit/s (~150 ms) the plan is taken back; a plan
    # within the margin of local (345 ms at 5 Mbit/s, its uplink queue included: 0.86 of local) is neither
    # left nor taken.
    fast = dataclasses.replace(dip, up_bps=10e6, up_hold_bps=10e6)
    assert policy(fast, front, health, dataclasses.replace(st, switched_s=-100.0), 0.0, config=cfg)[0].plan_key == A.key
    near = dataclasses.replace(dip, up_bps=5e6, up_hold_bps=5e6)
    kept, _ = policy(near, front, health, on_a, 0.0, config=cfg)
    assert kept.plan_key == A.key and not kept.switched
    stay, _ = policy(near, front, health, PolicyState(current=LOCAL, switched_s=-100.0), 0.0, config=cfg)
    assert stay.kind == LOCAL


def test_a_hedge_is_priced_from_when_the_request_was_sent():
    """The hedge starts the local tail no sooner than the request was sent: on the device the
    encode comes first. Cloud-only at 10 Mbit/s half the time (~150 ms) and 1 Mbit/s the other
    half (~1.2 s, raced at once by the 400 ms local run): sent at once, its raced requests
    answer at 400 ms, a mean of 275 that beats local by the margin. Sent after 150 ms of
    encoding, the fast half answers at 300 ms and the raced half at 550 ms, a mean of 425 that
    does not."""
    est = LinkEstimate(up_bps=10e6, down_bps=40e6, rtt_ms=20.0, samples=10, last_sample_s=0.0, last_change_s=None,
                       up_hold_bps=10e6, spread=(0.0,) * 5 + (math.log(0.1),) * 5)
    front = dataclasses.replace(FRONT, entries=(FrontierEntry(0.5e6, 1e9, A),))
    cfg = PolicyConfig(slo_ms=1000.0)
    quick, _ = policy(est, front, Health(local_ms=400.0), PolicyState(), 0.0, config=cfg)
    assert quick.plan_key == A.key and "remote 275 ms" in quick.reason
    slow, _ = policy(est, front, Health(local_ms=400.0, send_ms={A.key: 150.0}), PolicyState(), 0.0, config=cfg)
    assert slow.kind == LOCAL and "remote 425 ms" in slow.reason


def test_the_remote_correction_is_learnt_against_the_level_not_the_held_rate():
    """The policy plans cloud-only at the held 10 Mbit/s (~150 ms) through a drop to 5 Mbit/s
    shorter than `hold_s`; its answers then take ~270 ms. Learnt against the held rate's 150 ms,
    the drop would stay in the remote factor (x1.8) after the hold ends; `model_ms` prices the
    plan at the level the monitor measures, so the factor sees no error."""
    est = LinkEstimate(up_bps=5e6, down_bps=20e6, rtt_ms=20.0, samples=10, last_sample_s=0.0, last_change_s=None,
                       up_hold_bps=10e6, spread=(0.0,) * 10)
    front = dataclasses.replace(FRONT, entries=(FrontierEntry(0.5e6, 1e9, A),))
    on_a = PolicyState(current=A.key, switched_s=-100.0)
    act, _ = policy(est, front, Health(local_ms=600.0, remote_factor=1.5), on_a, 0.0,
                    config=PolicyConfig(slo_ms=1000.0))
    assert act.plan_key == A.key
    assert act.predicted_ms == pytest.approx(1.5 * (120.0 + 20.0 + 10.0), rel=0.01)  # held, and scaled
    assert act.model_ms == pytest.approx(240.0 + 20.0 + 10.0, rel=0.01)  # the level, unscaled
    # The device's part is measured ([Note: measured send]): neither scaled nor in `model_ms`.
    sent, _ = policy(est, front, Health(local_ms=600.0, remote_factor=1.5, send_ms={A.key: 30.0}), on_a,
                     0.0, config=PolicyConfig(slo_ms=1000.0))
    assert sent.predicted_ms == pytest.approx(30.0 + 1.5 * 150.0, rel=0.01)
    assert sent.model_ms == pytest.approx(act.model_ms)
    steady = dataclasses.replace(est, up_bps=10e6)
    assert policy(steady, front, Health(local_ms=400.0), PolicyState(), 0.0,
                  config=PolicyConfig(slo_ms=1000.0))[0].model_ms == pytest.approx(150.0, rel=0.01)


def test_a_held_drop_keeps_the_plan_in_use_but_takes_no_plan_up():
    """The level has fallen to 3 Mbit/s and the rate is held at 10 (the drop is younger than
    `hold_s`). Cloud-only in use stays in use, priced at the held rate (~160 ms at 1 req/s, its
    uplink queue included; a request meanwhile runs here, see the next test). From local, cloud-only is priced at the level (~560 ms against 400 ms
    local): it is not taken up, nor tried; at the held rate it would be. Once the level is back,
    it is."""
    est = LinkEstimate(up_bps=3e6, down_bps=12e6, rtt_ms=20.0, samples=10, last_sample_s=0.0, last_change_s=None,
                       up_hold_bps=10e6, spread=(0.0,) * 10)
    assert est.holding
    front = dataclasses.replace(FRONT, entries=(FrontierEntry(0.5e6, 1e9, A),))
    health = Health(local_ms=400.0, arrival_rps=1.0)
    cfg = PolicyConfig()
    kept, _ = policy(est, front, dataclasses.replace(health, request=False), PolicyState(current=A.key, switched_s=-100.0),
                     0.0, config=cfg)
    assert kept.plan_key == A.key and not kept.switched
    assert kept.predicted_ms == pytest.approx(158.0, rel=0.02)
    local = PolicyState(current=LOCAL, switched_s=-100.0)
    stay, _ = policy(est, front, health, local, 0.0, config=cfg)
    assert stay.kind == LOCAL and not stay.switched and not stay.trial
    assert "remote 563 ms vs local 400 ms" in stay.reason, stay.reason  # cloud-only priced at the level
    with_slo, _ = policy(est, front, health, local, 0.0, config=PolicyConfig(slo_ms=1000.0))
    assert with_slo.kind == LOCAL and not with_slo.switched and not with_slo.trial
    back = dataclasses.replace(est, up_bps=10e6)
    assert not back.holding
    taken, _ = policy(back, front, health, local, 0.0, config=cfg)
    assert taken.plan_key == A.key and taken.switched


def test_in_a_held_drop_a_request_the_plan_would_answer_later_than_local_runs_here_and_the_plan_stays():
    """Cloud-only in use, the rate held at 10 Mbit/s, the level at 2: at the level the plan takes
    ~630 ms, local 400. The request runs here (`held`), with no switch: the state still holds the
    plan, which a re-evaluation (no request) keeps. At a level of 8 Mbit/s (~180 ms) the request
    goes to the cloud. A trial or a breaker probe is never made local this way."""
    est = LinkEstimate(up_bps=2e6, down_bps=8e6, rtt_ms=20.0, samples=10, last_sample_s=0.0, last_change_s=None,
                       up_hold_bps=10e6, spread=(0.0,) * 10)
    front = dataclasses.replace(FRONT, entries=(FrontierEntry(0.5e6, 1e9, A),))
    health = Health(local_ms=400.0)
    on_a = PolicyState(current=A.key, switched_s=-100.0)
    for cfg in (PolicyConfig(), PolicyConfig(slo_ms=1000.0)):
        act, st = policy(est, front, health, on_a, 0.0, config=cfg)
        assert act.kind == LOCAL and act.held and not act.switched
        assert st == on_a
        assert "kept; this request here: 630 ms at the link's level vs local 400 ms" in act.reason
        tick, _ = policy(est, front, dataclasses.replace(health, request=False), on_a, 0.0, config=cfg)
        assert tick.plan_key == A.key and not tick.held
        near = dataclasses.replace(est, up_bps=8e6)
        sent, _ = policy(near, front, health, on_a, 0.0, config=cfg)
        assert sent.plan_key == A.key and not sent.held
    probe, _ = policy(est, front, dataclasses.replace(health, probe=True), on_a, 0.0, config=PolicyConfig())
    assert probe.plan_key == A.key and probe.probe and not probe.held
    # No plan in use to keep: from local, the plan is priced at the level and not taken up.
    fresh, _ = policy(est, front, health, PolicyState(current=LOCAL, switched_s=-100.0), 0.0, config=PolicyConfig())
    assert fresh.kind == LOCAL and not fresh.held and not fresh.switched
