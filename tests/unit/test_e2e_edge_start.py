"""The e2e bench starts its edge child again when it dies before ``ready``."""

from __future__ import annotations

import pytest

import bench._e2e_run as run


def test_a_child_that_dies_at_start_is_started_again_and_each_failure_is_noted(monkeypatch):
    starts: list[int] = []

    class Flaky:
        def __init__(self, address, model, setup):
            starts.append(1)
            if len(starts) < 3:
                raise RuntimeError("the edge child did not start (said '', exit code 1)")

    monkeypatch.setattr(run, "_Edge", Flaky)
    monkeypatch.setattr(run.time, "sleep", lambda s: None)
    notes: list[str] = []
    edge = run._start_edge("127.0.0.1:1", "m", {}, notes, say=lambda s: None)
    assert isinstance(edge, Flaky) and len(starts) == 3
    assert [n.split(":")[0] for n in notes] == ["edge child start 1 of 3 failed", "edge child start 2 of 3 failed"]


def test_a_child_that_never_starts_raises_after_the_last_try(monkeypatch):
    monkeypatch.setattr(run.time, "sleep", lambda s: None)
    # a real child given a set-up it cannot read dies before "ready"
    monkeypatch.setattr(run, "_child_env", lambda: {"PATH": "", "PYTHONPATH": "/nonexistent"})
    notes: list[str] = []
    with pytest.raises(RuntimeError, match="did not start"):
        run._start_edge("127.0.0.1:1", "m", {}, notes, say=lambda s: None, tries=2)
    assert len(notes) == 2
