"""Mahimahi packet-delivery traces: loading them, and the link that follows one.

A Mahimahi trace (``FILE.up``, ``FILE.down``) has one line per delivery opportunity: an
integer time in milliseconds from the start of the trace, at which the link can deliver
one 1500-byte packet. Several opportunities in the same millisecond repeat the time.
The trace repeats with a period equal to its last time. Values and arithmetic only;
time is passed in, as in `splitinfer.netem.link`.

[Note: opportunity link]
`OpportunityLink` is one direction of the link as Mahimahi's ``mm-link`` runs it: a FIFO
queue served by the trace. Each opportunity delivers up to `PACKET_BYTES` of queued data
(a byte stream has no packets, so a partly used opportunity serves the next bytes too
while they are already queued); an opportunity that finds the queue empty is lost.
Because the schedule is known in advance and the queue is FIFO, the moment each byte
leaves is fixed when it arrives, so `reserve` computes it at once and nothing has to
tick per opportunity. Opportunities that fall within `tick_ms` of each other are
merged into one piece, delivered together: a timer cannot wake more finely anyway.

The queue is drop-tail with a bound in bytes. Bytes of a TCP stream cannot be dropped,
so the proxy treats a full queue as a full router buffer that TCP's congestion control
would back off from: it stops reading from the sender until there is room (the sender's
socket buffers fill and its writes block). The bound caps the queueing delay inside the
link at the time the trace takes to deliver that many bytes.

[Note: scaled traces]
`MahimahiTrace.scaled(k)` replays a recording as a link k times as fast (or slow): every
instant that had an opportunity keeps its place, and by any time the scaled trace has
delivered k times the original's opportunities, rounded down. The dips, outages and bursts
stay where they were and keep their shape; only their depth in bytes changes. That tests an
agent on a faster network of the same kind (a 3x replay of a 4G drive is closer to a good
LTE cell than to 5G, whose variation has a different shape), not on another recording.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from splitinfer.netem.link import NetemError, TraceFormatError

__all__ = [
    "DEFAULT_QUEUE_BYTES",
    "PACKET_BYTES",
    "MahimahiTrace",
    "OpportunityLink",
    "load_mahimahi_trace",
]

PACKET_BYTES = 1500
DEFAULT_QUEUE_PACKETS = 100
DEFAULT_QUEUE_BYTES = DEFAULT_QUEUE_PACKETS * PACKET_BYTES
"""100 packets (150 kB): one bandwidth-delay product of a 30 Mbit/s, 40 ms link, so the
link stays busy at the fastest rates in the shipped-format traces, while a slow link
(1 Mbit/s) queues at most 1.2 s instead of growing without bound."""


@dataclass(frozen=True)
class MahimahiTrace:
    """One direction's delivery opportunities, as read from a Mahimahi trace file."""

    path: str
    """The file it was read from (for messages)."""
    opportunities_ms: tuple[int, ...]
    """Times of the delivery opportunities in one period, non-decreasing, in ms."""

    @property
    def period_ms(self) -> int:
        """The trace repeats after this many milliseconds (its last time)."""
        return self.opportunities_ms[-1]

    @property
    def mean_bps(self) -> float:
        return len(self.opportunities_ms) * PACKET_BYTES * 8 * 1000.0 / self.period_ms

    def count_between(self, start_ms: float, end_ms: float) -> int:
        """Opportunities at times t with start_ms <= t < end_ms, counting the repeats."""
        return _index_at(self.opportunities_ms, end_ms) - _index_at(self.opportunities_ms, start_ms)

    def scaled(self, factor: float) -> MahimahiTrace:
        """The same trace at `factor` times its rate: the same instants and period, each carrying
        `factor` times as many opportunities (cumulatively rounded down, so the count by any time is
        within one opportunity of `factor` times the original's); see [Note: scaled traces]."""
        if not (math.isfinite(factor) and factor > 0):
            raise NetemError(f"a Mahimahi trace's rate factor must be a number > 0, got {factor!r}",
                             fix="scale by e.g. 0.5 (half the rate) or 3 (three times)")
        if factor == 1:
            return self
        times: list[int] = []
        for n, t_ms in enumerate(self.opportunities_ms, start=1):
            times.extend([t_ms] * (math.floor(n * factor + 1e-9) - len(times)))
        if not times or times[-1] != self.period_ms:
            times.append(self.period_ms)  # the period is the last time: keep one opportunity there
        return MahimahiTrace(path=f"{self.path} x{factor:g}", opportunities_ms=tuple(times))

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "opportunities": len(self.opportunities_ms), "period_ms": self.period_ms,
                "mean_bps": self.mean_bps}


def load_mahimahi_trace(path: str | Path) -> MahimahiTrace:
    """Read a Mahimahi trace file; a bad file is a `TraceFormatError` naming it and the line.

    Blank lines are skipped. Every other line is one integer >= 0; the times never
    decrease and the last one (the period) is > 0.
    """
    name = str(path)
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise NetemError(f"cannot read Mahimahi trace {name!r}: {e}",
                         fix="pass the path of a Mahimahi trace (one integer millisecond time per line)") from e
    times: list[int] = []
    line = 0
    for line, raw in enumerate(text.splitlines(), start=1):
        cell = raw.strip()
        if not cell:
            continue
        if not cell.isdigit():
            raise TraceFormatError("a Mahimahi trace line must be one integer time in ms >= 0", path=name,
                                   line=line, value=cell, fix="write one whole number of milliseconds per line")
        t_ms = int(cell)
        if times and t_ms < times[-1]:
            raise TraceFormatError(f"times must not decrease (previous line is {times[-1]})", path=name, line=line,
                                   value=cell, fix="sort the lines in time order")
        times.append(t_ms)
    if not times:
        raise TraceFormatError("Mahimahi trace is empty", path=name, line=max(line, 1), value="",
                               fix="give one line per 1500-byte delivery opportunity, a time in ms")
    if times[-1] <= 0:
        raise TraceFormatError("the last time (the trace's period) must be > 0", path=name, line=line,
                               value=str(times[-1]), fix="end the trace with an opportunity after 0 ms")
    return MahimahiTrace(path=name, opportunities_ms=tuple(times))


def _index_at(times: tuple[int, ...] | list[int], t_ms: float) -> int:
    """Absolute index (counting repeats) of the first opportunity at or after t_ms."""
    period_ms = times[-1]
    cycle = math.floor(t_ms / period_ms)
    index = cycle * len(times) + bisect.bisect_left(times, t_ms - cycle * period_ms)
    if cycle > 0 and t_ms == cycle * period_ms:
        # The previous period's opportunities at its end fall at t_ms too.
        index -= len(times) - bisect.bisect_left(times, period_ms)
    return index


class OpportunityLink:
    """One direction of a link that delivers on a Mahimahi trace (see [Note: opportunity link]).

    The trace's time 0 is ``start_s`` on the caller's clock.
    """

    def __init__(self, trace: MahimahiTrace, *, start_s: float, tick_ms: float = 1.0) -> None:
        if not tick_ms >= 0:
            raise NetemError(f"tick_ms must be >= 0, got {tick_ms!r}", fix="pass e.g. 1.0")
        self.trace = trace
        self._times = list(trace.opportunities_ms)
        self._start_s = start_s
        self._tick_ms = tick_ms
        self._next = 0          # absolute index of the next opportunity not yet used up
        self._left = PACKET_BYTES  # bytes still free in that opportunity
        self._last_s = start_s  # when the last reserved byte leaves
        self._pending: deque[tuple[float, int]] = deque()  # (leaves at, bytes), in order
        self._pending_bytes = 0

    @property
    def start_s(self) -> float:
        return self._start_s

    def _time_ms(self, index: int) -> int:
        cycle, i = divmod(index, len(self._times))
        return cycle * self._times[-1] + self._times[i]

    def reserve(self, nbytes: int, *, arrival_s: float) -> list[tuple[float, int]]:
        """Queue ``nbytes`` that arrived at ``arrival_s``; returns when they leave, in pieces.

        Each piece is (time it leaves the link, bytes), in order; they add up to
        ``nbytes``. With ``nbytes = 0`` (end of stream) one empty piece leaves after the
        bytes queued before it.
        """
        arrival_s = max(arrival_s, self._start_s)
        arrival_ms = (arrival_s - self._start_s) * 1000.0
        if self._time_ms(self._next) < arrival_ms:
            # The queue was empty when these opportunities came: they are lost.
            self._next = _index_at(self._times, arrival_ms)
            self._left = PACKET_BYTES
        if nbytes <= 0:
            return [(max(arrival_s, self._last_s), 0)]
        pieces: list[tuple[float, int]] = []
        remaining = nbytes
        while remaining > 0:
            first_ms = self._time_ms(self._next)
            taken = 0
            while remaining > 0 and self._time_ms(self._next) - first_ms <= self._tick_ms:
                used = min(remaining, self._left)
                taken += used
                remaining -= used
                self._left -= used
                last_ms = self._time_ms(self._next)
                if self._left == 0:
                    self._next += 1
                    self._left = PACKET_BYTES
            leave_s = self._start_s + last_ms / 1000.0
            pieces.append((leave_s, taken))
            self._pending.append((leave_s, taken))
        self._pending_bytes += nbytes
        self._last_s = max(self._last_s, pieces[-1][0])
        return pieces

    def backlog_bytes(self, *, now_s: float) -> int:
        """Bytes queued and not yet delivered at ``now_s``."""
        while self._pending and self._pending[0][0] <= now_s:
            self._pending_bytes -= self._pending.popleft()[1]
        return self._pending_bytes

    def room_at_s(self, limit_bytes: int, *, now_s: float) -> float:
        """When the backlog falls to ``limit_bytes`` or below (``now_s`` if it already has)."""
        backlog = self.backlog_bytes(now_s=now_s)
        if backlog <= limit_bytes:
            return now_s
        for leave_s, nbytes in self._pending:
            backlog -= nbytes
            if backlog <= limit_bytes:
                return leave_s
        return self._last_s
