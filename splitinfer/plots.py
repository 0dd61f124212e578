"""Plots of the planner's what-ifs (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["SAME_REL_TOL", "compute_sweep_labels", "draw_sweep", "plot_sweep"]

logger = logging.getLogger(__name__)

# label, colour, line style, width, z-order. The chain scan is drawn dashed above the DAG
# optimum: the two are often equal, and a solid line underneath would hide.
_STYLE = {
    "edge_only": ("edge only", "tab:green", "--", 1.6, 2),
    "cloud_only": ("cloud only", "tab:blue", "--", 1.6, 2),
    "dag": ("DAG optimum (ours)", "black", "-", 1.6, 3),
    "chain": ("chain scan (Neurosurgeon)", "tab:orange", (0, (4, 3)), 2.4, 4),
}
_SHORT = {"edge_only": "edge only", "cloud_only": "cloud only", "chain": "chain scan", "dag": "DAG optimum"}
# Relative difference below which two series count as the same line: far below what a
# log axis 5.6 in tall can show (1e-3 is 0.01 mm per decade).
SAME_REL_TOL = 1e-3
_YLABEL = {"total_ms": "end-to-end latency (ms)", "period_ms": "pipeline period (ms per request)",
           "energy_mj": "device energy (mJ per request)"}


def _rate_label(bps: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} bit/s"


def _leading(v: float) -> int:
    """The leading digit of a positive number (2 for 0.02, 250, ...)."""
    return int(f"{v:e}"[0]) if v > 0 else 0


def _same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= SAME_REL_TOL * max(abs(a), abs(b))


def compute_sweep_labels(series: Mapping[str, Sequence[float | None]]) -> dict[str, str]:
    """Legend label of each series, saying where one line lies on another.

    A series equal to one drawn before it at every rate says so ("chain scan
    (Neurosurgeon) = DAG optimum at every rate"); the chain scan, the peer the DAG
    optimum is compared with, also says at how many rates it equals the DAG optimum
    when it does at some. Equal means within `SAME_REL_TOL`.
    """
    labels = {}
    drawn: list[str] = []
    for key, (label, *_style) in _STYLE.items():
        ys = series.get(key)
        if ys is None:
            continue
        for other in drawn:
            if all(_same(a, b) for a, b in zip(ys, series[other], strict=True)):
                label += f" = {_SHORT[other]} at every rate"
                break
        else:
            if key == "chain" and "dag" in series:
                n = sum(a is not None and _same(a, b) for a, b in zip(ys, series["dag"], strict=True))
                if n:
                    label += f" = {_SHORT['dag']} at {n} of {len(ys)} rates"
        labels[key] = label
        drawn.append(key)
    return labels


def plot_sweep(sweep: Mapping[str, Any], path: str) -> str:
    """Draw a sweep (the service's /v1/sweep answer) to ``path`` (PNG); returns the path."""
    fig = draw_sweep(sweep)
    import matplotlib.pyplot as plt

    try:
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        fig.savefig(path)
    finally:
        plt.close(fig)
    logger.info("wrote the sweep plot to %s", path)
    return path


def draw_sweep(sweep: Mapping[str, Any]) -> Any:
    """The sweep's figure (matplotlib, Agg): the caller saves and closes it.

    Log-log axes; the DAG optimum's breakpoints are dotted verticals labelled with the
    rate and the number of device layers above it. Lines that coincide are named in the
    legend (`compute_sweep_labels`), and the chain scan is dashed on top of the DAG
    optimum so both stay visible where they agree.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    ups = [u / 1e6 for u in sweep["uplink_bps"]]
    labels = compute_sweep_labels(sweep["series"])
    fig, ax = plt.subplots(figsize=(9.5, 5.6), dpi=120)
    try:
        for key, (_label, color, ls, lw, z) in _STYLE.items():
            ys = sweep["series"][key]
            pts = [(x, y) for x, y in zip(ups, ys) if y is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ls=ls, color=color, lw=lw, label=labels[key],
                        zorder=z, gid=key)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ymin, ymax = ax.get_ylim()
        # a link-starved cloud-only curve can reach 1000x the rest; keep the crossings readable
        best = [y for y in sweep["series"]["dag"] if y is not None]
        if best:
            ymax = min(ymax, 12.0 * max(best))
        for i, bp in enumerate(sweep["breakpoints"]):
            x = bp["up_bps"] / 1e6
            ax.axvline(x, color="tab:red", ls=":", lw=1.0, zorder=1)
            above = bp["above"]
            text = f"{_rate_label(bp['up_bps'])}\n{above['edge_layers']} dev layers"
            # stagger the labels so neighbouring breakpoints stay readable
            y = ymax / (1.35 ** (1 + 2 * (i % 3)))
            # labels near the right edge go on the line's left so they stay inside the axes
            right = x > ups[-1] ** 0.85 * ups[0] ** 0.15
            ax.annotate(text, (x, y), xytext=(-3 if right else 3, 0), textcoords="offset points",
                        fontsize=7.5, color="tab:red", va="top", ha="right" if right else "left")
        ax.set_ylim(ymin, ymax)
        ax.set_xlabel("uplink bandwidth (Mbit/s, log scale)")
        ax.set_ylabel(_YLABEL.get(sweep["metric"], sweep["metric"]) + ", log scale")
        rtt = sweep.get("rtt_ms", 0.0)
        title = (f"{sweep['model']}: {sweep['objective']} against uplink "
                 f"(edge {sweep['edge_device']}, cloud {sweep['cloud_device']}, RTT {rtt:g} ms)")
        g = sweep.get("max_gain") or {}
        if g.get("vs_chain") is not None:
            title += (f"\nDAG optimum: up to {g['vs_chain']:.2f}x faster than the chain scan, "
                      f"{g['vs_best_single_tier']:.2f}x than the better single tier")
        ax.set_title(title, fontsize=10)
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if _leading(v) in (2, 5) else ""))
        ax.xaxis.set_major_formatter(plain)
        ax.grid(True, which="major", alpha=0.35)
        ax.grid(True, which="minor", alpha=0.12)
        handles, legend = ax.get_legend_handles_labels()
        if sweep["breakpoints"]:
            from matplotlib.lines import Line2D

            handles.append(Line2D([], [], color="tab:red", ls=":", lw=1.0))
            kind = "exact" if all(b["exact"] for b in sweep["breakpoints"]) else "sampled"
            legend.append(f"breakpoint ({kind}): DAG optimum changes cut")
        ax.legend(handles, legend, loc="best", fontsize=8.5, framealpha=0.9)
        fig.tight_layout()
    except BaseException:
        plt.close(fig)
        raise
    return fig
