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

On big networks (``_SCALED_MIN_ARCS`` arcs and more) `min_cut` first tries SciPy's
compiled Dinic (`_scaled_min_cut`): SciPy takes integer capacities only, so the
capacities are scaled and floored in a few rounds, and the cut it yields is kept only
when its exact capacity equals the flow's value to 1e-10 (weak duality: a
certificate, not a guess); otherwise, or without SciPy, the pure-Python path below answers. At a slow
link that is the difference between one compiled pass and Python spreading the
input's flow over thousands of layers.

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

_scipy: tuple | None = None
"""(scipy.sparse, scipy.sparse.csgraph), or () without SciPy; loaded on the first big network."""


def _load_scipy() -> tuple:
    """SciPy's sparse and csgraph modules, or () when SciPy is not installed.

    An optional speed-up (the `planner` extra): the pure-Python solvers below are complete
    without it. Imported on first use, not with the planner, because importing SciPy's
    csgraph takes about 0.2 s and the edge agent rarely solves a network big enough to use it.
    """
    global _scipy
    if _scipy is None:
        try:
            from scipy import sparse
            from scipy.sparse import csgraph
        except ImportError:
            _scipy = ()
        else:
            _scipy = (sparse, csgraph)
    return _scipy

__all__ = ["min_cut", "min_cut_dinic", "max_flow_edmonds_karp"]

_DINIC_PHASES = 6
"""Phases `min_cut` gives Dinic before it switches to push-relabel."""
_DINIC_WORK = 2
"""...and the arc steps of augmenting paths, per arc of the network."""

_SCALED_MIN_ARCS = 1000
"""Networks with fewer arcs than this skip the compiled path: its set-up costs more."""
_SCALED_ROUNDS = 4
"""Scaling rounds at most; each leaves under a 2**-30 part of the flow behind."""
_SCALE = float(1 << 30)
"""Integer capacities up to 2**30 leave int32 room for every flow sum."""
_CERTIFY_REL = 1e-10
"""How far a cut may exceed the flow it is certified by, relative to the flow."""


def _scaled_min_cut(n: int, tails: Sequence[int], heads: Sequence[int], caps: Sequence[float], s: int,
                    t: int) -> tuple[float, np.ndarray] | None:
    """A minimum cut by SciPy's compiled Dinic on integer-scaled capacities, or None.

    SciPy takes integer capacities only. Each round floors the residual capacities,
    scaled so the largest possible flow fits in int32, to integers; the integer
    flow, scaled back, fits under the float residuals, so the sum of the rounds is a
    valid flow. Each round leaves at most a 2**-30 part behind, so after a few the
    residual network, read with the same ``eps`` as the pure-Python solvers, no
    longer links the source to the sink. The answer is then certified by weak
    duality: the cut's exact capacity, summed from the original arcs, must equal
    the flow's value. When it does not (an infinite arc in the cut, capacities too
    spread for the rounds), None sends the caller to the exact pure-Python solvers.
    """
    if s == t or not _load_scipy():
        return None
    _sparse, _csgraph = _load_scipy()
    tl = np.asarray(tails, dtype=np.int64)
    hd = np.asarray(heads, dtype=np.int64)
    c = np.asarray(caps, dtype=float)
    finite = np.isfinite(c)
    if not len(c) or not finite.any():
        return None
    eps = float(c[finite].max()) * 1e-12
    # parallel arcs summed; every pair present in both directions (the reverse
    # residual), so SciPy adds no arcs and its flow comes back on this very pattern
    keys = np.concatenate([tl * n + hd, hd * n + tl])
    uniq, inv = np.unique(keys, return_inverse=True)
    big = float(c[finite].sum()) + 1.0  # more than any finite cut: an infinite arc's stand-in
    res = np.bincount(inv[: len(c)], weights=np.where(finite, c, big), minlength=len(uniq))
    rows = uniq // n
    cols = uniq % n
    indptr = np.searchsorted(rows, np.arange(n + 1))
    cols32 = cols.astype(np.int32)
    indptr32 = indptr.astype(np.int32)
    out_s = slice(indptr[s], indptr[s + 1])
    into_t = np.flatnonzero(cols == t)

    def reach(live: np.ndarray) -> np.ndarray:
        """Nodes reachable from ``s`` over the ``live`` residual pairs."""
        ptr = np.concatenate([[0], np.cumsum(np.bincount(rows[live], minlength=n))])
        g = _sparse.csr_matrix((np.ones(int(ptr[-1]), dtype=np.int8), cols32[live], ptr),
                               shape=(n, n))
        seen = np.zeros(n, dtype=bool)
        seen[_csgraph.breadth_first_order(g, s, directed=True, return_predecessors=False)] = True
        return seen

    total = 0.0
    bound = min(float(res[out_s].sum()), float(res[into_t].sum()))
    side = None
    for _ in range(_SCALED_ROUNDS):
        if bound <= eps:
            break
        scale = _SCALE / bound
        icap = np.floor(np.minimum(res, bound) * scale).astype(np.int32)
        r = _csgraph.maximum_flow(_sparse.csr_matrix((icap, cols32, indptr32), shape=(n, n)), s, t,
                                  method="dinic")
        if r.flow_value:
            fl = r.flow
            if len(fl.data) != len(uniq) or not (np.array_equal(fl.indptr, indptr)
                                                 and np.array_equal(fl.indices, cols)):
                return None  # a SciPy that re-shapes the pattern: not worth a slow mapping
            res -= fl.data / scale
            total += r.flow_value / scale
        side = reach(res > eps)
        if not side[t]:
            break
        # the floors left under 1/scale on each pair; what can still move is at most
        # the residual out of the nodes reachable over the pairs with more than that
        near = reach(res > 2.0 / scale)
        if not near[t]:
            bound = float(res[near[rows] & ~near[cols]].sum())
        elif r.flow_value:
            bound = min(float(res[out_s].sum()), float(res[into_t].sum()))
        else:
            break
    if side is None:
        side = reach(res > eps)
    if side[t]:
        return None
    crossing = side[tl] & ~side[hd]
    cut = float(c[crossing].sum())
    if not math.isfinite(cut) or cut > total + _CERTIFY_REL * max(total, 1.0):
        return None
    return cut, side


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


def _rooms(cap: list[float], eps: float, order: Sequence[int], sinks: list[list[int]],
           fwd: list[list[int]], head: list[int], n: int, widest: bool) -> list[float]:
    """What each node and the nodes below it could still absorb: along the single best
    path (``widest``, an under-estimate) or summed over all successors (an
    over-estimate where branches share descendants)."""
    room = [0.0] * n
    for u in reversed(order):
        r = 0.0
        for a in sinks[u]:
            c = cap[a]
            if c > eps:
                r += c
        best = 0.0
        for a in fwd[u]:
            c = cap[a]
            if c > eps:
                rv = room[head[a]]
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
    # each node's arcs to the sink and forward in ``order``, in adjacency order: the
    # passes below only ever look at these
    sinks: list[list[int]] = [[] for _ in range(n)]
    fwd: list[list[int]] = [[] for _ in range(n)]
    built = [False] * n
    for u in order:
        if built[u]:
            continue
        built[u] = True
        ru = rank[u]
        su, fu = sinks[u], fwd[u]
        for idx in range(start[u], start[u + 1]):
            a = adj[idx]
            v = to[a]
            if v == t:
                su.append(a)
            elif rank[v] > ru and v != s:
                fu.append(a)
    for widest in (True, False):
        room = _rooms(cap, eps, order, sinks, fwd, to, n, widest)
        for u in order:
            e = excess[u]
            if e <= eps:
                continue
            for a in sinks[u]:
                c = cap[a]
                if c > eps:
                    d = e if e < c else c
                    cap[a] = c - d
                    cap[a ^ 1] += d
                    excess[t] += d
                    e -= d
                    break
            if e > eps:
                for a in fwd[u]:
                    c = cap[a]
                    if c > eps:
                        v = to[a]
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
    if len(tails) >= _SCALED_MIN_ARCS:
        done = _scaled_min_cut(n, tails, heads, caps, s, t)
        if done is not None:
            return done
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
