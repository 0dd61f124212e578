"""Turns one demo run into the dict saved as report.json (and drawn by `splitinfer.report`).

Pure: the run's records, timeline and model in, plain JSON-able values out.

[Note: local gap]
The device's prediction is the model's time on the emulated device: one thread's time here
stretched by the slowdown ([Note: time-scaled device] in edge_agent.device). A local answer
costs more, in parts the report measures: the agent's own Python (the app's msgpack request
decoded, the hop to the engine's thread, the answer encoded; not stretched) plus the app's
HTTP call (the app's latency minus the agent's), and sharing: with --window 2 two answers
can want the device at once, and its one core runs them one after the other. The agent does
not batch local runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from partitioner import Cut
from planner import Link
from planner import Encoding
from splitinfer.demo.edge import ENCODINGS
from splitinfer.demo.setup import DemoModel, describe_frontier, predicted_ms
from splitinfer.demo.stream import REL_TOL, SERVED_AS, Record, StreamResult, skip_reasons
from splitinfer.netem import TraceStep

__all__ = ["LOCAL_LABEL", "make_cut_labeler", "plan_labels", "summarize"]

LOCAL_LABEL = "local (edge-only)"


def make_cut_labeler(dm: DemoModel) -> Callable[[str], str]:
    """cut id -> a readable name: 'cloud-only', 'head: 23 layers', or the id for cuts off the frontier."""
    n = len(dm.graph)
    known: dict[str, str] = {}
    for e in dm.front.entries:
        d = len(e.plan.cut.device)
        known[e.plan.cut.key] = "cloud-only" if d == 0 else LOCAL_LABEL if d == n else f"head: {d} layers"

    def label(cut_id: str) -> str:
        if not cut_id:
            return LOCAL_LABEL
        return known.get(cut_id, f"cut {cut_id[:8]}")

    return label


def plan_labels(dm: DemoModel, seen: Sequence[str]) -> list[str]:
    """Every label the plots need, from the cloud end to the device end."""
    label = make_cut_labeler(dm)
    by_layers = sorted({(len(e.plan.cut.device), label(e.plan.cut.key)) for e in dm.front.entries})
    out = [lab for _, lab in by_layers if lab != LOCAL_LABEL]
    out += [s for s in seen if s not in out and s != LOCAL_LABEL]
    return out + [LOCAL_LABEL]


def _finite(x: float) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _median(xs: Sequence[float]) -> float | None:
    return float(np.median(xs)) if xs else None


def _best_encoding(dm: DemoModel, cut: Cut, link: Link) -> tuple[float, str]:
    """(predicted ms, encoding) of `cut` with the encoding the planner would choose for it."""
    return min((predicted_ms(dm, cut, link, Encoding(e)), e) for e in ENCODINGS)


def _local_gap(dm: DemoModel, records: Sequence[Record]) -> dict[str, Any]:
    """The measured local latency against the prediction, in parts; see [Note: local gap]."""
    local = [r for r in records if r.served == "local"]
    device = [r for r in records if r.served in ("local", "local_tail")]

    def shared(r: Record) -> bool:  # another answer ran on the device while this one did
        return any(o is not r and o.sent_s < r.done_s and r.sent_s < o.done_s for o in device)

    alone = [r for r in local if not shared(r)]
    return {
        "predicted_ms": round(dm.edge_model_ms, 1),
        "measured_agent_p50_ms": _median([r.agent_latency_ms for r in local]),
        "measured_app_p50_ms": _median([r.latency_ms for r in local]),
        "measured_alone_p50_ms": _median([r.latency_ms for r in alone]),
        "measured_shared_p50_ms": _median([r.latency_ms for r in local if shared(r)]),
        "local_answers": len(local),
        "local_answers_sharing_the_device": len(local) - len(alone),
    }


def summarize(dm: DemoModel, trace: Sequence[TraceStep], res: StreamResult, *, agent_status: Mapping[str, Any],
              gateway_calls: int, setup: Mapping[str, Any],
              tolerances: Mapping[str, float] = REL_TOL) -> dict[str, Any]:
    """`tolerances`: the largest relative error an answer may have, per encoding of what
    crossed the link (`stream.make_tolerances`); encodings not in it get fp16's."""
    label = make_cut_labeler(dm)
    reqs = []
    for r in res.records:
        ran_as = LOCAL_LABEL if r.served_by in ("local", "error") else label(r.cut_id)
        reqs.append({"id": r.request_id, "sent_s": round(r.sent_s, 3), "done_s": round(r.done_s, 3),
                     "served_by": r.served_by, "served_as": r.served, "cut_id": r.cut_id, "ran_as": ran_as,
                     "latency_ms": round(r.latency_ms, 2), "agent_latency_ms": _finite(round(r.agent_latency_ms, 2)),
                     "link_up_bps": r.link_up_bps, "fallback_reason": r.fallback_reason,
                     "rel_err": _finite(r.rel_err), "encoding": r.encoding})
    all_dev = Cut(frozenset(range(len(dm.graph))))
    cloud_only = Cut(frozenset())
    front_plans = [(e.plan.cut, e.plan.encoding) for e in dm.front.entries]
    split_plans = [(c, enc) for c, enc in front_plans if 0 < len(c.device) < len(dm.graph)]
    phases, pred_edge, pred_cloud, pred_best, meas = [], [], [], [], []
    pred_split: list[float | None] = []
    cloud_enc: list[str | None] = []
    for a, b in zip(trace, trace[1:]):
        s = a.setting
        lab = "outage" if s.is_outage else f"{s.up_bps / 1e6:.3g} Mbit/s"
        phases.append({"start_s": a.t_s, "end_s": b.t_s, "label": lab, "up_bps": s.up_bps, "rtt_ms": s.rtt_ms})
        edge = predicted_ms(dm, all_dev, Link(1e6, 1e6, 0.0))
        pred_edge.append(edge)
        if s.is_outage:
            pred_cloud.append(None)
            cloud_enc.append(None)
            pred_split.append(None)
            pred_best.append(edge)
        else:
            link = Link(s.up_bps, s.down_bps, s.rtt_ms)
            # The encoding the phase's offloaded answers crossed in, where they agree; else
            # the one the planner would choose.
            used = {r.encoding for r in res.records if a.t_s <= r.sent_s < b.t_s and r.served in ("split", "remote")}
            if len(used) == 1:
                enc = used.pop()
                ms = predicted_ms(dm, cloud_only, link, Encoding(enc))
            else:
                ms, enc = _best_encoding(dm, cloud_only, link)
            pred_cloud.append(ms)
            cloud_enc.append(enc)
            splits = [predicted_ms(dm, c, link, Encoding(enc)) for c, _ in split_plans]
            pred_split.append(min(splits) if splits else None)
            pred_best.append(min([edge, ms] + [predicted_ms(dm, c, link, e) for c, e in front_plans]))
        lats = [r.latency_ms for r in res.records if a.t_s <= r.sent_s < b.t_s and r.served_by != "error"]
        meas.append(float(np.median(lats)) if lats else None)

    ids_answered = {r.request_id for r in res.records if r.served_by != "error"}
    by = {k: sum(r.served == k for r in res.records) for k in (*SERVED_AS, "error")}
    c = agent_status.get("counters", {})
    counts = {
        "sent": res.sent,
        "answered": len(ids_answered),
        "errors": by["error"],
        "lost": res.sent - len(res.answers_per_id),
        "doubled": sum(max(0, n - 1) for n in res.answers_per_id.values()),
        "served_split": by["split"],
        "served_remote": by["remote"],
        "served_local": by["local"],
        "served_fallback": by["local_tail"],
        "frames_skipped": res.skipped_ticks,
        "agent_late_dropped": c.get("late_dropped", 0),
        "agent_local_dropped": c.get("local_dropped", 0),
        "agent_switches": c.get("switches", 0),
        "agent_probes": c.get("probes", 0),
        "gateway_calls": gateway_calls,
    }
    checked = [r for r in res.records if r.served_by != "error" and math.isfinite(r.rel_err)]
    errs = [r.rel_err for r in checked]
    def tol(e: str) -> float:
        return float(tolerances.get(e, tolerances.get("fp16", REL_TOL["fp16"])))

    per_encoding = {e: {"answers": sum(r.encoding == e for r in checked),
                        "max_rel_err": max((r.rel_err for r in checked if r.encoding == e), default=0.0),
                        "tolerance": tol(e),
                        "mismatched": sum(r.rel_err > tol(e) for r in checked if r.encoding == e)}
                    for e in sorted({r.encoding for r in checked})}
    verification = {"checked": len(errs), "mismatched": sum(r.rel_err > tol(r.encoding) for r in checked),
                    "max_rel_err": max(errs, default=0.0), "tolerance": tol("fp32"), "tolerances": dict(tolerances),
                    "by_encoding": {e: m["answers"] for e, m in per_encoding.items()}, "per_encoding": per_encoding,
                    "against": "the whole model in one ONNX Runtime session on this host"}
    front = describe_frontier(dm)
    for row in front:
        row["label"] = label(row["cut_id"])
    seen = sorted({r["ran_as"] for r in reqs} | {t["plan"] for t in res.timeline if t.get("plan") not in (None, "-")})
    return {
        "schema": "splitinfer.demo-report/1",
        "model": dm.name,
        "counts": counts,
        "verification": verification,
        "setup": dict(setup),
        "frontier": front,
        "phases": phases,
        "predicted": {"edge_only_ms": pred_edge, "cloud_only_ms": pred_cloud, "cloud_only_encoding": cloud_enc,
                      "split_ms": pred_split, "best_ms": pred_best,
                      "note": "the planner's cost model with the profiles measured in this run; cloud-only and "
                              "split in the encoding the phase's offloaded answers used (cloud_only_encoding), or "
                              "where they used none or several, the one the planner chooses"},
        "emulation": dict(dm.emulation),
        "local_gap": _local_gap(dm, res.records),
        "skip_reasons": skip_reasons(res),
        "measured_p50_ms": meas,
        "plan_labels": plan_labels(dm, seen),
        "timeline": res.timeline,
        "requests": reqs,
        "agent_status": dict(agent_status),
        "duration_s": res.duration_s,
    }
