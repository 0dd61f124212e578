"""The daemon: start-up (artifacts, engines, profile, frontier), the local API, idle
probes, and graceful shutdown.

Start-up order: fetch the artifacts from the gateway (GetArtifacts) and cache them;
if that fails, use the cache (the agent then serves locally, and offloads once the
gateway answers); if neither works, stop with a message naming the cause and the fix.
Then load the whole model, the device profile (estimated once if absent), the plan
frontier and the head and tail engines of every frontier cut, all off the event loop.
Ready (/readyz 200) once that is done. SIGTERM/SIGINT: stop accepting, finish what is
in flight, close.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import time
import uuid
from typing import Any

from cluster.protocol.client import InferenceClient
from cluster.protocol.errors import (
    ClusterError,
    PermissionDenied,
    Unauthenticated,
    UnknownModelError,
    UnknownVersionError,
)
from cluster.protocol.lossy import ImageNorm
from edge_agent.api import LocalApi
from edge_agent.cache import ArtifactCache
from edge_agent.config import EdgeConfig
from edge_agent.device import SlowDevice
from edge_agent.engines import (
    ModelSet,
    load_or_estimate_profile,
    make_frontier,
    preloaded_cuts,
    profile_model_ms,
    time_engine_ms,
)
from edge_agent.errors import ArtifactError, ConfigError, NotReadyError, StartupError
from edge_agent.model_inputs import image_norm, planning_graph
from edge_agent.runner import Runner
from edge_agent.transport import connect, make_credentials
from planner import Frontier, PlannerError
from planner.devices import reference_profile

__all__ = ["EdgeAgent", "run_agent"]

logger = logging.getLogger(__name__)

_TICK_S = 0.25
"""Longest time between two re-evaluations of the policy without a request."""
_IDS = itertools.count()
_PREFIX = uuid.uuid4().hex[:12]


class _DownloadLog:
    """Logs a model download's progress: each file's size as it starts, then the bytes, rate
    and files received every `every_s` seconds."""

    def __init__(self, model: str, every_s: float = 5.0, clock: Any = time.monotonic) -> None:
        self.model, self.every_s, self.clock = model, every_s, clock
        self.start_s = self.last_s = clock()
        self.bytes = 0
        self.files: set[str] = set()

    def __call__(self, chunk: Any) -> None:
        self.bytes += len(chunk.data)
        if chunk.name not in self.files:
            self.files.add(chunk.name)
            if chunk.total_bytes >= 1 << 20:
                logger.info("downloading %s: %s, %.1f MB", self.model, chunk.name, chunk.total_bytes / 1e6)
        now = self.clock()
        if now - self.last_s >= self.every_s:
            self.last_s = now
            logger.info("downloading %s: %.1f MB in %.0f s (%.2f Mbit/s), %d files so far", self.model,
                        self.bytes / 1e6, now - self.start_s, 8 * self.bytes / 1e6 / max(now - self.start_s, 1e-9),
                        len(self.files))


def _fix_for(e: BaseException, cfg: EdgeConfig) -> str:
    if isinstance(e, Unauthenticated):
        return "check 'token' / 'token_file' in the config: the gateway did not accept the token"
    if isinstance(e, PermissionDenied):
        return f"ask the operator to allow model {cfg.model_name!r} for this device's token"
    if isinstance(e, (UnknownModelError, UnknownVersionError)):
        return "check 'model' in the config against the gateway's registry"
    return (f"check that 'gateway' ({cfg.gateway}) is right and reachable; the agent needs one start with the "
            "gateway reachable to cache the model, after which it starts offline")


class EdgeAgent:
    """One agent: `await start()`, serve, `await stop()` (or `run_agent`)."""

    def __init__(self, config: EdgeConfig) -> None:
        self.config = config
        self.cache = ArtifactCache(config.resolved_cache_dir)
        self.remote: InferenceClient | None = None
        self.models: ModelSet | None = None
        self.frontier: Frontier | None = None
        self.image_norm: ImageNorm | None = None
        """The accuracy table's image normalisation, which jpeg/webp plans encode the frame with."""
        self.runner: Runner | None = None
        self.api: LocalApi | None = None
        self.version = config.model_version
        self.artifacts_source = ""
        self.profile_source = ""
        self.startup_warning = ""
        self.gateway_warmed: list[str] = []
        """Cuts the gateway loaded at this agent's start-up ([Note: cuts the gateway has not loaded])."""
        self._local_ms = 0.0
        self.host_model_ms = 0.0
        """The whole model's CPU time on one thread here (the device's time without its slowdown)."""
        self._ready = False
        self._stopping = False
        self._probe_task: asyncio.Task[None] | None = None
        self._inflight = 0
        self._idle: asyncio.Event | None = None
        self.started_s = time.monotonic()

    # -- start-up -----------------------------------------------------------------------

    async def start(self) -> None:
        """Starts everything; on failure releases what was started (channel, engines) and re-raises."""
        try:
            await self._start()
        except BaseException:
            await self._release()
            raise

    async def _release(self) -> None:
        if self.api is not None:
            await self.api.stop(0.0)
        await self._close_channel_and_engines()

    async def _close_channel_and_engines(self) -> None:
        """Closes the gateway channel, the runner and the engines; what start and stop both end with."""
        if self.remote is not None:
            await self.remote.close()
            self.remote = None
        if self.runner is not None:
            self.runner.close()
        if self.models is not None:
            self.models.close()
            self.models = None

    async def _start(self) -> None:
        cfg = self.config
        token = cfg.read_token()
        try:
            creds = make_credentials(cfg.tls_ca, cfg.tls_cert, cfg.tls_key)
        except OSError as e:
            key = next(k for k in ("tls_ca", "tls_cert", "tls_key") if getattr(cfg, k) == e.filename) \
                if e.filename in (cfg.tls_ca, cfg.tls_cert, cfg.tls_key) else "tls_ca"
            raise ConfigError(key=key, reason=f"({e.filename!r}) cannot be read: {e.strerror}",
                              fix="point it at a readable PEM file") from e
        self.remote = connect(cfg.gateway, credentials=creds, token=token)
        files = await self._fetch_or_cache()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self._load, files)
        assert self.models is not None
        local_ms = self._local_ms
        self.runner = Runner(self.models, self.frontier, self.remote, cfg, local_ms=local_ms,
                             image_norm=self.image_norm)
        self.api = LocalApi(self, host=cfg.api_host, port=cfg.api_port, socket_path=cfg.api_socket,
                            max_inflight=cfg.max_inflight, idle_timeout_s=cfg.api_idle_timeout_s,
                            read_timeout_s=cfg.api_read_timeout_s)
        await self.api.start()
        if self.artifacts_source == "gateway":
            # [Note: cuts the gateway has not loaded] in probing.py
            preloaded = preloaded_cuts(files)
            if preloaded is not None:
                self.gateway_warmed = await self.runner.warm_gateway(preloaded, cfg.startup_timeout_s)
            # Seeds the RTT (the first check also pays the connection set-up, the second does not)
            # and one bandwidth sample, so the first decision already sees the link.
            await self.runner.probe()
        self._ready = True
        self._probe_task = loop.create_task(self._probe_loop())
        logger.info("edge agent ready: %s@%s (artifacts from %s, profile %s, %d warm cuts, local %.1f ms) on %s",
                    cfg.model_name, self.version, self.artifacts_source, self.profile_source,
                    len(self.models.cuts), local_ms, self.api.address)

    async def _fetch_or_cache(self) -> dict[str, bytes]:
        cfg = self.config
        assert self.remote is not None
        try:
            # The gateway answers within startup_timeout_s; then each piece of the download
            # within download_stall_s, the whole as long as it takes: a 100 MB model over a
            # 5 Mbit/s link takes minutes, and a dead link still fails.
            await self.remote.health(timeout_s=cfg.startup_timeout_s)
            resp = await self.remote.get_artifacts(
                cfg.model_name, cfg.model_version, device_id=cfg.resolved_device_id, timeout_s=None,
                stall_timeout_s=cfg.download_stall_s, on_chunk=_DownloadLog(cfg.model))
            if not resp.files:
                raise ArtifactError(path=f"{cfg.model_name}@{cfg.model_version}", reason="the gateway sent no files",
                                    fix="check that the registry holds the model's files")
            self.version = resp.version or cfg.model_version
            self.cache.store(cfg.model_name, self.version, resp.files)
            self.artifacts_source = "gateway"
            return dict(resp.files)
        except (ClusterError, ArtifactError) as e:
            fetch_error: BaseException = e
        reason = f"fetching {cfg.model} from the gateway at {cfg.gateway} failed: {fetch_error}"
        version = cfg.model_version or self.cache.current_version(cfg.model_name)
        if version is None or not self.cache.has(cfg.model_name, version):
            raise StartupError(reason=f"{reason}, and no copy of {cfg.model_name} is cached in {self.cache.root}",
                               fix=_fix_for(fetch_error, cfg))
        try:
            files = self.cache.load(cfg.model_name, version)
        except ArtifactError as e:
            raise StartupError(reason=f"{reason}, and the cached copy is unusable: {e.path}: {e.reason}",
                               fix=f"{e.fix}; and {_fix_for(fetch_error, cfg)}") from e
        self.version = version
        self.artifacts_source = "cache"
        self.startup_warning = f"{reason}; serving {cfg.model_name}@{version} from the cache ({_fix_for(fetch_error, cfg)})"
        logger.warning("%s", self.startup_warning)
        return files

    def _load(self, files: dict[str, bytes]) -> None:
        cfg = self.config
        path = os.path.join(self.cache.version_dir(cfg.model_name, self.version), "model.onnx")
        # An emulated device has one core: one ORT thread, whose CPU time the slowdown stretches.
        emulated = cfg.emulate_device is not None or cfg.emulate_slowdown is not None
        self.models = models = ModelSet(path, cache=self.cache, model=cfg.model_name, version=self.version,
                                        intra_op_threads=1 if emulated else cfg.intra_op_threads,
                                        device=SlowDevice(cfg.emulate_slowdown or 1.0))
        self.image_norm = image_norm(files)
        graph = planning_graph(path, models.graph, files)  # [Note: agent graph sizes]
        if cfg.emulate_device is not None:
            # This host plays the reference device: plans use its roofline profile of the model,
            # and the device's work is stretched to match ([Note: time-scaled device]).
            profile = reference_profile(cfg.emulate_device, graph)
            self.profile_source = f"emulated {cfg.emulate_device} (roofline estimate)"
            device_ms = profile_model_ms(profile, graph)
            time_engine_ms(models.full, clock="thread")
            self.host_model_ms = models.full.reference_cpu_ms() or 0.0  # what its runs are stretched from
            if device_ms > self.host_model_ms:
                models.device.set_factor(device_ms / self.host_model_ms)
                models.local_ms = models.device.factor * self.host_model_ms  # what a stretched run takes
                logger.info("emulating %s: the model takes %.1f ms with one thread here and %.1f ms on %s (roofline "
                            "estimate); every run on the device is stretched %.1fx", cfg.emulate_device,
                            self.host_model_ms, device_ms, cfg.emulate_device, models.device.factor)
            else:
                logger.warning("emulating %s: one thread here takes %.1f ms for the model and the %s estimate is "
                               "%.1f ms; this host is not faster, so the device runs at this host's speed",
                               cfg.emulate_device, self.host_model_ms, cfg.emulate_device, device_ms)
        else:
            # a stretch's sleep is no CPU time; unstretched, the wall time measured at load is the host's
            self.host_model_ms = time_engine_ms(models.full, clock="thread") if emulated else models.local_ms
            prof_path = cfg.device_profile or self.cache.profile_path(cfg.model_name, self.version)
            profile, self.profile_source = load_or_estimate_profile(prof_path, graph, models.full)
        self._local_ms = models.local_ms if self.profile_source == "estimated" else profile_model_ms(profile, graph)
        try:
            self.frontier = make_frontier(graph, profile, files, cfg.policy.objective, cfg.encodings,
                                          min_agreement=cfg.min_agreement)
        except PlannerError as e:
            logger.error("no plan frontier (%s): every request runs locally", e)
            self.frontier = None
            return
        for entry in self.frontier.entries:
            models.load_cut(entry.plan.cut)
        logger.info("frontier: %s", ", ".join(f"{e.plan.key} from {e.up_lo_bps / 1e6:.3g} Mbit/s"
                                              for e in self.frontier.entries))

    # -- serving ------------------------------------------------------------------------

    def is_ready(self) -> bool:
        return self._ready and not self._stopping

    async def infer(self, inputs: dict[str, Any], request_id: str | None) -> dict[str, Any]:
        if self.runner is None or self._stopping:
            raise NotReadyError(state="shutting down" if self._stopping else "starting")
        rid = request_id or f"{_PREFIX}-{next(_IDS)}"
        if self._idle is None:
            self._idle = asyncio.Event()
        self._inflight += 1
        self._idle.clear()
        try:
            ans = await self.runner.infer(inputs, request_id=rid)
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()
        return {"id": ans.request_id, "outputs": ans.outputs, "served_by": ans.served_by, "cut_id": ans.cut_id,
                "latency_ms": ans.latency_ms, "fallback_reason": ans.fallback_reason, "encoding": ans.encoding}

    def status(self) -> dict[str, Any]:
        base = {"ready": self.is_ready(), "artifacts": self.artifacts_source, "profile": self.profile_source,
                "warning": self.startup_warning, "uptime_s": time.monotonic() - self.started_s,
                "gateway_warmed": list(self.gateway_warmed),
                "host_model_ms": self.host_model_ms,
                "device_slowdown": self.models.device.factor if self.models is not None else None}
        return base | (self.runner.status() if self.runner else {})

    def model_info(self) -> dict[str, Any]:
        if self.models is None:
            raise NotReadyError(state="starting")
        spec = lambda s: {"name": s.name, "dtype": s.dtype, "shape": list(s.shape)}  # noqa: E731
        return {"model": self.config.model_name, "version": self.version,
                "inputs": [spec(s) for s in self.models.full.inputs],
                "outputs": [spec(s) for s in self.models.full.outputs]}

    def metrics_text(self) -> str:
        if self.runner is None:
            return ""
        c = self.runner.counters
        est = self.runner.monitor.estimate()
        p = "splitinfer_edge_"
        lines = [f"# TYPE {p}requests_total counter", f"{p}requests_total {c.requests}",
                 f"# TYPE {p}answers_total counter"]
        lines += [f'{p}answers_total{{served_by="{k}"}} {getattr(c, k)}' for k in ("remote", "local", "local_tail")]
        lines += [f"# TYPE {p}failed_total counter", f"{p}failed_total {c.failed}",
                  f"# TYPE {p}late_dropped_total counter", f"{p}late_dropped_total {c.late_dropped}",
                  f"# TYPE {p}local_dropped_total counter", f"{p}local_dropped_total {c.local_dropped}",
                  f"# TYPE {p}local_cancelled_total counter", f"{p}local_cancelled_total {c.local_cancelled}",
                  f"# TYPE {p}hedges_total counter", f"{p}hedges_total {c.hedges}",
                  f"# TYPE {p}switches_total counter", f"{p}switches_total {c.switches}",
                  f"# TYPE {p}probes_total counter", f"{p}probes_total {c.probes}",
                  f"# TYPE {p}trials_total counter", f"{p}trials_total {c.trials}",
                  f"# TYPE {p}reachability_failures_total counter",
                  f"{p}reachability_failures_total {c.reachability_failures}",
                  f"# TYPE {p}remote_errors_total counter"]
        lines += [f'{p}remote_errors_total{{kind="{k}"}} {n}' for k, n in sorted(c.remote_errors.items())]
        lines += [f"# TYPE {p}inflight gauge", f"{p}inflight {c.inflight}",
                  f"# TYPE {p}link_up_bps gauge", f"{p}link_up_bps {est.up_bps or 0.0}",
                  f"# TYPE {p}link_rtt_ms gauge", f"{p}link_rtt_ms {est.rtt_ms or 0.0}",
                  f"# TYPE {p}breaker_open gauge", f"{p}breaker_open {0 if self.runner.breaker.state == 'closed' else 1}",
                  f"# TYPE {p}latency_ms summary"]
        for k, v in c.to_dict()["latency"].items():
            lines += [f'{p}latency_ms{{served_by="{k}",quantile="0.5"}} {v["p50_ms"]}',
                      f'{p}latency_ms{{served_by="{k}",quantile="0.9"}} {v["p90_ms"]}',
                      f'{p}latency_ms_count{{served_by="{k}"}} {v["count"]}']
        return "\n".join(lines) + "\n"

    async def _probe_loop(self) -> None:
        """Ticks every `_TICK_S` at most: re-evaluates the policy (a step detected between sparse
        requests moves the plan at once, and a dwell that ends is acted on), and keeps one probe
        running when one is due (idle-link probes, reachability checks while local, RTT checks)."""
        interval = self.config.probe_interval_s
        tick_s = min(_TICK_S, interval / 4, self.config.recovery_probe_s / 2)
        last_rtt_s = time.monotonic()
        probing: asyncio.Task[None] | None = None
        try:
            while True:
                await asyncio.sleep(tick_s)
                r = self.runner
                if r is None:
                    continue
                now = time.monotonic()
                r.reevaluate(now)
                if (probing is not None and not probing.done()) or not r.offload_enabled:
                    continue
                # Probe when the link is idle: nothing offloaded for a while (the app may be busy
                # running locally, which is exactly when only a probe can say the link came back).
                # While it is busy, a health check (a few bytes) still measures the RTT, which
                # the answers cannot separate from their bytes' time.
                if r.link_idle():
                    job = self._idle_probe(r)
                elif r.wants_reachability_check(now):
                    job = r.check_reachable()
                elif now - last_rtt_s >= interval:
                    job = r.probe_rtt()
                else:
                    continue
                last_rtt_s = now
                probing = asyncio.ensure_future(self._guarded(job))
        finally:
            if probing is not None:
                probing.cancel()

    @staticmethod
    async def _idle_probe(r: Runner) -> None:
        try:
            await r.probe()
        finally:
            r.last_remote_s = time.monotonic()

    @staticmethod
    async def _guarded(job: Any) -> None:
        try:
            await job
        except Exception as e:  # noqa: BLE001 - a failed probe must not end the loop
            logger.debug("probe failed: %s", e)

    # -- shutdown -----------------------------------------------------------------------

    async def stop(self, grace_s: float = 30.0) -> None:
        """Stop accepting, finish what is in flight, release everything."""
        if self._stopping:
            return
        self._stopping = True
        logger.info("shutting down: no new requests; finishing those in flight")
        t0 = time.monotonic()
        if self.api is not None:
            await self.api.stop(grace_s)
        if self._inflight and self._idle is not None:
            try:
                await asyncio.wait_for(self._idle.wait(), max(0.1, grace_s - (time.monotonic() - t0)))
            except TimeoutError:
                logger.warning("%d requests still running after the %.0f s shutdown grace", self._inflight, grace_s)
        if self._probe_task is not None:
            self._probe_task.cancel()
            try:
                await self._probe_task
            except asyncio.CancelledError:
                pass
        if self.runner is not None:
            self.runner.cancel_remote()  # calls past the grace: their requests already answered
        await self._close_channel_and_engines()
        logger.info("edge agent stopped")


async def run_agent(config: EdgeConfig, *, stop: asyncio.Event | None = None) -> int:
    """Runs an agent until SIGTERM/SIGINT (or `stop` is set). Returns the exit code."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    agent = EdgeAgent(config)
    try:
        await agent.start()
        await stop.wait()
    finally:
        await agent.stop()
    return 0

