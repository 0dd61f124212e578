"""docs/protocol.md's OIP gRPC example, run as printed against the gateway of the REST example.

The section "Open Inference Protocol (REST)" starts the gateway (its ```console block, up to the
background gateway command, as tests/e2e/test_protocol_doc.py runs it); the ```python block of
"Open Inference Protocol (gRPC)" then runs with tritonclient.grpc and must print the ```text
block that follows it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_protocol_doc import blocks
from tests.e2e.test_quickstart import _is_checkout, _stop, _taken, _wait_for, page_commands

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PAGE = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def section(title: str) -> str:
    text = PAGE.read_text(encoding="utf-8")
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start:end if end >= 0 else len(text)]


def test_the_grpc_section_has_a_tritonclient_grpc_example():
    [code] = blocks(section("## Open Inference Protocol (gRPC)"), "python")
    assert "import tritonclient.grpc" in "\n".join(code)


def test_oip_grpc_example_prints_what_the_page_shows(tmp_path: Path) -> None:
    try:
        import tritonclient.grpc  # noqa: F401 - only whether it loads
    except (ImportError, RuntimeError) as e:  # its stubs raise RuntimeError on grpcio < 1.81.1
        pytest.skip(f"needs tritonclient[grpc] with grpcio>=1.81.1 ({str(e).splitlines()[0][:120]})")
    if not _is_checkout():
        pytest.skip("the running venv's splitinfer is not this checkout")
    [console] = blocks(section("## Open Inference Protocol (REST)"), "console")
    cmds = page_commands("```console\n" + "\n".join(console) + "\n```")
    setup = cmds[:next(i for i, c in enumerate(cmds) if c.background) + 1]
    grpc_section = section("## Open Inference Protocol (gRPC)")
    [code] = blocks(grpc_section, "python")
    prints = blocks(grpc_section, "text")[0]
    assert not [p for p in (50161, 9601) if _taken(p)], "the loopback ports the page uses (50161, 9601) are taken"
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
               PYTHONUNBUFFERED="1", XDG_CACHE_HOME=str(tmp_path / "cache"))
    work = tmp_path / "work"
    work.mkdir()
    running = []
    try:
        for i, c in enumerate(setup):
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
        r = subprocess.run([sys.executable, "-c", "\n".join(code)], cwd=work, env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip().splitlines() == prints
    finally:
        codes = [_stop(p) for p in running]
    assert codes == [0] * len(running), "the gateway did not stop cleanly on SIGTERM"
