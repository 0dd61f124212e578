"""Size of the edge-only install: `pip install splitinfer[edge]` into a fresh venv.

The source is copied (pyproject, README and the packages, no caches) and installed
non-editable, as a device would install a wheel, so the checkout is left as it is. The
size is the venv's disk use (blocks, as `du` counts them), including pip and setuptools,
with the largest installed distributions listed. pip's cache is used: a warm cache makes
the install take seconds, and the size does not depend on it.

    python -m bench.edge_install [--keep DIR]

writes bench/results/edge_install.json. tests/e2e/test_edge_install.py uses the same
functions to check what the install holds and how its commands behave.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")

PACKAGES = ("splitinfer", "partitioner", "planner", "workers", "cluster", "edge_agent")
"""The top-level packages pyproject.toml ships."""
ABSENT = ("ray", "kubernetes", "prometheus_client", "matplotlib", "scipy", "sympy")
"""Modules an edge install must not carry."""
TARGET_BYTES = 350 * 10**6
"""The edge-only venv's budget: 350 MB."""

__all__ = ["ABSENT", "TARGET_BYTES", "copy_source", "make_edge_venv", "venv_bytes", "largest_distributions", "main"]


def copy_source(dest: str) -> str:
    """The files pip needs to build splitinfer, copied from this checkout into ``dest``."""
    os.makedirs(dest, exist_ok=True)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if os.path.exists(os.path.join(ROOT, name)):
            shutil.copy2(os.path.join(ROOT, name), dest)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for pkg in PACKAGES:
        shutil.copytree(os.path.join(ROOT, pkg), os.path.join(dest, pkg), ignore=skip)
    return dest


def make_edge_venv(venv: str, source: str, *, extra: str = "edge", timeout_s: float = 600) -> tuple[float, str]:
    """Creates ``venv`` and installs ``source[extra]`` into it (non-editable); returns the
    seconds the install took and pip's output (its warnings). Raises RuntimeError with
    pip's output when it fails."""
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, timeout=120)
    py = os.path.join(venv, "bin", "python")
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    t0 = time.monotonic()
    r = subprocess.run([py, "-m", "pip", "install", "--quiet", f"{source}[{extra}]"], capture_output=True,
                       text=True, timeout=timeout_s, env=env)
    took = time.monotonic() - t0
    if r.returncode != 0:
        raise RuntimeError(f"pip install {source}[{extra}] failed (rc {r.returncode}):\n{r.stdout}\n{r.stderr}")
    return took, r.stdout + r.stderr


def venv_bytes(path: str) -> int:
    """Disk use of a tree, in bytes, counted as `du` does (allocated blocks, each inode once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for base, dirs, files in os.walk(path):
        for name in dirs + files:
            st = os.lstat(os.path.join(base, name))
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def largest_distributions(venv: str, n: int = 8) -> list[dict[str, object]]:
    """The ``n`` installed top-level directories of site-packages that use the most disk."""
    lib = os.path.join(venv, "lib")
    site = next(os.path.join(lib, d, "site-packages") for d in os.listdir(lib) if d.startswith("python"))
    sizes = []
    for name in os.listdir(site):
        p = os.path.join(site, name)
        if os.path.isdir(p) and not name.endswith((".dist-info", ".egg-info")) and name != "__pycache__":
            sizes.append({"name": name, "mb": round(venv_bytes(p) / 1e6, 1)})
    return sorted(sizes, key=lambda d: -float(d["mb"]))[:n]  # type: ignore[arg-type]


def _versions(venv: str) -> dict[str, str]:
    r = subprocess.run([os.path.join(venv, "bin", "python"), "-m", "pip", "list", "--format", "json"],
                       capture_output=True, text=True, check=True, timeout=120)
    return {d["name"]: d["version"] for d in json.loads(r.stdout)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.edge_install", description=__doc__.split("\n\n")[0])
    p.add_argument("--keep", help="build the venv here and keep it (default: a temporary directory, removed)")
    p.add_argument("-o", "--out", default=os.path.join(RESULTS, "edge_install.json"))
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="splitinfer-edge-install-") as tmp:
        venv = a.keep or os.path.join(tmp, "venv")
        install_s, _ = make_edge_venv(venv, copy_source(os.path.join(tmp, "src")))
        size = venv_bytes(venv)
        versions = _versions(venv)
        result = {
            "what": "a fresh venv with `pip install splitinfer[edge]` (non-editable), pip and setuptools included",
            "venv_mb": round(size / 1e6, 1),
            "venv_mib": round(size / 2**20, 1),
            "target_mb": TARGET_BYTES / 1e6,
            "within_target": size <= TARGET_BYTES,
            "install_s_warm_cache": round(install_s, 1),
            "largest": largest_distributions(venv),
            "absent": {m: not os.path.exists(os.path.join(venv, "lib", f"python{sys.version_info.major}."
                                                          f"{sys.version_info.minor}", "site-packages", m))
                       for m in ABSENT},
            "installed": versions,
            "python": platform.python_version(),
            "platform": platform.platform(),
        }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1)
        fh.write("\n")
    print(f"edge-only venv: {result['venv_mb']} MB ({result['venv_mib']} MiB), target {result['target_mb']:g} MB; "
          f"installed in {result['install_s_warm_cache']} s; largest: "
          + ", ".join(f"{d['name']} {d['mb']} MB" for d in result["largest"][:5]))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
