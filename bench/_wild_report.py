"""How `bench.wild` shows its results: a line per step, the docs table, the PNG.

    python -m bench.wild --markdown bench/results/wild.json   # the table in docs/models.md
"""

from __future__ import annotations

import numpy as np

__all__ = ["STEPS", "QUANTISED_BELOW", "describe_shared", "markdown_cell", "plot_results", "print_table", "render_markdown",
           "summarize_step"]

STEPS = ("inspect", "cuts", "profile", "plan", "int8", "serve")
QUANTISED_BELOW = 0.95
"""An INT8 model at or above this fraction of the fp32 size had (almost) nothing quantised."""


def summarize_step(step: str, rec: dict) -> str:
    """One table cell: the key numbers, then the reason wherever the step was refused."""
    parts: list[str] = []
    if step == "inspect" and "layers" in rec:
        parts.append(f"{rec['layers']} layers, {len(rec.get('unknown_tensors', []))} unknown sizes "
                     f"({len(rec.get('unknown_without_inputs', []))} without --inputs)")
        if rec.get("control_flow_layers"):
            parts.append(f"{rec['control_flow_layers']} control-flow layer(s)")
    elif step == "cuts" and rec.get("cuts"):
        diff = rec.get("max_abs_diff")
        parts.append(f"{rec.get('verified', 0)}/{len(rec['cuts'])} verified"
                     + (f", max abs diff {diff:.2g}" if isinstance(diff, (int, float)) else ""))
    elif step == "profile" and rec.get("total_ms") is not None:
        parts.append(f"{rec['total_ms']:.1f} ms over {rec['layers']} layers")
    elif step == "plan" and rec.get("choice"):
        total = (rec.get("predicted") or {}).get("total_ms")
        parts.append(rec["choice"] + (f", {total:.1f} ms predicted" if isinstance(total, (int, float)) else ""))
        sweep = rec.get("sweep") or {}
        if sweep.get("choices"):
            parts.append(f"sweep 0.1-1000 Mbit/s: mid-network cut at {sweep['mid_network_points']} of "
                         f"{len(sweep['choices'])} uplinks")
        elif sweep.get("reason"):
            parts.append(f"sweep {sweep.get('status')}: {sweep['reason']}")
    elif step == "int8" and rec.get("summary"):
        s = rec["summary"]
        if "agreement" in s:
            parts.append(f"agreement {_num(s['agreement'])} ({s.get('metric')}, worst {s.get('worst_output')})")
        elif "top1_agreement" in s:
            parts.append(f"top-1 agreement {_num(s['top1_agreement'])}, max abs err {_num(s.get('max_abs_error'))}")
        parts.append(f"per_channel={s.get('per_channel')}")
        if isinstance(s.get("size_ratio"), (int, float)):
            parts.append(f"size x{s['size_ratio']:.2f}")
        for alt in rec.get("alternatives") or ():
            if alt.get("status") == "ok":
                parts.append(f"{_settings(alt['settings'])}: {_num(alt.get('agreement'))}")
        if s.get("note"):
            parts.append(str(s["note"]))
    elif step == "serve":
        for which in ("whole", "split"):
            r = rec.get(which)
            if isinstance(r, dict) and r.get("status") == "ok":
                diffs = [v for v in (r.get("max_abs_diff") or {}).values() if isinstance(v, (int, float))]
                parts.append(f"{which} {r['cut_id']}: {r['latency_ms']:.1f} ms"
                             + (f", diff {max(diffs):.2g}" if diffs else ""))
    if rec.get("flags") == "missing":
        plain = rec.get("without_flags") or {}
        parts.append(f"without --inputs: {plain.get('status')}"
                     + (f" ({plain.get('reason')})" if plain.get("reason") else ""))
    if rec.get("status") != "ok" and rec.get("reason"):
        parts.append(f"reason: {rec['reason']}")
    return "; ".join(parts)


def markdown_cell(step: str, rec: dict) -> str:
    """A short docs-table cell: the step's headline number, or 'refused'."""
    status = rec.get("status")
    if status != "ok":
        return f"**{status}**"
    if step == "inspect":
        return (f"{rec.get('layers')} layers, {len(rec.get('unknown_tensors', []))} unknown "
                f"({len(rec.get('unknown_without_inputs', []))} without inputs)")
    if step == "cuts":
        diff = rec.get("max_abs_diff")
        return f"{rec.get('verified')}/{len(rec.get('cuts', []))}, diff {_num(diff)}"
    if step == "profile":
        return f"{_num(rec.get('total_ms'))} ms"
    if step == "plan":
        total = (rec.get("predicted") or {}).get("total_ms")
        sweep = rec.get("sweep") or {}
        mid = (f"; mid-network at {sweep['mid_network_points']}/{len(sweep['choices'])} uplinks"
               if sweep.get("choices") else "")
        return f"{rec.get('choice')}, {_num(total)} ms{mid}"
    if step == "int8":
        s = rec.get("summary") or {}
        if s.get("kind") == "already_quantized":
            return "already INT8: passed through"
        cell = f"{s.get('metric')} {_num(s.get('value'))}" + (
            f" (agreement {_num(s.get('agreement'))})" if s.get("metric") == "rel_l2" else "")
        # A setting that quantised (almost) nothing agrees trivially: it is not an alternative.
        alts = [a for a in rec.get("alternatives") or ()
                if a.get("status") == "ok" and (a.get("size_ratio") or 1.0) < QUANTISED_BELOW]
        best = max(alts, key=lambda a: a.get("agreement") or 0.0, default=None)
        if best is not None and (best.get("agreement") or 0.0) > (s.get("agreement") or 0.0):
            cell += (f"; {_settings(best['settings'])}: {_num(best.get('agreement'))} "
                     f"(size x{best.get('size_ratio'):.2f})")
        return cell
    if step == "serve":
        parts = [f"{w} {_num(rec[w]['latency_ms'])} ms" for w in ("whole", "split")
                 if isinstance(rec.get(w), dict) and rec[w].get("status") == "ok"]
        return ", ".join(parts)
    return "ok"


def describe_shared(shared: dict) -> list[str]:
    """Lines on the one gateway that served every model: how many served, and why the
    others did not."""
    if shared.get("status") != "ok":
        return [f"One gateway over every model: {shared.get('status')}: {shared.get('reason')}"]
    models = shared.get("models") or {}
    lines = [f"One gateway over all {shared.get('models_in_registry')} models (one registry): "
             f"{shared.get('served')} served a whole-model request; the gateway kept serving."]
    for key, r in models.items():
        if r.get("status") != "ok":
            reason = str(r.get("reason"))
            lines.append(f"- {key} (health {r.get('health')}): {reason[:297] + '...' if len(reason) > 300 else reason}")
    return lines


def render_markdown(results: dict) -> str:
    """The docs table (one row a model, one column a step) and the refusals under it."""
    config = {m["key"]: m for m in results["config"]["models"]}
    lines = ["| model | package | " + " | ".join(STEPS) + " |", "|" + " --- |" * (len(STEPS) + 2)]
    refusals = []
    for key, entry in results["models"].items():
        m = config.get(key, {})
        cells = [markdown_cell(step, entry["steps"][step]) for step in STEPS]
        lines.append(f"| {key} ({m.get('task', '')}) | {m.get('package', '')} {m.get('version', '')} | "
                     + " | ".join(cells) + " |")
        note = (entry["steps"]["int8"].get("summary") or {}).get("note")
        if note:
            refusals.append(f"- {key}, int8 (note): {note}")
        for step in STEPS:
            rec = entry["steps"][step]
            if rec.get("status") != "ok":
                text = summarize_step(step, rec).replace("|", "/")
                refusals.append(f"- {key}, {step}: {text[:297] + '...' if len(text) > 300 else text}")
    shared = [""] + describe_shared(results["shared_gateway"]) if "shared_gateway" in results else []
    return "\n".join(lines + ([""] + refusals if refusals else []) + shared) + "\n"


def _settings(kwargs: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in kwargs.items()).replace("'", "")


def _num(v: object) -> str:
    return f"{v:.4g}" if isinstance(v, (int, float)) else str(v)


def print_table(results: dict) -> None:
    for key, entry in results["models"].items():
        print(f"\n{key}")
        for step in STEPS:
            rec = entry["steps"].get(step, {"status": "-"})
            print(f"  {step:<8} {rec['status']:<8} {summarize_step(step, rec)}")
    if "shared_gateway" in results:
        print()
        print("\n".join(describe_shared(results["shared_gateway"])))


def plot_results(results: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    colour = {"ok": 2, "refused": 0, "timeout": 0, "skipped": 1}
    keys = list(results["models"])
    grid = np.array([[colour.get(results["models"][k]["steps"][s]["status"], 1) for s in STEPS] for k in keys])
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(keys) + 1.5))
    ax.imshow(grid, cmap=matplotlib.colors.ListedColormap(["#d9534f", "#bbbbbb", "#5cb85c"]), vmin=0, vmax=2,
              aspect="auto")
    ax.set_xticks(range(len(STEPS)), STEPS)
    ax.set_yticks(range(len(keys)), keys)
    for i, k in enumerate(keys):
        for j, s in enumerate(STEPS):
            ax.text(j, i, results["models"][k]["steps"][s]["status"], ha="center", va="center", fontsize=8)
    ax.set_title("real-weight models from PyPI wheels: each workflow step (green ok, red refused)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
