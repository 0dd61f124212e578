"""`splitinfer fleet plan SPEC.yaml [--json] [--workers N] [--profiles-dir DIR]`: size a cloud tier
for a fleet (planner.fleet; docs/fleet.md)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from splitinfer.units import int_at_least, parse_args

__all__ = ["fleet_main", "read_spec", "format_plan"]


def read_spec(path: str) -> Any:
    """The spec file's YAML (or JSON) as plain data; a file or syntax problem raises `FleetSpecError`."""
    import yaml

    from planner.fleet_spec import FleetSpecError

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise FleetSpecError(f"SPEC {path!r}: cannot read it ({e.strerror}); give a fleet spec YAML file",
                             field="SPEC") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise FleetSpecError(f"SPEC {path!r} is not YAML{at} ({getattr(e, 'problem', e)}); fix the file",
                             field="SPEC") from None


def _ms(x: float | None) -> str:
    return "-" if x is None or x != x or x == float("inf") else f"{x:.0f}"


def format_plan(d: dict[str, Any]) -> str:
    """The plan as the tables `fleet plan` prints."""
    lines = [f"{d['devices']} devices, {d['rate_rps']:.0f} req/s; within SLO {100 * d['within_slo']:.1f}% "
             f"(goodput {d['goodput_rps']:.0f} req/s), p50 {_ms(d['p50_ms'])} ms, p95 {_ms(d['p95_ms'])} ms", ""]
    rows = [("class", "devices", "req/s", "options", "p50 ms", "p95 ms", "in SLO", "refused", "urgent")]
    for c in d["classes"]:
        opts = ", ".join(f"{o['option']} {100 * o['share']:.0f}%" for o in c["options"][:3])
        rows.append((c["name"], str(c["devices"]), f"{c['rate_rps']:.0f}", opts, _ms(c["p50_ms"]), _ms(c["p95_ms"]),
                     f"{100 * c['within_slo']:.1f}%", f"{100 * c['refused_share']:.1f}%",
                     f"{100 * c.get('urgent_share', 0.0):.0f}%"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    lines.append("")
    for m in d["models"]:
        lines.append(f"model {m['name']}: SLO {m['slo_ms']:g} ms, {100 * m['within_slo']:.1f}% within "
                     f"(target {100 * m['target']:g}%): {'meets' if m['meets'] else 'MISSES'}")
    c = d["cloud"]
    lines.append(f"cloud: {c['workers']} worker(s), utilisation {100 * c['utilisation']:.0f}%, capacity "
                 f"{c['capacity_rps']:.0f} req/s, offered {c['offered_rps']:.0f} req/s, admitted "
                 f"{100 * c['admitted_share']:.0f}%, wait for a worker {_ms(c['worker_wait_ms'])} ms")
    for p in c["pools"]:
        lines.append(f"  pool {p['pool']}: {p['rate_rps']:.0f} req/s, batch {p['batch']:.1f} in "
                     f"{p['run_ms']:.1f} ms, wait {p['wait_ms']:.1f} ms")
    fp = d["fixed_point"]
    lines.append(f"fixed point: cloud delay {fp['delay_ms']:.1f} ms after {fp['iterations']} steps "
                 f"(residual {fp['residual_ms']:.2g} ms, mixed share {fp['mixed_share']:.2f})")
    need = d["workers_needed"]
    lines.append(f"workers needed: {need if need is not None else 'none suffices'} ({d['workers_needed_note']})")
    return "\n".join(lines)


def fleet_main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="splitinfer fleet", description="plan a fleet of devices sharing one cloud tier")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="per-class cuts, latency, goodput at the SLO and the workers needed")
    p.add_argument("spec", metavar="SPEC", help="fleet spec YAML: classes, models with SLOs, cloud (docs/fleet.md)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (schema splitinfer.fleet-plan/1)")
    p.add_argument("--workers", type=int_at_least(1), metavar="N", help="plan with N workers instead of the spec's")
    p.add_argument("--profiles-dir", metavar="DIR",
                   help="stored profiles (<name>.json) that the spec's device names may use")
    args = parse_args(ap, argv)

    from planner.fleet import plan_fleet
    from planner.fleet_spec import FleetSpec
    from planner.whatif import Workspace

    spec = FleetSpec.from_dict(read_spec(args.spec))
    profiles = {}
    if args.profiles_dir:
        import os

        from splitinfer.planner_http import load_profiles_dir

        if not os.path.isdir(args.profiles_dir):
            from planner.errors import PlannerError

            raise PlannerError(f"--profiles-dir {args.profiles_dir!r} is not a directory; give the directory "
                               "holding <name>.json profiles", field="--profiles-dir")
        profiles = load_profiles_dir(args.profiles_dir)
    plan = plan_fleet(spec, Workspace(profiles=profiles), workers=args.workers)
    d = plan.to_dict()
    if args.json:
        json.dump(d, sys.stdout, indent=1)
        print()
    else:
        print(format_plan(d))
    return 0
