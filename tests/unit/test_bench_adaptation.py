"""bench.adaptation's per-step reading: when requests use the new link's plan, and when the agent switched."""

from bench.adaptation import _analyse


def _rec(t, by, cut=""):
    return {"sent_s": t, "served_by": by, "cut_id": cut, "latency_ms": 100.0}


def test_a_switch_after_requests_already_run_on_the_plan_is_still_the_decision():
    """At 10 s the link drops. The request at 10.1 s is still remote; from 10.4 s every request
    runs here (in a held drop, before the plan is left), and the agent switches to local at
    11.5 s: in use after 0.4 s, decided after 1.5 s."""
    records = [_rec(t / 10, "remote", "L") for t in range(0, 100, 3)]
    records += [_rec(10.1, "remote", "L")] + [_rec(10.4 + k * 0.3, "local") for k in range(20)]
    steps = [(0.0, "fast"), (10.0, "slow")]
    switches = [(0.0, "L:int8"), (11.5, "local")]
    first, slow = _analyse(records, steps, 20.0, switches)
    assert first["settled_plan"] == "L" and first["decision_s"] == 0.0
    assert slow["settled_plan"] == "local" and slow["stale_requests"] == 1
    assert abs(slow["adaptation_s"] - 0.4) < 1e-9 and abs(slow["decision_s"] - 1.5) < 1e-9
    # A re-evaluation that switched before any request used the plan is the decision.
    early = _analyse(records, steps, 20.0, [(0.0, "L:int8"), (10.2, "local"), (11.5, "local")])[1]
    assert abs(early["decision_s"] - 0.2) < 1e-9 and not early["already_on_plan"]
    # Already on the plan, no switch within the step: nothing to adapt.
    kept = _analyse([_rec(t / 10, "local") for t in range(200)], steps, 20.0, [(0.0, "local")])[1]
    assert kept["already_on_plan"] and kept["adaptation_s"] == 0.0 and kept["decision_s"] == 0.0
