"""Minimum s-t cut on float capacities.

`min_cut` runs a few phases of Dinic's algorithm, which finish the easy networks
(short augmenting paths: a fast link, a slow device), then hands the residual network
to FIFO push-relabel when the phases or the augmenting work run out. At a low
bandwidth the boundary costs more than any layer, the flow must travel down long
chains of layers, and Dinic would pay one BFS phase per layer of depth;
push-relabel moves the flow in a forward wave instead, seeded by a greedy pass along
the data flow (``order``). Only push-relabel's first phase runs: once no node that
can still reach the sink holds excess, the nodes that cannot reach it are a minimum
cut's source side.

`min_cut_dinic` (Dinic alone) and `max_flow_edmonds_karp` (one BFS per augmenting
path, DADS's textbook solver) are independent implementations kept for tests and the
benchmark. All are pure Python on flat lists: the planner's networks are sparse.
Infinite capacities (``math.inf``) are allowed on arcs that never form an s-t path
by themselves.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import numpy as np

__all__ = ["min_cut", "min_cut_dinic", "max_flow_edmonds_karp"]

_DINIC_PHASES = 6
"""Phases `min_cut` gives Dinic before it switches to push-relabel."""
_DINIC_WORK = 2
"""...and the arc steps of augmenting paths, per arc of the network."""


def _csr(n: int, tails: Sequence[int], heads: Sequence[int], caps: Sequence[float]
         ) -> tuple[list[int], list[float], list[int], list[int], float]:
    """Arcs 2e (forward) and 2e+1 (residual reverse), grouped by tail node, and eps."""
    t = np.asarray(tails, dtype=np.int64)
    h = np.asarray(heads, dtype=np.int64)
    c = np.asarray(caps, dtype=float)
    m = len(t)
    frm = np.empty(2 * m, dtype=np.int64)
    to = np.empty(2 * m, dtype=np.int64)
    cap = np.zeros(2 * m)
    frm[0::2], frm[1::2] = t, h
    to[0::2], to[1::2] = h, t
    cap[0::2] = c
    order = np.argsort(frm, kind="stable")
    start = np.searchsorted(frm[order], np.arange(n + 1))
    finite = c[np.isfinite(c)]
    eps = (float(finite.max()) if len(finite) else 1.0) * 1e-12
    return to.tolist(), cap.tolist(), order.tolist(), start.tolist(), eps


def _reachable_to(n: int, to: list[int], cap: list[float], adj: list[int], start: list[int], t: int,
                  eps: float) -> np.ndarray:
    """Nodes that can reach ``t`` in the residual network."""
    seen = np.zeros(n, dtype=bool)
    seen[t] = True
    q = [t]
    for v in q:
        for idx in range(start[v], start[v + 1]):
            a = adj[idx]
            w = to[a]
            if not seen[w] and cap[a ^ 1] > eps:
                seen[w] = True
                q.append(w)
    return seen


def _dinic(n: int, to: list[int], cap: list[float], adj: list[int], start: list[int], s: int, t: int,
           eps: float, max_phases: int | None, max_work: int | None = None) -> tuple[float, np.ndarray | None]:
    """Dinic phases; (flow, source side) when done, (flow, None) when out of phases
    or when the augmenting paths have cost more than ``max_work`` arc steps (long
    paths: push-relabel's job). The flow so far is always a valid flow."""
    total = 0.0
    phases = 0
    work = 0
    while True:
        level = [-1] * n
        level[s] = 0
        q = [s]
        qi = 0
        lt = -1
        while qi < len(q):
            u = q[qi]
            qi += 1
            lu = level[u]
            if lt >= 0 and lu >= lt:
                break
            nl = lu + 1
            for idx in range(start[u], start[u + 1]):
                a = adj[idx]
                if cap[a] > eps:
                    v = to[a]
                    if level[v] < 0:
                        level[v] = nl
                        if v == t:
                            lt = nl
                        q.append(v)
        if level[t] < 0:
            return total, np.array([x >= 0 for x in level])
        if max_phases is not None and phases >= max_phases:
            return total, None
        phases += 1
        it = start[:]
        path: list[int] = []
        u = s
        while True:
            if u == t:
                f = min(cap[a] for a in path)
                k = -1
                for j, a in enumerate(path):
                    cap[a] -= f
                    cap[a ^ 1] += f
                    if k < 0 and cap[a] <= eps:
                        k = j
                total += f
                work += len(path)
                if k < 0:  # an all-infinite path: cannot happen in the planner's networks
                    k = 0
                del path[k:]
                if max_work is not None and work > max_work:
                    return total, None
                u = s if k == 0 else to[path[k - 1]]
                continue
            i = it[u]
            end = start[u + 1]
            nl = level[u] + 1
            while i < end:
                a = adj[i]
                if cap[a] > eps and level[to[a]] == nl:
                    break
                i += 1
            it[u] = i
            if i < end:
                a = adj[i]
                path.append(a)
                u = to[a]
            else:
                level[u] = -1
                if not path:
                    break
                a = path.pop()
                u = to[a ^ 1]
                it[u] += 1


def _rooms(n: int, to: list[int], cap: list[float], adj: list[int], start: list[int], s: int, t: int,
           eps: float, order: Sequence[int], rank: list[int], widest: bool) -> list[float]:
    """What each node and the nodes below it could still absorb: along the single best
    path (``widest``, an under-estimate) or summed over all successors (an
    over-estimate where branches share descendants)."""
    room = [0.0] * n
    for u in reversed(order):
        ru = rank[u]
        r = 0.0
        best = 0.0
        for idx in range(start[u], start[u + 1]):
            a = adj[idx]
            c = cap[a]
            if c > eps:
                v = to[a]
                if v == t:
                    r += c
                elif rank[v] > ru and v != s:
                    rv = room[v]
                    if rv > c:
                        rv = c
                    if widest:
                        if rv > best:
                            best = rv
                    else:
                        best += rv
        room[u] = r + best
    return room


def _greedy(n: int, to: list[int], cap: list[float], adj: list[int], start: list[int], s: int, t: int,
            eps: float, excess: list[float], order: Sequence[int]) -> None:
    """Push excess forward along ``order``, to the sink first, within each node's room.

    The room keeps the pass from flooding branches that push-relabel would then have
    to drain. A first pass uses the cautious best-path room; a second pass moves what
    is left with the generous summed room.
    """
    rank = [n] * n
    for r, v in enumerate(order):
        rank[v] = r
    rank[t] = -1
    for widest in (True, False):
        room = _rooms(n, to, cap, adj, start, s, t, eps, order, rank, widest)
        moved = False
        for u in order:
            e = excess[u]
            if e <= eps:
                continue
            ru = rank[u]
            for idx in range(start[u], start[u + 1]):
                a = adj[idx]
                if to[a] == t and cap[a] > eps:
                    d = e if e < cap[a] else cap[a]
                    cap[a] -= d
                    cap[a ^ 1] += d
                    excess[t] += d
                    e -= d
                    break
            if e > eps:
                for idx in range(start[u], start[u + 1]):
                    a = adj[idx]
                    c = cap[a]
                    v = to[a]
                    if c > eps and rank[v] > ru and v != s:
                        rv = room[v]
                        if rv <= eps:
                            continue
                        d = e if e < c else c
                        if d > rv:
                            d = rv
                        cap[a] = c - d
                        cap[a ^ 1] += d
                        excess[v] += d
                        room[v] = rv - d
                        e -= d
                        moved = True
                        if e <= eps:
                            break
            excess[u] = e
        if not any(excess[u] > eps for u in order):
            break


def _push_relabel(n: int, to: list[int], cap: list[float], adj: list[int], start: list[int], s: int, t: int,
                  eps: float, order: Sequence[int] | None) -> tuple[float, np.ndarray]:
    excess = [0.0] * n
    height = [n] * n

    def global_relabel() -> None:
        for v in range(n):
            height[v] = n
        height[t] = 0
        q = [t]
        for v in q:
            hv = height[v] + 1
            for idx in range(start[v], start[v + 1]):
                a = adj[idx]
                w = to[a]
                if height[w] == n and w != s and cap[a ^ 1] > eps:
                    height[w] = hv
                    q.append(w)
        height[s] = n

    for idx in range(start[s], start[s + 1]):
        a = adj[idx]
        c = cap[a]
        if c > eps:
            if c == math.inf:  # a pinned layer: more than any cut can carry
                c = sum(x for x in cap if x != math.inf)
            cap[a] -= c
            cap[a ^ 1] += c
            excess[to[a]] += c
    if order is not None:
        _greedy(n, to, cap, adj, start, s, t, eps, excess, order)
    global_relabel()
    active = deque(v for v in range(n) if v != s and v != t and excess[v] > eps and height[v] < n)
    if not active:
        # the labels are exact distances: unlabelled nodes cannot reach the sink
        return excess[t], np.array([h >= n for h in height])
    queued = [False] * n
    for v in active:
        queued[v] = True
    it = start[:]
    relabels = 0
    while active:
        u = active.popleft()
        queued[u] = False
        hu = height[u]
        if hu >= n:
            continue
        e = excess[u]
        i = it[u]
        end = start[u + 1]
        while e > eps:
            if i == end:
                mh = 2 * n
                for idx in range(start[u], end):
                    a = adj[idx]
                    if cap[a] > eps:
                        hw = height[to[a]]
                        if hw < mh:
                            mh = hw
                hu = mh + 1 if mh + 1 < n else n
                height[u] = hu
                relabels += 1
                i = start[u]
                if hu >= n:
                    break
                continue
            a = adj[i]
            c = cap[a]
            if c > eps:
                v = to[a]
                if height[v] == hu - 1:
                    d = e if e < c else c
                    cap[a] = c - d
                    cap[a ^ 1] += d
                    e -= d
                    excess[v] += d
                    if v != t and not queued[v] and height[v] < n:
                        queued[v] = True
                        active.append(v)
                    if e <= eps:
                        break
            i += 1
        excess[u] = e
        it[u] = i
        if relabels > n // 8:
            relabels = 0
            global_relabel()
            it = start[:]
            for v in range(n):
                if v != s and v != t and excess[v] > eps and height[v] < n and not queued[v]:
                    queued[v] = True
                    active.append(v)
    return excess[t], ~_reachable_to(n, to, cap, adj, start, t, eps)


def min_cut(n: int, tails: Sequence[int], heads: Sequence[int], caps: Sequence[float], s: int, t: int,
            order: Sequence[int] | None = None) -> tuple[float, np.ndarray]:
    """Max flow value and the source side of a minimum cut.

    Nodes are 0..n-1; arc i goes tails[i] -> heads[i] with capacity caps[i] >= 0.
    ``order``, if given, is a topological order of the finite arcs (the data flow)
    for push-relabel's greedy first pass; any preflow is a valid start.
    """
    to, cap, adj, start, eps = _csr(n, tails, heads, caps)
    flow, side = _dinic(n, to, cap, adj, start, s, t, eps, _DINIC_PHASES, _DINIC_WORK * len(to))
    if side is not None:
        return flow, side
    more, side = _push_relabel(n, to, cap, adj, start, s, t, eps, order)
    return flow + more, side


def min_cut_dinic(n: int, tails: Sequence[int], heads: Sequence[int], caps: Sequence[float], s: int, t: int,
                  order: Sequence[int] | None = None) -> tuple[float, np.ndarray]:
    """Same contract as `min_cut`, by Dinic alone (the smallest source side).
    ``order`` is accepted for a common signature and ignored."""
    to, cap, adj, start, eps = _csr(n, tails, heads, caps)
    flow, side = _dinic(n, to, cap, adj, start, s, t, eps, None)
    assert side is not None
    return flow, side


def max_flow_edmonds_karp(n: int, tails: Sequence[int], heads: Sequence[int], caps: Sequence[float],
                          s: int, t: int, order: Sequence[int] | None = None) -> tuple[float, np.ndarray]:
    """Same contract as `min_cut`, one BFS per augmenting path (slow; a baseline).
    ``order`` is accepted for a common signature and ignored."""
    to, cap, adj, start, eps = _csr(n, tails, heads, caps)
    total = 0.0
    while True:
        parent = [-1] * n
        parent[s] = -2
        dq = deque([s])
        while dq and parent[t] == -1:
            u = dq.popleft()
            for idx in range(start[u], start[u + 1]):
                a = adj[idx]
                v = to[a]
                if cap[a] > eps and parent[v] == -1:
                    parent[v] = a
                    dq.append(v)
        if parent[t] == -1:
            break
        f = math.inf
        v = t
        while v != s:
            a = parent[v]
            f = min(f, cap[a])
            v = to[a ^ 1]
        v = t
        while v != s:
            a = parent[v]
            cap[a] -= f
            cap[a ^ 1] += f
            v = to[a ^ 1]
        total += f
    return total, np.array([p != -1 for p in parent])
