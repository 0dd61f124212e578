"""Shared pieces of the edge agent's integration tests.

`TailBackend` is a real backend of `cluster.server.serve`: it cuts the model at the
requested cut and runs the tail with ONNX Runtime (not a mock of the gateway). Tests
can make it fail, stall or check a token, to drive the agent's fallback paths.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from cluster.errors import Unauthenticated, UnknownModelError, Unavailable
from cluster.gateway import Gateway, LocalPoolFactory
from cluster.protocol.encoding import decode
from cluster.protocol.messages import ArtifactsResponse, InferRequest, InferResponse
from cluster.protocol.tensors import EncodedTensor
from cluster.registry import Registry
from cluster.server import serve
from edge_agent.cache import ArtifactCache
from edge_agent.config import config_from_dict
from edge_agent.daemon import EdgeAgent
from edge_agent.engines import ModelSet
from edge_agent.runner import Runner
from edge_agent.transport import connect
from partitioner import Cut, Splitter, boundary, candidate_cuts, prefix_cut
from planner import Encoding, Frontier, FrontierEntry, Link, LinkRange, Objective, Plan, evaluate, make_flops_profile
from splitinfer.netem import LinkEmulator
from tests.onnx_models import conv_bn_relu_chain, write
from workers.engine import Engine, EngineConfig

MODEL, VERSION = "chain", "1"


def write_model(tmp_path) -> str:
    return write(conv_bn_relu_chain(3), os.path.join(str(tmp_path), "model.onnx"))


def one_cut(tmp_path) -> tuple[str, Any, Cut, np.ndarray, np.ndarray]:
    """The chain model written under `tmp_path`, a ModelSet of it with its one-layer cut loaded, an
    input and ONNX Runtime's output for it: (path, models, cut, x, reference y)."""
    path = write_model(tmp_path)
    models = ModelSet(path, cache=ArtifactCache(str(tmp_path / "cache")), model=MODEL, version=VERSION)
    cut = prefix_cut(models.graph, 1)
    models.load_cut(cut)
    x = np.random.default_rng(0).standard_normal((1, 4, 5, 5)).astype(np.float32)
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    return path, models, cut, x, ref


class TailBackend:
    def __init__(self, model_path: str, *, token: str | None = None, cache_dir: str | None = None) -> None:
        self.model_path = model_path
        self.splitter = Splitter(model_path)
        self.cuts = {c.key: c for c in candidate_cuts(self.splitter.graph)}
        self.token = token
        self.cache_dir = cache_dir
        self.engines: dict[str, Engine] = {}
        self.calls = 0
        self.served = 0
        self.delay_s: Callable[[InferRequest], float] | None = None
        self.fail: BaseException | None = None
        self.release = threading.Event()
        self.release.set()
        self._lock = threading.Lock()

    def _auth(self, context) -> None:
        if self.token is not None and context.bearer_token != self.token:
            raise Unauthenticated(reason="the bearer token is not valid")

    def _engine(self, cut_id: str) -> Engine:
        with self._lock:
            if cut_id not in self.engines:
                _, tail = self.splitter.split(self.cuts[cut_id])
                self.engines[cut_id] = Engine(tail.model, EngineConfig(batch_buckets=(1,), dynamic_batch=False,
                                                                       cache_dir=self.cache_dir))
            return self.engines[cut_id]

    async def infer(self, request: InferRequest, context) -> InferResponse:
        self.calls += 1
        self._auth(context)
        if request.model != MODEL:
            raise UnknownModelError(model=request.model, known=[MODEL])
        if self.fail is not None:
            raise self.fail
        if self.delay_s is not None:
            await asyncio.sleep(self.delay_s(request))
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        inputs = {k: decode(v) if isinstance(v, EncodedTensor) else np.asarray(v) for k, v in request.tensors.items()}
        eng = await asyncio.to_thread(self._engine, request.cut_id)
        out = await asyncio.to_thread(lambda: eng.run(inputs, copy=True))
        self.served += 1
        return InferResponse(request_id=request.request_id, outputs=out, timings_ms={"compute": 0.1},
                             served_by=f"{MODEL}@{VERSION}")

    async def plan(self, request, context):
        raise Unavailable(reason="no planner here")

    async def get_artifacts(self, request, context) -> ArtifactsResponse:
        self._auth(context)
        if request.model != MODEL:
            raise UnknownModelError(model=request.model, known=[MODEL])
        with open(self.model_path, "rb") as fh:
            data = fh.read()
        return ArtifactsResponse(model=MODEL, version=VERSION, files={"model.onnx": data})


def slow_device_profile(graph):
    """A device 1000x slower than the cloud estimate, so offloading always wins."""
    return make_flops_profile(graph, device="slow-test-device", gflops=1e-4, fixed_ms=1.0)


def fixed_frontier(graph, cut: Cut, *, encoding: Encoding = Encoding(), local_gflops: float = 1e-4) -> Frontier:
    """A one-plan frontier that offloads at `cut` on every link (tests pick the cut)."""
    dev = make_flops_profile(graph, device="dev", gflops=local_gflops)
    cloud = make_flops_profile(graph, device="cloud", gflops=100.0)
    link = Link(10e6, 40e6, 5.0)
    b = evaluate(graph, cut, [dev, cloud], link, encoding)
    plan = Plan(graph.model, (cut,), encoding, Objective.LATENCY, link, b, tuple(boundary(graph, cut)))
    rng = LinkRange(0.1e6, 1e9, 4.0, 5.0)
    return Frontier(graph.model, Objective.LATENCY, rng, (FrontierEntry(rng.up_lo_bps, rng.up_hi_bps, plan),))


@asynccontextmanager
async def gateway_and_agent(tmp_path: Path, model: str, device_profile: Path,
                            **config: Any) -> AsyncIterator[tuple[Gateway, EdgeAgent]]:
    """A gateway with in-process pools on the registry in `tmp_path / "registry"`, served on
    loopback, and a started edge agent of `model` with `device_profile` that offloads to it
    within 5 s (`config`: further agent keys); both stopped on exit."""
    registry = Registry(str(tmp_path / "registry"), cache_dir=str(tmp_path / "gw-cache"))
    gateway = Gateway(registry, LocalPoolFactory(cache_dir=str(tmp_path / "gw-cache")))
    await gateway.start()
    server = await serve(gateway)
    agent = EdgeAgent(config_from_dict({"gateway": server.address, "model": model, "apiPort": 0,
                                        "cacheDir": str(tmp_path / "edge-cache"), "deviceProfile": str(device_profile),
                                        "remoteTimeoutMs": 5000, **config}))
    try:
        await agent.start()
        yield gateway, agent
    finally:
        await agent.stop()
        await server.stop(None)
        await gateway.close()


@asynccontextmanager
async def runner_over_link(models: Any, frontier: Frontier, model_path: str, cut_key: str, server_cache: Path,
                           setting: Any, config: dict[str, Any], *, local_ms: float, outage_mode: Any = None,
                           backend_cls: type[TailBackend] = TailBackend) -> AsyncIterator[tuple[Any, TailBackend, Any]]:
    """A Runner over `models` and `frontier` whose gateway is a `backend_cls` of `model_path`
    (tail `cut_key` warm, as a gateway's frontier tails are) behind a LinkEmulator at
    `setting`: (runner, backend, emulator). `config`: the agent's keys but `gateway`.
    Everything is closed on exit, calls still in flight cancelled first."""
    backend = backend_cls(model_path, cache_dir=str(server_cache))
    backend._engine(cut_key)
    server = await serve(backend)
    extra = {} if outage_mode is None else {"outage_mode": outage_mode}
    emu = LinkEmulator(upstream=("127.0.0.1", server.port), setting=setting, **extra)
    await emu.start()
    cfg = config_from_dict({"gateway": f"127.0.0.1:{emu.port}", **config})
    remote = connect(cfg.gateway)
    runner = Runner(models, frontier, remote, cfg, local_ms=local_ms)
    try:
        yield runner, backend, emu
    finally:
        runner.cancel_remote()
        await remote.close()
        await emu.stop()
        await server.stop(None)
        runner.close()
