"""The exact placement solver: a weighted sum of stage costs minimised by one s-t min cut.

[Note: min-cut construction]
For a set of allowed tiers t_0 < ... < t_m, layer v gets threshold variables
x_j(v) = [tier(v) <= t_j], j < m (x_j = 1: v on the source side of copy j). Nested
cuts are x_j <= x_{j+1} (an infinite arc v_j -> v_{j+1}); down-closure is an
infinite arc from each consumer to its producer in every copy. A layer's own cost
u(v, tier) telescopes into terminal arcs: u(v, t_m) + sum_j x_j (u(v, t_j) -
u(v, t_{j+1})). Copy j carries the hops t_j .. t_{j+1}-1: a tensor read by one layer
is an arc producer -> consumer with its transfer + codec cost; a tensor read by
several layers gets an auxiliary node (DADS): producer -> aux with the cost, aux ->
each consumer infinite, so it is charged once however many consumers are across. A
model input's arc starts at the source. A model output's downlink is charged on the
terminal arc source -> producer (paid when the producer is beyond the cut).
Before the flow runs, each node's two terminal arcs are netted (only the difference
can carry flow), which keeps the flows short.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from planner.costmodel import _Tables
from planner.maxflow import min_cut

__all__: list[str] = []


@dataclass(frozen=True, eq=False)
class _Weights:
    """Multipliers of the stage components; latency is all ones."""

    seg: np.ndarray  # (k,) per tier compute (the caller folds batch factors in)
    codec: np.ndarray  # (k,)
    up: np.ndarray  # (k-1,)
    down: np.ndarray  # (k-1,)


def _ones(k: int) -> _Weights:
    return _Weights(np.ones(k), np.ones(k), np.ones(k - 1), np.ones(k - 1))


def _solve_labels(
    tb: _Tables,
    w: _Weights,
    allowed: tuple[int, ...],
    pinned: np.ndarray,
    extra0: np.ndarray | None = None,
    _flow=min_cut,
) -> np.ndarray | None:
    """Labels minimising the weighted modular cost over placements using only
    ``allowed`` tiers; None when a pinned layer cannot be on the device."""
    n = tb.n
    if pinned.any() and allowed[0] != 0:
        return None
    if len(allowed) == 1 or n == 0:
        return np.full(n, allowed[0], dtype=np.int64)
    m = len(allowed) - 1
    # auxiliary nodes for tensors read by several layers
    ncons = np.diff(np.append(tb.t_off, len(tb.t_cons)))
    multi = np.flatnonzero(ncons > 1)
    aux_of = np.full(len(tb.t_prod), -1, dtype=np.int64)
    aux_of[multi] = n + np.arange(len(multi))
    stride = n + len(multi)
    nn = m * stride + 2
    s, t = nn - 2, nn - 1
    src = np.zeros((m, stride))
    snk = np.zeros((m, stride))
    tails: list[np.ndarray] = []
    heads: list[np.ndarray] = []
    caps: list[np.ndarray] = []

    def u(level: int) -> np.ndarray:
        x = w.seg[level] * tb.unary[level]
        if level == 0 and extra0 is not None:
            x = x + extra0
        return x

    first = np.where(ncons > 0, tb.t_cons[np.minimum(tb.t_off, max(len(tb.t_cons) - 1, 0))], -1)
    edge_p = np.repeat(np.arange(len(tb.t_prod)), ncons)
    for j in range(m):
        base = j * stride
        a = u(allowed[j]) - u(allowed[j + 1])
        snk[j, :n] += np.maximum(a, 0.0)
        src[j, :n] += np.maximum(-a, 0.0)
        hops = range(allowed[j], allowed[j + 1])
        cost = np.zeros(len(tb.t_prod))
        dcost = np.zeros(len(tb.o_prod))
        for h in hops:
            cost += w.up[h] * tb.up[h] + w.codec[h] * tb.enc[h] + w.codec[h + 1] * tb.dec[h]
            dcost += w.down[h] * tb.down[h]
        has_o = tb.o_prod >= 0
        np.add.at(src[j], tb.o_prod[has_o], dcost[has_o])
        # tensors: the arc's tail is the producer (or the source), its head the single
        # consumer or the aux node
        live = cost > 0
        single = live & (ncons == 1)
        many = live & (ncons > 1)
        from_input = tb.t_prod < 0
        # single-consumer model inputs: a terminal arc on the consumer
        si = single & from_input
        np.add.at(src[j], first[si], cost[si])
        sp = single & ~from_input
        tails.append(base + tb.t_prod[sp])
        heads.append(base + first[sp])
        caps.append(cost[sp])
        mi = many & from_input
        tails.append(np.full(int(mi.sum()), s))
        heads.append(base + aux_of[mi])
        caps.append(cost[mi])
        mp = many & ~from_input
        tails.append(base + tb.t_prod[mp])
        heads.append(base + aux_of[mp])
        caps.append(cost[mp])
        sel = many[edge_p]
        tails.append(base + aux_of[edge_p[sel]])
        heads.append(base + tb.t_cons[sel])
        caps.append(np.full(int(sel.sum()), math.inf))
        # down-closure: consumer -> producer
        ok = tb.t_prod[edge_p] >= 0
        tails.append(base + tb.t_cons[ok])
        heads.append(base + tb.t_prod[edge_p[ok]])
        caps.append(np.full(int(ok.sum()), math.inf))
        if j + 1 < m:
            tails.append(base + np.arange(n))
            heads.append(base + stride + np.arange(n))
            caps.append(np.full(n, math.inf))
    if pinned.any():
        src[0, :n][pinned] = math.inf
    net = src - snk
    nodes = np.arange(m * stride).reshape(m, stride)
    pos = net > 0
    neg = net < 0
    tails += [np.full(int(pos.sum()), s), nodes[neg]]
    heads += [nodes[pos], np.full(int(neg.sum()), t)]
    caps += [net[pos], -net[neg]]
    # data-flow order for the greedy first pass: a tensor's aux node right after its
    # producer, copies one after another
    key = np.concatenate([np.arange(n, dtype=float), tb.t_prod[multi] + 0.5])
    within = np.argsort(key, kind="stable")
    order = (np.arange(m)[:, None] * stride + within[None, :]).ravel().tolist()
    _, side = _flow(nn, np.concatenate(tails), np.concatenate(heads), np.concatenate(caps), s, t, order)
    x = side[: m * stride].reshape(m, stride)[:, :n]
    labels = np.full(n, allowed[m], dtype=np.int64)
    for j in range(m - 1, -1, -1):
        labels[x[j]] = allowed[j]
    return labels
