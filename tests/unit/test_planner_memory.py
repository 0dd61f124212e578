"""Head memory: weights plus the partitioner's arena peak."""

from __future__ import annotations

import random

import pytest

from partitioner.cuts import random_cut
from partitioner.memplan import plan_memory
from partitioner.synthetic import make_random_graph
from planner.memory import head_memory_bytes


@pytest.mark.parametrize("seed", range(12))
def test_head_memory_is_weights_plus_the_arena_peak(seed: int) -> None:
    g = make_random_graph(12, seed=seed)
    cut = random_cut(g, random.Random(seed))
    params = sum(g.layers[v].param_bytes for v in cut.device)
    expect = params + plan_memory(g, sorted(cut.device)).peak_bytes if cut.device else 0
    assert head_memory_bytes(g, cut.device) == expect


def test_empty_head_needs_nothing() -> None:
    g = make_random_graph(4, seed=0)
    assert head_memory_bytes(g, ()) == 0
