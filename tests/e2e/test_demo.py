"""`splitinfer demo --quick` end to end, as a user runs it: a subprocess, a report, and
nothing left running afterwards (on success and on Ctrl-C).

Every process the demo starts (Ray's, the edge agent, the timing child) inherits the
environment, so a random token in the demo's environment finds them all afterwards,
even those that left the demo's session or process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from partitioner import Cut

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
TOKEN_VAR = "SPLITINFER_DEMO_TEST_TOKEN"


def _tagged(token: str) -> list[int]:
    """Live processes whose environment carries `token` (zombies have none, and are gone)."""
    needle = f"{TOKEN_VAR}={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if needle in fh.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _start(args: list[str], token: str) -> subprocess.Popen[str]:
    env = dict(os.environ, **{TOKEN_VAR: token, "PYTHONUNBUFFERED": "1"})
    return subprocess.Popen([sys.executable, "-m", "splitinfer", "demo", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _gone(token: str, wait_s: float = 20.0) -> list[int]:
    """Waits for tagged processes to exit (the kernel reaps Ray's workers shortly after)."""
    t0 = time.monotonic()
    while True:
        left = _tagged(token)
        if not left or time.monotonic() - t0 > wait_s:
            return left
        time.sleep(0.5)


def _kill(pids: list[int]) -> None:
    for pid in pids:  # only processes this test started (they carry its token)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _cgroups_left(pid: int) -> list[str]:
    name = f"splitinfer-demo-{pid}"
    return [p for p in (f"/sys/fs/cgroup/cpu/{name}", f"/sys/fs/cgroup/{name}") if os.path.exists(p)]


def test_quick_demo_reports_every_answer_once_and_leaves_nothing_running(tmp_path):
    token = uuid.uuid4().hex
    out = tmp_path / "report"
    proc = _start(["--quick", "-o", str(out)], token)
    try:
        log, _ = proc.communicate(timeout=540)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    left = _gone(token)
    _kill(left)
    assert proc.returncode == 0, log[-4000:]
    assert left == [], f"processes left running after the demo: {left}\n{log[-2000:]}"
    assert _cgroups_left(proc.pid) == []

    for name in ("index.html", "report.json", "timeline.png", "compare.png"):
        assert (out / name).stat().st_size > 0, name
    data = json.loads((out / "report.json").read_text())
    c = data["counts"]
    assert c["sent"] > 0
    assert c["lost"] == 0 and c["doubled"] == 0
    assert c["answered"] == c["sent"]
    assert c["served_split"] + c["served_remote"] + c["served_local"] + c["served_fallback"] == c["answered"]
    # The product, shown: some answers ran the head on the device and the tail in the cloud.
    assert c["served_split"] > 0, log[-3000:]
    split = [r for r in data["requests"] if r["served_as"] == "split"]
    assert len(split) == c["served_split"]
    assert all(0 < len(Cut.from_key(r["cut_id"]).device) < data["setup"]["layers"] for r in split)
    # The fast first phase is served by the cloud (docs/demo.md): the agent's first remote answers,
    # slower than priced while the download's fast link was still held, do not send it back local.
    fast = data["phases"][0]
    in_fast = [r for r in data["requests"] if r["sent_s"] < fast["end_s"]]
    offloaded = [r for r in in_fast if r["served_as"] in ("split", "remote")]
    assert len(offloaded) >= len(in_fast) / 2, (fast, [r["served_as"] for r in in_fast], log[-3000:])
    v = data["verification"]
    assert v["checked"] == c["answered"] and v["mismatched"] == 0
    # Every answer within its encoding's tolerance of the whole model, and the worst of each recorded.
    per = v["per_encoding"]
    assert sum(m["answers"] for m in per.values()) == c["answered"]
    for enc, m in per.items():
        errs = [r["rel_err"] for r in data["requests"] if r["encoding"] == enc and r["served_as"] != "error"]
        assert m["max_rel_err"] == max(errs) <= m["tolerance"], (enc, m)
    # The ratio is the reference devices', stated, and the device was timed near it.
    emu = data["emulation"]
    assert emu["reference"]["edge_device"] == "rpi4" and emu["reference"]["cloud_device"] == "t4"
    assert sum(data["skip_reasons"].values()) == c["frames_skipped"]
    # The live table printed about a line per second, and the report covers every phase of the trace.
    table = [x for x in log.splitlines() if ("Mbit/s" in x or "OUTAGE" in x) and x.strip()[:1].isdigit()]
    assert len(table) >= 10, log[-3000:]
    assert [p["label"] for p in data["phases"]][2] == "outage"
    assert len(data["requests"]) == c["sent"]


def test_ctrl_c_stops_everything_the_demo_started(tmp_path):
    token = uuid.uuid4().hex
    proc = _start(["--quick", "--no-ray", "-o", str(tmp_path / "report")], token)
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "edge agent: pid" in line:  # the gateway, the link and the agent process all run now
                break
        assert any("edge agent: pid" in x for x in lines), "".join(lines[-30:])
        assert len(_tagged(token)) >= 2  # the demo and its edge agent
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    left = _gone(token)
    _kill(left)
    assert proc.returncode == 130, "".join(lines[-20:]) + rest[-3000:]
    assert "interrupted" in rest
    assert left == [], f"processes left running after Ctrl-C: {left}"
    assert _cgroups_left(proc.pid) == []
    assert not (tmp_path / "report" / "report.json").exists()
