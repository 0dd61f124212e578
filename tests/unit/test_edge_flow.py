"""The request state machine: one test per transition, and the exactly-once guarantee."""

import itertools

import pytest

from edge_agent.flow import EVENTS, STATES, TRANSITIONS, FlowError, RequestFlow


def _at(*events, fallback_local=True) -> RequestFlow:
    f = RequestFlow("r", fallback_local=fallback_local)
    for e in events:
        f.fire(e)
    return f


CASES = [
    # (events before, event, expected state, delivers)
    ((), "local", "local", False),
    ((), "offload", "head", False),
    (("offload",), "head_done", "remote", False),
    (("offload",), "head_error", "local", False),
    (("offload",), "encode_error", "local_tail", False),
    (("offload", "head_done"), "remote_ok", "answered", True),
    (("offload", "head_done"), "remote_error", "local_tail", False),
    (("offload", "head_done"), "remote_timeout", "local_tail", False),
    (("offload", "head_done"), "remote_cancelled", "local_tail", False),
    (("local",), "local_done", "answered", True),
    (("local",), "local_error", "failed", True),
    (("offload", "head_done", "remote_timeout"), "local_done", "answered", True),
    (("offload", "head_done", "remote_timeout"), "local_error", "failed", True),
    (("offload", "head_done", "remote_timeout"), "remote_ok", "answered", True),
    (("offload", "head_done", "remote_timeout"), "remote_error", "local_tail", False),
    (("offload", "head_done", "remote_error"), "remote_timeout", "local_tail", False),
    (("offload", "head_done", "remote_timeout"), "remote_cancelled", "local_tail", False),
]


@pytest.mark.parametrize("before,event,state,delivers", CASES, ids=[f"{c[1]}@{'/'.join(c[0]) or 'new'}" for c in CASES])
def test_each_transition(before, event, state, delivers):
    f = _at(*before)
    step = f.fire(event)
    assert (step.state, step.delivers, step.late) == (state, delivers, False)


def test_table_is_covered_by_the_cases():
    covered = set()
    for before, event, _, _ in CASES:
        covered.add((_at(*before).state, event))
    assert set(TRANSITIONS) <= covered


@pytest.mark.parametrize("event", ["remote_error", "remote_timeout", "remote_cancelled"])
def test_fallback_none_answers_with_the_error(event):
    step = _at("offload", "head_done", fallback_local=False).fire(event)
    assert (step.state, step.delivers) == ("failed", True)


def test_late_remote_answer_after_local_is_dropped():
    f = _at("offload", "head_done", "remote_timeout", "local_done")
    step = f.fire("remote_ok")
    assert step.late and not step.delivers and f.state == "answered" and f.answered_by == "local_done"


def test_local_tail_after_remote_won_is_dropped():
    f = _at("offload", "head_done", "remote_timeout", "remote_ok")
    step = f.fire("local_done")
    assert step.late and f.answered_by == "remote_ok"


def test_impossible_and_unknown_events_raise():
    with pytest.raises(FlowError, match="cannot happen"):
        _at().fire("remote_ok")
    with pytest.raises(FlowError, match="unknown event"):
        _at().fire("teleport")


def test_exactly_one_delivery_on_every_event_order():
    # Every ordering of the racing results after the remote call starts delivers exactly once.
    racing = ["remote_ok", "remote_timeout", "local_done"]
    for order in itertools.permutations(racing):
        f = _at("offload", "head_done")
        delivered = 0
        for e in order:
            if f.state == "remote" and e == "local_done":
                continue  # the local tail only runs after a fallback
            delivered += f.fire(e).delivers
        assert delivered == 1, order
    assert set(STATES) >= {"new", "answered"} and "local_done" in EVENTS
