"""The policy under a loaded cloud, with time passed in: a reported queue wait is the plan's
queue term (a loaded pool moves the device to a deeper edge cut, then local, and back as the
wait falls, without flapping), and a refusal's retry-after takes its cut out until it ends.
`CloudLoad` drains reported waits and bounds retry-after hints."""

import dataclasses
import math
import random

from edge_agent.cloud_load import DEFAULT_RETRY_AFTER_MS, MAX_RETRY_AFTER_MS, CloudLoad
from edge_agent.monitor import LinkEstimate
from edge_agent.policy import LOCAL, OFFLOAD, Health, PolicyConfig, PolicyState, policy
from partitioner import Cut
from planner import Breakdown, Encoding, Frontier, FrontierEntry, Link, LinkRange, Objective, Plan

REF = Link(10e6, 40e6, 20.0)


def _plan(layers, boundary_bytes, edge_ms, cloud_ms):
    up_ms = boundary_bytes * 8 / REF.up_bps * 1e3
    b = Breakdown(edge_ms=edge_ms, encode_ms=0.0, uplink_ms=up_ms, rtt_ms=REF.rtt_ms, queue_ms=0.0,
                  cloud_ms=cloud_ms, downlink_ms=0.0, total_ms=edge_ms + up_ms + REF.rtt_ms + cloud_ms, energy_j=0.0,
                  bottleneck="uplink", tier_ms=(edge_ms, cloud_ms), tier_codec_ms=(0.0, 0.0), hop_up_ms=(up_ms,),
                  hop_down_ms=(0.0,))
    return Plan("m", (Cut(frozenset(layers)),), Encoding(), Objective.LATENCY, REF, b, ("t",))


# A: cloud-only (46 ms at 18.88 Mbit/s); B: two layers here, a small boundary (57 ms). Local: 400 ms.
A = _plan([], 50_000, 0.0, 5.0)
B = _plan([0, 1], 10_000, 30.0, 3.0)
A_CUT, B_CUT = A.cut.key, B.cut.key
FRONT = Frontier("m", Objective.LATENCY, LinkRange(0.5e6, 1e9, 4.0, 20.0),
                 (FrontierEntry(0.5e6, 8e6, B), FrontierEntry(8e6, 1e9, A)))
CFG = PolicyConfig(hysteresis=0.15, dwell_s=1.0)
EST = LinkEstimate(18.88e6, 75.5e6, 20.0, 10, 0.0, None)


def _run(steps, hz=10.0):
    """steps: (queue_ms, refused_until_s) per request at `hz`; returns the actions and the last state."""
    state, actions = PolicyState(), []
    for i, (queue, refused) in enumerate(steps):
        health = Health(local_ms=400.0, queue_ms=queue, refused_until_s=refused)
        a, state = policy(EST, FRONT, health, state, i / hz, config=CFG)
        actions.append(a)
    return actions, state


def _runs(keys):
    return [k for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k]


def test_a_loaded_pool_moves_to_a_deeper_cut_then_local_and_back_as_the_wait_falls():
    idle, a_loaded, both_loaded = {}, {A_CUT: 300.0}, {A_CUT: 600.0, B_CUT: 600.0}
    steps = [(idle, {})] * 20 + [(a_loaded, {})] * 30 + [(both_loaded, {})] * 30 + [(idle, {})] * 40
    actions, state = _run(steps)
    keys = [a.plan_key for a in actions]
    assert _runs(keys) == [A.key, B.key, LOCAL, A.key]
    assert keys[20] == B.key  # at once: B costs under half of A with A's queue
    to_local = keys.index(LOCAL)
    assert to_local == 50  # local is over the 15% hysteresis cheaper, and B was held past the 1 s dwell
    assert "cloud queue" in actions[to_local].reason and "600 ms" in actions[to_local].reason
    assert keys[80] == A.key  # the wait is gone: A (46 ms) is urgent against local (400 ms)
    assert state.switches == 3
    assert actions[20].predicted_ms > 0 and all(a.kind == OFFLOAD for a in actions[:50])


def test_a_queue_wait_that_jitters_around_the_break_even_does_not_flap():
    rng = random.Random(7)
    # Remote at ~350-400 ms of queue costs about local's 400 ms: inside the hysteresis.
    steps = [({A_CUT: w, B_CUT: w}, {}) for w in (rng.uniform(330.0, 370.0) for _ in range(300))]
    actions, state = _run(steps)
    assert state.switches <= 1
    assert len(_runs([a.plan_key for a in actions])) <= 2


def test_the_queue_term_replaces_the_plans_batch_fill_wait_where_larger():
    b = B.breakdown
    batched = Plan("m", B.cuts, Encoding(), Objective.LATENCY, REF,
                   dataclasses.replace(b, queue_ms=50.0, total_ms=b.total_ms + 50.0), ("t",))
    front = Frontier("m", Objective.LATENCY, LinkRange(0.5e6, 1e9, 4.0, 20.0), (FrontierEntry(0.5e6, 1e9, batched),))

    def ms(wait):
        a, _ = policy(EST, front, Health(local_ms=math.inf, queue_ms={B_CUT: wait}), PolicyState(), 0.0, config=CFG)
        return a.predicted_ms

    assert ms(30.0) == ms(0.0)  # within the plan's own 50 ms
    assert math.isclose(ms(80.0), ms(0.0) + 30.0)


def test_the_queue_wait_is_the_clouds_figure_not_scaled_by_the_remote_factor():
    front = Frontier("m", Objective.LATENCY, LinkRange(0.5e6, 1e9, 4.0, 20.0), (FrontierEntry(0.5e6, 1e9, A),))

    def act(factor, wait):
        health = Health(local_ms=math.inf, remote_factor=factor, queue_ms={A_CUT: wait})
        return policy(EST, front, health, PolicyState(), 0.0, config=CFG)[0]

    base = act(1.0, 0.0).predicted_ms
    loaded = act(2.0, 300.0)
    assert math.isclose(loaded.predicted_ms, 2.0 * base + 300.0) and loaded.queue_ms == 300.0
    assert act(2.0, 0.0).queue_ms == 0.0


def test_a_refused_cut_is_no_option_until_its_retry_after_ends():
    refused_a = {A_CUT: 1.5}
    refused_both = {A_CUT: 1.5, B_CUT: 1.5}
    actions, _ = _run([({}, {})] * 5 + [({}, refused_a)] * 5 + [({}, refused_both)] * 5 + [({}, refused_both)] * 10)
    keys = [a.plan_key for a in actions]
    assert keys[:5] == [A.key] * 5
    assert keys[5] == B.key and actions[5].switched  # the current plan is unavailable: no dwell
    assert "refused for load" in actions[5].reason
    assert keys[10] == LOCAL and "the cloud refused every warm plan for load" in actions[10].reason
    assert keys[15] == A.key  # 1.5 s: the retry-after is over, and A is urgent against local


def test_cloud_load_drains_a_reported_wait_at_one_ms_per_ms():
    load = CloudLoad()
    load.observe_wait("c", 1000.0, 10.0)
    assert math.isclose(load.queue_ms(10.4)["c"], 600.0)
    assert load.queue_ms(11.1) == {}
    for bad in (-1.0, math.nan, math.inf):
        load.observe_wait("c", bad, 12.0)
    assert load.queue_ms(12.0) == {}


def test_cloud_load_holds_a_cut_off_for_the_hint_bounded_and_defaulted():
    load = CloudLoad()
    assert load.refuse("a", 250.0, 0.0) == 250.0
    assert load.refused_until_s(0.2) == {"a": 0.25} and math.isclose(load.queue_ms(0.2)["a"], 50.0)
    assert load.refused_until_s(0.25) == {}
    assert load.refuse("b", None, 1.0) == DEFAULT_RETRY_AFTER_MS
    assert load.refuse("b", math.nan, 1.0) == DEFAULT_RETRY_AFTER_MS
    assert load.refuse("c", 1e9, 1.0) == MAX_RETRY_AFTER_MS
    assert load.refusals == 4
    # A shorter hint never shortens a hold-off already running.
    load.refuse("c", 10.0, 2.0)
    assert load.refused_until_s(2.0)["c"] == 1.0 + MAX_RETRY_AFTER_MS / 1e3
    assert set(load.to_dict(2.0)) == {"queue_ms", "utilisation", "refusals", "retry_after_ms"}


def test_under_the_energy_objective_the_device_idles_through_the_queue_wait():
    front = Frontier("m", Objective.ENERGY, LinkRange(0.5e6, 1e9, 4.0, 20.0), (FrontierEntry(0.5e6, 1e9, A),),
                     compute_w=2.0, idle_w=0.5)
    cfg = PolicyConfig(objective="energy")

    def act(wait):
        return policy(EST, front, Health(local_ms=400.0, queue_ms={A_CUT: wait}), PolicyState(), 0.0, config=cfg)[0]

    assert act(0.0).kind == OFFLOAD  # ~0 J against 2 W * 0.4 s
    assert act(2000.0).kind == LOCAL  # 0.5 W * 2 s idle waiting costs more than 0.8 J of compute
