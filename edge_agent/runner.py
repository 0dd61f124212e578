"""The request path: policy, head, remote tail or local finish, and exactly one answer.

Each request is a `flow.RequestFlow`. The remote call, its timer and the local tail
are separate callbacks racing on one event loop; every result goes through
`flow.fire`, and only the event it marks as delivering sets the answer. A remote
answer after the local one is dropped and counted (`late_dropped`); it still feeds
the link monitor, because a slow answer is the best evidence of a slow link. Probing
the link while no request uses it is `probing.LinkProbing`, which `Runner` mixes in.

[Note: remote budget]
A request waits for the cloud until its budget: with an SLO, the SLO minus the time
already spent minus the local tail's measured time (so the fallback still lands in
time); without, `remote_timeout_ms`. The gRPC deadline is twice the budget (at least
one second more): the call is not cancelled at the budget, so a late answer can still
arrive, be dropped and be measured. The local tail usually starts before the budget,
beside the remote call: the hedge (see [Note: hedge] in hedge.py) starts it once the
remote answer is later than its pessimistic prediction, or once waiting longer would
make the local answer late. The flow sees that as a `remote_timeout` (the remote is
late by its own prediction); the budget's timer then only counts the timeout for the
breaker and the link monitor if the remote call is still unanswered.

[Note: measured correction]
The policy's predictions come from profiles, and the agent's own work per request
(the CPU quota shared by requests in flight, decoding, gRPC) is not in them: measured
local answers took about twice the profile's time in the demo. So the runner keeps,
per path, an EWMA of measured/predicted latency (local: whole-model answers against
the profile's time; remote: the time from a request's send to its answer against
`Action.model_ms`, the device's own part being measured per plan, see [Note: measured
send] in policy.py) and the policy scales its predictions by them. The remote ratio
restarts at 1 when the link monitor detects a step, so the lag of the estimate behind a
step is not learnt as a bias and then counted twice. For the same reason `model_ms` prices
the plan at the link's measured level, not at the rate the policy plans with: that rate
holds a drop off for `hold_s` (see [Note: held rate and spread] in edge_agent/monitor.py),
and answers measured against it learnt the drop as the cloud path's own slowness, which
stayed in every remote time after the hold (in the demo, a 1.9x ratio after 2 s on the
3-layer cut: the agent left the split, 159 ms against local's 135). A gateway's one-off
wait for a tail to load (`timings_ms['load']`) is no part of the path's speed either.

[Note: refusal]
A RESOURCE_EXHAUSTED from the gateway is its admission control refusing load, at once:
the request finishes here from the head's output (the same local tail as any remote
failure, without waiting for the budget), and `cloud_load.CloudLoad` holds offloading
at that cut off for the hinted retry-after (see [Note: cloud load] in policy.py). It is
not a link failure: the gateway answered, quickly, so the breaker records a success
(which also frees a half-open probe slot) and the link monitor learns nothing from it
(the round trip has no server time to subtract, and a refusal is not a timeout). Counting
it as a breaker failure would open the breaker for `open_s` instead of the gateway's own
hint, and would cut the link off on a device whose link is fine.

[Note: local runs cancelled]
The device runs one thing at a time, so a local run nobody needs delays the next request.
Two kinds are cancelled (`workers.engine.RunCancel`, [Note: cancelled runs] there):
* A local tail whose remote answer won the race stops when that answer is delivered. Left
  to finish, on the LTE trace (ResNet50 at an rpi4's speed) 96 of 108 hedged tails ran on
  after their remote answer, each holding the device for up to a whole model's time.
* While the plan in use is local, the whole model starts before the policy decides, so the
  decision's time (0.1-0.4 ms here on a two-plan frontier; more on a slower CPU and a larger
  frontier) overlaps the run instead of preceding it; if the policy sends the request to the
  cloud after all (a switch, a trial or a probe) the run is cancelled before the head starts.
  The decision is Python and holds the interpreter lock, as does the run until it enters the
  runtime (its checks, the input's copy): submitted and left to the thread, the run started
  only after the decision, and on the LTE trace ours' local answers still took 0.27 ms longer
  at the median than edge-only's. So a request on an idle device waits (at most
  `_EARLY_START_S`) until its run has entered the runtime, and decides then.
Either way `local_cancelled` counts it; a tail that finished before its cancel is
`local_dropped`.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from cluster.protocol.client import InferenceClient, InferResult
from cluster.protocol.encoding import decode, encode
from cluster.protocol.errors import EncodingError, ResourceExhausted, Unauthenticated, UnknownCutError
from cluster.protocol.lossy import IMAGE_FORMATS, ImageNorm
from cluster.protocol.messages import InferRequest
from cluster.protocol.tensors import EncodedTensor
from edge_agent import breaker as B
from edge_agent.answers import Answer, Counters
from edge_agent.cloud_load import CloudLoad
from edge_agent.config import EdgeConfig
from edge_agent.engines import DEFAULT_LINK_RANGE, CutEngines, ModelSet
from edge_agent.errors import RequestError
from edge_agent.flow import RequestFlow, Step
from edge_agent.hedge import urgent_priority
from edge_agent.monitor import LinkMonitor
from edge_agent.policy import (
    LOAD_WINDOWS_S,
    LOCAL,
    Action,
    Health,
    PolicyState,
    after_trial,
    arrival_rps,
    hedge_delay_s,
    policy,
)
from edge_agent.probing import LinkProbing, error_kind
from planner import Encoding, Frontier
from planner.costmodel import remote_budget_ms, remote_call_ms
from workers.engine import RunCancel
from workers.errors import InputError, RunCancelledError, WorkerError

__all__ = ["Answer", "Counters", "Runner"]

logger = logging.getLogger(__name__)
T = TypeVar("T")
_STALL_CHECK_S = 0.2
"""How often an overdue transfer re-checks whether it bounds the link rate."""
_RECORD = 32
"""Remote answers per plan the hedge's record keeps."""
_EARLY_START_S = 0.002
"""How long a request waits for its early local run to enter the runtime before the policy decides
([Note: local runs cancelled]); the run's checks and the input's copy take ~0.1 ms here."""
_FACTOR_ALPHA = 0.3
_FACTOR_RANGE = {"local": (0.5, 4.0), "remote": (0.5, 3.0)}


def encode_boundary(enc: Encoding, names: Sequence[str], boundary: Mapping[str, np.ndarray],
                    image_norm: ImageNorm | None) -> dict[str, Any]:
    """What crosses the link for `boundary` under `enc` (EncodingError where it cannot)."""
    tensors: dict[str, Any] = {}
    for name in names:
        arr = boundary[name]
        if arr.dtype == np.float32 and enc.codec != "none":  # a lossy codec: quality or bit depth as level
            norm = image_norm if enc.codec in IMAGE_FORMATS else None
            tensors[name] = encode(arr, precision=enc.codec, level=enc.level, norm=norm)  # type: ignore[arg-type]
        elif arr.dtype == np.float32 and (enc.precision != "fp32" or enc.compression != "none"):
            tensors[name] = encode(arr, precision=enc.precision, compression=enc.compression,  # type: ignore[arg-type]
                                   per_channel=enc.per_channel)
        else:
            tensors[name] = np.ascontiguousarray(arr)
    return tensors


class Runner(LinkProbing):
    """The online core: one per agent, on one event loop. Link probing is `probing.LinkProbing`."""

    def __init__(self, models: ModelSet, frontier: Frontier | None, remote: InferenceClient | None, config: EdgeConfig,
                 *, executor: concurrent.futures.Executor | None = None, local_ms: float | None = None,
                 image_norm: ImageNorm | None = None) -> None:
        self.models = models
        self.image_norm = image_norm
        """How the frame becomes pixels under a jpeg/webp plan: the accuracy table's
        (`edge_agent.model_inputs.image_norm`), so the bytes sent and the agreement are those
        measured; None fits each channel's range, as calibrate does without a declared one."""
        self.local_ms = models.local_ms if local_ms is None else local_ms
        """Whole-model ms on this device as the policy sees it (the device profile's, else measured)."""
        self.frontier = frontier
        self.remote = remote
        self.config = config
        link_range = frontier.link_range if frontier else DEFAULT_LINK_RANGE
        self.monitor = LinkMonitor(config.monitor, down_ratio=link_range.down_ratio)
        self.breaker_config = B.BreakerConfig(config.breaker_failures, config.breaker_open_s)
        self.breaker = B.BreakerState()
        self.policy_config = config.policy
        self.cloud = CloudLoad(self.config.policy.cloud_load_tau_s)
        """The cloud's reported queue waits and refusals; see [Note: cloud load] in policy.py."""
        self.state = PolicyState()
        self.last_action: Action | None = None
        self.counters = Counters()
        self.unusable_cuts: set[str] = set()
        self.last_activity_s = time.monotonic()
        self._last_request: InferRequest | None = None
        self._remote_tasks: set[asyncio.Task[InferResult]] = set()
        self._local_tasks: set[asyncio.Task[None]] = set()
        self._abandoned: set[asyncio.Task[InferResult]] = set()
        """Remote calls past their budget whose requests finish locally (still on the wire until their deadline)."""
        self._uploads: dict[asyncio.Task[InferResult], tuple[float, int]] = {}
        """Remote calls in flight: (sent at, request bytes)."""
        self._arrivals: collections.deque[float] = collections.deque()
        self.last_remote_s = 0.0
        """When the link last carried a remote call (idle probes wait for a quiet link)."""
        self._executor = executor or concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="edge-engine")
        self._own_executor = executor is None
        self._device_jobs = 0
        """Work on the engines' threads, queued or running (`_on_device`)."""
        self._device_id = config.resolved_device_id
        self.factors = {"local": 1.0, "remote": 1.0}
        """Measured / predicted latency per path; see [Note: measured correction]."""
        self._logged_factors = dict(self.factors)
        self.switch_events: collections.deque[tuple[float, str, str]] = collections.deque(maxlen=256)
        """(monotonic s, plan_key, reason) of recent switches, by requests and re-evaluations."""
        self._last_check_s = 0.0
        self._changes_seen = 0
        self._probe_ok: bool | None = None
        self._quiet_probes = 0
        """Bandwidth probes in a row that left the plan local; see [Note: probing and the device]."""
        self._answered_ms: dict[str, collections.deque[float]] = {}
        """Measured ms of recent remote answers per plan, for the hedge's record."""
        self._sent_ms: dict[str, collections.deque[float]] = {}
        self.send_ms: dict[str, float] = {}
        """Median ms from a request's start until it was sent, per plan (`Health.send_ms`)."""
        self.offload_enabled = True
        """False: every request runs the whole model here and the link is left alone (no probes or
        checks): the agent as a plain local model server, e.g. as a benchmark's local baseline."""

    # -- deciding -----------------------------------------------------------------------

    def decide(self, now_s: float) -> Action:
        """Breaker, then policy; logs every switch once with its reason."""
        remote_ok = self.offload_enabled and self.remote is not None and self.frontier is not None
        probe = False
        unprobed = self.breaker
        if remote_ok:
            before = self.breaker.state
            remote_ok, self.breaker = B.allow(self.breaker, now_s, self.breaker_config)
            probe = remote_ok and before != B.CLOSED
        action = self._policy(now_s, remote_ok, probe, request=True)
        if probe and not action.probe:
            # The policy kept this request local (the link as estimated does not pay): the
            # probe slot stays free, and the idle link probe tests the link instead.
            self.breaker = unprobed
        self.counters.probes += action.probe
        self.counters.held_local += action.held
        if action.trial:
            self.counters.trials += 1
            logger.info("remote trial: %s", action.reason)
        self.last_action = action
        return action

    def reevaluate(self, now_s: float | None = None) -> Action | None:
        """The policy again without a request (a timer, or the estimate moved), so a detected step
        moves the plan before the next request arrives; see [Note: policy]. Returns the action if
        it switched. Takes no breaker probe and no trial, and counts no arrival."""
        if self.last_action is None:
            return None  # nothing planned yet: the first request decides
        now_s = time.monotonic() if now_s is None else now_s
        remote_ok = (self.offload_enabled and self.remote is not None and self.frontier is not None
                     and self.breaker.state == B.CLOSED)
        action = self._policy(now_s, remote_ok, False, request=False)
        if not action.switched:
            return None
        self.last_action = action
        return action

    def _policy(self, now_s: float, remote_ok: bool, probe: bool, *, request: bool) -> Action:
        warm = frozenset(k for k in self.models.cuts if k not in self.unusable_cuts)
        est = self.monitor.estimate(now_s)
        if est.changes != self._changes_seen:
            self._changes_seen = est.changes
            if abs(self._logged_factors["remote"] - 1.0) > 0.1:  # the scaling was announced: so is its end
                logger.info("the link stepped: remote predictions are unscaled again (were x%.2f)",
                            self.factors["remote"])
            self.factors["remote"] = self._logged_factors["remote"] = 1.0
        health = Health(remote_ok, probe, self.breaker.state, self.local_ms * self.factors["local"], warm,
                        self._arrival_rps(now_s, count=request), remote_factor=self.factors["remote"],
                        local_factor=self.factors["local"], request=request,
                        queue_ms=self.cloud.queue_ms(now_s), urgent_queue_ms=self.cloud.queue_ms(now_s, urgent=True),
                        refused_until_s=self.cloud.refused_until_s(now_s), unconfirmed=self.cloud.busy_cuts(now_s),
                        inflight=self.counters.inflight + (0 if request else 1), send_ms=self.send_ms)
        action, self.state = policy(est, self.frontier, health, self.state, now_s,
                                    config=self.policy_config)
        if action.switched:
            self._quiet_probes = 0
            self.counters.switches += 1
            self.switch_events.append((now_s, action.plan_key, action.reason))
            logger.info("switch%s: %s", "" if request else " (re-evaluated, no request waiting)", action.reason)
        return action

    def _estimate_moved(self) -> None:
        """Called after a monitor update: a detected step re-plans at once, not at the next request."""
        if self.monitor.estimate().changes != self._changes_seen:
            self.reevaluate()

    def _observe_latency(self, path: str, measured_ms: float, predicted_ms: float) -> None:
        """One measured answer against its prediction; see [Note: measured correction]."""
        if not (predicted_ms > 0 and math.isfinite(predicted_ms) and measured_ms > 0):
            return
        lo, hi = _FACTOR_RANGE[path]
        ratio = min(max(measured_ms / predicted_ms, lo), hi)
        f = self.factors[path] = self.factors[path] + _FACTOR_ALPHA * (ratio - self.factors[path])
        if abs(f / self._logged_factors[path] - 1.0) > 0.1:
            self._logged_factors[path] = f
            logger.info("%s answers take x%.2f the predicted time (last %.0f ms, predicted %.0f ms); "
                        "the policy now scales %s predictions by it", path, f, measured_ms, predicted_ms, path)

    def _arrival_rps(self, now_s: float, *, count: bool = True) -> float:
        """The request rate the policy plans for (`policy.arrival_rps`); `count` records an arrival now."""
        q = self._arrivals
        while q and now_s - q[0] > LOAD_WINDOWS_S[-1]:
            q.popleft()
        rps = arrival_rps(q, now_s)
        if count:
            q.append(now_s)
        return rps

    def _remote_budget_s(self, start_s: float, ce: CutEngines) -> float:
        cap = self.config.remote_timeout_ms / 1e3
        slo_ms = self.policy_config.slo_ms
        if slo_ms is None:
            return cap
        tail_ms = ce.tail.stats().median_ms or self.local_ms
        return min(cap, remote_budget_ms(slo_ms, (time.monotonic() - start_s) * 1e3, tail_ms) / 1e3)

    # -- running ------------------------------------------------------------------------

    def _check_inputs(self, inputs: Mapping[str, np.ndarray]) -> None:
        want = set(self.models.input_names)
        if set(inputs) != want:
            raise RequestError(reason=f"inputs {sorted(inputs)} do not match the model's {sorted(want)}",
                               fix="send exactly the model's inputs (GET /v1/model lists them)")
        try:  # dtypes and shapes too, before a cut that runs nothing here sends them to the gateway
            self.models.full.check(inputs)
        except InputError as e:
            raise RequestError(reason=str(e), fix="match the model's input dtypes and shapes") from e

    def _on_device(self, work: Callable[[], T]) -> asyncio.Future[T]:
        """`work` on the engines' threads (the device's), counted in `_device_jobs` while it is there."""
        self._device_jobs += 1
        fut = asyncio.get_running_loop().run_in_executor(self._executor, work)

        def done(_: asyncio.Future[T]) -> None:
            self._device_jobs -= 1

        fut.add_done_callback(done)
        return fut

    async def _run_engine(self, engine: Any, inputs: Mapping[str, np.ndarray],
                          cancel: RunCancel | None = None) -> dict[str, np.ndarray]:
        return await self._on_device(lambda: engine.run(inputs, copy=True, cancel=cancel))

    async def infer(self, inputs: Mapping[str, np.ndarray], *, request_id: str) -> Answer:
        """Answers one request exactly once (an Answer, or the error that is its answer)."""
        self._check_inputs(inputs)
        start = time.monotonic()
        self.last_activity_s = start
        self.counters.requests += 1
        self.counters.inflight += 1
        early = None
        try:
            early = self._start_local_early(inputs)
            action = self.decide(start)
            ce = self.models.cuts.get(action.cut_id) if action.kind != LOCAL else None
            flow = RequestFlow(request_id, fallback_local=self.config.fallback == "local")
            if ce is None:
                flow.fire("local")
                return await self._finish_local(flow, inputs, start, None if early is None else early[0])
            if early is not None:
                early[1].cancel()
            flow.fire("offload")
            return await self._offload(flow, action, ce, inputs, start)
        except BaseException:
            if early is not None:
                early[1].cancel()
            self.counters.failed += 1
            raise
        finally:
            self.counters.inflight -= 1
            self.last_activity_s = time.monotonic()

    def _start_local_early(self, inputs: Mapping[str, np.ndarray]
                           ) -> tuple[asyncio.Future[dict[str, np.ndarray]], RunCancel] | None:
        """While the plan in use is local, the whole model's run, started before the policy decides
        and cancelled if it sends the request to the cloud ([Note: local runs cancelled])."""
        if self.last_action is None or self.last_action.kind != LOCAL:
            return None
        cancel = RunCancel()
        engine = self.models.full
        idle = self._device_jobs == 0
        run = self._on_device(lambda: engine.run(inputs, copy=True, cancel=cancel))
        if idle:  # the run's own Python (its checks, the input's copy) goes first: the decision needs the
            cancel.started.wait(_EARLY_START_S)  # interpreter lock, and the run gives it up in the runtime

        def settled(f: asyncio.Future[dict[str, np.ndarray]]) -> None:
            if not f.cancelled() and isinstance(f.exception(), RunCancelledError):
                self.counters.local_cancelled += 1

        run.add_done_callback(settled)
        return run, cancel

    async def _finish_local(self, flow: RequestFlow, inputs: Mapping[str, np.ndarray], start: float,
                            running: asyncio.Future[dict[str, np.ndarray]] | None = None) -> Answer:
        try:
            out = await (running if running is not None else self._run_engine(self.models.full, inputs))
        except InputError as e:
            flow.fire("local_error")
            raise RequestError(reason=str(e), fix="match the model's input names, dtypes and shapes") from e
        except WorkerError:
            flow.fire("local_error")
            raise
        flow.fire("local_done")
        ans = self._answered(flow.request_id, out, "local", "", start)
        self._observe_latency("local", ans.latency_ms, self.local_ms)
        return ans

    def _answered(self, rid: str, out: Mapping[str, np.ndarray], by: str, cut_id: str, start: float,
                  why: str = "", encoding: str = "fp32") -> Answer:
        ms = (time.monotonic() - start) * 1e3
        self.counters.answered += 1
        setattr(self.counters, by, getattr(self.counters, by) + 1)
        self.counters.observe(by, ms)
        ordered = {k: out[k] for k in self.models.output_names if k in out}
        return Answer(rid, ordered, by, cut_id, ms, why, encoding)

    async def _encoded(self, action: Action, ce: CutEngines, boundary: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """`_encode` on the device: on the engines' threads, in the device's time, where anything is encoded
        (an encode of a large boundary would hold the event loop); in place where fp32 crosses as it is."""
        enc = action.encoding
        if enc.codec == "none" and enc.precision == "fp32" and enc.compression == "none":
            return encode_boundary(enc, ce.boundary, boundary, self.image_norm)
        work = lambda: encode_boundary(enc, ce.boundary, boundary, self.image_norm)  # noqa: E731
        tensors, _ = await self._on_device(lambda: self.models.device.run(work))
        return tensors

    def _make_request(self, action: Action, ce: CutEngines, boundary: Mapping[str, np.ndarray], rid: str,
                      timeout_s: float, *, tensors: dict[str, Any] | None = None, priority: int = 0) -> InferRequest:
        """The request for `boundary`, encoded here unless `tensors` holds it encoded (`_encoded`)."""
        if tensors is None:
            tensors = encode_boundary(action.encoding, ce.boundary, boundary, self.image_norm)
        return InferRequest(request_id=rid, model=self.models.model, version=self.models.version, cut_id=ce.cut_id,
                            deadline_unix_ms=int((time.time() + timeout_s) * 1000), tensors=tensors,
                            priority=priority, device_id=self._device_id)

    async def _offload(self, flow: RequestFlow, action: Action, ce: CutEngines,
                       inputs: Mapping[str, np.ndarray], start: float) -> Answer:
        rid = flow.request_id
        if ce.head is not None:
            try:
                head_out = await self._run_engine(ce.head, inputs)
            except InputError as e:
                raise RequestError(reason=str(e), fix="match the model's input names, dtypes and shapes") from e
            except WorkerError as e:
                logger.warning("head of cut %s failed (%s); running the whole model", ce.cut_id, e)
                flow.fire("head_error")
                return await self._finish_local(flow, inputs, start)
        else:
            head_out = {}
        values = {**inputs, **head_out}
        boundary = {n: values[n] for n in ce.boundary}
        kept = {n: head_out[n] for n in ce.head_model_outputs}
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[Answer] = loop.create_future()
        budget_s = self._remote_budget_s(start, ce)
        call_s = remote_call_ms(budget_s * 1e3) / 1e3
        timed_out = False

        def deliver(step: Step, value: Any, by: str, why: str = "") -> None:
            if step.delivers and not answer.done():
                if isinstance(value, BaseException):
                    answer.set_exception(value)
                else:
                    enc = action.encoding.key if by == "remote" else "fp32"
                    answer.set_result(self._answered(rid, {**kept, **value}, by, ce.cut_id, start, why, enc))

        tail_cancel = RunCancel()  # [Note: local runs cancelled] once the remote answer wins

        def start_local_tail(why: str) -> None:
            async def tail() -> None:
                try:
                    out = await self._run_engine(ce.tail, boundary, tail_cancel)
                except Exception as e:  # noqa: BLE001 - becomes this request's answer
                    if isinstance(e, RunCancelledError):
                        self.counters.local_cancelled += 1
                    deliver(flow.fire("local_error"), e, "local_tail")  # cancelled: answered already
                    return
                step = flow.fire("local_done")
                if step.late:
                    self.counters.local_dropped += 1
                deliver(step, out, "local_tail", why)

            t = loop.create_task(tail())
            self._local_tasks.add(t)  # the loop keeps only weak references to tasks
            t.add_done_callback(self._local_tasks.discard)

        try:
            tensors = await self._encoded(action, ce, boundary)
            hedge_s = self._hedge_delay_s(action, ce, start) if flow.fallback_local else math.inf
            urgent = urgent_priority(self.policy_config.slo_ms, hedge_s)  # [Note: priority under overload]
            request = self._make_request(action, ce, boundary, rid, call_s, tensors=tensors, priority=urgent)
        except EncodingError as e:
            flow.fire("encode_error")
            start_local_tail(f"encoding failed: {e}")
            return await answer
        flow.fire("head_done")
        self._last_request = request
        sent_s = time.monotonic()
        sent = self._sent_ms.setdefault(action.plan_key, collections.deque(maxlen=_RECORD))
        sent.append((sent_s - start) * 1e3)
        self.send_ms[action.plan_key] = float(np.median(sent))
        share = self._sharing(sent_s)
        assert self.remote is not None

        def on_timeout() -> None:
            nonlocal timed_out
            if task.done():
                return
            timed_out = True
            self._abandoned.add(task)
            self._remote_failed("timeout", action, request.tensor_bytes() * share, time.monotonic() - sent_s)
            self._estimate_moved()
            if flow.state != "remote":
                return  # hedged: the local run is already under way
            step = flow.fire("remote_timeout")
            if step.delivers:  # fallback 'none'
                deliver(step, TimeoutError(f"no answer from the gateway within {budget_s * 1e3:.0f} ms"), "remote")
            else:
                start_local_tail(f"no remote answer within {budget_s * 1e3:.0f} ms")

        timer = loop.call_later(budget_s, on_timeout)

        def on_hedge() -> None:
            # [Note: hedge] in hedge.py: the remote call goes on; the first answer wins.
            if flow.state != "remote":
                return
            flow.fire("remote_timeout")  # late by its own prediction: the same path to the local tail
            self.counters.hedges += 1
            elapsed_ms = (time.monotonic() - start) * 1e3
            logger.debug("hedge: %s still unanswered after %.0f ms (predicted at most %.0f ms); running the "
                         "tail here too", action.plan_key, elapsed_ms, action.hi_ms)
            start_local_tail(f"hedged: no remote answer after {elapsed_ms:.0f} ms "
                             f"(predicted at most {action.hi_ms:.0f} ms)")

        hedge = loop.call_later(hedge_s, on_hedge) if hedge_s < budget_s else None

        def on_remote(task: asyncio.Task[InferResult]) -> None:
            timer.cancel()
            if hedge is not None:
                hedge.cancel()
            now = time.monotonic()
            if task.cancelled():
                kind, exc = "remote_cancelled", asyncio.CancelledError("the remote call was cancelled")
            elif task.exception() is not None:
                kind, exc = "remote_error", task.exception()
            else:
                r = task.result()
                self.last_remote_s = now
                self.cloud.observe_timings(ce.cut_id, r.response.timings_ms, now)
                self.monitor.observe_transfer(r.up_bytes * share, r.down_bytes * share, r.elapsed_s, r.server_ms, now)
                if not timed_out:
                    self.breaker = B.on_success(self.breaker, now, self.breaker_config)
                outs = {k: decode(v) if isinstance(v, EncodedTensor) else v for k, v in r.response.outputs.items()}
                step = flow.fire("remote_ok")
                if step.late:
                    self.counters.late_dropped += 1
                deliver(step, outs, "remote")
                if step.delivers:
                    tail_cancel.cancel()
                load_ms = r.response.timings_ms.get("load", 0.0)  # [Note: tail load time] in cluster/gateway.py
                self._answered_ms.setdefault(action.plan_key, collections.deque(maxlen=_RECORD)).append(
                    (now - start) * 1e3 - load_ms)
                self._observe_latency("remote", (now - sent_s) * 1e3 - load_ms, action.model_ms)
                if action.trial:
                    self._trial_answered((now - start) * 1e3 - load_ms, step.late)
                self._estimate_moved()
                return
            assert exc is not None
            self.last_remote_s = now
            if isinstance(exc, ResourceExhausted):
                self._refused(action, exc, now, timed_out)
            elif not timed_out:
                self._remote_failed(error_kind(exc), action, request.tensor_bytes() * share, now - sent_s, exc)
            elif error_kind(exc) == "DeadlineExceeded":
                # Still unanswered at its gRPC deadline, well past the budget: a tighter bound.
                self.monitor.observe_timeout(request.tensor_bytes() * share, now - sent_s, now)
            self._estimate_moved()
            if flow.state != "remote":
                flow.fire(kind)  # already falling back or answered: nothing to do
                return
            step = flow.fire(kind)
            if step.delivers:
                deliver(step, exc, "remote")
            else:
                start_local_tail(f"remote {error_kind(exc)}: {exc}")

        task = loop.create_task(self.remote.infer_counted(request, timeout_s=call_s))
        self._remote_tasks.add(task)
        task.add_done_callback(self._remote_tasks.discard)
        task.add_done_callback(self._abandoned.discard)
        self._uploads[task] = (sent_s, request.tensor_bytes())
        task.add_done_callback(lambda t: self._uploads.pop(t, None))
        task.add_done_callback(on_remote)
        self._watch_stall(task, request.tensor_bytes() * share, sent_s)
        return await answer

    def _hedge_delay_s(self, action: Action, ce: CutEngines, start_s: float) -> float:
        """When this request's local tail starts beside its remote call; see [Note: hedge] in hedge.py."""
        deadline_ms = self.config.remote_timeout_ms if self.policy_config.slo_ms is None else self.policy_config.slo_ms
        tail_ms = ce.tail.stats().median_ms or self.local_ms * self.factors["local"]
        held = self.monitor.estimate().holding
        return hedge_delay_s(action, elapsed_ms=(time.monotonic() - start_s) * 1e3, deadline_ms=deadline_ms,
                             local_ms=tail_ms, record_ms=self._answered_ms.get(action.plan_key, ()),
                             held_ms=action.model_ms * self.factors["remote"] if held else None,
                             config=self.policy_config)

    def _trial_answered(self, measured_ms: float, late: bool) -> None:
        """A trial's answer: it may clear the back-off that kept the agent local; see [Note: policy] 5."""
        local_ms = self.local_ms * self.factors["local"]
        before = self.state
        self.state = after_trial(self.state, measured_ms, local_ms, config=self.policy_config)
        logger.info("remote trial answered in %.0f ms%s against local %.0f ms: %s", measured_ms,
                    " (late: the local answer was sent)" if late else "", local_ms,
                    "back-off cleared" if self.state != before else "no change")

    def _sharing(self, now_s: float) -> int:
        """How many uploads share the link with one sent now (itself included).

        Calls in flight together share the link: each sees about 1/n of its rate. Counted are
        only calls whose upload should still be running at the estimated rate (a call waiting
        for the server's answer uses no uplink; counting it made the demo's estimate 2x too
        high), and not calls already abandoned: on a collapsed link those pile up until their
        deadlines, and counting them would inflate every bound taken from this call, keeping
        the estimate high exactly when it must fall. A count that is too low makes this call's
        bound too tight by at most the app's window; the next measurement replaces a bound.
        """
        up_bps = self.monitor.estimate().up_bps
        n = 1
        for t, (sent_s, nbytes) in self._uploads.items():
            if t.done() or t in self._abandoned:
                continue
            if up_bps is None or now_s - sent_s < 8.0 * nbytes / up_bps:
                n += 1
        return n

    def _watch_stall(self, task: asyncio.Task[InferResult], up_bytes: int, sent_s: float) -> None:
        """While `task` runs past what the link estimate allows, its bytes bound the rate from above
        (see [Note: link estimation]): the estimate falls while the transfers are still stuck."""
        after_s = self.monitor.stall_after_s(up_bytes)
        if after_s is None:
            return
        loop = asyncio.get_running_loop()
        handle: list[asyncio.TimerHandle] = []

        def check() -> None:
            if task.done():
                return
            now = time.monotonic()
            if self.monitor.observe_stall(up_bytes, now - sent_s, now):
                logger.info("link: a %d-byte transfer still in flight after %.0f ms: up at most %.2f Mbit/s",
                            up_bytes, (now - sent_s) * 1e3, (self.monitor.estimate().up_bps or 0.0) / 1e6)
                # No re-evaluation here: a transfer a little late on a busy host often answers a
                # moment later and replaces the bound; the next request or the daemon's tick acts on it.
            handle[:] = [loop.call_later(_STALL_CHECK_S, check)]

        handle.append(loop.call_later(after_s, check))
        task.add_done_callback(lambda _: handle[0].cancel())

    def cancel_remote(self) -> int:
        """Cancels every remote call in flight; their requests finish locally. Returns how many."""
        tasks = [t for t in self._remote_tasks if not t.done()]
        for t in tasks:
            t.cancel()
        return len(tasks)

    def _refused(self, action: Action, exc: ResourceExhausted, now_s: float, timed_out: bool) -> None:
        """The gateway refused for load; see [Note: refusal]."""
        self.counters.remote_errors["ResourceExhausted"] = self.counters.remote_errors.get("ResourceExhausted", 0) + 1
        if not timed_out:  # a refusal after the budget already counted as a timeout
            self.breaker = B.on_success(self.breaker, now_s, self.breaker_config)
        hold_ms = self.cloud.refuse(action.cut_id, exc.retry_after_ms, now_s)
        logger.info("the cloud refused cut %s for load (%s); not offloading at it for %.0f ms",
                    action.cut_id, exc.resource, hold_ms)
        self.reevaluate(now_s)

    def _remote_failed(self, kind: str, action: Action, up_bytes: int, elapsed_s: float,
                       exc: BaseException | None = None) -> None:
        now = time.monotonic()
        self.counters.remote_errors[kind] = self.counters.remote_errors.get(kind, 0) + 1
        self.breaker = B.on_failure(self.breaker, now, self.breaker_config)
        if kind == "timeout" or kind == "DeadlineExceeded":
            self.monitor.observe_timeout(up_bytes, elapsed_s, now)
        if isinstance(exc, UnknownCutError) and action.cut_id not in self.unusable_cuts:
            self.unusable_cuts.add(action.cut_id)
            logger.warning("the gateway does not know cut %s; not offloading at it again: %s", action.cut_id, exc)
        elif isinstance(exc, Unauthenticated):
            logger.error("the gateway refused the token: %s", exc)
        else:
            logger.debug("remote %s for cut %s after %.0f ms", kind, action.cut_id, elapsed_s * 1e3)

    def status(self) -> dict[str, Any]:
        est = self.monitor.estimate(time.monotonic())
        a = self.last_action
        return {
            "model": f"{self.models.model}@{self.models.version}",
            "action": None if a is None else {"kind": a.kind, "cut_id": a.cut_id, "encoding": a.encoding.key,
                                              "predicted_ms": a.predicted_ms if math.isfinite(a.predicted_ms) else None,
                                              "reason": a.reason},
            "link": {"up_bps": est.up_bps, "up_hold_bps": est.up_hold_bps, "up_low_bps": est.up_low_bps,
                     "rtt_ms": est.rtt_ms, "samples": est.samples, "changes": est.changes},
            "breaker": self.breaker.state, "offload_enabled": self.offload_enabled,
            "cloud": self.cloud.to_dict(time.monotonic()),
            "local_ms": self.local_ms, "measured_local_ms": self.models.local_ms,
            "latency_factors": dict(self.factors), "send_ms": dict(self.send_ms),
            "warm_cuts": sorted(k for k in self.models.cuts if k not in self.unusable_cuts),
            "counters": self.counters.to_dict(),
        }

    def close(self) -> None:
        if self._own_executor:
            self._executor.shutdown(wait=True)
