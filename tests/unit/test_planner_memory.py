"""Head memory: weights plus the partitioner's arena peak, or the planner's own sweep."""

from __future__ import annotations

import random
import sys

import pytest

from partitioner.cuts import random_cut
from partitioner.memplan import plan_memory
from partitioner.synthetic import make_random_graph
from planner.memory import _peak_live_bytes, head_memory_bytes


@pytest.mark.parametrize("seed", range(12))
def test_head_memory_is_weights_plus_the_arena_peak(seed: int) -> None:
    g = make_random_graph(12, seed=seed)
    cut = random_cut(g, random.Random(seed))
    params = sum(g.layers[v].param_bytes for v in cut.device)
    expect = params + plan_memory(g, sorted(cut.device)).peak_bytes if cut.device else 0
    assert head_memory_bytes(g, cut.device) == expect


@pytest.mark.parametrize("seed", range(12))
def test_fallback_sweep_never_undercuts_the_live_lower_bound(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    g = make_random_graph(10, seed=seed)
    device = frozenset(range(1 + seed % 10))
    lower = plan_memory(g, sorted(device)).lower_bound_bytes
    assert _peak_live_bytes(g, device) >= lower
    monkeypatch.setitem(sys.modules, "partitioner.memplan", None)  # import now fails
    params = sum(g.layers[v].param_bytes for v in device)
    assert head_memory_bytes(g, device) == params + _peak_live_bytes(g, device)


def test_empty_head_needs_nothing() -> None:
    g = make_random_graph(4, seed=0)
    assert head_memory_bytes(g, ()) == 0 and _peak_live_bytes(g, frozenset()) == 0
