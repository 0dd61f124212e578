"""docs/protocol.md's OIP gRPC example, run as printed against the gateway of the REST example.

The section "Open Inference Protocol (REST)" starts the gateway (its ```console block, up to the
background gateway command, as tests/e2e/test_protocol_doc.py runs it); the ```python block of
"Open Inference Protocol (gRPC)" then runs with tritonclient.grpc and must print the ```text
block that follows it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_protocol_doc import blocks, run_example, section
from tests.e2e.test_quickstart import _is_checkout, _taken, page_commands

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


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
    run_example(tmp_path, setup, code, prints)
