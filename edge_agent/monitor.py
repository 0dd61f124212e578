"""Link estimation from the traffic the agent already sends.

Pure: no clocks and no I/O; every method takes `now_s` (time.monotonic() seconds).

[Note: link estimation]
Every remote call is a sample: the bits it moved over the time the network took
(elapsed minus the server's reported time minus one RTT). Downlink bytes are counted
as `1/down_ratio` uplink bytes, since the planner's links keep that ratio. A call
dominated by the RTT only bounds the rate from below. Samples are smoothed in log
space (rates multiply) by an EWMA, and a two-sided CUSUM on the same log samples
detects a step: each sample adds its deviation beyond a dead band `delta` to an up or
down sum, and a sum past `threshold` means the link changed, so the level jumps to the
median of the samples that built the sum (a step from 18.88 to 1.1 Mbit/s, log ratio
2.8, is seen at the first sample; 1.1 to 5.85, log ratio 1.7, at the second).
An upper bound is stronger evidence than a sample. A call that timed out, or a
transfer still in flight `stall_factor` times longer than the level predicts, proves
the rate is at most bits/(elapsed - server time - RTT) (the server's usual time, an
EWMA of what it reported). Once the level is such a bound, a transfer still in flight
after `stall_factor` times the fixed time alone (RTT and server) keeps tightening it:
the margin then only has to cover the fixed time's jitter, and a step from 18.88 to
1.1 Mbit/s is bounded low enough to act on about 1 s into the stuck upload, not when
it would be twice as late as the first bound predicts. A bound below the level by
more than the dead band replaces the level at once (jitter of `stall_factor` does not produce one), so a step down is
seen while the transfers that would measure it are still stuck, not after they time
out (while they time out, no completed sample ever arrives). The first measurement
after such a bound replaces it too, either side: the bound only said "at most", and
its server time and sharing are guesses. But a transfer that began before the bound
was set cannot lift it: it averages in the link from before the step (one lifted the
benchmark's bound to 8 Mbit/s 0.2 s into its 1.1 Mbit/s phase). One above the bound by
more than the dead band is a step up (the link came back) and counts as a change, one below only refines the
step down the bound already reported. A transfer begun before the bound and slower than it is a
tighter bound, not a measurement: its rate averages the dip with the faster link before it, so
the rate now is at most that, and the first transfer sent since still sets the level either
side. Taken as the level, such a transfer held the link at 1.8 Mbit/s for 2.4 s after it came
back at 20 (a single sample 11x above a level needs the CUSUM's second one).
Silence is evidence too: while nothing is offloaded, a reachability check (a health
check on an otherwise idle link) that gets no answer divides the level by
`outage_decay` (down to `floor_bps`) and makes it a bound, so during an outage the
estimate falls towards 0 instead of staying at the last bound (a blackhole yields no
sample at all); the first answered check or transfer ends the run of failures. That check
is no RTT sample (the runner checks again and keeps the second): sent into the outage, it
waited for the link's return, and after an outage longer than `rtt_max_age_s` it would be
the window's only sample. In the demo's 10 s outage one read 179 ms on a 50 ms link; the
bandwidth probe that follows the first answer was then priced as RTT-dominated, and its
floor (4x its bytes' mean rate) taken as the level: 12.9 Mbit/s on a 5.85 Mbit/s link.
A link that fails its first check, before any sample, starts at `floor_bps`, a bound that
the first measurement replaces. Priced at the rate a policy assumes before the first sample
(the frontier's middle), a device that started where nothing answered sent its first
requests to the cloud, and each waited for its hedge: on a trace with no delivery for its
first 12 s (ResNet50 on an emulated rpi4, 494 ms locally), the first three answers took 864,
735 and 604 ms; from the floor, 494 ms each.
The RTT is the windowed minimum of health-check round trips and of the calls that
moved almost no bytes (less their bytes' time): a reconnect or a queue only adds
delay, as in BBR's min_rtt. Jitter within the dead band never accumulates; a single
outlier (up to ~e^(threshold+delta)) does not move the level by more than one EWMA step.

[Note: hidden fixed time]
A call's time is more than its RTT, its bytes and the time the server reports: the
client's and the server's gRPC stacks, TCP's first window, an emulator's packet clock.
Read as transfer time, that cost makes small transfers look slow: at an emulated
18.88 Mbit/s, 16 kB boundaries (7 ms of bytes) took the estimate to 5.85 Mbit/s. The
part is the intercept of a call's time (past the RTT and the server's time) against its
bits, fitted by least squares over the transfers of the last `window_s` since the last
step, when their sizes span `fit_span` (a probe of the smallest plan, a trial, a switch
of cut); an intercept less than `fit_sigmas` standard errors above 0 counts as 0 (on a
link whose rate moves, the slope's error moves the intercept: with sizes of 16 and 150 kB
and a rate jittered by a factor e^0.2, one seed in 40 fitted a 6 ms intercept where there
was none, and the estimate read 1.4x the rate). It is subtracted from every later
sample, and held while the sizes do not span (it belongs to the stack, not to the link). Transfers of a single size cannot tell it
from their bytes' time. And a sample whose bytes took less than `full_weight_share` of
its call's time weighs in proportion: its pull on the level and on the step sums is
scaled by it, so a call that the RTT and the server's time dominate moves the estimate
little, and a step needs the transfers that carry bytes to show it.

[Note: held rate and spread]
The level follows the link within a sample or two, dips included: on a cellular link
the 1-second rate moves 5-10x between its 10th and 90th percentiles, and a plan that
followed every dip would switch every few seconds. So the estimate has two more
figures, for the policy. `up_hold_bps` is the level, or the level `hold_s` ago where
that was higher: a drop shorter than `hold_s` never moves the plan in use (the requests
inside it are covered by the hedge, see [Note: hedge] in edge_agent/hedge.py; plans not in
use are priced at the level, see [Note: risk] there), and a step is planned for `hold_s`
after the level shows it. A rise is planned for at once.
`spread` is the log prediction error of each recent transfer (its rate over the level
just before it: the delivery record of the last `window_s`, at most `window_samples`),
so `up_hold_bps * exp(spread)` is the distribution of the rate the next transfer will
see, and `up_low_bps` its `low_quantile`: a lower-confidence rate. Errors, not rates,
are kept because a step moves the level, not the spread: after a step the distribution
moves with the level instead of mixing both sides of the step for `window_s`. The
samples that built a step (the CUSUM's run) are errors of the old level only until the
step is detected; from then on their errors are taken against the new level. Left as they
were, a step from 1 to 8 Mbit/s kept errors of +2 in the window for `window_s`, and the
distribution's 20th percentile read 8x the new level.
"""

from __future__ import annotations

import collections
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

__all__ = ["LinkEstimate", "MonitorConfig", "LinkMonitor", "quantile"]


def quantile(values: Sequence[float], q: float) -> float:
    """The `q` quantile of `values` (linear between order statistics, as numpy's default)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("quantile of no values")
    pos = min(max(q, 0.0), 1.0) * (len(xs) - 1)
    i = int(pos)
    return xs[i] if i + 1 >= len(xs) else xs[i] + (xs[i + 1] - xs[i]) * (pos - i)


@dataclass(frozen=True)
class LinkEstimate:
    """What the agent believes about its link now."""

    up_bps: float | None
    """Uplink rate; None before the first informative sample."""
    down_bps: float | None
    """Downlink rate (up_bps * down_ratio)."""
    rtt_ms: float | None
    """Round-trip time; None before the first sample."""
    samples: int
    """Bandwidth samples seen."""
    last_sample_s: float | None
    """Monotonic time of the last sample."""
    last_change_s: float | None
    """Monotonic time the last step was detected."""
    changes: int = 0
    """Steps detected so far."""
    unreachable: int = 0
    """Reachability checks failed in a row since the last answer (0: the link answers)."""
    up_hold_bps: float | None = None
    """The uplink rate plans use: `up_bps`, or the level `hold_s` ago where that was higher;
    None: plan with `up_bps`. See [Note: held rate and spread]."""
    up_low_bps: float | None = None
    """Lower-confidence uplink rate: the `low_quantile` of `up_hold_bps * exp(spread)`."""
    spread: tuple[float, ...] = ()
    """Log prediction errors (log rate - log level) of recent transfers, oldest first; empty: a
    point estimate."""

    @property
    def holding(self) -> bool:
        """A drop is held: the level is below `up_hold_bps`, the rate plans use."""
        return self.up_bps is not None and self.up_hold_bps is not None and self.up_bps < self.up_hold_bps

    def rates_bps(self) -> tuple[float, ...]:
        """The distribution of the rate the next transfer sees: `up_hold_bps` times each recent
        prediction error; `(up_bps,)` without a spread; () before the first sample."""
        base = self.up_hold_bps or self.up_bps
        if base is None:
            return ()
        return tuple(base * math.exp(d) for d in self.spread) or (base,)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> LinkEstimate:
        d = json.loads(text)
        d["spread"] = tuple(d.get("spread", ()))
        return cls(**d)


@dataclass(frozen=True)
class MonitorConfig:
    """Smoothing, step detection and bounds (edge.yaml's `monitor:` section; see [Note: link estimation])."""

    alpha: float = 0.15
    """EWMA weight of a new log-rate sample."""
    delta: float = 0.35
    """CUSUM dead band in log units (0.35: a factor 1.4 of jitter is ignored)."""
    threshold: float = 2.2
    """CUSUM sum in log units that declares a step."""
    rtt_window: int = 5
    """The RTT is the minimum of this many recent samples (queueing and reconnects only add delay)."""
    rtt_max_age_s: float = 10.0
    """Older RTT samples drop out when a new one comes: a minimum from before a path change must not stay."""
    min_payload_fraction: float = 0.25
    """Below this share of the network time spent on bytes, a call only bounds the rate from below."""
    stall_factor: float = 2.0
    """A transfer in flight this many times longer than the level predicts bounds the rate from above."""
    server_alpha: float = 0.3
    """EWMA weight of a new server-time sample (the server's share of a call's time)."""
    outage_decay: float = 2.0
    """Each failed reachability check divides the level by this (the estimate decays during an outage)."""
    floor_bps: float = 1e3
    """The level never decays below this rate."""
    hold_s: float = 1.5
    """A drop of the level shorter than this is not planned for; a step is planned for this long
    after it is seen (0: plan with the level). See [Note: held rate and spread]."""
    window_s: float = 10.0
    """Transfers this recent make the spread (the delivery record the policy's distribution uses)."""
    window_samples: int = 32
    """At most this many recent transfers make the spread."""
    low_quantile: float = 0.2
    """`up_low_bps` is this quantile of the rate distribution (0.2: four transfers in five saw more)."""
    fit_span: float = 2.0
    """Transfers whose sizes span this factor (largest / smallest) within `window_s` tell a call's
    hidden fixed time from its bytes' time (the intercept of time against bytes); see [Note: hidden
    fixed time]. 0: never fit (only the RTT and the server's reported time are subtracted)."""
    fit_samples: int = 4
    """Least transfers in the window for that fit."""
    fit_sigmas: float = 2.0
    """The fitted hidden time is used only when it is this many standard errors above 0 (on a
    link whose rate moves, a small intercept is noise)."""
    full_weight_share: float = 0.5
    """A transfer whose bytes took at least this share of its call's time is a full sample; one
    with less weighs in proportion (see [Note: hidden fixed time])."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)):
                raise ValueError(f"{f.name}={value!r} must be {'an integer' if f.type == 'int' else 'a number'}")
        for name, ok, want in (
            ("alpha", 0 < self.alpha <= 1, "in (0, 1]"),
            ("delta", self.delta >= 0, ">= 0"),
            ("threshold", self.threshold > 0, "> 0"),
            ("rtt_window", isinstance(self.rtt_window, int) and self.rtt_window >= 1, "an integer >= 1"),
            ("rtt_max_age_s", self.rtt_max_age_s > 0, "> 0"),
            ("min_payload_fraction", 0 <= self.min_payload_fraction <= 1, "in [0, 1]"),
            ("stall_factor", self.stall_factor > 1, "> 1 (a transfer on time bounds nothing)"),
            ("server_alpha", 0 < self.server_alpha <= 1, "in (0, 1]"),
            ("outage_decay", self.outage_decay >= 1, ">= 1"),
            ("floor_bps", self.floor_bps > 0, "> 0"),
            ("hold_s", self.hold_s >= 0, ">= 0"),
            ("window_s", self.window_s > 0, "> 0"),
            ("window_samples", isinstance(self.window_samples, int) and self.window_samples >= 1, "an integer >= 1"),
            ("low_quantile", 0 < self.low_quantile <= 0.5, "in (0, 0.5]"),
            ("fit_span", self.fit_span == 0 or self.fit_span > 1, "0 (off) or > 1"),
            ("fit_samples", isinstance(self.fit_samples, int) and self.fit_samples >= 3, "an integer >= 3"),
            ("fit_sigmas", self.fit_sigmas >= 0, ">= 0"),
            ("full_weight_share", 0 < self.full_weight_share <= 1, "in (0, 1]"),
        ):
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} must be {want}")


class LinkMonitor:
    """Passive (and probe) samples in, `estimate()` out."""

    def __init__(self, config: MonitorConfig | None = None, *, down_ratio: float = 4.0) -> None:
        self.config = config or MonitorConfig()
        if not (isinstance(down_ratio, (int, float)) and math.isfinite(down_ratio) and down_ratio > 0):
            raise ValueError(f"down_ratio={down_ratio!r} must be > 0")
        self.down_ratio = down_ratio
        """Downlink rate / uplink rate, to count response bytes: the plan frontier's, so the
        monitor counts bytes as the plans price them (hence not a `MonitorConfig` knob)."""
        self._level: float | None = None  # log(bps)
        self._rtts: collections.deque[tuple[float, float]] = collections.deque(maxlen=self.config.rtt_window)
        self._up = 0.0
        self._down = 0.0
        self._run_up: list[float] = []
        self._run_down: list[float] = []
        self._samples = 0
        self._last_sample_s: float | None = None
        self._last_change_s: float | None = None
        self._changes = 0
        self._server_ms: float | None = None
        self._bounded = False  # the level is an upper bound, not a measurement
        self._bound_s = -math.inf  # when the current bound was last set or tightened
        self._unreachable = 0
        self._levels: collections.deque[tuple[float, float]] = collections.deque()
        """(time, log level) after each change of the level, back to `hold_s` before the latest."""
        self._errors: collections.deque[tuple[float, float, float]] = collections.deque(
            maxlen=self.config.window_samples)
        """(time, log rate - log level before it, log rate) of recent transfers; see [Note: held rate and spread]."""
        self._step_run = 0
        """Samples that built the step just detected (0: none)."""
        self._sizes: collections.deque[tuple[float, float, float]] = collections.deque(
            maxlen=self.config.window_samples)
        """(time, bits, time past the RTT and the server's time in s) of recent transfers, for the fit."""
        self._hidden_s = 0.0
        """A call's fixed time beyond the RTT and the server's reported time; see [Note: hidden fixed time]."""
        self._now_s = -math.inf

    # -- samples ------------------------------------------------------------------------

    def observe_rate(self, bps: float, now_s: float, *, started_s: float | None = None,
                     spread: bool = True, weight: float = 1.0) -> bool:
        """One bandwidth sample (of a transfer that began at `started_s`; None: a fresh one).
        `spread` False: a bound from below, not a measurement (it joins no spread). `weight` in
        (0, 1]: how much of the sample's time its bytes took, which scales its pull on the level
        (see [Note: hidden fixed time]). Returns True when it completed a step."""
        if not bps > 0 or not math.isfinite(bps):
            return False
        before, bounded, samples = self._level, self._bounded, self._samples
        step = self._observe_rate(bps, now_s, started_s, min(1.0, max(weight, 0.0)))
        self._seen(now_s)
        if self._level != before:
            self._note_level(now_s)
        if spread and self._samples > samples:
            # A prediction error of the level; the first sample, and the first after a bound (a
            # ceiling, not a level), predicted nothing.
            err = 0.0 if before is None or bounded else math.log(bps) - before
            self._errors.append((now_s, err, math.log(bps)))
        if step and self._step_run and self._level is not None:
            # The samples that built a step measured the new level, not an error of the old one:
            # their errors are taken against the level they revealed.
            n = min(self._step_run, len(self._errors))
            for i in range(len(self._errors) - n, len(self._errors)):
                t, _, x = self._errors[i]
                self._errors[i] = (t, x - self._level, x)
        self._step_run = 0
        return step

    def _observe_rate(self, bps: float, now_s: float, started_s: float | None, weight: float = 1.0) -> bool:
        x = math.log(bps)
        # Begun before the bound's evidence, it averages in the faster link from before the step:
        # it cannot lift the bound (a transfer sent since, or a probe, will), and one below it is
        # a tighter ceiling, not a level.
        stale = self._bounded and started_s is not None and started_s < self._bound_s and self._level is not None
        if stale and x >= self._level:
            return False
        self._samples += 1
        self._last_sample_s = now_s
        self._unreachable = 0
        if stale:
            self._level = x
            return False
        if self._level is None:
            self._level = x
            return False
        c = self.config
        if self._bounded:
            # A bound is only a ceiling, and a loose one (the server time and the calls sharing
            # the link are guesses): the first measurement after it is the level, either side.
            # Above it by more than the dead band, the link got faster since: a step up.
            up = x > self._level + c.delta
            self._bounded = False
            self._level = x
            self._reset_sums()
            if up:
                self._last_change_s = now_s
                self._changes += 1
            return up
        dev = x - self._level
        self._up = max(0.0, self._up + weight * dev - c.delta)
        self._down = max(0.0, self._down - weight * dev - c.delta)
        self._run_up = self._run_up + [x] if self._up > 0 else []
        self._run_down = self._run_down + [x] if self._down > 0 else []
        for total, run in ((self._up, self._run_up), (self._down, self._run_down)):
            if total > c.threshold and run:
                self._step_run = len(run)
                self._level = statistics.median(run)
                self._reset_sums()
                self._last_change_s = now_s
                self._changes += 1
                return True
        self._level += c.alpha * weight * dev
        return False

    @property
    def rising(self) -> bool:
        """A sample above the level by more than the dead band has begun a step up that no step
        has completed yet: the next samples confirm it or wear it down."""
        return self._up > 0

    def observe_rtt(self, rtt_ms: float, now_s: float) -> None:
        """An RTT sample (a health probe, or a call that moved almost no bytes)."""
        if not rtt_ms >= 0 or not math.isfinite(rtt_ms):
            return
        self._seen(now_s)
        self._unreachable = 0
        while self._rtts and now_s - self._rtts[0][0] > self.config.rtt_max_age_s:
            self._rtts.popleft()
        self._rtts.append((now_s, rtt_ms))

    @property
    def _rtt_ms(self) -> float | None:
        return min(r for _, r in self._rtts) if self._rtts else None

    def observe_transfer(self, up_bytes: int, down_bytes: int, elapsed_s: float, server_ms: float,
                         now_s: float) -> bool:
        """A completed remote call. Returns True when it completed a step."""
        c = self.config
        self._unreachable = 0
        if math.isfinite(server_ms) and server_ms >= 0:
            self._server_ms = server_ms if self._server_ms is None else (
                self._server_ms + c.server_alpha * (server_ms - self._server_ms))
        net_s = elapsed_s - max(0.0, server_ms) / 1e3
        if net_s <= 0:
            return False
        bits = 8.0 * (up_bytes + down_bytes / self.down_ratio)
        if self._level is not None and bits / math.exp(self._level) < c.min_payload_fraction * net_s:
            # Almost no bytes at the level's rate: the rest of the network time is an RTT sample.
            self.observe_rtt((net_s - bits / math.exp(self._level)) * 1e3, now_s)
        rtt_s = (self._rtt_ms or 0.0) / 1e3
        self._fit_hidden(bits, net_s - rtt_s, now_s)
        payload_s = net_s - rtt_s - self._hidden_s
        if payload_s >= c.min_payload_fraction * net_s:
            # [Note: hidden fixed time] a sample whose bytes took a small share of its time weighs little.
            return self.observe_rate(bits / payload_s, now_s, started_s=now_s - elapsed_s,
                                     weight=payload_s / elapsed_s / c.full_weight_share)
        # RTT-dominated: the rate is at least this; only a level below it (or none yet) learns anything.
        floor_bps = bits / (c.min_payload_fraction * net_s)
        if self._level is None or math.log(floor_bps) > self._level:
            return self.observe_rate(floor_bps, now_s, started_s=now_s - elapsed_s, spread=False)
        self._last_sample_s = now_s
        return False

    def _fit_hidden(self, bits: float, past_rtt_s: float, now_s: float) -> None:
        """Refits the hidden fixed time from the recent transfers' time against their bits, when
        their sizes span `fit_span`; see [Note: hidden fixed time]."""
        c = self.config
        if past_rtt_s <= 0 or bits <= 0:
            return
        self._sizes.append((now_s, bits, past_rtt_s))
        if c.fit_span == 0:
            return
        since_s = max(now_s - c.window_s, self._last_change_s if self._last_change_s is not None else -math.inf)
        pts = [(b, t) for when, b, t in self._sizes if when >= since_s]  # one link: none from before a step
        if len(pts) < c.fit_samples or max(b for b, _ in pts) < c.fit_span * min(b for b, _ in pts):
            return
        mb = statistics.fmean(b for b, _ in pts)
        mt = statistics.fmean(t for _, t in pts)
        var = sum((b - mb) ** 2 for b, _ in pts)
        slope = sum((b - mb) * (t - mt) for b, t in pts) / var
        if slope <= 0:
            return  # the rate moved more than the sizes did: the fit says nothing
        hidden_s = mt - slope * mb
        residual = sum((t - mt - slope * (b - mb)) ** 2 for b, t in pts) / (len(pts) - 2)
        if hidden_s < c.fit_sigmas * math.sqrt(residual * (1.0 / len(pts) + mb * mb / var)):
            hidden_s = 0.0  # not told from 0 by these transfers
        # At most most of the quickest transfer's time: each transfer's bytes took some of it.
        self._hidden_s = min(hidden_s, 0.9 * min(t for _, t in pts))

    def observe_timeout(self, up_bytes: int, elapsed_s: float, now_s: float) -> bool:
        """A call that timed out or failed after `elapsed_s` with `up_bytes` sent: the rate was lower."""
        if elapsed_s <= 0 or up_bytes <= 0:
            return False
        return self._observe_ceiling(8.0 * up_bytes / elapsed_s, now_s)

    def stall_after_s(self, up_bytes: int) -> float | None:
        """How long a transfer of `up_bytes` may run before it says the link is slower; None: no level yet."""
        if self._level is None or up_bytes <= 0:
            return None
        if self._bounded:
            # The level is already a ceiling (often this very transfer's): every further moment
            # in flight tightens it, so only the fixed time's jitter needs the margin.
            return self.config.stall_factor * self._fixed_s()
        return self.config.stall_factor * (8.0 * up_bytes / math.exp(self._level) + self._fixed_s())

    def observe_stall(self, up_bytes: int, elapsed_s: float, now_s: float) -> bool:
        """A transfer still in flight after `elapsed_s`: the rate is at most its bits over the time its
        bytes had (elapsed minus the usual server time and one RTT). Returns True when it moved the level."""
        after = self.stall_after_s(up_bytes)
        if after is None or elapsed_s < after:
            return False
        payload_s = elapsed_s - self._fixed_s()
        if payload_s <= 0:
            return False
        return self._observe_ceiling(8.0 * up_bytes / payload_s, now_s)

    def _fixed_s(self) -> float:
        """A call's time besides its bytes: one RTT, the server's usual time and the hidden fixed time."""
        return ((self._rtt_ms or 0.0) + (self._server_ms or 0.0)) / 1e3 + self._hidden_s

    def _observe_ceiling(self, ceiling_bps: float, now_s: float) -> bool:
        """An upper bound on the rate; see [Note: link estimation]."""
        if not ceiling_bps > 0 or not math.isfinite(ceiling_bps):
            return False
        if self._level is None:
            return self.observe_rate(ceiling_bps, now_s, spread=False)
        x = math.log(ceiling_bps)
        self._seen(now_s)
        if x >= self._level - self.config.delta:
            return False  # consistent with the level (or within jitter): says nothing
        self._samples += 1
        self._last_sample_s = now_s
        self._level = x
        self._note_level(now_s)
        self._bounded = True
        self._bound_s = now_s
        self._reset_sums()
        self._last_change_s = now_s
        self._changes += 1
        return True

    def observe_unreachable(self, now_s: float) -> bool:
        """A reachability check on an idle link got no answer; see [Note: link estimation].
        Returns True when it started a run of failures (a change)."""
        self._unreachable += 1
        self._seen(now_s)
        c = self.config
        # Never measured, the link is at most the floor: plans are not priced at a guess of a
        # link that has not answered.
        floor = math.log(c.floor_bps)
        self._level = floor if self._level is None else max(self._level - math.log(c.outage_decay), floor)
        self._note_level(now_s)
        self._bounded = True
        self._bound_s = now_s
        self._reset_sums()
        if self._unreachable > 1:
            return False
        self._last_change_s = now_s
        self._changes += 1
        return True

    def _seen(self, now_s: float) -> None:
        self._now_s = max(self._now_s, now_s)

    def _note_level(self, now_s: float) -> None:
        """Keeps the level's history back to `hold_s` before now (one entry older: the level then)."""
        assert self._level is not None
        q = self._levels
        q.append((now_s, self._level))
        while len(q) > 1 and q[1][0] <= now_s - self.config.hold_s:
            q.popleft()

    def _level_at(self, t_s: float) -> float | None:
        """The level that held at `t_s`: the last one set at or before it (None: none yet)."""
        at = None
        for when, x in self._levels:
            if when > t_s:
                break
            at = x
        return at

    def _reset_sums(self) -> None:
        self._up = self._down = 0.0
        self._run_up, self._run_down = [], []

    # -- estimate -----------------------------------------------------------------------

    def estimate(self, now_s: float | None = None) -> LinkEstimate:
        """What the monitor believes at `now_s` (None: at its latest sample or check)."""
        up = None if self._level is None else math.exp(self._level)
        now = self._now_s if now_s is None else max(now_s, self._now_s)
        hold = up
        if up is not None and self.config.hold_s > 0:
            then = self._level_at(now - self.config.hold_s)
            if then is not None and math.exp(then) > up:
                hold = math.exp(then)
        c = self.config
        spread = tuple(e for t, e, _ in self._errors if t > now - c.window_s)
        low = None
        if hold is not None:
            low = quantile([hold * math.exp(e) for e in spread] or [hold], c.low_quantile)
        return LinkEstimate(
            up_bps=up,
            down_bps=None if up is None else up * self.down_ratio,
            rtt_ms=self._rtt_ms,
            samples=self._samples,
            last_sample_s=self._last_sample_s,
            last_change_s=self._last_change_s,
            changes=self._changes,
            unreachable=self._unreachable,
            up_hold_bps=hold,
            up_low_bps=low,
            spread=spread,
        )

    def transfer_s(self, up_bytes: float, down_bytes: float = 0.0, *, within: float = 0.5,
                   now_s: float | None = None) -> float | None:
        """Predicted network time (s) of a transfer of these bytes from the delivery record: the
        time it takes at most with probability `within` (0.9: as long as nine recent transfers in
        ten allow), plus one RTT. None before the first sample."""
        if not 0 <= within <= 1:
            raise ValueError(f"within={within!r} must be in [0, 1]")
        rates = self.estimate(now_s).rates_bps()
        if not rates:
            return None
        rate = quantile(rates, 1.0 - within)
        return 8.0 * (up_bytes + down_bytes / self.down_ratio) / rate + (self._rtt_ms or 0.0) / 1e3 + self._hidden_s
