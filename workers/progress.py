"""Progress of a long step: a tqdm bar on a terminal, one plain line per step otherwise.

A bar redraws itself with carriage returns, which is what a terminal wants and what a log
file or a CI console does not: there each redraw is kept, and a 60-run profile leaves 60
fragments on one line. Off a terminal the step is reported once, when it ends:

    with progress(total=80, desc="profile resnet50") as bar:
        for ...:
            bar.update(1)
    # off a terminal: "profile resnet50: 80/80 in 3.1 s"
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol, TextIO

__all__ = ["Progress", "progress"]


class Progress(Protocol):
    def update(self, n: int = 1) -> object: ...


class _Silent:
    def update(self, n: int = 1) -> None:
        pass


class _Line:
    """Counts the step's units and writes one line when the step ends."""

    def __init__(self, total: int, desc: str, stream: TextIO) -> None:
        self.total, self.desc, self.stream = total, desc, stream
        self.done = 0
        self._t0 = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.done += n

    def close(self) -> None:
        took_s = time.monotonic() - self._t0
        took = f"{took_s:.1f} s" if took_s >= 1 else f"{took_s * 1e3:.0f} ms"
        label = f"{self.desc}: " if self.desc else ""
        print(f"{label}{self.done}/{self.total} in {took}", file=self.stream, flush=True)


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


@contextmanager
def progress(total: int, desc: str = "", *, enabled: bool = True, stream: TextIO | None = None) -> Iterator[Progress]:
    """A progress display for one step of ``total`` units, written to ``stream`` (stderr).

    On a terminal it is a tqdm bar that clears itself when the step ends; otherwise one
    line, "desc: done/total in 3.1 s" (or "in 40 ms"), when the step ends (also when it ends by an error).
    Disabled, it writes nothing.
    """
    out = sys.stderr if stream is None else stream
    if not enabled:
        yield _Silent()
        return
    if _is_tty(out):
        from tqdm import tqdm

        # tqdm's monitor thread is joined from tqdm's own lock when the last bar goes away,
        # which can deadlock a process that also runs servers' threads (seen as a hang in
        # the test suite); a bar updated every unit needs no monitor.
        tqdm.monitor_interval = 0
        with tqdm(total=total, desc=desc, leave=False, file=out) as bar:
            yield bar
        return
    line = _Line(total, desc, out)
    try:
        yield line
    finally:
        line.close()
