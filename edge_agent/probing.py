"""Link probing while the link carries no requests: reachability checks, RTT checks and
bandwidth probes, and how their outcomes (or their silence) move the link estimate and
the breaker. A mixin of `runner.Runner`, kept apart because it is the recovery half of
the runner: it decides when the link is worth a probe and what a probe's answer means,
while the runner serves requests.

[Note: probing and the device]
Probes never use the device's engines: a reachability check is a gRPC health check (a
few hundred bytes) and a bandwidth probe resends the last boundary already encoded (or
a boundary of zeros before the first request), so requests running locally wait for
none of them. None runs while offload is disabled (`Runner.offload_enabled`).
A probe still costs: its bytes cross the device's link, and the cloud runs the tail. So
while the agent runs locally by choice (the breaker closed, the link answering), each
bandwidth probe after which the plan is still local doubles the quiet time before the
next, up to 8 times (half of `probe_interval_s` becomes 4 of them): on a link where
offloading does not pay, probing settles at one boundary every few seconds. A switch,
a failed probe, a check that gets no answer, or a probe that found the link faster than
the level by more than the monitor's dead band (a rise begun that the next sample
confirms, `LinkMonitor.rising`) starts again from the shortest wait: while local after a dip,
the agent sees the link come back through probes alone, and a rise the CUSUM has begun needs
the next sample, which the back-off spaced 2.4-4.4 s out (on the shared LTE trace, ours alone
for 6 rounds of 60 s: p50 494 ms, 264 requests of 576 answered remotely; with the reset, 378
ms and 307, with the same switches, 4-6 a minute; replayed at 3 times its rate, 72 and 59
requests answered slower than 400 ms, most of them locally after a dip; bytes sent +3 to
+14 %). An outage's recovery does not wait for the back-off (the checks are cheap and keep
their pace, and the first one that answers is followed by a probe at once).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from cluster.protocol.errors import ClusterError, UnknownCutError
from cluster.protocol.messages import InferRequest
from edge_agent import breaker as B
from edge_agent.policy import LOCAL, OFFLOAD, Action

if TYPE_CHECKING:
    from cluster.protocol.client import InferenceClient, InferResult
    from edge_agent.config import EdgeConfig
    from edge_agent.engines import CutEngines, ModelSet
    from edge_agent.monitor import LinkMonitor
    from planner import Frontier, Plan

__all__ = ["LinkProbing"]

logger = logging.getLogger(__name__)

_PROBE_TIMEOUT_S = 5.0
"""Least time a link probe waits: on a slow link a probe cut off at the request budget
bounds the rate only by its bytes over that budget (602 kB in 0.84 s: 5.7 Mbit/s, above
the demo's 1.1), while one given the time measures it."""
_PROBE_BACKOFF = 3
"""While the agent runs locally by choice, each bandwidth probe that leaves it local doubles the
quiet time before the next, up to 2**3 times; see [Note: probing and the device]."""
_CHECK_TIMEOUT_S = 0.5
"""Least time a reachability check waits (at least 4 RTTs): longer would slow the decay in an
outage; a blackholed check still completes if the link returns while it waits."""


def error_kind(e: BaseException) -> str:
    """The exception's class name, as failures are counted and logged (e.g. `DeadlineExceeded`)."""
    return type(e).__name__


class LinkProbing:
    """The probing half of `runner.Runner`; the names below are the runner's."""

    models: ModelSet
    frontier: Frontier | None
    remote: InferenceClient | None
    config: EdgeConfig
    monitor: LinkMonitor
    breaker: B.BreakerState
    breaker_config: B.BreakerConfig
    last_action: Action | None
    counters: Any
    unusable_cuts: set[str]
    last_remote_s: float
    offload_enabled: bool
    _remote_tasks: set[asyncio.Task[InferResult]]
    _probing: bool = False
    """A probe is on the link (see `probe`)."""
    _last_request: InferRequest | None
    _last_check_s: float
    _probe_ok: bool | None
    _quiet_probes: int

    if TYPE_CHECKING:
        def _estimate_moved(self) -> None: ...

        def _watch_stall(self, task: Any, up_bytes: int, sent_s: float) -> None: ...

        def _make_request(self, action: Action, ce: CutEngines, boundary: Mapping[str, np.ndarray], rid: str,
                          timeout_s: float) -> InferRequest: ...

    def _recovering(self) -> bool:
        """Requests run locally (or the breaker keeps them off the network): only probes see the link."""
        a = self.last_action
        return (a is not None and a.kind == LOCAL) or self.breaker.state != B.CLOSED

    def _uploading(self) -> bool:
        """A request's remote call or a probe is on the link."""
        return self._probing or any(not t.done() for t in self._remote_tasks)

    def link_idle(self) -> bool:
        """No remote call or probe in flight and none for `probe_interval_s`: a probe competes with nothing.

        While requests run locally (or the breaker is open) probes are the only samples of the
        link, and how soon a recovery is seen depends on them: the quiet time is then halved.
        """
        if not self.offload_enabled:
            return False
        interval_s = self.config.probe_interval_s
        if self._recovering():
            interval_s /= 2
            if self.breaker.state == B.CLOSED:  # local by choice: [Note: probing and the device]
                interval_s *= 2 ** min(self._quiet_probes, _PROBE_BACKOFF)
        return time.monotonic() - self.last_remote_s >= interval_s and not self._uploading()

    def wants_reachability_check(self, now_s: float) -> bool:
        """While running locally, a health check (a few hundred bytes) every `recovery_probe_s` on a
        link nothing else uses: the cheapest way to see an outage end, and its silence the evidence
        that one goes on. A check queued behind an upload would prove nothing, so none then."""
        return (self.offload_enabled and self.remote is not None and self._recovering() and not self._uploading()
                and now_s - self._last_check_s >= self.config.recovery_probe_s)

    def _check_timeout_s(self) -> float:
        rtt_ms = self.monitor.estimate().rtt_ms or 0.0
        return max(_CHECK_TIMEOUT_S, 4.0 * rtt_ms / 1e3)

    async def check_reachable(self) -> bool:
        """A reachability check. No answer: the estimate decays (see [Note: link estimation]). The
        first answer after failures is followed at once by a bandwidth probe, which measures the
        link that came back; the estimate then re-plans without waiting for a request."""
        was_down = self.monitor.estimate().unreachable > 0
        ok = await self.probe_rtt(timeout_s=self._check_timeout_s())
        self._last_check_s = time.monotonic()
        if not ok:
            self._unreachable()
            return False
        if was_down:
            logger.info("link: the gateway answers again after %d failed checks; measuring the link",
                        self.counters.reachability_failures)
            await self.probe(check=False)
        return True

    def _unreachable(self) -> None:
        self.counters.reachability_failures += 1
        self._quiet_probes = 0
        before_bps = self.monitor.estimate().up_bps
        if self.monitor.observe_unreachable(time.monotonic()):
            if before_bps is None:
                logger.info("link: no answer before any measurement; the estimate starts at the floor (%.3g Mbit/s) "
                            "until the link answers", self.monitor.config.floor_bps / 1e6)
            else:
                logger.info("link: no answer on an idle link; the estimate (%.3g Mbit/s before) decays while it lasts",
                            before_bps / 1e6)
        self._estimate_moved()

    async def probe_rtt(self, timeout_s: float = 2.0) -> bool:
        """A health check as an RTT sample; False when the gateway did not answer.

        Before the first sample it checks twice and keeps the second: the first also
        pays the connection set-up, which is not the link's RTT. So it does after failed
        checks: the first answer may have waited for the link to come back (see [Note: link
        estimation] in monitor.py).
        """
        if self.remote is None:
            return False
        est = self.monitor.estimate()
        for i in range(2 if est.rtt_ms is None or est.unreachable > 0 else 1):
            t0 = time.monotonic()
            try:
                await self.remote.health(timeout_s=timeout_s)
            except ClusterError:
                return False
            rtt_ms = (time.monotonic() - t0) * 1e3
        self.monitor.observe_rtt(rtt_ms, time.monotonic())
        return True

    async def probe(self, *, check: bool = True) -> None:
        """An active probe, for idle times: RTT by health check (unless `check` is False: one just
        answered), then the last boundary again.

        Its outcome also moves an open or half-open breaker: while requests run locally
        (breaker open, or no plan fits the link) only a probe can show the link is back.
        A probe while another is in flight returns at once: the two would share the link and
        each read it at part of its rate.
        """
        if self._probing:
            return
        self._probing = True
        try:
            await self._probe(check)
        finally:
            self._probing = False

    async def _probe(self, check: bool) -> None:
        # Before any RTT is known the check also sets up the connection: give it time.
        first = self.monitor.estimate().rtt_ms is None
        if check and not await self.probe_rtt(timeout_s=2.0 if first else self._check_timeout_s()):
            self._last_check_s = time.monotonic()
            self._unreachable()
            self._probe_outcome(False, "the health check got no answer")
            return
        timeout_s = max(self.config.remote_timeout_ms / 1e3, _PROBE_TIMEOUT_S)
        req = self._last_request or self._zero_request(timeout_s)
        if req is None:
            return
        req = InferRequest(request_id=req.request_id + "-probe", model=req.model, version=req.version,
                           cut_id=req.cut_id, deadline_unix_ms=int((time.time() + timeout_s) * 1000),
                           tensors=req.tensors, device_id=req.device_id)
        t0 = time.monotonic()
        # Watched like a request's upload: a probe stuck in an outage that began under it bounds
        # the rate lower every check, instead of holding the estimate until its timeout.
        call = asyncio.ensure_future(self.remote.infer_counted(req, timeout_s=timeout_s))
        self._watch_stall(call, req.tensor_bytes(), t0)
        try:
            r = await call
        except ClusterError as e:
            now = time.monotonic()
            self.last_remote_s = now
            self.monitor.observe_timeout(req.tensor_bytes(), now - t0, now)
            if self.breaker.state == B.HALF_OPEN:
                self.breaker = B.on_failure(self.breaker, now, self.breaker_config)
            self._probe_outcome(False, f"{error_kind(e)} after {(now - t0) * 1e3:.0f} ms")
            self._quiet_probes = 0
            self._estimate_moved()
            return
        self.counters.probes += 1
        if self.breaker.state != B.CLOSED:
            self.breaker = B.on_success(self.breaker, time.monotonic(), self.breaker_config)
        self.last_remote_s = time.monotonic()
        self.monitor.observe_transfer(r.up_bytes, r.down_bytes, r.elapsed_s, r.server_ms, time.monotonic())
        self._probe_outcome(True, f"{r.up_bytes} bytes in {r.elapsed_s * 1e3:.0f} ms")
        self._estimate_moved()
        self._probed()

    def _probed(self) -> None:
        """After a probe's sample: the quiet time before the next; see [Note: probing and the device]."""
        self._quiet_probes = self._quiet_probes + 1 if self._recovering() and not self.monitor.rising else 0

    def _probe_outcome(self, ok: bool, what: str) -> None:
        """Logs a probe at INFO when its outcome changed (the link came back or went), else at DEBUG."""
        est = self.monitor.estimate()
        level = logging.INFO if ok != self._probe_ok else logging.DEBUG
        self._probe_ok = ok
        logger.log(level, "link probe %s: %s; estimate up %.2f Mbit/s, rtt %s ms", "ok" if ok else "failed", what,
                   (est.up_bps or 0.0) / 1e6, "unknown" if est.rtt_ms is None else f"{est.rtt_ms:.0f}")

    def _remote_plans(self) -> list[Plan]:
        """The frontier's remote plans whose cut is warm here and not refused by the gateway."""
        return [e.plan for e in (self.frontier.entries if self.frontier is not None else ())
                if e.plan.boundary and e.plan.cut.key in self.models.cuts and e.plan.cut.key not in self.unusable_cuts]

    def _zero_request(self, timeout_s: float) -> InferRequest | None:
        """A boundary of zeros: measures the link before any request offloaded. It is the warm frontier
        plan with the fewest bytes to send, in that plan's encoding: a probe holds the device's uplink
        while it runs (ResNet50's fp32 input, 602 kB, takes 5 s at 1 Mbit/s; its int8 plan a quarter)."""
        warm = self._remote_plans()
        if warm:
            plan = min(warm, key=lambda p: p.breakdown.hop_up_ms[0] if p.breakdown.hop_up_ms else p.breakdown.uplink_ms)
            ce, action = self.models.cuts[plan.cut.key], Action(OFFLOAD, plan.cut.key, plan.encoding)
        else:
            ce = next((c for k, c in self.models.cuts.items() if k not in self.unusable_cuts), None)
            if ce is None:
                return None
            action = Action(OFFLOAD, ce.cut_id)
        return self._make_request(action, ce, _zeros(ce), "probe", timeout_s)

    async def warm_gateway(self, preloaded: Collection[str], timeout_s: float) -> list[str]:
        """Loads at the gateway the tails of this device's frontier that it did not preload; returns
        their cut ids.

        [Note: cuts the gateway has not loaded]
        The gateway preloads the tails of its registry's frontier, planned for the registry's
        device profile and encodings; this device plans its own frontier (its profile, its
        `encodings`, the lowest RTT), which can hold a cut outside that set. Such a tail is cut
        and loaded on its first request, which on a Ray gateway starts a new actor (1-2 s for
        the demo's SqueezeNet here). Met by the first real request, that load is priced as the
        link's or the cloud's slowness: in the demo, on a busy host, the agent's first cloud-only
        requests (fp16, a cut the fp32 registry frontier lacks) hedged after 560 ms, the link
        estimate fell to 8.7 Mbit/s on an 18.9 Mbit/s link, and 7 of the fast phase's 27 requests
        ran locally. So at start-up each such cut gets one boundary of zeros, all at once, and the
        agent is ready once they are answered or `timeout_s` has passed. Their answers are not
        link samples (the load is in them); a cut the gateway refuses as unknown is not offloaded
        at. A backend that sends no frontier.json says nothing of what it loaded: nothing is sent.
        """
        if self.remote is None:
            return []
        ces = {p.cut.key: (self.models.cuts[p.cut.key], Action(OFFLOAD, p.cut.key, p.encoding))
               for p in self._remote_plans() if p.cut.key not in preloaded}
        if not ces:
            return []
        t0 = time.monotonic()
        reqs = {k: self._make_request(a, ce, _zeros(ce), f"warm-{k}", timeout_s) for k, (ce, a) in ces.items()}
        self.counters.gateway_warmups += len(reqs)
        results = await asyncio.gather(*(self.remote.infer(r, timeout_s=timeout_s) for r in reqs.values()),
                                       return_exceptions=True)
        warmed = []
        for k, r in zip(reqs, results, strict=True):
            if isinstance(r, UnknownCutError):
                self.unusable_cuts.add(k)
                logger.warning("the gateway does not know cut %s; not offloading at it: %s", k, r)
            elif isinstance(r, BaseException):
                logger.warning("loading cut %s at the gateway failed (%s: %s)", k, error_kind(r), r)
            else:
                warmed.append(k)
        logger.info("loaded %d of %d cut(s) the gateway had not preloaded in %.1f s: %s", len(warmed), len(reqs),
                    time.monotonic() - t0, ", ".join(reqs))
        return warmed


def _zeros(ce: CutEngines) -> dict[str, np.ndarray]:
    """A boundary of zeros for `ce`'s tail (symbolic dims as 1)."""
    return {s.name: np.zeros(tuple(d or 1 for d in s.shape), np.dtype(s.dtype)) for s in ce.tail.inputs}
