"""`splitinfer netem --trace` takes the shipped names, and the checkout's path to them, from any directory."""

import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

LOOPBACK = "127.0.0.1"


@pytest.mark.parametrize("spec", ["4g", "splitinfer/traces/4g.csv"])
def test_netem_command_replays_a_shipped_trace_from_another_directory(spec, tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        [sys.executable, "-m", "splitinfer.netem", "--listen", f"{LOOPBACK}:0", "--upstream", f"{LOOPBACK}:1",
         "--trace", spec, "--control", f"{LOOPBACK}:0", "--log-level", "WARNING"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = process.stdout.readline()
        assert line.startswith("netem listening on"), process.stderr.read() if process.poll() is not None else line
        control_port = int(line.rsplit(":", 1)[1])
        with urllib.request.urlopen(f"http://{LOOPBACK}:{control_port}/state", timeout=5) as response:
            state = json.load(response)
        assert state["setting"]["up_mbps"] == pytest.approx(5.85)
        assert state["trace"]["steps"] == 2
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0
