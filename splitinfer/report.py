"""The demo report: `index.html` with PNG plots, from the data written to `report.json`.

`write_report(out_dir, data)` is pure apart from writing files: everything it draws is
in `data` (the same dict the demo saves as report.json), so a report can be redrawn
from a saved report.json with `python -m splitinfer.report DIR`.
"""

from __future__ import annotations

import html
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["write_report", "plot_timeline", "plot_compare"]

_COLORS = {"remote": "#1f77b4", "local": "#2ca02c", "local_tail": "#ff7f0e", "error": "#d62728"}


def _plt():  # noqa: ANN202 - matplotlib.pyplot, loaded off-screen and only when drawing
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _shade_phases(ax: Any, phases: Sequence[Mapping[str, Any]]) -> None:
    for p in phases:
        if p["label"] == "outage":
            ax.axvspan(p["start_s"], p["end_s"], color="#d62728", alpha=0.12, lw=0)


def plot_timeline(data: Mapping[str, Any], path: str) -> str:
    """Bandwidth (emulated and estimated), plan in use, and per-request latency over time."""
    plt = _plt()
    reqs = data["requests"]
    tl = data["timeline"]
    phases = data["phases"]
    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True, gridspec_kw={"height_ratios": [1, 1, 1.4]})
    ax = axes[0]
    steps_t, steps_v = [], []
    for p in phases:
        v = 0.0 if p["label"] == "outage" else p["up_bps"] / 1e6
        steps_t += [p["start_s"], p["end_s"]]
        steps_v += [v, v]
    ax.plot(steps_t, steps_v, color="black", lw=2, label="emulated uplink")
    est = [(r["t_s"], r["est_up_bps"] / 1e6) for r in tl if r.get("est_up_bps")]
    if est:
        ax.plot(*zip(*est), "o-", color="#9467bd", ms=3, lw=1, label="agent's estimate")
    ax.set_yscale("symlog", linthresh=0.5)
    ax.set_ylabel("uplink (Mbit/s)")
    ax.legend(loc="upper right", fontsize=8)
    _shade_phases(ax, phases)
    ax.set_title(f"{data['model']}: link, plan and latency (red band: outage)")

    ax = axes[1]
    labels = data["plan_labels"]
    order = {lab: i for i, lab in enumerate(labels)}
    pts = [(r["t_s"], order[r["plan"]]) for r in tl if r.get("plan") in order]
    if pts:
        ax.step(*zip(*pts), where="post", color="black", lw=1.5, label="plan chosen (agent)")
    for k, c in _COLORS.items():
        xs = [r["sent_s"] for r in reqs if r["served_by"] == k]
        ys = [order.get(r["ran_as"], 0) for r in reqs if r["served_by"] == k]
        if xs:
            ax.scatter(xs, ys, s=10, color=c, label=f"request: {k}", alpha=0.7, zorder=3)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_ylim(-0.5, len(labels) - 0.5)
    ax.set_ylabel("where it ran")
    ax.legend(loc="upper right", fontsize=7, ncol=2)
    _shade_phases(ax, phases)

    ax = axes[2]
    for k, c in _COLORS.items():
        xs = [r["sent_s"] for r in reqs if r["served_by"] == k]
        ys = [r["latency_ms"] for r in reqs if r["served_by"] == k]
        if xs:
            ax.scatter(xs, ys, s=12, color=c, label=f"measured: {k}", zorder=3)
    pred = data["predicted"]
    for key, style, lab in (("edge_only_ms", "--", "predicted edge-only"),
                            ("cloud_only_ms", ":", "predicted cloud-only"),
                            ("best_ms", "-", "predicted best plan")):
        xs, ys = [], []
        for p, v in zip(phases, pred[key]):
            if v is not None and math.isfinite(v):
                xs += [p["start_s"], p["end_s"], float("nan")]
                ys += [v, v, float("nan")]
        if xs:
            ax.plot(xs, ys, style, color="gray" if key != "best_ms" else "black", lw=1.2, label=lab)
    ax.set_yscale("log")
    ax.set_ylabel("latency (ms)")
    ax.set_xlabel("time since the stream started (s)")
    ax.legend(loc="upper left", fontsize=7, ncol=2)
    _shade_phases(ax, phases)
    for a in axes:
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_compare(data: Mapping[str, Any], path: str) -> str:
    """Per link phase: the demo's measured median against predicted edge-only and cloud-only."""
    plt = _plt()
    phases = data["phases"]
    pred = data["predicted"]
    meas = data["measured_p50_ms"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    n = len(phases)
    width = 0.27
    series = (("measured: the demo (median)", meas, "#1f77b4", ""),
              ("predicted: edge-only", pred["edge_only_ms"], "#2ca02c", "//"),
              ("predicted: cloud-only", pred["cloud_only_ms"], "#7f7f7f", "//"))
    top = max([v for _, vals, _, _ in series for v in vals if v is not None and math.isfinite(v)] or [1.0])
    for j, (lab, vals, color, hatch) in enumerate(series):
        for i, v in enumerate(vals):
            x = i + (j - 1) * width
            if v is None or not math.isfinite(v):
                ax.text(x, top * 0.02, "no\nlink" if j == 2 else "n/a", ha="center", fontsize=7)
                continue
            ax.bar(x, v, width, color=color, hatch=hatch, edgecolor="white", label=lab if i == 0 or
                   all(u is None or not math.isfinite(u) for u in vals[:i]) else None)
            ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(n))
    ax.set_xticklabels([f"{p['label']}\n{p['start_s']:.0f}-{p['end_s']:.0f} s" for p in phases])
    ax.set_ylabel("latency per request (ms)")
    ax.set_title("chosen plan (measured) against edge-only and cloud-only (planner's prediction)")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _table(rows: Sequence[Sequence[Any]], head: Sequence[str]) -> str:
    h = "".join(f"<th>{html.escape(str(x))}</th>" for x in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(x))}</td>" for x in r) + "</tr>" for r in rows)
    return f"<table><tr>{h}</tr>{body}</table>"


def write_report(out_dir: str, data: Mapping[str, Any]) -> str:
    """Writes timeline.png, compare.png and index.html into `out_dir`; returns the HTML path."""
    os.makedirs(out_dir, exist_ok=True)
    plot_timeline(data, os.path.join(out_dir, "timeline.png"))
    plot_compare(data, os.path.join(out_dir, "compare.png"))
    c = data["counts"]
    counts = _table([[k, v] for k, v in c.items()], ["count", "value"])
    front = _table([[f"{r['up_lo_bps'] / 1e6:.3g}-{r['up_hi_bps'] / 1e6:.3g}", r["label"], r["sends"],
                     ", ".join(r["boundary"][:4]) + (" ..." if len(r["boundary"]) > 4 else ""),
                     f"{r['predicted_ms_mid']:.0f}"] for r in data["frontier"]],
                   ["uplink (Mbit/s)", "plan", "sends per request", "boundary tensors", "predicted ms (mid-range)"])
    env = data["setup"]
    setup = _table([[k, v] for k, v in env.items()], ["setting", "value"])
    v = data["verification"]
    ok = c["lost"] == 0 and c["doubled"] == 0 and c["answered"] == c["sent"] and v["mismatched"] == 0
    verdict = ("Every request got exactly one answer, equal to the whole model run locally." if ok
               else "Something went wrong: see the counts below.")
    title = html.escape(data["model"])
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>splitinfer demo: {title}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}}
table{{border-collapse:collapse;margin:.5em 0 1.5em}}
td,th{{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:left}}
.ok{{color:#2ca02c}}.bad{{color:#d62728}}img{{max-width:100%}}</style></head><body>
<h1>splitinfer demo: {title}</h1>
<p class="{'ok' if ok else 'bad'}"><b>{verdict}</b></p>
<h2>What happened</h2>
<p>The edge agent served a stream of requests while the link emulator replayed a trace: a fast link,
a step down, an outage and a recovery. Each dot below is one request, coloured by where it ran:
<i>remote</i> (head here, tail in the cloud), <i>local</i> (the whole model on the device) or
<i>local_tail</i> (the cloud failed or was late, so the device finished it).
Lines marked <i>predicted</i> are the planner's cost model with the profiles measured in this run;
dots are measured.</p>
<img src="timeline.png" alt="timeline">
<img src="compare.png" alt="comparison">
<h2>Counts</h2>{counts}
<p>Answers checked against the whole model on this host: {v['checked']} checked, {v['mismatched']} outside
their encoding's tolerance (max relative error {v['max_rel_err']:.2g}; tolerance {v['tolerance']:g} for an fp32
boundary, {v.get('tolerances', {}).get('fp16', v['tolerance']):g} for fp16; answers by encoding:
{', '.join(f'{k} {n}' for k, n in v.get('by_encoding', {}).items()) or 'none'}).</p>
<h2>Plan frontier</h2><p>The plans that are optimal somewhere in the uplink range, as the planner computed them
before the stream. The agent switches between these as its link estimate moves.</p>{front}
<h2>Set-up</h2>{setup}
<p>Raw data: <a href="report.json">report.json</a>.</p></body></html>"""
    path = os.path.join(out_dir, "index.html")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(page)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m splitinfer.report DEMO_REPORT_DIR (redraws index.html from report.json)")
        return 2
    with open(os.path.join(args[0], "report.json"), encoding="utf-8") as fh:
        data = json.load(fh)
    print(write_report(args[0], data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
