"""cluster._pools.WorkerCount: a count the workers keep, summed across them and their restarts."""

from __future__ import annotations

from cluster._pools import WorkerCount


def test_counts_are_summed_over_replicas_and_kept_across_a_restart():
    c = WorkerCount()
    assert c.total == 0
    c.report(0, pid=100, count=3)
    c.report(1, pid=200, count=2)
    assert c.total == 5
    c.report(0, pid=100, count=4)  # the same process counts on
    assert c.total == 6
    c.report(0, pid=101, count=1)  # replica 0 restarted: its new process counts from 0
    assert c.total == 4 + 1 + 2
    c.report(1, pid=200, count=1)  # a count never goes back within one process
    assert c.total == 7
