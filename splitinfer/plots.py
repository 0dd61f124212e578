"""Plots of the planner's what-ifs (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["plot_sweep"]

logger = logging.getLogger(__name__)

_STYLE = {
    "edge_only": ("edge only", "tab:green", "--", 1.6),
    "cloud_only": ("cloud only", "tab:blue", "--", 1.6),
    "chain": ("chain scan (Neurosurgeon)", "tab:orange", "-", 2.2),
    "dag": ("DAG optimum (ours)", "black", "-", 1.4),
}
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


def plot_sweep(sweep: Mapping[str, Any], path: str) -> str:
    """Draw a sweep (the service's /v1/sweep answer) to ``path`` (PNG); returns the path.

    Log-log axes; the DAG optimum's breakpoints are dashed verticals labelled with the
    rate and the number of device layers above it.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    ups = [u / 1e6 for u in sweep["uplink_bps"]]
    fig, ax = plt.subplots(figsize=(9.5, 5.6), dpi=120)
    try:
        for key, (label, color, ls, lw) in _STYLE.items():
            ys = sweep["series"][key]
            pts = [(x, y) for x, y in zip(ups, ys) if y is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, color=color, lw=lw, label=label,
                        zorder=3 if key == "dag" else 2)
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
        handles, labels = ax.get_legend_handles_labels()
        if sweep["breakpoints"]:
            from matplotlib.lines import Line2D

            handles.append(Line2D([], [], color="tab:red", ls=":", lw=1.0))
            kind = "exact" if all(b["exact"] for b in sweep["breakpoints"]) else "sampled"
            labels.append(f"breakpoint ({kind}): DAG optimum changes cut")
        ax.legend(handles, labels, loc="best", fontsize=8.5, framealpha=0.9)
        fig.tight_layout()
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        fig.savefig(path)
    finally:
        plt.close(fig)
    logger.info("wrote the sweep plot to %s", path)
    return path
