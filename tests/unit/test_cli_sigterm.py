"""SIGTERM makes a command unwind as Ctrl-C does: its `with`/`finally` and atexit clean-ups
run, so the temporary directories it made are gone, and it exits 143 with one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import atexit, shutil, sys, tempfile, time, types
    from splitinfer import cli

    def slow_main(argv):
        kept = tempfile.mkdtemp(prefix="splitinfer-engine-")  # removed at exit, as the engine's cache is
        atexit.register(shutil.rmtree, kept, True)
        with tempfile.TemporaryDirectory(prefix="splitinfer-profile-") as tmp:
            print("ready", kept, tmp, flush=True)
            time.sleep(60)
        return 0

    sys.modules["_slow_cmd"] = types.SimpleNamespace(slow_main=slow_main)
    cli.COMMANDS["slow"] = ("_slow_cmd", "slow_main", "a command that works for a while")
    sys.exit(cli.main(["slow"]))
""")


def test_sigterm_unwinds_a_command_and_removes_its_temp_dirs(tmp_path) -> None:
    p = subprocess.Popen([sys.executable, "-c", _SCRIPT], env=dict(os.environ, TMPDIR=str(tmp_path)),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        ready = p.stdout.readline().split()
        assert ready[:1] == ["ready"], p.stderr.read() if p.stderr else ""
        assert all(os.path.isdir(d) for d in ready[1:])
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM
    assert err == "splitinfer slow: terminated\n"
    assert os.listdir(tmp_path) == []


def test_main_puts_the_sigterm_handler_back_when_the_command_returns() -> None:
    from splitinfer import cli

    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(["demo", "--fps", "0"]) == 2  # refused before any work
    assert signal.getsignal(signal.SIGTERM) is before
