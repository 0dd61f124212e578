"""The pure policy over scripted estimate sequences: no flapping under jitter, a switch
after a step, deadline-driven local execution, the breaker's effect, energy."""

import dataclasses
import math
import random

from edge_agent.monitor import LinkEstimate
from edge_agent.policy import LOCAL, OFFLOAD, Action, Health, PolicyConfig, PolicyState, after_trial, policy
from partitioner import Cut
from planner import Breakdown, Encoding, Frontier, FrontierEntry, Link, LinkRange, Objective, Plan

REF = Link(10e6, 40e6, 20.0)


def _plan(layers, boundary_bytes, edge_ms, cloud_ms, enc=Encoding()):
    up_ms = boundary_bytes * 8 / REF.up_bps * 1e3
    total = edge_ms + up_ms + REF.rtt_ms + cloud_ms
    b = Breakdown(edge_ms=edge_ms, encode_ms=0.0, uplink_ms=up_ms, rtt_ms=REF.rtt_ms, queue_ms=0.0,
                  cloud_ms=cloud_ms, downlink_ms=0.0, total_ms=total, energy_j=0.0, bottleneck="uplink",
                  tier_ms=(edge_ms, cloud_ms), tier_codec_ms=(0.0, 0.0), hop_up_ms=(up_ms,), hop_down_ms=(0.0,))
    return Plan("m", (Cut(frozenset(layers)),), enc, Objective.LATENCY, REF, b, ("t",))


# A: cloud-only, 50 kB boundary; B: 2 layers on the device, 10 kB boundary.
A = _plan([], 50_000, 0.0, 5.0)
B = _plan([0, 1], 10_000, 30.0, 3.0)
FRONT = Frontier("m", Objective.LATENCY, LinkRange(0.5e6, 1e9, 4.0, 20.0),
                 (FrontierEntry(0.5e6, 8e6, B), FrontierEntry(8e6, 1e9, A)), compute_w=2.0, radio_tx_w=1.0)
# No switch cost: these tests take the hysteresis, dwell and back-off one at a time
# (tests/unit/test_edge_policy_risk.py has the switch cost, the risk and the hedge).
CFG = PolicyConfig(hysteresis=0.15, dwell_s=1.0, switch_cost_ms=0.0)
HEALTH = Health(local_ms=400.0)


def _est(up_bps, rtt_ms=20.0):
    return LinkEstimate(up_bps, up_bps * 4, rtt_ms, 10, 0.0, None)


def _run(rates, cfg=CFG, health=HEALTH, hz=10.0):
    state, actions = PolicyState(), []
    for i, r in enumerate(rates):
        a, state = policy(_est(r), FRONT, health, state, i / hz, config=cfg)
        actions.append(a)
    return actions, state


def test_fast_link_offloads_cloud_only_and_slow_link_picks_the_small_boundary():
    (a,), _ = _run([18.88e6])
    assert (a.kind, a.plan_key, a.switched) == (OFFLOAD, A.key, True)
    (b,), _ = _run([1.1e6])
    assert (b.kind, b.plan_key) == (OFFLOAD, B.key)
    assert b.cut_id == B.cut.key and b.predicted_ms < a.local_ms


def test_switch_right_after_a_step():
    actions, state = _run([18.88e6] * 30 + [1.1e6] * 10)
    assert [a.plan_key for a in actions[:30]] == [A.key] * 30
    assert actions[30].plan_key == B.key and actions[30].switched
    assert "1.10 Mbit/s" in actions[30].reason and A.key in actions[30].reason
    assert state.switches == 1


def test_no_flapping_under_jitter_near_the_crossover():
    # A and B cost the same near 11.4 Mbit/s: (400 kbit - 80 kbit) / up = 28 ms.
    rng = random.Random(3)
    rates = [11.4e6 * rng.lognormvariate(0, 0.25) for _ in range(300)]
    damped, _ = _run(rates)
    naive, _ = _run(rates, cfg=PolicyConfig(hysteresis=0.0, dwell_s=0.0, switch_cost_ms=0.0))
    n_damped = sum(a.switched for a in damped[1:])
    n_naive = sum(a.switched for a in naive[1:])
    assert n_naive > 20 and n_damped <= n_naive / 10


def test_dwell_holds_a_small_win_but_not_after_it():
    state = PolicyState()
    a, state = policy(_est(18.88e6), FRONT, HEALTH, state, 0.0, config=CFG)
    a, state = policy(_est(1.1e6), FRONT, HEALTH, state, 0.1, config=CFG)  # 3x cheaper: urgent, dwell or not
    assert a.plan_key == B.key and a.switched and "forced" in a.reason
    a, state = policy(_est(18.88e6), FRONT, HEALTH, state, 0.2, config=CFG)
    assert a.plan_key == B.key and not a.switched and "dwell" in a.reason
    a, state = policy(_est(18.88e6), FRONT, HEALTH, state, 1.2, config=CFG)
    assert a.plan_key == A.key and a.switched


def test_slo_forces_a_switch_inside_the_dwell():
    cfg = PolicyConfig(slo_ms=150.0, dwell_s=10.0, urgent_ratio=0.0)
    state = PolicyState()
    a, state = policy(_est(18.88e6), FRONT, HEALTH, state, 0.0, config=cfg)
    a, state = policy(_est(1.1e6), FRONT, HEALTH, state, 0.1, config=cfg)  # A would take ~390 ms
    assert a.plan_key == B.key and "forced" in a.reason


def test_deadline_goes_local_when_remote_misses_and_local_meets():
    # without a hedge (hedge_tail 0) the remote plan's own times miss
    cfg = PolicyConfig(slo_ms=100.0, hedge_tail=0.0)
    (a,), _ = _run([0.3e6], cfg=cfg, health=Health(local_ms=80.0))
    assert a.kind == LOCAL and "misses the 100 ms SLO" in a.reason
    # with one, a local run of 80 ms starts at once beside the call: the remote plan is priced at
    # the local time and does not beat it by the hysteresis margin, so the device stays local
    (a,), _ = _run([0.3e6], cfg=PolicyConfig(slo_ms=100.0), health=Health(local_ms=80.0))
    assert a.kind == LOCAL and a.miss == 0.0


def test_deadline_keeps_remote_when_only_remote_meets():
    cfg = PolicyConfig(slo_ms=100.0)
    (a,), _ = _run([18.88e6], cfg=cfg, health=Health(local_ms=300.0))
    assert a.kind == OFFLOAD and "only the remote" in a.reason


def test_breaker_open_runs_local_and_the_probe_goes_remote_without_moving_state():
    actions, state = _run([18.88e6] * 3)
    open_health = Health(remote_allowed=False, breaker="open", local_ms=400.0)
    a, state2 = policy(_est(18.88e6), FRONT, open_health, state, 1.0, config=CFG)
    assert a.kind == LOCAL and a.switched and "breaker open" in a.reason
    probe = Health(remote_allowed=True, probe=True, breaker="half_open", local_ms=400.0)
    p, state3 = policy(_est(18.88e6), FRONT, probe, state2, 3.0, config=CFG)
    assert p.kind == OFFLOAD and p.probe and state3 == state2


def test_cold_cuts_are_not_used():
    h = Health(local_ms=400.0, warm_cuts=frozenset({B.cut.key}))
    (a,), _ = _run([18.88e6], health=h)
    assert a.plan_key == B.key
    (none,), _ = _run([18.88e6], health=Health(local_ms=400.0, warm_cuts=frozenset()))
    assert none.kind == LOCAL and "no warm remote plan" in none.reason


def test_local_wins_when_faster_and_without_frontier():
    (a,), _ = _run([18.88e6], health=Health(local_ms=10.0))
    assert a.kind == LOCAL
    b, _ = policy(_est(18.88e6), None, HEALTH, PolicyState(), 0.0, config=CFG)
    assert b.kind == LOCAL


def test_no_estimate_uses_the_range_middle_and_rtt_replaces_the_plans():
    a, _ = policy(LinkEstimate(None, None, None, 0, None, None), FRONT, HEALTH, PolicyState(), 0.0, config=CFG)
    assert a.kind == OFFLOAD and "unknown" in a.reason
    near, _ = policy(_est(18.88e6, rtt_ms=5.0), FRONT, HEALTH, PolicyState(), 0.0, config=CFG)
    far, _ = policy(_est(18.88e6, rtt_ms=105.0), FRONT, HEALTH, PolicyState(), 0.0, config=CFG)
    assert math.isclose(far.predicted_ms - near.predicted_ms, 100.0)


def test_energy_objective_compares_joules():
    cfg = PolicyConfig(objective="energy")
    (a,), _ = _run([18.88e6], cfg=cfg, health=Health(local_ms=40.0))
    # local: 2 W * 40 ms = 0.08 J; remote plans' breakdowns carry 0 J here, so offload wins on energy
    assert a.kind == OFFLOAD and " J " in a.reason


def test_action_and_state_json_round_trip():
    (a,), state = _run([1.1e6])
    assert Action.from_json(a.to_json()) == a
    assert PolicyState.from_json(state.to_json()) == state


def test_load_that_saturates_the_uplink_rules_a_plan_out():
    # At 18.88 Mbit/s A uploads 50 kB in 21 ms: 10 rps loads the uplink to 0.21, 50 rps past 0.9.
    light, _ = policy(_est(18.88e6), FRONT, Health(local_ms=400.0, arrival_rps=10.0), PolicyState(), 0.0, config=CFG)
    idle, _ = policy(_est(18.88e6), FRONT, Health(local_ms=400.0), PolicyState(), 0.0, config=CFG)
    heavy, _ = policy(_est(18.88e6), FRONT, Health(local_ms=400.0, arrival_rps=50.0), PolicyState(), 0.0, config=CFG)
    assert light.plan_key == A.key and light.predicted_ms > idle.predicted_ms  # queueing delay added
    assert heavy.plan_key == B.key  # A would saturate the uplink; B's 10 kB still fits


# -- measured correction and reversals ---------------------------------------------------------

CLOUD_ONLY = Frontier("m", Objective.LATENCY, LinkRange(0.5e6, 1e9, 4.0, 20.0), (FrontierEntry(0.5e6, 1e9, A),),
                      compute_w=2.0, radio_tx_w=1.0)


def test_remote_factor_scales_remote_predictions_and_is_logged_in_the_reason():
    base, _ = policy(_est(5.85e6), CLOUD_ONLY, Health(local_ms=200.0), PolicyState(), 0.0, config=CFG)
    slow, _ = policy(_est(5.85e6), CLOUD_ONLY, Health(local_ms=200.0, remote_factor=3.0), PolicyState(), 0.0,
                     config=CFG)
    slower, _ = policy(_est(5.85e6), CLOUD_ONLY, Health(local_ms=1e4, remote_factor=3.0), PolicyState(), 0.0,
                       config=CFG)
    assert base.kind == OFFLOAD and math.isclose(slower.predicted_ms, 3 * base.predicted_ms)
    assert slow.kind == LOCAL  # 3 x ~93 ms > 200 ms
    # A measured-slow local path (the profile's 80 ms, measured x2.4) loses to the same link's remote.
    state = PolicyState()
    a, state = policy(_est(5.85e6), CLOUD_ONLY, Health(local_ms=80.0), state, 0.0, config=CFG)
    assert a.kind == LOCAL
    h = Health(local_ms=192.0, local_factor=2.4)
    b, state = policy(_est(5.85e6), CLOUD_ONLY, h, state, 2.0, config=CFG)
    assert b.kind == OFFLOAD and b.switched and "local x2.40" in b.reason


def _closed_loop(cfg, seconds=30.0, hz=10.0, forget=False):
    """The demo's recovery loop: offloading raises the request rate (answers come sooner and the
    app's window refills) until the uplink saturates and the plan is ruled out; locally the rate
    falls, and the plan fits again. Locally the device is busy under 0.6 of the time, so the
    policy takes the app's rate as it is (test_edge_policy_risk.py has the busy device)."""
    state, switches, t = PolicyState(current=LOCAL, switched_s=-100.0, previous=A.key), [], 0.0
    for i in range(int(seconds * hz)):
        t = i / hz
        rps = 14.0 if state.current == A.key else 1.4  # A's 68 ms upload at 5.85 Mbit/s: 14 rps > 0.9
        if forget:  # the policy before back-off: no reversal is ever counted
            state = dataclasses.replace(state, reversals=0)
        a, state = policy(_est(5.85e6), CLOUD_ONLY, Health(local_ms=400.0, arrival_rps=rps), state, t, config=cfg)
        if a.switched:
            switches.append(t)
    return switches, state


def test_reversals_back_off_instead_of_flipping_every_request():
    naive, _ = _closed_loop(CFG, forget=True)
    damped, state = _closed_loop(CFG)
    assert len(naive) > 100  # flips at every request: saturated -> local -> fits again -> offload
    assert len(damped) <= 10 and state.reversals >= 3
    # Each return to the option just left waits twice as long as the one before.
    returns = [b - a for a, b in zip(damped[1::2], damped[2::2])]
    assert len(returns) >= 3 and all(later > 1.5 * earlier for earlier, later in zip(returns, returns[1:]))


def test_holding_an_option_past_its_back_off_and_the_flap_window_clears_the_reversals():
    state = PolicyState(current=A.key, switched_s=0.0, switches=5, previous=LOCAL, reversals=3)
    # Local is urgent-cheaper, but returning to it after 3 reversals waits 8 s...
    heavy = Health(local_ms=20.0)
    a, state = policy(_est(5.85e6), CLOUD_ONLY, heavy, state, 4.0, config=CFG)
    assert a.kind == OFFLOAD and "dwell 8 s" in a.reason
    a, state = policy(_est(5.85e6), CLOUD_ONLY, heavy, state, 8.0, config=CFG)
    assert a.kind == LOCAL and a.switched and state.reversals == 4
    # ... and a switch after holding past the back-off (now 16 s) and flap_window_s starts counting afresh.
    a, state = policy(_est(5.85e6), CLOUD_ONLY, Health(local_ms=400.0), state, 8.0 + 16.0 + CFG.flap_window_s,
                      config=CFG)
    assert a.kind == OFFLOAD and a.switched and state.reversals == 0
    assert PolicyState.from_json(state.to_json()) == state


def test_breaker_probe_is_declined_when_local_is_predicted_cheaper():
    probe = Health(remote_allowed=True, probe=True, breaker="half_open", local_ms=400.0)
    state = PolicyState(current=LOCAL, switched_s=0.0)
    slow, state2 = policy(_est(0.05e6), FRONT, probe, state, 5.0, config=CFG)  # B would take ~1.6 s
    assert slow.kind == LOCAL and not slow.probe and state2 == state
    fast, _ = policy(_est(18.88e6), FRONT, probe, state, 5.0, config=CFG)
    assert fast.kind == OFFLOAD and fast.probe


# -- trials, re-evaluation without a request, and recovery after an outage ---------------------

def _backed_off_local(t=0.0):
    """Local after two quick reversals: a return to A now waits 4 s (dwell x 2^2)."""
    return PolicyState(current=LOCAL, switched_s=t, switches=4, previous=A.key, reversals=2)


def test_a_held_back_remote_option_gets_one_trial_request_per_interval():
    state, h = _backed_off_local(), Health(local_ms=400.0)  # A at 5.85 Mbit/s: ~93 ms, over 4x faster
    a, s1 = policy(_est(5.85e6), CLOUD_ONLY, h, state, 1.5, config=CFG)
    assert a.kind == OFFLOAD and a.trial and not a.switched and a.plan_key == A.key
    assert "trial" in a.reason and "5.85 Mbit/s" in a.reason
    assert (s1.current, s1.reversals, s1.switched_s, s1.trial_s) == (LOCAL, 2, 0.0, 1.5)
    b, s2 = policy(_est(5.85e6), CLOUD_ONLY, h, s1, 2.0, config=CFG)  # inside trial_every_s
    assert b.kind == LOCAL and not b.trial and s2 == s1
    c, _ = policy(_est(5.85e6), CLOUD_ONLY, h, s1, 1.5 + CFG.trial_every_s, config=CFG)
    assert c.trial and Action.from_json(c.to_json()) == c


def test_no_trial_without_a_request_or_without_a_clear_win():
    state = _backed_off_local()
    r, s = policy(_est(5.85e6), CLOUD_ONLY, Health(local_ms=400.0, request=False), state, 1.5, config=CFG)
    assert r.kind == LOCAL and not r.trial and s == state
    # 120 ms local vs A's ~93 ms: better by the hysteresis, but not 1.5x: the back-off holds, no trial.
    m, s = policy(_est(5.85e6), CLOUD_ONLY, Health(local_ms=120.0), state, 1.5, config=CFG)
    assert m.kind == LOCAL and not m.trial and s == state and "dwell 4 s" in m.reason


def test_a_trial_that_beats_local_clears_the_back_off_and_the_next_request_switches():
    h = Health(local_ms=400.0)
    a, state = policy(_est(5.85e6), CLOUD_ONLY, h, _backed_off_local(), 1.5, config=CFG)
    assert a.trial
    assert after_trial(state, 380.0, 400.0, config=CFG) == state  # not 15 % better: proves nothing
    won = after_trial(state, 120.0, 400.0, config=CFG)
    assert won.reversals == 0 and won.current == LOCAL
    b, s = policy(_est(5.85e6), CLOUD_ONLY, h, won, 1.6, config=CFG)
    assert b.kind == OFFLOAD and b.switched and s.current == A.key


def test_a_reevaluation_without_a_request_switches_after_a_step_and_takes_no_probe():
    _, state = policy(_est(18.88e6), FRONT, HEALTH, PolicyState(), 0.0, config=CFG)
    a, state = policy(_est(1.1e6), FRONT, dataclasses.replace(HEALTH, request=False), state, 5.0, config=CFG)
    assert a.switched and a.plan_key == B.key and state.current == B.key and state.switched_s == 5.0
    probe = Health(probe=True, breaker="half_open", local_ms=400.0, request=False)
    p, s = policy(_est(18.88e6), FRONT, probe, state, 5.1, config=CFG)
    assert not p.probe and s == state  # within the dwell: kept, and no probe spent


def test_scripted_outage_and_recovery_through_the_monitor_and_the_policy():
    """18.88 -> 1.1 -> outage -> 5.85 Mbit/s: samples while offloading, failed reachability checks
    while local, then one probe sample; the plan follows a step down `hold_s` after the sample
    that shows it, and a step up at that sample."""
    from edge_agent.monitor import LinkMonitor

    mon, state, t, plans = LinkMonitor(), PolicyState(), 0.0, []
    hold_s = mon.config.hold_s

    def decide(now, remote_allowed=True, request=True):
        nonlocal state
        h = Health(remote_allowed=remote_allowed, local_ms=400.0, request=request)
        a, state = policy(mon.estimate(now), FRONT, h, state, now, config=CFG)
        plans.append((now, a.plan_key, a.switched))
        return a

    for i in range(30):  # 18.88 Mbit/s: 10 Hz samples
        t = i / 10
        mon.observe_rate(18.88e6, t)
        assert decide(t).plan_key == A.key
    for i in range(20):  # 1.1 Mbit/s: the CUSUM sees it at the first sample, the plan hold_s later
        t = 3.0 + i / 10
        mon.observe_rate(1.1e6, t)
        assert decide(t).plan_key == (B.key if t >= 3.0 + hold_s - 1e-9 else A.key), t
    # Outage: the breaker opens (local), and the idle-link checks fail every half second.
    assert decide(5.0, remote_allowed=False).plan_key == LOCAL
    ups = []
    for i in range(20):
        mon.observe_unreachable(5.0 + 0.5 * i)
        ups.append(mon.estimate().up_bps)
        assert decide(5.0 + 0.5 * i, remote_allowed=False, request=False).plan_key == LOCAL
    assert all(b < a for a, b in zip(ups, ups[1:10])) and ups[-1] < 1.1e6 / 1000  # towards 0
    # The link is back: a check answers, the probe measures 5.85 Mbit/s, and a re-evaluation (no
    # request waiting) switches at that instant: B at 5.85 (~67 ms) is over 5x faster than local.
    mon.observe_rtt(50.0, 15.2)
    assert mon.observe_rate(5.85e6, 15.3) is True
    a = decide(15.3, request=False)
    assert a.switched and a.plan_key == B.key and "5.85 Mbit/s" in a.reason
    assert decide(15.4).plan_key == B.key
    assert [k for _, k, s in plans if s] == [A.key, B.key, LOCAL, B.key]
