"""Progress bars only on a terminal; one plain line per step otherwise."""

from __future__ import annotations

import io
import os
import pty

import pytest

from workers.progress import progress


def test_progress_off_a_terminal_writes_one_plain_line_per_step() -> None:
    out = io.StringIO()
    for desc in ("profile squeezenet", "segments squeezenet"):
        with progress(40, desc, stream=out) as bar:
            for _ in range(40):
                bar.update(1)
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("profile squeezenet: 40/40 in ") and lines[0].endswith((" s", " ms"))
    assert lines[1].startswith("segments squeezenet: 40/40 in ")


def test_progress_says_how_far_a_step_got_when_it_fails() -> None:
    out = io.StringIO()
    with pytest.raises(RuntimeError), progress(10, "profile x", stream=out) as bar:
        bar.update(3)
        raise RuntimeError("a run failed")
    assert out.getvalue().startswith("profile x: 3/10 in ")


def test_progress_disabled_writes_nothing() -> None:
    out = io.StringIO()
    with progress(5, "x", enabled=False, stream=out) as bar:
        bar.update(5)
    assert out.getvalue() == ""


def test_progress_on_a_terminal_draws_a_bar() -> None:
    leader, follower = pty.openpty()
    try:
        with open(follower, "w", closefd=False) as tty:
            with progress(3, "profile x", stream=tty) as bar:
                for _ in range(3):
                    bar.update(1)
            tty.flush()
        drawn = os.read(leader, 65536).decode()
    finally:
        os.close(leader)
        os.close(follower)
    assert "\r" in drawn and "profile x:" in drawn and "/3 [" in drawn


def test_measure_progress_off_a_terminal_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    import onnxruntime as ort

    from tests.unit._engine_models import make_small_cnn
    from workers.profile.measure import time_interleaved

    sess = ort.InferenceSession(make_small_cnn().SerializeToString(), providers=["CPUExecutionProvider"])
    feed = {i.name: _zeros(i) for i in sess.get_inputs()}
    time_interleaved([(sess, feed)], warmup=0, runs=4, progress=True, desc="profile tiny")
    err = capsys.readouterr().err
    assert "\r" not in err
    assert err.startswith("profile tiny: 4/4 in ") and err.count("\n") == 1


def _zeros(arg):  # noqa: ANN001, ANN202 - an ORT NodeArg
    import numpy as np

    shape = [d if isinstance(d, int) else 1 for d in arg.shape]
    return np.zeros(shape, dtype=np.float32)
