"""The link model of the emulator: settings, traces and the token bucket.

Values and arithmetic only; the proxy that applies them is `splitinfer.netem.proxy`, and
the package `splitinfer.netem` re-exports all of it. Time is always
passed in, so everything here is testable without a clock or a socket.
"""

from __future__ import annotations

import bisect
import csv
import difflib
import enum
import math
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any, Sequence

from splitinfer.units import format_rate_bps

__all__ = [
    "TRACE_HEADER",
    "LinkSetting",
    "NetemError",
    "NetemStats",
    "OutageMode",
    "TokenBucket",
    "TraceFormatError",
    "TraceStep",
    "load_trace",
    "resolve_trace",
    "setting_at",
    "shipped_trace_names",
    "shipped_trace_path",
    "trace_position",
]

TRACE_HEADER = ("t_s", "up_mbps", "down_mbps", "rtt_ms", "up")


class NetemError(Exception):
    """Root error of the link emulator."""

    def __init__(self, message: str, *, fix: str = "") -> None:
        super().__init__(f"{message}; {fix}" if fix else message)
        self.fix = fix


class TraceFormatError(NetemError, ValueError):
    """A trace CSV that cannot be read: names the file, line and value."""

    def __init__(self, message: str, *, path: str, line: int, value: str, fix: str) -> None:
        super().__init__(f"{path}:{line}: {message} (got {value!r})", fix=fix)
        self.path = path
        self.line = line
        self.value = value


class OutageMode(str, enum.Enum):
    """What the link does to TCP while it is down."""

    BLACKHOLE = "blackhole"
    RESET = "reset"


@dataclass(frozen=True)
class LinkSetting:
    """The state of the emulated link at one moment."""

    up_bps: float
    """Uplink (client -> upstream) bandwidth in bits/s; 0 means the link is down."""
    down_bps: float
    """Downlink (upstream -> client) bandwidth in bits/s; 0 means the link is down."""
    rtt_ms: float = 0.0
    """Round-trip time the link adds; each direction adds rtt_ms / 2."""
    up: bool = True
    """False is an outage whatever the bandwidths say."""

    def __post_init__(self) -> None:
        for name in ("up_bps", "down_bps", "rtt_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise NetemError(f"LinkSetting.{name} must be a finite number >= 0, got {value!r}",
                                 fix="pass a non-negative number (0 bandwidth means an outage)")
        if not isinstance(self.up, bool):
            raise NetemError(f"LinkSetting.up must be a bool, got {self.up!r}", fix="pass True or False")

    @classmethod
    def from_mbps(cls, up_mbps: float, down_mbps: float, rtt_ms: float = 0.0, up: bool = True) -> LinkSetting:
        return cls(up_bps=up_mbps * 1e6, down_bps=down_mbps * 1e6, rtt_ms=rtt_ms, up=up)

    @property
    def is_outage(self) -> bool:
        return not self.up or self.up_bps <= 0 or self.down_bps <= 0

    def describe(self) -> str:
        if self.is_outage:
            return "outage"
        return f"up {format_rate_bps(self.up_bps)}, down {format_rate_bps(self.down_bps)}, rtt {self.rtt_ms:g}ms"

    def to_json(self) -> dict[str, Any]:
        return {"up_bps": self.up_bps, "down_bps": self.down_bps, "rtt_ms": self.rtt_ms, "up": self.up}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LinkSetting:
        return cls(up_bps=data["up_bps"], down_bps=data["down_bps"], rtt_ms=data["rtt_ms"], up=data["up"])


@dataclass(frozen=True)
class TraceStep:
    """From ``t_s`` seconds after the replay starts, the link is ``setting``."""

    t_s: float
    """Start of this step, seconds since the start of the replay."""
    setting: LinkSetting
    """The link from ``t_s`` until the next step."""

    def to_json(self) -> dict[str, Any]:
        return {"t_s": self.t_s, "setting": self.setting.to_json()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TraceStep:
        return cls(t_s=data["t_s"], setting=LinkSetting.from_json(data["setting"]))


@dataclass(frozen=True)
class NetemStats:
    """Counters since the emulator started."""

    bytes_up: int = 0
    """Bytes delivered client -> upstream."""
    bytes_down: int = 0
    """Bytes delivered upstream -> client."""
    dropped_bytes: int = 0
    """Queued bytes thrown away when an outage reset their connection."""
    connections_accepted: int = 0
    connections_active: int = 0
    connections_refused: int = 0
    """Connections reset on arrival because the link was down in reset mode."""
    connections_reset: int = 0
    """Open connections reset by an outage in reset mode."""
    upstream_failures: int = 0
    """Connections whose upstream could not be reached."""
    outages: int = 0
    """Transitions from up to down."""

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NetemStats:
        return cls(**{f.name: int(data[f.name]) for f in fields(cls)})


# -- traces ------------------------------------------------------------------------


def _traces_dir() -> Path:
    return Path(str(resources.files("splitinfer.traces")))


def shipped_trace_names() -> list[str]:
    """Names of the traces shipped with the package, sorted: ``['3g', '4g', '5g', ...]``."""
    return sorted(p.stem for p in _traces_dir().glob("*.csv"))


def _unknown_trace(message: str, spec: str) -> NetemError:
    names = shipped_trace_names()
    stem = Path(spec).name.removesuffix(".csv").lower()
    close = difflib.get_close_matches(stem, names, n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return NetemError(message, fix=f"{hint}shipped traces: {', '.join(names)}; or give the path of a trace CSV")


def shipped_trace_path(name: str) -> Path:
    """Path of a trace shipped with the package (``'demo'``, ``'3g'``, ``'4g'``, ...)."""
    if name not in shipped_trace_names():
        raise _unknown_trace(f"no shipped trace named {name!r}", name)
    return _traces_dir() / f"{name}.csv"


def resolve_trace(spec: str | Path) -> Path:
    """The trace file that ``spec`` names, from any working directory.

    In order: an existing file at ``spec``; a shipped name (``'4g'``, also ``'4g.csv'``);
    the shipped file's path as the checkout shows it (``splitinfer/traces/4g.csv``), which
    resolves through the installed package wherever the command runs. Anything else is a
    `NetemError` listing the shipped names, with the closest one suggested.
    """
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    names = shipped_trace_names()
    text = str(spec)
    if path.name == text and path.name.removesuffix(".csv") in names:
        return _traces_dir() / f"{path.name.removesuffix('.csv')}.csv"
    if path.suffix == ".csv" and path.parent.parts[-2:] == ("splitinfer", "traces") and path.stem in names:
        return _traces_dir() / path.name
    if path.name == text and not path.suffix:
        raise _unknown_trace(f"no shipped trace named {text!r} and no file of that name", text)
    raise _unknown_trace(f"no trace file at {text!r}", text)


def load_trace(path: str | Path) -> list[TraceStep]:
    """Read a trace CSV with header ``t_s,up_mbps,down_mbps,rtt_ms,up``.

    ``path`` is a file or a shipped trace's name (``'4g'``), as `resolve_trace` reads it.

    Blank lines and lines starting with ``#`` are skipped. The first step starts at
    t_s = 0 and times increase strictly. The last row marks the end of the trace: its
    setting holds for ever when not looping, and a looping replay restarts at its time.
    """
    path = resolve_trace(path)
    name = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise NetemError(f"cannot read trace {name!r}: {e}", fix="pass the path of a CSV trace file") from e
    rows = [(n, row) for n, row in enumerate(csv.reader(text.splitlines()), start=1)
            if row and "".join(row).strip() and not row[0].lstrip().startswith("#")]
    if not rows:
        raise TraceFormatError("trace is empty", path=name, line=1, value="",
                               fix=f"start with the header '{','.join(TRACE_HEADER)}' and add at least one row")
    header_line, header = rows[0]
    if tuple(c.strip() for c in header) != TRACE_HEADER:
        raise TraceFormatError("bad header", path=name, line=header_line, value=",".join(header),
                               fix=f"the first line must be '{','.join(TRACE_HEADER)}'")
    steps: list[TraceStep] = []
    for line, row in rows[1:]:
        if len(row) != len(TRACE_HEADER):
            raise TraceFormatError(f"expected {len(TRACE_HEADER)} columns, found {len(row)}", path=name,
                                   line=line, value=",".join(row), fix=f"give {','.join(TRACE_HEADER)} on every row")
        values: list[float] = []
        for column, cell in zip(TRACE_HEADER, row):
            try:
                number = float(cell)
            except ValueError:
                number = math.nan
            if not math.isfinite(number) or number < 0:
                raise TraceFormatError(f"column {column} must be a finite number >= 0", path=name, line=line,
                                       value=cell.strip(), fix=f"write a plain non-negative number in {column}")
            values.append(number)
        t_s, up_mbps, down_mbps, rtt_ms, up = values
        if up not in (0.0, 1.0):
            raise TraceFormatError("column up must be 1 (link up) or 0 (outage)", path=name, line=line,
                                   value=row[4].strip(), fix="write 1 or 0")
        if not steps and t_s != 0:
            raise TraceFormatError("the first row must start at t_s = 0", path=name, line=line,
                                   value=row[0].strip(), fix="add a row at t_s = 0 for the initial link")
        if steps and t_s <= steps[-1].t_s:
            raise TraceFormatError(f"t_s must increase strictly (previous row is at {steps[-1].t_s:g})", path=name,
                                   line=line, value=row[0].strip(), fix="sort the rows by t_s and remove duplicates")
        steps.append(TraceStep(t_s=t_s, setting=LinkSetting.from_mbps(up_mbps, down_mbps, rtt_ms, up == 1.0)))
    if not steps:
        raise TraceFormatError("trace has a header but no rows", path=name, line=header_line, value="",
                               fix="add at least one row, starting at t_s = 0")
    return steps


def trace_position(steps: Sequence[TraceStep], elapsed_s: float, *, loop: bool = False) -> tuple[int, float | None]:
    """Index of the step active ``elapsed_s`` into a replay, and when the next one starts.

    The next start is on the same time base as ``elapsed_s``; None when nothing follows.
    When looping, the last row only marks the period and is never active.
    """
    if not steps:
        raise NetemError("trace_position needs at least one step", fix="load a trace with load_trace()")
    starts = [s.t_s for s in steps]
    period_s = starts[-1]
    if loop and len(steps) > 1 and period_s > 0:
        cycles = math.floor(max(elapsed_s, 0.0) / period_s)
        base_s = cycles * period_s
        index = max(bisect.bisect_right(starts, elapsed_s - base_s, hi=len(steps) - 1) - 1, 0)
        return index, base_s + starts[index + 1]
    index = max(bisect.bisect_right(starts, elapsed_s) - 1, 0)
    return index, (starts[index + 1] if index + 1 < len(steps) else None)


def setting_at(steps: Sequence[TraceStep], elapsed_s: float, *, loop: bool = False) -> LinkSetting:
    """The link setting ``elapsed_s`` into a replay of ``steps``."""
    return steps[trace_position(steps, elapsed_s, loop=loop)[0]].setting


# -- scheduling --------------------------------------------------------------------


class TokenBucket:
    """A token bucket that schedules instead of dropping (see [Note: timing model]).

    Tokens are bytes. A reservation may drive the count negative: the debt is the
    backlog still waiting for serialisation, and it pays off at the link rate. With
    ``burst_bytes = 0`` (the default) the bucket is a pure serialiser, as a physical
    link is: every byte costs 8 / rate seconds. Time is passed in, so the arithmetic
    can be tested without a clock.
    """

    def __init__(self, rate_bps: float, *, now_s: float, burst_bytes: int = 0) -> None:
        if rate_bps < 0 or burst_bytes < 0:
            raise NetemError(f"TokenBucket needs rate_bps >= 0 and burst_bytes >= 0, got {rate_bps!r}, {burst_bytes!r}",
                             fix="pass non-negative values")
        self._rate_bytes_per_s = rate_bps / 8.0
        self._burst_bytes = float(burst_bytes)
        self._tokens = float(burst_bytes)
        self._stamp_s = now_s

    @property
    def rate_bps(self) -> float:
        return self._rate_bytes_per_s * 8.0

    def _refill(self, now_s: float) -> None:
        if now_s > self._stamp_s:
            self._tokens = min(self._burst_bytes, self._tokens + (now_s - self._stamp_s) * self._rate_bytes_per_s)
            self._stamp_s = now_s

    def set_rate(self, rate_bps: float, *, now_s: float) -> None:
        """Change the rate from ``now_s`` on; what accrued before is kept."""
        self._refill(now_s)
        self._rate_bytes_per_s = max(rate_bps, 0.0) / 8.0

    def backlog_bytes(self, *, now_s: float) -> float:
        """Bytes reserved but not yet serialised at ``now_s`` (does not change the bucket)."""
        tokens = self._tokens + max(now_s - self._stamp_s, 0.0) * self._rate_bytes_per_s
        return max(-tokens, 0.0)

    def reserve(self, nbytes: int, *, now_s: float, ready_s: float | None = None) -> float:
        """Reserve ``nbytes`` at ``now_s``; returns when their serialisation ends (inf at rate 0).

        ``ready_s`` is when the bytes were ready to send, if the caller reserves them
        late (a busy CPU woke it late). Serialisation then starts at ``ready_s`` or when
        the previous backlog ends, whichever is later, so a late caller does not lose
        link time a real link would have used; the result may lie before ``now_s``.
        """
        start_s = now_s if ready_s is None else min(max(ready_s, self._stamp_s), now_s)
        self._refill(start_s)
        self._tokens -= nbytes
        if self._tokens >= 0:
            return start_s
        if self._rate_bytes_per_s <= 0:
            return math.inf
        return start_s + (-self._tokens) / self._rate_bytes_per_s
