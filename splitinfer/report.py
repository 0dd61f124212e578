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

_COLORS = {"split": "#9467bd", "remote": "#1f77b4", "local": "#2ca02c", "local_tail": "#ff7f0e", "error": "#d62728"}


def _served(r: Mapping[str, Any]) -> str:
    """How a request was served; reports written before `served_as` existed say only `served_by`."""
    return str(r.get("served_as") or r["served_by"])


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
        xs = [r["sent_s"] for r in reqs if _served(r) == k]
        ys = [order.get(r["ran_as"], 0) for r in reqs if _served(r) == k]
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
        xs = [r["sent_s"] for r in reqs if _served(r) == k]
        ys = [r["latency_ms"] for r in reqs if _served(r) == k]
        if xs:
            ax.scatter(xs, ys, s=12, color=c, label=f"measured: {k}", zorder=3)
    pred = data["predicted"]
    for key, style, lab in (("edge_only_ms", "--", "predicted edge-only"),
                            ("cloud_only_ms", ":", "predicted cloud-only"),
                            ("split_ms", "-.", "predicted best split"),
                            ("best_ms", "-", "predicted best plan")):
        xs, ys = [], []
        for p, v in zip(phases, pred.get(key) or []):
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
    width = 0.2
    series = [("measured: the demo (median)", meas, "#1f77b4", ""),
              ("predicted: edge-only", pred["edge_only_ms"], "#2ca02c", "//"),
              ("predicted: cloud-only" + _encodings(pred.get("cloud_only_encoding")), pred["cloud_only_ms"],
               "#7f7f7f", "//")]
    if pred.get("split_ms"):
        series.append(("predicted: best split", pred["split_ms"], "#9467bd", "//"))
    top = max([v for _, vals, _, _ in series for v in vals if v is not None and math.isfinite(v)] or [1.0])
    for j, (lab, vals, color, hatch) in enumerate(series):
        for i, v in enumerate(vals):
            x = i + (j - (len(series) - 1) / 2) * width
            if v is None or not math.isfinite(v):
                ax.text(x, top * 0.02, "no\nlink" if j >= 2 else "n/a", ha="center", fontsize=7)
                continue
            ax.bar(x, v, width, color=color, hatch=hatch, edgecolor="white", label=lab if i == 0 or
                   all(u is None or not math.isfinite(u) for u in vals[:i]) else None)
            ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(n))
    ax.set_xticklabels([f"{p['label']}\n{p['start_s']:.0f}-{p['end_s']:.0f} s" for p in phases])
    ax.set_ylabel("latency per request (ms)")
    ax.set_title("chosen plan (measured) against edge-only, cloud-only and split (planner's prediction)")
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles))
    ax.legend(uniq.values(), uniq.keys(), fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _encodings(encs: Sequence[str | None] | None) -> str:
    """' (fp16)' when the predictions are for one encoding, ' (fp16/fp32)' for several."""
    seen = sorted({e for e in encs or [] if e})
    return f" ({'/'.join(seen)})" if seen else ""


def _ms(x: Any) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{float(x):.1f} ms" if abs(float(x)) < 10 else f"{float(x):.0f} ms"


def _explanations(data: Mapping[str, Any]) -> str:
    """The ratio, the gap between predicted and measured local latency, and skipped frames, in numbers."""
    out = []
    emu = data.get("emulation") or {}
    ref = emu.get("reference")
    env = data["setup"]
    if ref:
        how = (f"its work stretched {emu.get('slowdown', '?')}x in time, the factor that makes it that many times slower"
               if emu.get("slowdown_from") == "reference ratio"
               else f"its work stretched {emu.get('slowdown', '?')}x in time (from {emu.get('slowdown_from', 'the flags')})")
        out.append(f"""<h2>The device and the cloud</h2><p>The device is emulated as an <b>{html.escape(ref['edge_device'])}</b>
against a <b>{html.escape(ref['cloud_device'])}</b> cloud: the planner's reference roofline profiles of {html.escape(data['model'])}
take {ref['edge_ms']:.3g} ms and {ref['cloud_ms']:.3g} ms, <b>{ref['ratio']:.3g}x</b>. Here the cloud is this host's cores
({env.get('cloud_model_ms')} ms for the model, measured) and the device one ONNX Runtime thread, {how}: every engine run and
encode on the device takes that many times the CPU time it spent. The model takes {env.get('edge_model_ms')} ms there,
<b>{env.get('edge_over_cloud')}x</b> the cloud. Link rates are the trace's, unscaled.</p>""")
    gap = data.get("local_gap")
    if gap and gap.get("local_answers"):
        out.append(f"""<h2>Why local answers take longer than predicted</h2>
<p>The prediction for a local answer is the model's time on the emulated device: <b>{_ms(gap['predicted_ms'])}</b>.
The {gap['local_answers']} local answers took a median <b>{_ms(gap['measured_app_p50_ms'])}</b> as the app measured them
({_ms(gap['measured_agent_p50_ms'])} inside the agent). The parts:</p><ul>
<li><b>the agent's own Python</b> (decoding the app's msgpack request, the hop to the engine's thread and back, encoding
the answer) and the app's HTTP call over the unix socket: the difference between the two medians above and the
prediction;</li>
<li><b>sharing the device</b>: the agent answers up to --window requests at once, and the device's one core runs them
one after the other: {gap['local_answers_sharing_the_device']} of the local answers overlapped another one on the device
(median {_ms(gap['measured_shared_p50_ms'])}, against {_ms(gap['measured_alone_p50_ms'])} for those that ran alone).
The agent does not batch local runs.</li></ul>
<p>What these parts leave is other work on this host delaying the agent's threads.</p>
<p>The agent learns the ratio of measured to predicted latency as answers come (its <code>latency_factors</code> in
<code>/v1/status</code>) and plans with it, which is why it may offload a little below the frontier's breakpoint.</p>""")
    skips = data.get("skip_reasons")
    c = data["counts"]
    if skips is not None:
        rows = "".join(f"<li>{html.escape(k)}: {v}</li>" for k, v in skips.items())
        out.append(f"""<h2>Skipped frames</h2><p>The app sends a frame every 1/fps s ({env.get('fps')} fps) and keeps at most
--window ({env.get('window')}) requests unanswered: a frame whose tick finds the window full is skipped, as a camera drops
a frame rather than queue without bound. It is never sent, so it is neither lost nor answered.
{c['frames_skipped']} of {c['sent'] + c['frames_skipped']} ticks were skipped, by what held the window:</p><ul>{rows}</ul>""")
    return "".join(out)


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
    verdict = ("Every request got exactly one answer, equal to the whole model run locally within its encoding's "
               "tolerance." if ok else "Something went wrong: see the counts below.")
    if "served_split" in c:
        verdict += (f" {c['served_split']} answers were split (head on the device, tail in the cloud), "
                    f"{c['served_remote']} ran in the cloud, {c['served_local']} on the device and "
                    f"{c['served_fallback']} were finished on the device after the cloud failed or was late.")
    per_enc = v.get("per_encoding") or {}
    checks = ("; ".join(f"{html.escape(e)}: {m['answers']} answers, max relative error {m['max_rel_err']:.2g}, "
                        f"tolerance {m['tolerance']:g}, {m['mismatched']} outside" for e, m in per_enc.items())
              or f"max relative error {v['max_rel_err']:.2g}")
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
<i>split</i> (the head on the device, the tail in the cloud), <i>remote</i> (the whole model in the cloud),
<i>local</i> (the whole model on the device) or <i>local_tail</i> (the cloud failed or was late, so the device
finished it). Lines marked <i>predicted</i> are the planner's cost model with the profiles measured in this run,
for the encoding the planner chooses (the boundary or input as fp16 where that is faster); dots are measured.</p>
<img src="timeline.png" alt="timeline">
<img src="compare.png" alt="comparison">
<h2>Counts</h2>{counts}
<p>Every answer is compared with the whole model run in one ONNX Runtime session on this host, on the same frame:
the largest absolute difference over the largest absolute output, against a tolerance per encoding of what crossed
the link (local answers count as fp32). {v['checked']} checked, {v['mismatched']} outside their tolerance;
{checks}.</p>
<h2>Plan frontier</h2><p>The plans that are optimal somewhere in the uplink range, as the planner computed them
before the stream. The agent switches between these as its link estimate moves.</p>{front}
{_explanations(data)}
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
