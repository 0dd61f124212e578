"""docs/quickstart.md, run as printed: the page's commands must reach a split answer.

How the page is read (the convention the page follows):
- Every fenced ```console block is run, in order. In it, a line that starts with `$ `
  is a command; every other line is sample output and is not checked.
- A command that ends with `&` is long-running (the gateway, the agent). It is started
  in the background, and when the `&` is followed by `# wait for "TEXT"`, the next
  command waits until TEXT appears in its output (its log is shown if it never does).
- Every command runs with `bash -c` exactly as printed, in a fresh temporary directory,
  with the running interpreter's bin directory first on PATH (so `splitinfer` and
  `python` are this venv's), and with XDG_CACHE_HOME in that directory (so the agent's
  cache stays out of the home directory). Ports are not substituted: the page uses
  fixed, uncommon loopback ports (50151, 9591, 8591); the test fails at once, saying
  so, when one is taken.
- The install command (the first, `pip install -e ...`) is not re-run: the test checks
  instead that the `splitinfer` it runs is this checkout, and skips if it is not.
- A `curl` command is left out, with its check, on a machine without curl.

It asserts that `splitinfer edge infer` printed a split answer (head on the device,
tail in the cloud), that curl's answer names a cut with device layers, and that the
gateway and the agent stop cleanly on SIGTERM (exit 0) without leaving the agent's
cgroup or temporary directory behind.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "quickstart.md"
_WAIT = re.compile(r'&\s*#\s*wait for "([^"]+)"\s*$')
_WAIT_S = 180.0


@dataclass(frozen=True)
class Command:
    line: str
    """The command as printed, without `$ ` and without the trailing `& # wait for ...`."""
    background: bool
    wait_for: str | None


def page_commands(text: str) -> list[Command]:
    """The `$ ` lines of the page's ```console blocks, in order (see the module docstring)."""
    out, in_console = [], False
    for raw in text.splitlines():
        line = raw.rstrip()
        if line.startswith("```"):
            in_console = line.strip() == "```console" if not in_console else False
            continue
        if not in_console or not line.startswith("$ "):
            continue
        cmd = line[2:]
        m = _WAIT.search(cmd)
        if m is not None:
            out.append(Command(cmd[:m.start()].rstrip(), True, m.group(1)))
        elif cmd.endswith("&"):
            out.append(Command(cmd[:-1].rstrip(), True, None))
        else:
            out.append(Command(cmd, False, None))
    return out


def test_page_commands_parse() -> None:
    """The page has the install, the registry, the two long-running parts and the request."""
    cmds = page_commands(PAGE.read_text(encoding="utf-8"))
    assert "pip install" in cmds[0].line
    assert [c.wait_for for c in cmds if c.background] == ["gateway ready", "edge agent ready"]
    assert any(c.line.startswith("splitinfer edge infer") for c in cmds)
    assert any(c.line.startswith("curl ") for c in cmds)


def _is_checkout() -> bool:
    import splitinfer

    return Path(splitinfer.__file__).resolve().parent == ROOT / "splitinfer"


def _ports(cmds: list[Command]) -> list[int]:
    return sorted({int(p) for c in cmds for p in re.findall(r"(?:port |:)(\d{4,5})\b", c.line)})


def _taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _wait_for(proc: subprocess.Popen[bytes], log: Path, text: str, what: str) -> None:
    t0 = time.monotonic()
    while text not in log.read_text(errors="replace"):
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode} before printing {text!r}; its log:\n{log.read_text()}")
        if time.monotonic() - t0 > _WAIT_S:
            pytest.fail(f"{what} did not print {text!r} within {_WAIT_S:.0f} s; its log:\n{log.read_text()}")
        time.sleep(0.2)


def _stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            return proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            return -9
    return proc.returncode


def _cgroups() -> set[str]:
    found = set()
    for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/cpu"):
        try:
            found |= {os.path.join(root, n) for n in os.listdir(root) if n.startswith("splitinfer-edge-")}
        except OSError:
            continue
    return found


def test_quickstart_reaches_a_split_answer(tmp_path: Path) -> None:
    cmds = page_commands(PAGE.read_text(encoding="utf-8"))
    install, rest = cmds[0], cmds[1:]
    assert "pip install" in install.line, f"the page's first command is not the install: {install.line!r}"
    if not _is_checkout():
        pytest.skip("the running venv's splitinfer is not this checkout; the install command would have to run")
    taken = [p for p in _ports(rest) if _taken(p)]
    assert not taken, f"loopback ports {taken} that the page uses are taken; free them to run this test"

    bindir = os.path.dirname(sys.executable)
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""), XDG_CACHE_HOME=str(tmp_path / "cache"),
               PYTHONUNBUFFERED="1")
    tmp_before = {n for n in os.listdir("/tmp") if n.startswith("splitinfer-edge-")}
    cgroups_before = _cgroups()
    work = tmp_path / "work"
    work.mkdir()
    running: list[tuple[subprocess.Popen[bytes], str]] = []
    outputs: dict[str, str] = {}
    try:
        for i, c in enumerate(rest):
            if c.line.startswith("curl ") and shutil.which("curl") is None:
                continue
            if c.background:
                log = tmp_path / f"bg{i}.log"
                with open(log, "wb") as fh:
                    proc = subprocess.Popen(["bash", "-c", f"exec {c.line}"], cwd=work, env=env, stdout=fh,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
                running.append((proc, c.line))
                if c.wait_for is not None:
                    _wait_for(proc, log, c.wait_for, shlex.split(c.line)[:2][-1])
                continue
            r = subprocess.run(["bash", "-c", c.line], cwd=work, env=env, capture_output=True, text=True, timeout=240)
            assert r.returncode == 0, f"$ {c.line}\nexited {r.returncode}:\n{r.stdout}\n{r.stderr}"
            outputs[c.line] = r.stdout
        infer = next(out for line, out in outputs.items() if line.startswith("splitinfer edge infer"))
        assert "served by: split: head on the device" in infer and "tail in the cloud" in infer, infer
        for line, out in outputs.items():
            if line.startswith("curl "):
                served_by, cut_id = out.split()[:2]
                assert served_by == "remote" and re.fullmatch(r"L\d.*", cut_id), out
    finally:
        codes = [(_stop(p), line) for p, line in reversed(running)]
    for code, line in codes:
        assert code == 0, f"$ {line}\nexited {code} on SIGTERM"
    assert _cgroups() == cgroups_before, "the agent's cgroup was left behind"
    assert {n for n in os.listdir("/tmp") if n.startswith("splitinfer-edge-")} == tmp_before, \
        "the agent's temporary directory was left behind"
