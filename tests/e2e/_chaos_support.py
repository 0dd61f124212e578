"""The chaos run behind tests/e2e/test_chaos.py: many requests through a flapping link and a dying gateway.

    driver (N concurrent requests) -> EdgeAgent (in-process, real Runner and ORT engines)
        --gRPC--> LinkEmulator (127.0.0.1, flaps every `flap_s`) --> gateway subprocess
        (`python -m splitinfer gateway --ray-address local-noray`, SIGKILLed and restarted
        on the same port `gateway_kills` times)

`run_worker_kill` is the Ray variant: an in-process gateway with Ray replica pools and
one replica actor killed mid-stream.

Every request carries its own id; the run records each answer's id, where it was
served and its latency, and checks the outputs against the full model run locally.
The gateway is a real process in its own process group, killed with SIGKILL (no
drain), so in-flight calls die mid-stream, as on a crashed pod.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["ChaosResult", "GatewayProcess", "run_chaos", "run_worker_kill"]

MODEL, VERSION = "chain", "1"
_INPUT_SHAPE = (1, 4, 5, 5)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class GatewayProcess:
    """`splitinfer gateway` (in-process pools) as a child in its own process group, on a fixed port."""

    def __init__(self, *, registry_dir: str, cache_dir: str, log_path: str, port: int) -> None:
        self.registry_dir = registry_dir
        self.cache_dir = cache_dir
        self.log_path = log_path
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        cmd = [sys.executable, "-m", "splitinfer", "gateway", "--host", "127.0.0.1", "--port", str(self.port),
               "--metrics-port", "-1", "--registry", self.registry_dir, "--ray-address", "local-noray",
               "--cache-dir", self.cache_dir, "--provider", "cpu", "--log-format", "text", "--log-level", "WARNING"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        self.starts += 1

    def wait_serving(self, timeout_s: float = 90.0) -> float:
        """Blocks until gRPC health says SERVING; returns the seconds waited."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        t0 = time.monotonic()
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the gateway exited with code {self.proc.returncode}; see {self.log_path}")
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"the gateway was not SERVING after {timeout_s:.0f} s; see {self.log_path}")
                with contextlib.suppress(grpc.RpcError):
                    r = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return time.monotonic() - t0
                time.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL to the whole process group: no drain, in-flight calls die."""
        p = self.proc
        if p is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(30)
        self.proc = None


@dataclass
class ChaosResult:
    sent: int = 0
    answers: Counter = field(default_factory=Counter)  # request id -> answers received
    served_by: Counter = field(default_factory=Counter)
    latencies_ms: list[float] = field(default_factory=list)
    mismatched: Counter = field(default_factory=Counter)  # served_by -> answers not bit-identical
    max_abs_diff: float = 0.0
    errors: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    flaps: int = 0
    gateway_kills: int = 0
    wall_s: float = 0.0
    counters: dict[str, Any] = field(default_factory=dict)

    @property
    def lost(self) -> int:
        return sum(1 for i in range(self.sent) if self.answers.get(f"req-{i}", 0) == 0)

    @property
    def doubled(self) -> int:
        return sum(1 for n in self.answers.values() if n > 1)

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(np.asarray(self.latencies_ms), q)) if self.latencies_ms else float("nan")

    def summary(self) -> dict[str, Any]:
        return {"sent": self.sent, "answered": sum(self.answers.values()), "lost": self.lost,
                "doubled": self.doubled, "served_by": dict(self.served_by), "mismatched": dict(self.mismatched),
                "max_abs_diff": self.max_abs_diff, "errors": len(self.errors), "flaps": self.flaps,
                "gateway_kills": self.gateway_kills, "p50_ms": round(self.percentile_ms(50), 3),
                "p99_ms": round(self.percentile_ms(99), 3), "wall_s": round(self.wall_s, 1),
                "events": self.events, "agent_counters": self.counters}


def _prepare(work_dir: str) -> tuple[str, str]:
    from partitioner import Splitter
    from planner import make_flops_profile
    from tests.onnx_models import conv_bn_relu_chain, write

    reg = os.path.join(work_dir, "registry", MODEL, VERSION)
    os.makedirs(reg, exist_ok=True)
    path = write(conv_bn_relu_chain(3), os.path.join(reg, "model.onnx"))
    # One request per batch and one ORT thread, as the agent runs its own engines, so a
    # remote tail's fp32 output is bit-identical to the full model run locally (batched
    # or multi-threaded kernels sum in another order and differ in the last bit).
    with open(os.path.join(reg, "model.yaml"), "w", encoding="utf-8") as fh:
        fh.write("max_batch_size: 1\nintra_op_threads: 1\n")
    # A device far slower than the cloud estimate, so the agent offloads whenever the link is up.
    prof = os.path.join(work_dir, "device.json")
    with open(prof, "w", encoding="utf-8") as fh:
        fh.write(make_flops_profile(Splitter(path).graph, device="chaos-device", gflops=1e-4, fixed_ms=1.0).to_json())
    return path, prof


def _reference_outputs(model_path: str, xs: list[np.ndarray]) -> list[np.ndarray]:
    """The full model, run locally as the agent runs it (one ORT thread, same engine settings)."""
    from workers.engine import Engine, EngineConfig

    eng = Engine(model_path, EngineConfig(intra_op_threads=1, batch_buckets=(1,), dynamic_batch=False))
    return [np.asarray(eng.run({"x": x}, copy=True)["y"]) for x in xs]


def _agent(gateway: str, work_dir: str, prof: str, remote_timeout_ms: int) -> Any:
    """The edge agent of both runs: fp32 only, one ORT thread, quick probes and breaker."""
    from edge_agent.config import config_from_dict
    from edge_agent.daemon import EdgeAgent

    return EdgeAgent(config_from_dict({
        "gateway": gateway, "model": f"{MODEL}@{VERSION}", "apiPort": 0,
        "cacheDir": os.path.join(work_dir, "edge-cache"), "deviceProfile": prof, "encodings": ["fp32"],
        "intraOpThreads": 1, "remoteTimeoutMs": remote_timeout_ms, "probeIntervalS": 0.5, "breakerOpenS": 0.5,
        "dwellS": 0.5, "startupTimeoutS": 30}))


class _OpenLoop:
    """Clients that share one sequence of `res.sent` requests, paced open-loop: request i
    is due at `t_run + i / rate_rps` and a late client does not wait. Each answer is
    counted by id and where it was served, and checked bit for bit against `refs`."""

    def __init__(self, agent: Any, xs: list[np.ndarray], refs: list[np.ndarray], res: ChaosResult,
                 rate_rps: float, t_run: float) -> None:
        self.agent, self.xs, self.refs, self.res = agent, xs, refs, res
        self.rate_rps, self.t_run = rate_rps, t_run
        self.next_id = 0
        self.done = 0
        """Requests answered or failed."""

    async def run(self, concurrency: int) -> None:
        """`concurrency` clients until every request has its answer or error; `res.wall_s` is their time."""
        try:
            await asyncio.gather(*(self.client() for _ in range(concurrency)))
        finally:
            self.res.wall_s = time.monotonic() - self.t_run

    async def client(self) -> None:
        res, n_inputs = self.res, len(self.xs)
        while self.next_id < res.sent:
            i = self.next_id
            self.next_id += 1
            due = self.t_run + i / self.rate_rps - time.monotonic()
            if due > 0:
                await asyncio.sleep(due)
            rid = f"req-{i}"
            t0 = time.perf_counter()
            try:
                ans = await self.agent.infer({"x": self.xs[i % n_inputs]}, rid)
            except Exception as e:  # noqa: BLE001 - a failed request is a lost answer, recorded
                res.errors.append(f"{rid}: {type(e).__name__}: {e}")
                continue
            finally:
                self.done += 1
            res.latencies_ms.append((time.perf_counter() - t0) * 1e3)
            res.answers[ans["id"]] += 1
            res.served_by[ans["served_by"]] += 1
            y, ref = np.asarray(ans["outputs"]["y"]), self.refs[i % n_inputs]
            if y.shape != ref.shape or not np.array_equal(y, ref):
                res.mismatched[ans["served_by"]] += 1
                if y.shape == ref.shape:
                    res.max_abs_diff = max(res.max_abs_diff, float(np.max(np.abs(y - ref))))


async def _quietly(aw: Any) -> None:
    """Awaits `aw`, its errors swallowed: clean-up that must not hide the run's own outcome."""
    with contextlib.suppress(Exception):
        await aw


def run_chaos(work_dir: str, *, n_requests: int = 10_000, concurrency: int = 4, flap_s: float = 2.0,
              gateway_kills: int = 2, n_inputs: int = 32, rate_rps: float = 150.0) -> ChaosResult:
    """Sends `n_requests` at about `rate_rps` (so the run spans many flaps) from `concurrency` clients."""
    return asyncio.run(_run(work_dir, n_requests=n_requests, concurrency=concurrency, flap_s=flap_s,
                            gateway_kills=gateway_kills, n_inputs=n_inputs, rate_rps=rate_rps))


async def _run(work_dir: str, *, n_requests: int, concurrency: int, flap_s: float, gateway_kills: int,
               n_inputs: int, rate_rps: float) -> ChaosResult:
    from splitinfer.netem import LinkEmulator, LinkSetting

    model_path, prof = _prepare(work_dir)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(_INPUT_SHAPE).astype(np.float32) for _ in range(n_inputs)]
    refs = _reference_outputs(model_path, xs)

    res = ChaosResult(sent=n_requests)
    gw = GatewayProcess(registry_dir=os.path.join(work_dir, "registry"), cache_dir=os.path.join(work_dir, "gw-cache"),
                        log_path=os.path.join(work_dir, "gateway.log"), port=_free_port())
    up = LinkSetting.from_mbps(50, 50, 2.0)
    slow = LinkSetting.from_mbps(1, 1, 20.0)
    down = LinkSetting.from_mbps(50, 50, 2.0, up=False)
    emu = None
    agent = None
    t_start = time.monotonic()
    try:
        gw.start()
        await asyncio.to_thread(gw.wait_serving)
        emu = LinkEmulator(upstream=("127.0.0.1", gw.port), setting=up)
        await emu.start()
        agent = _agent(f"127.0.0.1:{emu.port}", work_dir, prof, remote_timeout_ms=300)
        await agent.start()
        stop = asyncio.Event()

        async def flapper() -> None:
            # 50 Mbit/s, 1 Mbit/s, 50 Mbit/s, outage, ...: every change is a flap; the slow
            # phases keep the agent offloading (so kills hit calls in flight), the outages
            # black-hole them.
            cycle = [slow, up, down, up]
            while not stop.is_set():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), flap_s)
                    return
                emu.set(cycle[res.flaps % len(cycle)])
                res.flaps += 1

        async def killer() -> None:
            # Kill at evenly spaced fractions of the run, while the link may be up or down.
            for k in range(gateway_kills):
                mark = n_requests * (k + 1) // (gateway_kills + 1)
                while sender.done < mark and not stop.is_set():
                    await asyncio.sleep(0.05)
                if stop.is_set():
                    return
                gw.kill()
                res.gateway_kills += 1
                res.events.append(f"gateway SIGKILL after {sender.done} answers at "
                                  f"{time.monotonic() - t_start:.1f} s")
                await asyncio.sleep(1.0)
                gw.start()
                waited = await asyncio.to_thread(gw.wait_serving)
                res.events.append(f"gateway restarted on port {gw.port}, serving after {waited:.1f} s")

        t_run = time.monotonic()
        sender = _OpenLoop(agent, xs, refs, res, rate_rps, t_run)
        side = [asyncio.create_task(flapper()), asyncio.create_task(killer())]
        try:
            await sender.run(concurrency)
        finally:
            stop.set()
            for t in side:
                await _quietly(t)
        res.counters = dict(agent.status().get("counters", {}))
        return res
    finally:
        if agent is not None:
            await _quietly(asyncio.wait_for(agent.stop(grace_s=5.0), 30))
        if emu is not None:
            await _quietly(emu.stop())
        gw.kill()


def run_worker_kill(work_dir: str, *, n_requests: int = 1500, concurrency: int = 4, rate_rps: float = 100.0,
                    n_inputs: int = 16) -> ChaosResult:
    """The agent offloads to an in-process gateway on local Ray (2 replicas per tail); one
    replica actor of the busiest tail is `ray.kill`ed (Ray restarts it) a third of the way in."""
    return asyncio.run(_run_worker_kill(work_dir, n_requests=n_requests, concurrency=concurrency,
                                        rate_rps=rate_rps, n_inputs=n_inputs))


async def _run_worker_kill(work_dir: str, *, n_requests: int, concurrency: int, rate_rps: float,
                           n_inputs: int) -> ChaosResult:
    import ray

    from cluster.gateway import Gateway
    from cluster.ray_cluster import RayPool, RayPoolFactory, connect, shutdown
    from cluster.registry import Registry
    from cluster.server import serve

    model_path, prof = _prepare(work_dir)
    with open(os.path.join(os.path.dirname(model_path), "model.yaml"), "a", encoding="utf-8") as fh:
        # Two replicas, so the pool can resend a dead replica's request to the other one;
        # one preloaded chain point keeps the actor count (and start-up) small on 2 cores.
        fh.write("replicas: 2\nfrontier:\n  default_cut_count: 1\n  include_cloud_only: false\n")
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(_INPUT_SHAPE).astype(np.float32) for _ in range(n_inputs)]
    refs = _reference_outputs(model_path, xs)
    res = ChaosResult(sent=n_requests)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    connect("local", num_cpus=2)
    gateway = server = agent = None
    try:
        registry = Registry(os.path.join(work_dir, "registry"), cache_dir=os.path.join(work_dir, "gw-cache"))
        gateway = Gateway(registry, RayPoolFactory(provider="cpu"))
        await gateway.start()
        server = await serve(gateway, host="127.0.0.1", port=0)
        agent = _agent(server.address, work_dir, prof, remote_timeout_ms=1000)
        await agent.start()
        sender = _OpenLoop(agent, xs, refs, res, rate_rps, time.monotonic())

        async def killer() -> None:
            while sender.done < n_requests // 3:
                await asyncio.sleep(0.02)
            # The gateway's pools, read from its private table: the test needs an actor handle.
            with gateway._pools_lock:  # noqa: SLF001
                pools = [p for p in gateway._pools.values() if isinstance(p, RayPool)]  # noqa: SLF001
            busiest = max(pools, key=lambda p: sum(p.pool._routed))  # noqa: SLF001
            ray.kill(busiest.pool.replicas[0], no_restart=False)
            res.gateway_kills = 0
            res.events.append(f"ray.kill replica 0 of {busiest.segment_key} after {sender.done} answers "
                              f"({sum(busiest.pool._routed)} calls routed to it so far)")  # noqa: SLF001

        side = asyncio.create_task(killer())
        try:
            await sender.run(concurrency)
        finally:
            await _quietly(asyncio.wait_for(side, 5))
        res.counters = dict(agent.status().get("counters", {}))
        res.counters["replica_failures"] = sum(
            p.pool._replica_failures for p in gateway._pools.values() if isinstance(p, RayPool))  # noqa: SLF001
        return res
    finally:
        if agent is not None:
            await _quietly(asyncio.wait_for(agent.stop(grace_s=5.0), 30))
        if server is not None:
            await _quietly(server.stop(1.0))
        if gateway is not None:
            await _quietly(asyncio.wait_for(gateway.close(), 30))
        shutdown()
