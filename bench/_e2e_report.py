"""The e2e benchmark's headline figures and plots, computed from the measured runs.

Pure arithmetic over `ModelRun.to_dict()` rows (`compute_summary`) and four PNGs
(`write_plots`): the regret of every strategy per model and link, our speed-up over the
better of edge-only and cloud-only as a heat map, predicted against measured latency, and
latency against agreement per strategy for one real-weight model at two uplinks.

Every regret is against the oracle *within the accuracy budget*: the fastest measured
cut and encoding whose agreement with the fp32 model is at least
``summary.accuracy_budget.min_agreement`` (fp32 and edge-only agree fully; the others
carry the accuracy table's figure).
"""

from __future__ import annotations

import math
import os
from statistics import median
from typing import Any

__all__ = ["REGRET_DPI", "STRATEGIES", "TARGETS", "accuracy_model", "compute_summary", "draw_accuracy", "draw_regret",
           "markdown_table", "regret_layout", "write_plots"]

STRATEGIES = ("edge-only", "cloud-only", "neurosurgeon", "dads", "dads_encoded", "cloud_only_jpeg", "ours")
TARGETS = {"regret_geomean": 1.05, "regret_worst": 1.15, "cost_model_median_abs_pct_error": 10.0}


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def _p50(link: dict[str, Any], strategy: str) -> float | None:
    m = link["strategies"][strategy]["measured"]
    return None if m is None else float(m["p50_ms"])


def compute_summary(models: list[dict[str, Any]], min_agreement: float = 0.99) -> dict[str, Any]:
    """Regret per strategy against the oracle within the `min_agreement` budget, each
    strategy's agreement, our speed-up, and the cost model's error, over every model and link."""
    regrets: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    bounds: dict[str, int] = {s: 0 for s in STRATEGIES}
    speedups: list[float] = []
    cells = []
    errors_all: list[float] = []
    errors_chosen: list[float] = []
    for m in models:
        for lk in m["links"]:
            oracle = float(lk["oracle"]["p50_ms"])
            cell: dict[str, Any] = {"model": m["model"], "up_mbps": lk["up_bps"] / 1e6, "oracle_ms": oracle,
                                    "regret": {}}
            for s in STRATEGIES:
                if s not in lk["strategies"] or lk["strategies"][s].get("cut_id") is None:
                    continue  # no plan (cloud_only_jpeg: no JPEG quality meets the budget)
                v = _p50(lk, s)
                if v is not None:
                    regrets[s].append(v / oracle)
                    cell["regret"][s] = v / oracle
                elif "lower_bound_ms" in lk["strategies"][s]:
                    # not run: its measured lower bound already lost by 10x (bench._e2e_run)
                    regrets[s].append(lk["strategies"][s]["lower_bound_ms"] / oracle)
                    cell.setdefault("regret_at_least", {})[s] = regrets[s][-1]
                    bounds[s] += 1
            ours, edge, cloud = _p50(lk, "ours"), _p50(lk, "edge-only"), _p50(lk, "cloud-only")
            base = min(x for x in (edge, cloud) if x is not None) if (edge or cloud) else None
            if ours is not None and base is not None:
                cell["speedup_vs_best_single_side"] = base / ours
                speedups.append(base / ours)
            cells.append(cell)
            chosen = {(lk["strategies"][s]["cut_id"], lk["strategies"][s]["encoding"]) for s in STRATEGIES
                      if s in lk["strategies"]}
            for c in lk["candidates"]:
                e = abs(c["predicted_ms"] - c["p50_ms"]) / c["p50_ms"] * 100.0
                errors_all.append(e)
                if (c["cut_id"], c["encoding"]) in chosen:
                    errors_chosen.append(e)
    throughput = []
    for m in models:
        for lk in m["links"]:
            ld = lk.get("load")
            if not ld or "ours" not in ld["strategies"]:
                continue
            base = {s: v["achieved_hz"] for s, v in ld["strategies"].items() if s != "ours"}
            best = max(base, key=base.__getitem__)
            ours_hz = ld["strategies"]["ours"]["achieved_hz"]
            throughput.append({"model": m["model"], "up_mbps": lk["up_bps"] / 1e6, "offered_hz": ld["offered_hz"],
                               "ours_hz": ours_hz, "best_baseline": best, "best_baseline_hz": base[best],
                               "ratio": ours_hz / base[best] if base[best] > 0 else float("inf")})
    per_strategy = {s: {"geomean": _geomean(v), "worst": max(v) if v else float("nan"), "n": len(v),
                        "n_lower_bounds": bounds[s]} for s, v in regrets.items()}
    ours = per_strategy["ours"]
    accuracy = _accuracy(models)
    below = [c for c in _cells_of(models) if (c[2].get("ours", {}).get("agreement") or 0.0) < min_agreement]
    err = median(errors_all) if errors_all else float("nan")
    return {
        "regret": per_strategy,
        "speedup_vs_best_single_side": {"geomean": _geomean(speedups), "max": max(speedups, default=float("nan")),
                                        "min": min(speedups, default=float("nan"))},
        "cost_model_median_abs_pct_error": err,
        "cost_model_median_abs_pct_error_chosen_plans": median(errors_chosen) if errors_chosen else float("nan"),
        "cost_model_points": len(errors_all),
        "targets": TARGETS,
        "meets": {"ours_within_budget": not below,
                  "regret_geomean": ours["geomean"] <= TARGETS["regret_geomean"],
                  "regret_worst": ours["worst"] <= TARGETS["regret_worst"],
                  "cost_model_median_abs_pct_error": err <= TARGETS["cost_model_median_abs_pct_error"]},
        "cells": cells,
        "throughput": throughput,
        "accuracy_budget": {"min_agreement": min_agreement,
                            "oracle": "the fastest measured cut and encoding whose agreement is at least the budget",
                            "ours_below_budget": len(below)},
        "accuracy": accuracy,
        "ratios": _ratios(models),
        "splitting": _splitting(models),
        "encode_measured_over_predicted": _encode_ratios(models),
    }


def _encode_ratios(models: list[dict[str, Any]]) -> dict[str, Any]:
    """Per cast (fp32, fp16, int8), the median of measured / predicted encode ms over the
    measured candidates that send something, and over how many: the device codec's error."""
    by: dict[str, list[float]] = {}
    for m in models:
        for lk in m["links"]:
            for c in lk["candidates"]:
                pred = c.get("predicted", {}).get("encode_ms", 0.0)
                if c["encoding"] in ("fp32", "fp16", "int8") and pred > 0:
                    by.setdefault(c["encoding"], []).append(c["encode_ms"] / pred)
    return {k: {"median": median(v), "n": len(v)} for k, v in sorted(by.items())}


def _cells_of(models: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    return [(m["model"], lk, lk["strategies"]) for m in models for lk in m["links"]]


def _accuracy(models: list[dict[str, Any]]) -> dict[str, Any]:
    """Per strategy: the predicted agreement of its picks (min, median over cells) and the
    measured agreement of its first answer per cell with the whole model's (the check)."""
    out: dict[str, Any] = {}
    for s in STRATEGIES:
        pred = [st[s]["agreement"] for _, _, st in _cells_of(models) if st.get(s, {}).get("agreement") is not None]
        checked = [st[s]["measured"]["check_agreement"] for _, _, st in _cells_of(models)
                   if (st.get(s, {}).get("measured") or {}).get("check_agreement") is not None]
        out[s] = {"min_agreement": min(pred, default=float("nan")),
                  "median_agreement": median(pred) if pred else float("nan"), "n": len(pred),
                  "checked_answers": len(checked), "checked_min_agreement": min(checked, default=float("nan")),
                  "checked_median_agreement": median(checked) if checked else float("nan")}
    return out


def _ratios(models: list[dict[str, Any]]) -> dict[str, Any]:
    """Ours' measured p50 over dads_encoded's and over cloud_only_jpeg's, geomean over the
    cells where both ran (below 1: ours is faster)."""
    out: dict[str, Any] = {}
    for other in ("dads_encoded", "cloud_only_jpeg"):
        xs = []
        per_model: dict[str, list[float]] = {}
        for name, lk, _ in _cells_of(models):
            if lk["strategies"].get(other) is None:
                continue
            a, b = _p50(lk, "ours"), _p50(lk, other) if lk["strategies"][other].get("cut_id") else None
            if a is not None and b is not None:
                xs.append(a / b)
                per_model.setdefault(name, []).append(a / b)
        out[f"ours_over_{other}"] = {"geomean": _geomean(xs), "min": min(xs, default=float("nan")),
                                     "max": max(xs, default=float("nan")), "n": len(xs),
                                     "per_model_geomean": {k: _geomean(v) for k, v in per_model.items()},
                                     "meaning": f"ours' measured p50 / {other}'s, per cell where both ran; "
                                                "below 1: ours is faster"}
    return out


def _splitting(models: list[dict[str, Any]]) -> dict[str, Any]:
    """Where a mid-network cut is the oracle within the budget and beats the better of
    edge-only, cloud-only and cloud_only_jpeg as measured; the models where it never does."""
    pays, per_model = [], {}
    for m in models:
        n_layers = m.get("setup", {}).get("layers")
        wins = 0
        for lk in m["links"]:
            o = lk["oracle"]
            mid = 0 < o["device_layers"] < (n_layers or 10**9)
            sides = [x for x in (_p50(lk, s) for s in ("edge-only", "cloud-only", "cloud_only_jpeg")
                                 if lk["strategies"].get(s, {}).get("cut_id")) if x is not None]
            if mid and sides and o["p50_ms"] < min(sides):
                wins += 1
                pays.append({"model": m["model"], "up_mbps": lk["up_bps"] / 1e6, "oracle_encoding": o["encoding"],
                             "device_layers": o["device_layers"], "gain_over_best_side": min(sides) / o["p50_ms"]})
        per_model[m["model"]] = wins
    never = [k for k, v in per_model.items() if v == 0]
    note = ("splitting pays in no cell: on every link the fastest plan within the budget runs the whole model "
            "on the device, or sends the model input (as it is or through a codec)" if not pays else
            f"splitting pays in {len(pays)} of {sum(len(m['links']) for m in models)} cells; "
            + (f"it pays in no cell of {', '.join(never)}" if never else "it pays in some cell of every model"))
    return {"pays_in": pays, "cells_where_split_pays": len(pays), "does_not_pay_on": never, "note": note}


REGRET_DPI = 110
_REGRET_CAP = 5.0
_PANEL_W_IN, _PANEL_H_IN, _MAX_FIG_W_IN = 7.0, 2.3, 22.0


def _cell_rtts_ms(models: list[dict[str, Any]], cells: list[dict[str, Any]]) -> list[float]:
    """Each cell's RTT: `compute_summary` makes one cell per model and link, in that order."""
    links = [(m["model"], lk["up_bps"] / 1e6, float(lk["rtt_ms"])) for m in models for lk in m["links"]]
    if [(m, u) for m, u, _ in links] != [(c["model"], c["up_mbps"]) for c in cells]:
        raise ValueError("the summary's cells do not match the models' links; recompute it with compute_summary")
    return [r for _, _, r in links]


def regret_layout(n_models: int, n_ups: int, n_rtts: int) -> tuple[int, int, tuple[float, float]]:
    """Rows, columns and size in inches of the regret figure: a panel per model and RTT.

    Columns are the RTTs (with one RTT, the models wrap into three columns); a panel
    narrows with fewer uplinks, and the figure is never wider than `_MAX_FIG_W_IN`.
    """
    ncols = n_rtts if n_rtts > 1 else min(3, n_models)
    nrows = math.ceil(n_models * n_rtts / ncols)
    panel_w_in = min(_PANEL_W_IN, max(3.0, 0.55 * n_ups + 1.0), (_MAX_FIG_W_IN - 0.8) / ncols)
    return nrows, ncols, (0.8 + panel_w_in * ncols, 1.2 + _PANEL_H_IN * nrows)


def draw_regret(models: list[dict[str, Any]], summary: dict[str, Any]) -> Any:
    """The regret of every strategy, one panel per model and RTT (rows: models, columns: RTTs).

    One panel per model and RTT keeps the figure at most `_MAX_FIG_W_IN` inches wide
    (about 2,400 px at `REGRET_DPI`) however large the grid: a single row of bars for
    9 models x 7 uplinks x 3 RTTs is 19,000 px wide. With one RTT the models wrap into
    three columns. The y axis is logarithmic so that 1.05 and 1.15 stay apart next to
    a capped 5; a strategy not run because its measured lower bound already lost is a
    hatched bar at that bound. Returns the matplotlib figure (Agg).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cells = summary["cells"]
    rtts_of = _cell_rtts_ms(models, cells)
    names = list(dict.fromkeys(c["model"] for c in cells))
    rtts = sorted(set(rtts_of))
    ups = sorted({c["up_mbps"] for c in cells})
    facets = [(n, r) for n in names for r in rtts]
    nrows, ncols, size_in = regret_layout(len(names), len(ups), len(rtts))
    fig, axes = plt.subplots(nrows, ncols, figsize=size_in, sharex=True, sharey=True, squeeze=False,
                             layout="constrained")
    by_facet = {(c["model"], r): [] for c, r in zip(cells, rtts_of)}
    for c, r in zip(cells, rtts_of):
        by_facet[(c["model"], r)].append(c)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    w = 0.8 / len(STRATEGIES)
    x = np.arange(len(ups))
    for k, ax in enumerate(axes.flat):
        if k >= len(facets):
            ax.set_visible(False)
            continue
        name, rtt = facets[k]
        at = {c["up_mbps"]: c for c in by_facet[(name, rtt)]}
        for i, s in enumerate(STRATEGIES):
            xs = x + (i - (len(STRATEGIES) - 1) / 2) * w
            run = [at[u]["regret"].get(s, np.nan) if u in at else np.nan for u in ups]
            bound = [at[u].get("regret_at_least", {}).get(s, np.nan) if u in at else np.nan for u in ups]
            ax.bar(xs, np.minimum(run, _REGRET_CAP), w, color=colors[i % len(colors)], label=s)
            ax.bar(xs, np.minimum(bound, _REGRET_CAP), w, facecolor="none", edgecolor=colors[i % len(colors)],
                   hatch="///", lw=0.6)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(TARGETS["regret_worst"], color="r", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set_ylim(0.9, _REGRET_CAP * 1.15)
        ax.set_yticks([1, TARGETS["regret_worst"], 1.5, 2, 3, 5], ["1", f"{TARGETS['regret_worst']:g}", "1.5",
                                                                     "2", "3", "5"])
        ax.minorticks_off()
        ax.set_title(f"{name}, RTT {rtt:g} ms", fontsize=9)
        ax.tick_params(labelsize=8)
        ax.set_xticks(x, [f"{u:g}" for u in ups])
        ax.tick_params(axis="x", labelbottom=True)
    for ax in axes[-1]:
        ax.set_xlabel("uplink Mbit/s (downlink 4x)", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("p50 / oracle p50", fontsize=8)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    handles += [matplotlib.patches.Patch(facecolor="none", edgecolor="0.3", hatch="///"),
                matplotlib.lines.Line2D([], [], color="r", lw=0.8, ls="--")]
    labels += ["not run: measured lower bound", f"target worst {TARGETS['regret_worst']:g}"]
    # The title rides on the legend: constrained layout places a suptitle over an outside legend.
    fig.legend(handles, labels, loc="outside upper center", ncol=4 if ncols < 3 else min(len(labels), 5), fontsize=9,
               frameon=False, title="Regret against the measured oracle (lower is better, 1 = oracle; capped at 5)",
               title_fontsize=11)
    return fig


_MARKERS = {"edge-only": "s", "cloud-only": "^", "neurosurgeon": "v", "dads": "D", "dads_encoded": "P",
            "cloud_only_jpeg": "X", "ours": "o"}


def accuracy_model(models: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """The model of the accuracy plot and two of its links (the slowest and the fastest
    uplink): the real-weight model whose picks agree least (where the budget binds), else
    the first model."""
    if not models:
        return None

    def lowest(x: dict[str, Any]) -> float:
        return min((st.get("agreement") if st.get("agreement") is not None else 1.0)
                   for lk in x["links"] for st in lk["strategies"].values())

    real = [x for x in models if x.get("setup", {}).get("real_weights") and x["links"]]
    m = min(real, key=lowest) if real else models[0]
    links = sorted(m["links"], key=lambda lk: lk["up_bps"])
    if not links:
        return None
    return m, [links[0], links[-1]] if len(links) > 1 else links


def draw_accuracy(models: list[dict[str, Any]], summary: dict[str, Any]) -> Any:
    """Measured p50 latency against predicted agreement per strategy, one panel per uplink."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    picked = accuracy_model(models)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), squeeze=False)
    budget = summary.get("accuracy_budget", {}).get("min_agreement")
    if picked is None:
        return fig
    m, links = picked
    lowest_agreement = min((st.get("agreement") if st.get("agreement") is not None else 1.0)
                           for lk in links for st in lk["strategies"].values())
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, lk in zip(axes[0], links):
        for i, s in enumerate(STRATEGIES):
            st = lk["strategies"].get(s) or {}
            v = _p50(lk, s) if st.get("cut_id") else None
            if v is None or st.get("agreement") is None:
                continue
            ax.scatter([st["agreement"]], [v], s=70, marker=_MARKERS[s], color=colors[i % len(colors)],
                       label=f"{s} ({st['encoding']}, {st.get('device_layers', 0)} layers)", alpha=0.85)
        o = lk["oracle"]
        ax.axhline(o["p50_ms"], color="0.5", lw=0.8, ls=":")
        if budget is not None:
            ax.axvline(budget, color="r", lw=0.8, ls="--")
            ax.set_xlim(min(budget, lowest_agreement) - 0.004, 1.002)
        ax.set_yscale("log")
        ax.set_xlabel("agreement with the fp32 model (accuracy table)")
        ax.set_ylabel("measured p50 ms")
        ax.set_title(f"{lk['up_bps'] / 1e6:g} Mbit/s up, RTT {lk.get('rtt_ms', 0):g} ms", fontsize=10)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle(f"{m['model']}: latency against agreement per strategy (red dashed: budget "
                 f"{budget}; dotted: oracle within it)", fontsize=11)
    fig.tight_layout()
    return fig


def write_plots(models: list[dict[str, Any]], summary: dict[str, Any], out_dir: str, stem: str = "e2e") -> list[str]:
    """Writes `<stem>_regret.png`, `<stem>_speedup.png`, `<stem>_error.png` and
    `<stem>_accuracy.png`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    paths = []
    cells = summary["cells"]
    fig = draw_regret(models, summary)
    paths.append(os.path.join(out_dir, f"{stem}_regret.png"))
    fig.savefig(paths[-1], dpi=REGRET_DPI)
    plt.close(fig)

    names = [m["model"] for m in models]
    ups = sorted({c["up_mbps"] for c in cells})
    grid = np.full((len(names), len(ups)), np.nan)
    per_cell: dict[tuple[int, int], list[float]] = {}
    for c in cells:  # one value per model and uplink: the geomean over the RTTs
        if "speedup_vs_best_single_side" in c:
            per_cell.setdefault((names.index(c["model"]), ups.index(c["up_mbps"])), []).append(
                c["speedup_vs_best_single_side"])
    for (i, j), xs in per_cell.items():
        grid[i, j] = _geomean(xs)
    fig, ax = plt.subplots(figsize=(1.3 * len(ups) + 3, 0.7 * len(names) + 2))
    im = ax.imshow(grid, cmap="viridis", aspect="auto")
    for i in range(len(names)):
        for j in range(len(ups)):
            if not np.isnan(grid[i, j]):
                light = grid[i, j] > np.nanmin(grid) + 0.6 * (np.nanmax(grid) - np.nanmin(grid))
                ax.text(j, i, f"{grid[i, j]:.2f}x", ha="center", va="center", color="k" if light else "w", fontsize=9)
    ax.set_xticks(range(len(ups)), [f"{u:g}" for u in ups])
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("uplink Mbit/s (downlink 4x)")
    n_rtt = max((len(xs) for xs in per_cell.values()), default=1)
    ax.set_title("Speed-up of ours over the better of edge-only and cloud-only (measured p50)"
                 + (f"\ngeomean over {n_rtt} RTTs" if n_rtt > 1 else ""))
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, f"{stem}_speedup.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 5))
    lo, hi = float("inf"), 0.0
    for m in models:
        xs = [c["predicted_ms"] for lk in m["links"] for c in lk["candidates"]]
        ys = [c["p50_ms"] for lk in m["links"] for c in lk["candidates"]]
        ax.scatter(xs, ys, s=12, label=m["model"])
        lo, hi = min([lo, *xs, *ys]), max([hi, *xs, *ys])
    if hi > 0:
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        ax.plot([lo, hi], [lo * 1.1, hi * 1.1], "k:", lw=0.6)
        ax.plot([lo, hi], [lo / 1.1, hi / 1.1], "k:", lw=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("predicted end-to-end ms (planner.evaluate)")
    ax.set_ylabel("measured p50 ms")
    ax.set_title(f"Cost model: median |error| {summary['cost_model_median_abs_pct_error']:.1f}% (dotted: +-10%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, f"{stem}_error.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig = draw_accuracy(models, summary)
    paths.append(os.path.join(out_dir, f"{stem}_accuracy.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def markdown_table(doc: dict[str, Any]) -> str:
    """The README's results table, drawn from a written e2e JSON (`python -m bench.e2e --markdown`)."""
    s, cfg = doc["summary"], doc["config"]
    by_model: dict[str, list[dict[str, Any]]] = {}
    for c in s["cells"]:
        by_model.setdefault(c["model"], []).append(c)
    budget = s.get("accuracy_budget", {}).get("min_agreement", cfg.get("min_agreement"))
    others = ("neurosurgeon", "dads", "dads_encoded", "cloud_only_jpeg", "edge-only", "cloud-only")
    lines = [f"End to end, {len(s['cells'])} cells ({len(by_model)} models x uplinks "
             f"{', '.join(f'{u:g}' for u in cfg['uplinks_mbps'])} Mbit/s x RTT "
             f"{', '.join(f'{r:g}' for r in cfg['rtts_ms'])} ms), measured p50 / the measured oracle's "
             f"within agreement ≥ {budget:g}:",
             "",
             "| model | regret: ours geomean (worst) | Neurosurgeon | DADS | DADS encoded | cloud-only JPEG "
             "| edge-only | cloud-only | ours vs better single side: geomean (max) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def gm(cells: list[dict[str, Any]], k: str) -> str:
        xs = [c["regret"][k] for c in cells if k in c["regret"]]
        xs += [c["regret_at_least"][k] for c in cells if k in c.get("regret_at_least", {})]
        bound = any(k in c.get("regret_at_least", {}) for c in cells)
        return ("≥ " if bound else "") + f"{_geomean(xs):.2f}" if xs else "–"

    for name, cells in by_model.items():
        ours = [c["regret"]["ours"] for c in cells if "ours" in c["regret"]]
        sp = [c["speedup_vs_best_single_side"] for c in cells if "speedup_vs_best_single_side" in c]
        lines.append(f"| {name} | {_geomean(ours):.3f} ({max(ours):.2f}) | "
                     + " | ".join(gm(cells, k) for k in others)
                     + f" | {_geomean(sp):.2f}x ({max(sp):.2f}x) |")
    o, sp = s["regret"]["ours"], s["speedup_vs_best_single_side"]

    def total(k: str) -> str:
        r = s["regret"][k]
        return "–" if not r["n"] else ("≥ " if r.get("n_lower_bounds") else "") + f"{r['geomean']:.2f}"

    lines.append(f"| **all** | **{o['geomean']:.3f} ({o['worst']:.2f})** | "
                 + " | ".join(total(k) for k in others) + f" | {sp['geomean']:.2f}x ({sp['max']:.2f}x) |")
    lines += ["", f"Targets: regret geomean ≤ {TARGETS['regret_geomean']} "
              f"({'met' if s['meets']['regret_geomean'] else 'missed'}), worst ≤ {TARGETS['regret_worst']} "
              f"({'met' if s['meets']['regret_worst'] else 'missed'}); cost model median |error| end to end "
              f"{s['cost_model_median_abs_pct_error']:.1f} % over {s['cost_model_points']} measured cuts "
              f"(target ≤ {TARGETS['cost_model_median_abs_pct_error']:g} %, "
              f"{'met' if s['meets']['cost_model_median_abs_pct_error'] else 'missed'})."]
    r = s.get("ratios", {})
    if r:
        a, b = r["ours_over_dads_encoded"], r["ours_over_cloud_only_jpeg"]
        lines += ["", f"Ours / DADS encoded: geomean {a['geomean']:.3f} over {a['n']} cells; ours / cloud-only "
                      f"JPEG: geomean {b['geomean']:.3f} over {b['n']} cells (below 1: ours is faster). "
                      f"{s['splitting']['note'][0].upper()}{s['splitting']['note'][1:]}."]
    return "\n".join(lines) + "\n"
