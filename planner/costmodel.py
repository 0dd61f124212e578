"""The cost model: what a placement costs, stage by stage.

[Note: cost model]
Tiers 0..k-1 (device first; two tiers: device and cloud) run the layers labelled
with their index; labels never decrease along an edge (nested, down-closed cuts).
Hop h joins tier h and tier h+1 and carries

* up: every tensor produced in tiers <= h (model inputs count as produced before the
  device) that a layer in a tier > h reads, once however many read it; a tensor
  from the device to the cloud relays through the edge server, so it crosses every
  hop in between and is encoded by each hop's sender and decoded by its receiver;
* down: every model output produced in a tier > h, in float32 as computed.

With ``seg_i`` the sum of tier i's layer ms (its profile's, times the corrections'
scale) and ``const_i`` = fixed_ms + corrections.offset_ms:

    tier_ms_i   = seg_i + const_i if tier i runs a layer, else 0
    up_ms_h     = sum(wire_bytes(t) for t crossing h) * 8 / (up_bps_h * (1 - loss_h)) * 1000
    down_ms_h   = sum(bytes(o) for o crossing h) * 8 / (down_bps_h * (1 - loss_h)) * 1000
    codec_ms_i  = encode on the hop it sends + decode on the hop it receives (CodecModel:
                  per MB, a model input's cast at its own rate, plus a fixed ms per tensor
                  sent); a lossy codec's measured encode + decode, all on the sender; plus, on an
                  accelerator, the copy of what it receives (as decoded) to the device,
                  times its CodecModel.host_copy_ms_per_mb (a model output's copy back
                  counts in the time of the layer that computes it)
    wire_bytes  = a float32 tensor's bytes cast and compressed (Encoding), or times the
                  lossy codec's measured ratio
    rtt_ms      = sum(rtt_h for hops h with a layer beyond them)
    total_ms    = sum(tier_ms) + sum(codec_ms) + sum(up_ms) + rtt_ms + queue_ms + sum(down_ms)

With fp32, no corrections and two tiers this is exactly: device ms + device fixed +
RTT + boundary bytes * 8 / uplink + cloud ms + cloud fixed + cloud-computed outputs *
8 / downlink; edge-only is device ms + device fixed (no network, no RTT).

Throughput: the stages (tier_i + codec_i per tier, then every hop's up and down) run
pipelined; the period is the slowest. The last tier may batch B samples: its
per-sample stage is batch_factor(B) * seg + const / B, its batch run takes
B * batch_factor(B) * seg + const (reported as cloud_ms) and a request waits
queue_ms = (B - 1) * (slowest stage before the last tier) for the batch to fill.

Energy (device only, joules): (compute_w * (tier_ms_0 + codec_ms_0) + radio_tx_w *
up_ms_0 + idle_w * (total_ms - tier_ms_0 - codec_ms_0 - up_ms_0)) / 1000.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from partitioner.cuts import Cut, boundary, make_tiers
from partitioner.errors import PartitionError
from partitioner.graph import LayerGraph
from planner.errors import PlannerError
from planner.profile import Profile
from planner.types import Breakdown, Encoding, Link, Plan

__all__ = ["HEDGE_MARGIN", "evaluate", "labels_of", "cuts_of", "tier_names", "hop_names", "require_known_sizes",
           "latest_local_start_ms", "goes_urgent"]

HEDGE_MARGIN = 0.25
"""The share of its own time a local fallback keeps to spare before its deadline: the edge
policy's default ``hedge_margin`` and the fleet planner's ([Note: hedge] in edge_agent/hedge.py)."""


def latest_local_start_ms(deadline_ms: float, local_ms: float, margin: float = HEDGE_MARGIN,
                          now_ms: float = 0.0) -> float:
    """The last moment a local run of ``local_ms`` can start and land by ``deadline_ms`` with
    ``margin`` of its time to spare, or, once that moment is past at ``now_ms``, with what is left."""
    with_margin = deadline_ms - local_ms * (1.0 + margin)
    return with_margin if with_margin > now_ms else deadline_ms - local_ms

def goes_urgent(slo_ms: float | None, send_ms: float, tail_ms: float) -> bool:
    """Whether a request sent ``send_ms`` after its start, whose local tail takes ``tail_ms`` (inf:
    none), has no local answer in time: under an SLO, its tail started at the send lands at or
    after it, so the agent's hedge would not start one, and the request goes to the cloud with
    priority 1 ([Note: priority under overload] in edge_agent/hedge.py)."""
    return slo_ms is not None and send_ms + tail_ms >= slo_ms


REMOTE_BUDGET_FLOOR = 0.3
"""The least share of the SLO a remote call gets once the head is done ([Note: remote budget])."""


def remote_budget_ms(slo_ms: float, elapsed_ms: float, tail_ms: float, floor: float = REMOTE_BUDGET_FLOOR) -> float:
    """How long a remote call may run once the head is done at ``elapsed_ms`` before the device
    runs its local tail of ``tail_ms``.

    [Note: remote budget]
    What is left of the SLO after the tail, so that the tail still lands by it; and never
    under ``floor`` of the SLO: where the head and the tail already fill the SLO, the tail
    answers late either way, and the cloud, which may yet answer in time, gets the call.
    The edge runner, the fleet planner, the fleet simulator and bench.fleet_load use this."""
    return max(slo_ms - elapsed_ms - tail_ms, floor * slo_ms)


def remote_call_ms(budget_ms: float) -> float:
    """How long the edge runner's remote call may take once sent, which its request carries to
    the gateway as its deadline: twice the budget, at least a second more, so that an answer
    later than the budget still arrives to be measured ([Note: remote budget])."""
    return max(2.0 * budget_ms, budget_ms + 1000.0)

# [Note: unknown sizes]
# A tensor whose size no shape inference knows (bytes_per_sample None) cannot be priced,
# and pricing it at 0 would make the solver cut exactly there. The tables price it at
# _UNKNOWN_BYTES, far above any real tensor, so that the solver crosses it only where no
# placement of known cost exists; `require_known_sizes` then refuses every placement
# (a solved plan, an evaluated baseline) that sends one, naming the tensors and the
# flags that make their sizes known. Cuts whose boundary is known still plan.
_UNKNOWN_BYTES = 1e15

_INT8_QPARAM_BYTES = 8  # fp32 scale + int32 zero point
_CASTABLE = ("float32",)


def tier_names(k: int) -> tuple[str, ...]:
    return ("edge", "cloud") if k == 2 else ("edge",) + tuple(
        "server" if i == 1 and k == 3 else f"server{i}" for i in range(1, k - 1)
    ) + ("cloud",)


def hop_names(k: int) -> tuple[tuple[str, str], ...]:
    return tuple(
        ("uplink", "downlink") if h == 0 else (f"uplink{h + 1}", f"downlink{h + 1}") for h in range(k - 1)
    )


@dataclass(frozen=True, eq=False)
class _Tables:
    """Everything `_stages` needs, as arrays; built once per (graph, profiles, links,
    encoding, batch) and shared by the solvers."""

    n: int
    k: int
    unary: np.ndarray  # (k, n): scaled batch-1 ms per layer per tier
    const: np.ndarray  # (k,)
    bfactor: float  # last tier's per-sample factor at ``batch``
    batch: int
    t_prod: np.ndarray  # (T,) producer layer, -1 for model inputs
    t_cons: np.ndarray  # flat consumers
    t_off: np.ndarray  # (T,) offsets into t_cons
    up: np.ndarray  # (k-1, T) ms per hop if the tensor crosses
    enc: np.ndarray  # (k-1, T) sender codec ms
    dec: np.ndarray  # (k-1, T) receiver codec ms
    o_prod: np.ndarray  # (O,)
    down: np.ndarray  # (k-1, O)
    rtt: np.ndarray  # (k-1,)
    compute_w: float
    radio_tx_w: float
    idle_w: float
    t_names: tuple[str, ...]
    param_bytes: np.ndarray
    wire: np.ndarray  # (k-1, T) wire bytes per hop
    o_bytes: np.ndarray  # (O,)


def _wire_and_codec(graph: LayerGraph, tensors: Sequence[Any], enc: Encoding, sender: Profile,
                    receiver: Profile) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    wire = np.zeros(len(tensors))
    e_ms = np.zeros(len(tensors))
    d_ms = np.zeros(len(tensors))
    if enc.lossy_codec:
        return _lossy_wire_and_codec(tensors, enc, sender.codec.encode_fixed_ms)
    ratio = 1.0 if enc.compression == "none" else sender.codec.ratio[enc.compression]
    for i, t in enumerate(tensors):
        raw = _UNKNOWN_BYTES if t.bytes_per_sample is None else float(t.bytes_per_sample)
        cast = raw
        e_ms[i] = sender.codec.encode_fixed_ms
        if t.dtype in _CASTABLE and enc.precision != "fp32":
            cast = raw * enc.scale
            if enc.precision == "int8":
                ch = 1
                if enc.per_channel and t.shape is not None and len(t.shape) > 1 and isinstance(t.shape[1], int):
                    ch = t.shape[1]
                cast += _INT8_QPARAM_BYTES * ch
            e_ms[i] += raw / 1e6 * sender.codec.cast_ms_per_mb(enc.precision, model_input=t.producer is None)
            d_ms[i] += raw / 1e6 * receiver.codec.decode_ms_per_mb[enc.precision]
        if enc.compression != "none":
            e_ms[i] += cast / 1e6 * sender.codec.encode_ms_per_mb[enc.compression]
            d_ms[i] += cast / 1e6 * receiver.codec.decode_ms_per_mb[enc.compression]
        wire[i] = cast * ratio
    return wire, e_ms, d_ms


def _lossy_wire_and_codec(tensors: Sequence[Any], enc: Encoding,
                          fixed_ms: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A lossy codec's measured bytes and time per float32 byte ([Note: cost model]): all of
    its encode + decode ms is counted on the sender, as it was measured on one host, plus the
    sender's `fixed_ms` per tensor sent."""
    if enc.ratio is None or enc.codec_ms_per_mb is None:
        raise PlannerError(
            f"the lossy encoding {enc.key} carries no measured ratio and codec_ms_per_mb, so it cannot be "
            "priced; plan it within an accuracy budget (min_agreement=, accuracy=) so the accuracy table's "
            "measurement prices it", field="encoding")
    wire = np.zeros(len(tensors))
    e_ms = np.full(len(tensors), float(fixed_ms))
    for i, t in enumerate(tensors):
        raw = _UNKNOWN_BYTES if t.bytes_per_sample is None else float(t.bytes_per_sample)
        if t.dtype in _CASTABLE:
            wire[i] = raw * enc.ratio
            e_ms[i] += raw / 1e6 * enc.codec_ms_per_mb
        else:
            wire[i] = raw
    return wire, e_ms, np.zeros(len(tensors))


_CACHE: dict[tuple[Any, ...], tuple[LayerGraph, tuple[Profile, ...], _Tables]] = {}
_CACHE_SIZE = 16
_CACHE_LOCK = threading.Lock()  # the what-if service plans from several threads


def _tables(graph: LayerGraph, profiles: Sequence[Profile], links: Sequence[Link], encoding: Encoding,
            batch: int = 1) -> _Tables:
    """Tables for these inputs. The link-free part is memoised by the identity of the
    (immutable) graph and profiles, so re-planning on a new link costs only `_relink`."""
    profiles = tuple(profiles)
    key = (id(graph), tuple(id(p) for p in profiles), encoding, len(links))
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
    if hit is not None and hit[0] is graph and all(a is b for a, b in zip(hit[1], profiles)):
        tb = _relink(hit[2], links)
    else:
        tb = _build_tables(graph, profiles, links, encoding)
        with _CACHE_LOCK:
            if len(_CACHE) >= _CACHE_SIZE:
                _CACHE.pop(next(iter(_CACHE)))
            _CACHE[key] = (graph, profiles, tb)
    if batch != 1:
        tb = dataclasses.replace(tb, batch=batch, bfactor=profiles[-1].batch_factor(batch))
    return tb


def _build_tables(graph: LayerGraph, profiles: Sequence[Profile], links: Sequence[Link],
                  encoding: Encoding) -> _Tables:
    k = len(profiles)
    if k < 2:
        raise PlannerError(
            f"got {k} profile(s); give at least two (device, cloud) or three (device, edge server, cloud)",
            model=graph.model, field="profiles",
        )
    if len(links) != k - 1:
        raise PlannerError(
            f"{k} tiers need {k - 1} link(s), got {len(links)}; give one link per hop, device side first",
            model=graph.model, field="links",
        )
    n = len(graph)
    unary = np.zeros((k, n))
    for i, p in enumerate(profiles):
        try:
            unary[i] = [p.layers[v].ms for v in range(n)]
        except KeyError:
            for v in range(n):
                p.layer_ms(v)  # raises, naming the layer and the profile
        unary[i] *= p.scale
        # a model output's copy back to the host counts in the layer that computes it
        for o in graph.outputs:
            t = graph.tensor[o]
            if t.producer is not None and p.codec.host_copy_ms_per_mb:
                size = _UNKNOWN_BYTES if t.bytes_per_sample is None else float(t.bytes_per_sample)
                unary[i][t.producer] += size / 1e6 * p.codec.host_copy_ms_per_mb
    const = np.array([p.segment_const_ms for p in profiles])
    tens = [t for t in graph.tensors if t.consumers]
    t_prod = np.array([-1 if t.producer is None else t.producer for t in tens], dtype=np.int64)
    t_cons = np.array([c for t in tens for c in t.consumers], dtype=np.int64)
    t_off = np.cumsum([0] + [len(t.consumers) for t in tens])[:-1].astype(np.int64)
    up = np.zeros((k - 1, len(tens)))
    enc = np.zeros((k - 1, len(tens)))
    dec = np.zeros((k - 1, len(tens)))
    outs = [graph.tensor[o] for o in graph.outputs]
    o_prod = np.array([-1 if t.producer is None else t.producer for t in outs], dtype=np.int64)
    o_bytes = np.array([_UNKNOWN_BYTES if t.bytes_per_sample is None else float(t.bytes_per_sample) for t in outs])
    down = np.zeros((k - 1, len(outs)))
    wire_all = np.zeros((k - 1, len(tens)))
    raw_mb = np.array([_UNKNOWN_BYTES if t.bytes_per_sample is None else float(t.bytes_per_sample) for t in tens]) / 1e6
    for h, lk in enumerate(links):
        wire, e_ms, d_ms = _wire_and_codec(graph, tens, encoding, profiles[h], profiles[h + 1])
        wire_all[h] = wire
        up[h] = wire * 8.0 / lk.up_goodput_bps * 1000.0
        enc[h] = e_ms
        dec[h] = d_ms + raw_mb * profiles[h + 1].codec.host_copy_ms_per_mb
        down[h] = o_bytes * 8.0 / lk.down_goodput_bps * 1000.0
    dev = profiles[0]
    return _Tables(
        n=n, k=k, unary=unary, const=const, bfactor=1.0, batch=1,
        t_prod=t_prod, t_cons=t_cons, t_off=t_off, up=up, enc=enc, dec=dec, o_prod=o_prod, down=down,
        rtt=np.array([lk.rtt_ms for lk in links], dtype=float),
        compute_w=dev.compute_w, radio_tx_w=dev.radio_tx_w, idle_w=dev.idle_w,
        t_names=tuple(t.name for t in tens),
        param_bytes=np.array([layer.param_bytes for layer in graph.layers], dtype=float),
        wire=wire_all, o_bytes=o_bytes,
    )


def _relink(tb: _Tables, links: Sequence[Link]) -> _Tables:
    """The same tables on other links (codec and compute do not depend on the link)."""
    up = np.vstack([tb.wire[h] * 8.0 / lk.up_goodput_bps * 1000.0 for h, lk in enumerate(links)])
    down = np.vstack([tb.o_bytes * 8.0 / lk.down_goodput_bps * 1000.0 for lk in links])
    return dataclasses.replace(tb, up=up, down=down, rtt=np.array([lk.rtt_ms for lk in links], dtype=float))


def _crossings(tb: _Tables, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Producer and last-consumer tier of each tensor, for each row of ``labels``."""
    m = labels.shape[0]
    if len(tb.t_prod) == 0:
        z = np.zeros((m, 0), dtype=labels.dtype)
        return z, z
    prod = np.where(tb.t_prod >= 0, labels[:, np.maximum(tb.t_prod, 0)], -1)
    maxc = np.maximum.reduceat(labels[:, tb.t_cons], tb.t_off, axis=1)
    return prod, maxc


@dataclass(frozen=True, eq=False)
class _Stages:
    """Per-row components (arrays of length M, or (k, M) / (k-1, M))."""

    seg: np.ndarray
    nonempty: np.ndarray
    codec: np.ndarray
    up: np.ndarray
    down: np.ndarray
    rtt: np.ndarray
    boundary: np.ndarray  # (M, T) bool: crosses hop 0


def _stages(tb: _Tables, labels: np.ndarray) -> _Stages:
    labels = np.asarray(labels, dtype=np.int64)
    if labels.ndim == 1:
        labels = labels[None, :]
    m = labels.shape[0]
    k = tb.k
    seg = np.zeros((k, m))
    nonempty = np.zeros((k, m), dtype=bool)
    for i in range(k):
        mask = labels == i
        seg[i] = mask @ tb.unary[i]
        nonempty[i] = mask.any(axis=1)
    prod, maxc = _crossings(tb, labels)
    codec = np.zeros((k, m))
    up = np.zeros((k - 1, m))
    down = np.zeros((k - 1, m))
    boundary = np.zeros((m, len(tb.t_prod)), dtype=bool)
    top = labels.max(axis=1) if labels.shape[1] else np.full(m, -1)
    if len(tb.o_prod):
        oprod = np.where(tb.o_prod >= 0, labels[:, np.maximum(tb.o_prod, 0)], -1)
    else:
        oprod = np.zeros((m, 0), dtype=np.int64)
    for h in range(k - 1):
        cross = (prod <= h) & (maxc > h)
        if h == 0:
            boundary = cross
        cf = cross.astype(float)
        up[h] = cf @ tb.up[h]
        codec[h] += cf @ tb.enc[h]
        codec[h + 1] += cf @ tb.dec[h]
        down[h] = (oprod > h).astype(float) @ tb.down[h]
    rtt = ((top[None, :] > np.arange(k - 1)[:, None]) * tb.rtt[:, None]).sum(axis=0)
    return _Stages(seg=seg, nonempty=nonempty, codec=codec, up=up, down=down, rtt=rtt, boundary=boundary)


def _summaries(tb: _Tables, st: _Stages) -> dict[str, np.ndarray]:
    """Latency, energy and period (and their parts) per row."""
    k, b = tb.k, tb.batch
    tier = np.where(st.nonempty, st.seg + tb.const[:, None], 0.0)
    last_run = np.where(st.nonempty[-1], b * tb.bfactor * st.seg[-1] + tb.const[-1], 0.0)
    last_stage = np.where(st.nonempty[-1], tb.bfactor * st.seg[-1] + tb.const[-1] / b, 0.0) + st.codec[-1]
    stage_rows = [tier[i] + st.codec[i] for i in range(k - 1)] + [last_stage]
    stage_rows += [st.up[h] for h in range(k - 1)] + [st.down[h] for h in range(k - 1)]
    stages = np.vstack(stage_rows)
    upstream = np.vstack([tier[i] + st.codec[i] for i in range(k - 1)] + [st.up[h] for h in range(k - 1)])
    queue = (b - 1) * upstream.max(axis=0)
    cloud = tier[1:-1].sum(axis=0) + last_run
    total = tier[0] + st.codec.sum(axis=0) + st.up.sum(axis=0) + st.rtt + queue + cloud + st.down.sum(axis=0)
    busy = tier[0] + st.codec[0]
    energy = (tb.compute_w * busy + tb.radio_tx_w * st.up[0] + tb.idle_w * (total - busy - st.up[0])) / 1000.0
    return {"tier": tier, "cloud": cloud, "queue": queue, "total": total, "energy": energy,
            "stages": stages, "period": stages.max(axis=0), "bottleneck": stages.argmax(axis=0)}


def _stage_names(k: int) -> tuple[str, ...]:
    hops = hop_names(k)
    return tier_names(k) + tuple(h[0] for h in hops) + tuple(h[1] for h in hops)


def _breakdown(tb: _Tables, labels: np.ndarray) -> Breakdown:
    return _plan_parts(tb, labels)[0]


def _plan_parts(tb: _Tables, labels: np.ndarray) -> tuple[Breakdown, tuple[str, ...]]:
    """The breakdown of one placement and the tensors crossing its first cut."""
    st = _stages(tb, labels)
    s = _summaries(tb, st)
    k = tb.k
    tier = s["tier"][:, 0]
    b = Breakdown(
        edge_ms=float(tier[0]),
        encode_ms=float(st.codec[:, 0].sum()),
        uplink_ms=float(st.up[:, 0].sum()),
        rtt_ms=float(st.rtt[0]),
        queue_ms=float(s["queue"][0]),
        cloud_ms=float(s["cloud"][0]),
        downlink_ms=float(st.down[:, 0].sum()),
        total_ms=float(s["total"][0]),
        energy_j=float(s["energy"][0]),
        bottleneck=_stage_names(k)[int(s["bottleneck"][0])],
        period_ms=float(s["period"][0]),
        batch=tb.batch,
        tier_ms=tuple(float(x) for x in tier),
        tier_codec_ms=tuple(float(x) for x in st.codec[:, 0]),
        hop_up_ms=tuple(float(x) for x in st.up[:, 0]),
        hop_down_ms=tuple(float(x) for x in st.down[:, 0]),
    )
    return b, tuple(tb.t_names[i] for i in np.flatnonzero(st.boundary[0]))


def labels_of(graph: LayerGraph, cuts: Sequence[Cut]) -> np.ndarray:
    """Tier of each layer for a chain of nested cuts."""
    labels = np.full(len(graph), len(cuts), dtype=np.int64)
    for i in range(len(cuts) - 1, -1, -1):
        if cuts[i].device:
            labels[np.fromiter(cuts[i].device, dtype=np.int64)] = i
    return labels


def cuts_of(labels: np.ndarray, k: int) -> tuple[Cut, ...]:
    return tuple(Cut(frozenset(int(v) for v in np.flatnonzero(labels <= h))) for h in range(k - 1))


def require_known_sizes(graph: LayerGraph, cuts: Sequence[Cut]) -> None:
    """Refuse a placement that sends a tensor of unknown size over a link (see
    [Note: unknown sizes]): a boundary tensor, or a model output computed beyond a cut."""
    unknown: list[str] = []
    for cut in cuts:
        sent = list(boundary(graph, cut)) + [o for o in graph.outputs
                                             if graph.tensor[o].producer is not None
                                             and graph.tensor[o].producer not in cut.device]
        unknown += [n for n in sent if graph.tensor[n].bytes_per_sample is None and n not in unknown]
    if unknown:
        shown = ", ".join(repr(n) for n in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise PlannerError(
            f"cannot plan {graph.model} across a boundary of unknown size: {shown} would cross the link, and no "
            "shape inference knows their size; fix the input shapes with --input-shape NAME=D0xD1x... "
            "(input_shapes=) or pass sample inputs with --inputs FILE.npz (inputs=), then plan again",
            model=graph.model, field="input_shapes",
        )


def evaluate(
    graph: LayerGraph,
    plan_or_cut: Plan | Cut | Sequence[Cut],
    profiles: Sequence[Profile],
    link: Link | Sequence[Link] | None = None,
    encoding: Encoding | None = None,
    *,
    batch: int | None = None,
) -> Breakdown:
    """Predict the cost of a placement; see [Note: cost model] for the formulas.

    ``plan_or_cut`` is a Plan (its cuts, link(s), encoding and batch are the defaults),
    one Cut (two tiers) or a sequence of nested cuts (k tiers, k-1 cuts). ``link`` is
    one Link, or one per hop. Pure: no I/O, no clocks.
    """
    if isinstance(plan_or_cut, Plan):
        cuts = plan_or_cut.cuts
        link = plan_or_cut.links if link is None else link
        encoding = plan_or_cut.encoding if encoding is None else encoding
        batch = plan_or_cut.breakdown.batch if batch is None else batch
    elif isinstance(plan_or_cut, Cut):
        cuts = (plan_or_cut,)
    else:
        cuts = tuple(plan_or_cut)
    if link is None:
        raise PlannerError("evaluate needs a link: pass link=Link(up_bps, down_bps, rtt_ms)",
                           model=graph.model, field="link")
    links = (link,) if isinstance(link, Link) else tuple(link)
    if len(cuts) != len(profiles) - 1:
        raise PlannerError(
            f"{len(profiles)} profiles need {len(profiles) - 1} nested cut(s), got {len(cuts)}; "
            f"give one cut per hop, device side first",
            model=graph.model, field="cuts",
        )
    try:
        make_tiers(graph, [c.device for c in cuts])
    except PartitionError as e:
        raise PlannerError(f"invalid placement: {e.message}", model=graph.model, field="cuts",
                           layer=e.layer) from e
    require_known_sizes(graph, cuts)
    tb = _tables(graph, profiles, links, encoding or Encoding(), batch or 1)
    return _breakdown(tb, labels_of(graph, cuts))
