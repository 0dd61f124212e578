"""An emulated device end to end: the agent plans with the reference device's profile,
`edge infer` reports where an answer ran, and `run_emulated` cleans up after an agent
that cannot start. (tests/e2e/test_quickstart.py runs the emulated device behind the
emulated link through a real gateway.)"""

from __future__ import annotations

import asyncio
import os
import re
import tempfile

import pytest

from cluster.server import serve
from edge_agent.config import config_from_dict
from edge_agent.daemon import EdgeAgent
from edge_agent.engines import profile_model_ms
from partitioner import Splitter
from planner.devices import reference_profile
from splitinfer.edge_cmd import edge_main
from splitinfer.emulate import run_emulated
from tests.integration._edge_support import MODEL, VERSION, TailBackend, write_model

pytestmark = [pytest.mark.grpc, pytest.mark.timeout(120)]


def test_an_emulated_device_plans_with_its_reference_profile_and_edge_infer_says_where_it_ran(tmp_path, capsys):
    path = write_model(tmp_path)
    graph = Splitter(path).graph

    async def go():
        backend = TailBackend(path, cache_dir=str(tmp_path / "server-cache"))
        server = await serve(backend)
        agent = EdgeAgent(config_from_dict({
            "gateway": server.address, "model": f"{MODEL}@{VERSION}", "cacheDir": str(tmp_path / "cache"),
            "apiPort": 0, "startupTimeoutS": 3.0, "emulate": {"device": "rpi4"}}))
        try:
            await agent.start()
            url = f"http://127.0.0.1:{agent.api.port}"
            rc = await asyncio.to_thread(edge_main, ["infer", "--url", url, "--random", "--seed", "3"])
            return rc, agent.status()
        finally:
            await agent.stop()
            await server.stop(None)

    rc, status = asyncio.run(go())
    out = capsys.readouterr().out
    assert rc == 0
    assert status["profile"] == "emulated rpi4 (roofline estimate)"
    assert status["local_ms"] == pytest.approx(profile_model_ms(reference_profile("rpi4", graph), graph))
    # this host's own time is kept apart, and the device's runs are stretched by the ratio of the two
    assert status["host_model_ms"] > 0
    assert status["device_slowdown"] == pytest.approx(max(1.0, status["local_ms"] / status["host_model_ms"]))
    assert not os.path.exists(os.path.join(str(tmp_path / "cache"), "profiles"))  # no estimate written
    by = status["counters"]
    where = re.search(r"^served by: (\w+)", out, re.M)
    assert where is not None, out
    # The answer's placement in words matches how the agent counted it.
    assert {"split": "remote", "remote": "remote", "local": "local"}[where.group(1)] in \
        [k for k in ("remote", "local", "local_tail") if by[k] == 1]
    assert re.search(r"^output y: float32 \[1, 3\]  top-3: ", out, re.M), out


def test_run_emulated_cleans_up_after_an_agent_that_cannot_start(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    tempfile.tempdir = None  # mkdtemp reads TMPDIR again
    try:
        config = config_from_dict({
            "gateway": "127.0.0.1:9", "model": "nothing@1", "cacheDir": str(tmp_path / "cache"), "apiPort": 0,
            "startupTimeoutS": 0.5, "emulate": {"device": "rpi4", "uplink": "10mbit", "rtt": "5ms"}})
        rc = run_emulated(config, log_level="warning")
    finally:
        tempfile.tempdir = None
    assert rc != 0
    assert not [n for n in os.listdir(tmp_path) if n.startswith("splitinfer-edge-")]
