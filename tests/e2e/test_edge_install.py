"""`pip install splitinfer[edge]` into a fresh venv: no cloud or plotting modules, the edge
commands work, a cloud command says which extra it needs, and the venv fits in 350 MB.

One venv for the module (about 25 s with a warm pip cache); bench/edge_install.py makes it
the same way and records its size in bench/results/edge_install.json."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from bench.edge_install import ABSENT, TARGET_BYTES, copy_source, largest_distributions, make_edge_venv, venv_bytes

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def edge_venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(venv path, pip's output) of a fresh edge-only install."""
    root = tmp_path_factory.mktemp("edge-install")
    venv = str(root / "venv")
    _, pip_output = make_edge_venv(venv, copy_source(str(root / "src")))
    return venv, pip_output


def _run(venv: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([os.path.join(venv, "bin", args[0]), *args[1:]], capture_output=True, text=True,
                          timeout=120, env=env, cwd=os.path.dirname(venv))


def test_edge_extra_is_known_to_pip(edge_venv: tuple[str, str]) -> None:
    _, pip_output = edge_venv
    assert "does not provide the extra" not in pip_output


def test_edge_install_has_no_cloud_or_plotting_modules(edge_venv: tuple[str, str]) -> None:
    venv, _ = edge_venv
    probe = ("import importlib.util, json; "
             f"print(json.dumps([m for m in {ABSENT!r} if importlib.util.find_spec(m) is not None]))")
    r = _run(venv, "python", "-c", probe)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []


def test_edge_run_help_works_in_the_edge_install(edge_venv: tuple[str, str]) -> None:
    r = _run(edge_venv[0], "splitinfer", "edge", "run", "--help")
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout


@pytest.mark.parametrize(("args", "module"), [
    (("gateway", "--port", "0", "--registry", "X"), "prometheus_client"),
    (("cluster", "status"), "kubernetes"),
])
def test_cloud_command_in_the_edge_install_names_the_cloud_extra(edge_venv: tuple[str, str], args: tuple[str, ...],
                                                                 module: str) -> None:
    r = _run(edge_venv[0], "splitinfer", *args)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr == (f"splitinfer {args[0]}: needs the 'cloud' extra (missing module {module!r}): "
                        "pip install 'splitinfer[cloud]'\n")


def test_edge_install_fits_in_350_mb(edge_venv: tuple[str, str]) -> None:
    venv, _ = edge_venv
    size = venv_bytes(venv)
    largest = ", ".join(f"{d['name']} {d['mb']} MB" for d in largest_distributions(venv, 5))
    print(f"edge-only venv: {size / 1e6:.1f} MB (target {TARGET_BYTES / 1e6:g} MB); largest: {largest}")
    assert size <= TARGET_BYTES, f"the edge-only venv takes {size / 1e6:.1f} MB; largest: {largest}"
