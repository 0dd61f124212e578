"""`make` says what it installs, and about how long it takes, before the silent pip install."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_says_what_it_installs_and_how_long_before_installing(tmp_path) -> None:
    venv = str(tmp_path / "venv")
    r = subprocess.run(["make", "-n", "-B", f"VENV={venv}", f"{venv}/.installed"], cwd=ROOT, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    install = next(i for i, line in enumerate(lines) if "pip install" in line and ".[all]" in line)
    said = "\n".join(line for line in lines[:install] if line.startswith("echo "))
    assert "installing splitinfer[all]" in said and venv in said
    assert "minutes" in said
    assert any(line.startswith("echo ") and "installed into" in line for line in lines[install:])
