"""docs/protocol.md's OIP REST example, run as printed: each command's output must be what the page shows.

The section "Open Inference Protocol (REST)" is read with docs/quickstart.md's convention
(tests/e2e/test_quickstart.py): its ```console block runs line by line (`$ ` lines are
commands, `&  # wait for "TEXT"` starts one in the background), in a fresh directory with
this venv first on PATH. Here each command's printed output lines must equal its stdout.
The ```python block then runs against the same gateway, and must print the ```text block
that follows it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_quickstart import _is_checkout, _stop, _taken, _wait_for, page_commands

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "protocol.md"
TITLE = "## Open Inference Protocol (REST)"


def section(title: str = TITLE) -> str:
    """The page's `title` section, up to the next `## ` heading."""
    text = PAGE.read_text(encoding="utf-8")
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start:end if end >= 0 else len(text)]


def blocks(text: str, lang: str) -> list[list[str]]:
    """The lines of each ```lang block."""
    out: list[list[str]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if current is None and line.strip() == f"```{lang}":
            current = []
        elif current is not None and line.startswith("```"):
            out.append(current)
            current = None
        elif current is not None:
            current.append(line)
    return out


def printed_outputs(console: list[str]) -> dict[str, str]:
    """Command (as page_commands gives it) -> the output lines the page prints under it."""
    out: dict[str, list[str]] = {}
    last = None
    for line in console:
        if line.startswith("$ "):
            last = page_commands(f"```console\n{line}\n```")[0].line
            out[last] = []
        elif last is not None:
            out[last].append(line)
    return {k: "\n".join(v) for k, v in out.items()}


def test_the_section_has_a_curl_and_a_tritonclient_example():
    text = section()
    [console] = blocks(text, "console")
    cmds = page_commands("```console\n" + "\n".join(console) + "\n```")
    assert [c.wait_for for c in cmds if c.background] == ["gateway ready"]
    assert sum(c.line.startswith("curl ") for c in cmds) >= 3
    [code] = blocks(text, "python")
    assert "tritonclient.http" in "\n".join(code)


def test_oip_rest_example_prints_what_the_page_shows(tmp_path: Path) -> None:
    pytest.importorskip("tritonclient.http", reason="the test extra installs tritonclient[http]")
    if shutil.which("curl") is None:
        pytest.skip("the example uses curl")
    if not _is_checkout():
        pytest.skip("the running venv's splitinfer is not this checkout")
    text = section()
    [console] = blocks(text, "console")
    [code] = blocks(text, "python")
    prints = blocks(text, "text")[0]
    cmds = page_commands("```console\n" + "\n".join(console) + "\n```")
    want = printed_outputs(console)
    assert not [p for p in (50161, 9601) if _taken(p)], "the loopback ports the page uses (50161, 9601) are taken"
    run_example(tmp_path, cmds, code, prints, want)


def run_example(tmp_path: Path, cmds: list[Any], code: list[str], prints: list[str],
                want: dict[str, str] | None = None) -> None:
    """Runs `cmds` in a fresh folder (a background one until its log shows its wait_for
    text), checks each command's output where `want` has one, then the Python `code`'s
    output against `prints`; the background processes must stop cleanly on SIGTERM."""
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               PYTHONUNBUFFERED="1", XDG_CACHE_HOME=str(tmp_path / "cache"))
    work = tmp_path / "work"
    work.mkdir()
    running = []
    try:
        for i, c in enumerate(cmds):
            if c.background:
                log = tmp_path / f"bg{i}.log"
                with open(log, "wb") as fh:
                    proc = subprocess.Popen(["bash", "-c", f"exec {c.line}"], cwd=work, env=env, stdout=fh,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
                running.append(proc)
                _wait_for(proc, log, c.wait_for or "", "gateway")
                continue
            r = subprocess.run(["bash", "-c", c.line], cwd=work, env=env, capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, f"$ {c.line}\nexited {r.returncode}:\n{r.stdout}\n{r.stderr}"
            if want and want[c.line]:
                assert r.stdout.strip() == want[c.line].strip(), f"$ {c.line}"
        r = subprocess.run([sys.executable, "-c", "\n".join(code)], cwd=work, env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip().splitlines() == prints
    finally:
        codes = [_stop(p) for p in running]
    assert codes == [0] * len(running), "the gateway did not stop cleanly on SIGTERM"
