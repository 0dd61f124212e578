"""`splitinfer demo` removes its temporary directory on every way out: an error in set-up,
a Ray that never started, SIGTERM. The set-up is replaced by a stand-in that records the
directory it was given, so each test runs in well under a second."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest

from splitinfer import demo
from splitinfer.demo import setup as demo_setup
from splitinfer.demo import stack as demo_stack


@pytest.fixture
def tmp_root(tmp_path, monkeypatch: pytest.MonkeyPatch) -> str:
    """tempfile's directory for the test, and the demo's gRPC log switch restored after it."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("GRPC_VERBOSITY", os.environ.get("GRPC_VERBOSITY", "ERROR"))
    return str(tmp_path)


def _failing_prepare(seen: list[str], *, call_before_cloud: bool = False):
    def prepare(name, work_dir, *, runs, slowdown=None, say=print, before_cloud=lambda: None):
        seen.append(work_dir)
        with open(os.path.join(work_dir, "partial.onnx"), "wb") as fh:
            fh.write(b"\0" * 1024)
        if call_before_cloud:
            before_cloud()
        raise RuntimeError("set-up failed")

    return prepare


def _demo_dirs(root: str) -> list[str]:
    return [n for n in os.listdir(root) if n.startswith("splitinfer-demo-")]


def test_demo_removes_its_temp_dir_when_set_up_fails(tmp_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    monkeypatch.setattr(demo_setup, "prepare", _failing_prepare(seen))
    with pytest.raises(RuntimeError, match="set-up failed"):
        demo.main(["--no-ray", "-o", os.path.join(tmp_root, "report")])
    assert seen and seen[0].startswith(os.path.join(tmp_root, "splitinfer-demo-"))
    assert _demo_dirs(tmp_root) == []


def test_demo_removes_its_temp_dir_when_ray_fails_to_start(tmp_root: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_ray(*, quiet: bool = True) -> float:
        raise RuntimeError("the raylet never started")

    seen: list[str] = []
    stopped: list[bool] = []
    monkeypatch.setattr(demo_setup, "prepare", _failing_prepare(seen, call_before_cloud=True))
    monkeypatch.setattr(demo_stack, "start_ray", no_ray)
    monkeypatch.setattr(demo_stack, "stop_ray", lambda: stopped.append(True))
    with pytest.raises(RuntimeError, match="raylet never started"):
        demo.main(["-o", os.path.join(tmp_root, "report")])
    assert seen and stopped == [True]
    assert _demo_dirs(tmp_root) == []


@pytest.mark.parametrize("flag", [("--trace-scale", "-1"), ("--trace-scale", "nan"), ("--slowdown", "0.5")])
def test_demo_refuses_bad_numbers_before_making_anything(flag: tuple[str, str], tmp_root: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--no-ray", *flag]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"splitinfer demo: {flag[0]} must be") and flag[1] in err
    assert _demo_dirs(tmp_root) == []


_SIGTERM_SCRIPT = textwrap.dedent("""
    import sys, time
    from splitinfer import demo
    from splitinfer.demo import setup as demo_setup

    def prepare(name, work_dir, *, runs, slowdown=None, say=print, before_cloud=lambda: None):
        print("ready", work_dir, flush=True)
        time.sleep(0.5)  # a set-up thread keeps going after the signal, as profiling does
        open(work_dir + "/late.onnx", "wb").close()
        raise RuntimeError("not reached in time")

    demo_setup.prepare = prepare
    sys.exit(demo.main(["--no-ray", "-o", sys.argv[1]]))
""")


def test_demo_removes_its_temp_dir_on_sigterm(tmp_path) -> None:
    env = dict(os.environ, TMPDIR=str(tmp_path))
    p = subprocess.Popen([sys.executable, "-c", _SIGTERM_SCRIPT, str(tmp_path / "report")], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("ready ") and p.poll() is None:
            line = p.stdout.readline()
        assert line.startswith("ready "), p.stderr.read()
        assert os.path.isdir(line.split()[1])
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "interrupted" in err and "Traceback" not in err
    assert _demo_dirs(str(tmp_path)) == []
