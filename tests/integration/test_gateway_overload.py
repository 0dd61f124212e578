"""Admission control over real gRPC on 127.0.0.1 with an in-process pool (real ONNX Runtime):
an overloaded gateway refuses with RESOURCE_EXHAUSTED and a retry-after at once, no request
outlives its deadline, health still answers, and every refusal is counted and shown."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from cluster.errors import DeadlineExceeded, ResourceExhausted
from cluster.gateway import Gateway, LocalPoolFactory, PoolKey
from cluster.metrics import MetricsServer
from cluster.protocol.client import InferenceClient, make_request
from cluster.registry import Registry
from tests.integration._gateway_support import serving, write_version

pytestmark = pytest.mark.grpc

SHAPE = (1, 8, 32, 32)


def conv_stack(n_layers: int = 5, width: int = 48, shape: tuple[int, ...] = SHAPE) -> onnx.ModelProto:
    """x[shape] -> Conv 3x3 (width channels) * n -> GlobalAveragePool -> y: at the defaults
    (1x8x32x32) about 10 ms per request on one core, so a queue builds behind it."""
    rng = np.random.default_rng(0)
    nodes, inits, prev, c_in = [], [], "x", shape[1]
    for i in range(n_layers):
        w = (rng.standard_normal((width, c_in, 3, 3)) * 0.1).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes += [helper.make_node("Conv", [prev, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"])]
        prev, c_in = f"r{i}", width
    nodes.append(helper.make_node("GlobalAveragePool", [prev], ["y"]))
    graph = helper.make_graph(nodes, "stack", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, width, 1, 1])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    write_version(root, "s", "1", conv_stack(), "max_batch_size: 4\nmax_queue_delay_ms: 0\nintra_op_threads: 1\n"
                                                "frontier: {default_cut_count: 1}\n")
    registry = Registry(str(root), cache_dir=str(tmp_path_factory.mktemp("cache")))
    gateway = Gateway(registry, LocalPoolFactory(cache_dir=str(tmp_path_factory.mktemp("ort"))))
    registry.load("s", "1")
    with serving(gateway) as server:
        http = MetricsServer(gateway.metrics, gateway.readiness)
        try:
            yield registry, gateway, server, http
        finally:
            http.stop()


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_overload_is_refused_at_once_with_a_retry_after_and_nothing_hangs(stack):
    registry, gateway, server, http = stack
    cut = next(c for c in registry.resolve("s", "1").frontier.cuts if not c.edge_layers)
    pool = gateway._pools[PoolKey("s", "1", cut.cut_id)]
    x = {"x": np.ones(SHAPE, np.float32)}
    m = gateway.metrics

    async def main():
        async with InferenceClient(server.address) as c:
            # Time batches of one and of four (the pool's estimate comes from these runs).
            for _ in range(3):
                await c.infer(make_request("s", "1", cut.cut_id, x, timeout_s=30.0))
            await asyncio.gather(*(c.infer(make_request("s", "1", cut.cut_id, x, timeout_s=30.0)) for _ in range(8)))
            full_s = pool.batcher.run_times.estimate_s(4)
            # Three full batches' time (at least 50 ms, so that gRPC's own time on a
            # shared machine stays small beside it): 64 clients queue 16 batches deep.
            deadline_s = max(3 * full_s, 0.05)
            outcomes: list[tuple[str, float, object]] = []

            async def client() -> None:
                for _ in range(4):
                    t0 = time.monotonic()
                    try:
                        await c.infer(make_request("s", "1", cut.cut_id, x, timeout_s=deadline_s))
                        outcomes.append(("ok", time.monotonic() - t0, None))
                    except ResourceExhausted as e:
                        outcomes.append(("refused", time.monotonic() - t0, e))
                    except DeadlineExceeded as e:
                        outcomes.append(("expired", time.monotonic() - t0, e))

            async def probe() -> list[str]:
                seen = []
                for _ in range(5):
                    seen.append(await c.health(timeout_s=5.0))
                    await asyncio.sleep(deadline_s)
                return seen

            health, *_ = await asyncio.gather(probe(), *(client() for _ in range(64)))
            return deadline_s, outcomes, health

    deadline_s, outcomes, health = asyncio.run(main())
    refused = [e for kind, _, e in outcomes if kind == "refused"]
    assert len(outcomes) == 64 * 4
    assert refused, "64 clients on a pool that answers 4 per batch time must be refused"
    assert all(isinstance(e.retry_after_ms, float) and e.retry_after_ms > 0 for e in refused)
    assert all("retry after" in e.message for e in refused)
    # No request hangs: each is answered by its deadline, plus scheduling slack on a shared machine.
    assert max(elapsed for _, elapsed, _ in outcomes) < deadline_s + 1.0
    assert health == ["SERVING"] * 5

    stats = pool.batcher.stats()
    load_refusals = sum(m.sample("splitinfer_refusals_total", {"model": "s", "reason": r}) or 0.0
                        for r in ("predicted_wait", "deadline_unreachable", "queue_full"))
    assert load_refusals == len(refused)
    # The batcher may refuse a request whose deadline then passes before its handler resumes.
    assert load_refusals <= sum(stats.rejected.get(r, 0) for r in ("predicted_wait", "deadline_unreachable"))
    exhausted = m.sample("splitinfer_requests_total", {"model": "s", "version": "1", "status": "RESOURCE_EXHAUSTED"})
    assert exhausted == len(refused)
    early = [e for kind, _, e in outcomes if kind == "expired" and "reached the backend" in e.message]
    assert (m.sample("splitinfer_refusals_total", {"model": "s", "reason": "expired_before_backend"}) or 0) == len(early)
    # Queue time is observed for failures too: once per request that reached the pool.
    assert m.sample("splitinfer_stage_latency_seconds_count", {"stage": "queue"}) >= len(outcomes) - len(early)
    labels = {"model": "s", "version": "1", "cut": cut.cut_id}
    assert m.sample("splitinfer_queue_depth", labels) is not None
    assert m.sample("splitinfer_predicted_wait_seconds", labels) is not None
    assert m.sample("splitinfer_discarded_results_total", labels) == stats.discarded

    # /readyz stays 200; its load view reports the overload (refusals in the last few seconds).
    code, body = _get(http.url + "/readyz")
    assert code == 200 and "load" not in body
    code, body = _get(http.url + "/readyz?load=1")
    assert code == 503 and body["ready"] is True and body["load"]["overloaded"] is True
    pool_view = body["load"]["pools"][f"s@1@{cut.cut_id}"]
    assert pool_view["queue_depth"] == 0 and pool_view["capacity_rps"] > 0
    assert pool_view["headroom_rps"] == pytest.approx(pool_view["capacity_rps"] - pool_view["arrival_rps"], abs=1e-2)
    assert gateway.load(now_s=time.monotonic() + gateway.overload_window_s)["overloaded"] is False


def test_a_request_already_late_on_arrival_is_counted(stack):
    registry, gateway, server, _ = stack
    cut = next(c for c in registry.resolve("s", "1").frontier.cuts if not c.edge_layers)
    m = gateway.metrics
    before = m.sample("splitinfer_requests_total", {"model": "s", "version": "-", "status": "DEADLINE_EXCEEDED"}) or 0.0

    async def main():
        async with InferenceClient(server.address) as c:
            req = make_request("s", "1", cut.cut_id, {"x": np.ones(SHAPE, np.float32)}, timeout_s=-1.0)
            with pytest.raises(DeadlineExceeded, match="before the request reached the backend"):
                await c.infer(req, timeout_s=5.0)

    asyncio.run(main())
    after = m.sample("splitinfer_requests_total", {"model": "s", "version": "-", "status": "DEADLINE_EXCEEDED"})
    assert after == before + 1
    assert m.sample("splitinfer_refusals_total", {"model": "s", "reason": "expired_before_backend"}) >= 1


def test_overload_refusals_map_to_resource_exhausted_with_a_retry_after():
    import grpc

    from cluster.gateway import refusal_reason, to_cluster_error
    from cluster.protocol.status import from_status, status_of, to_status, trailing_metadata
    from workers import errors as W

    cases = [
        (W.OverloadedError("late", reason="predicted_wait", predicted_finish_s=2.0, deadline_s=1.5,
                           retry_after_s=0.5), "predicted_wait", 500.0),
        (W.OverloadedError("late", reason="deadline_unreachable", predicted_finish_s=2.0, deadline_s=1.5,
                           retry_after_s=0.25), "deadline_unreachable", 250.0),
        (W.QueueFullError("full", queue_size=4, max_queue_size=4, retry_after_s=0.04), "queue_full", 40.0),
        # A full queue with no batch timed yet still says when to retry.
        (W.QueueFullError("full", queue_size=4, max_queue_size=4), "queue_full", 100.0),
    ]
    for exc, reason, after_ms in cases:
        err = to_cluster_error(exc, "m@1@c")
        assert type(err) is ResourceExhausted and status_of(err) is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refusal_reason(exc) == reason
        assert err.retry_after_ms == after_ms and f"retry after {after_ms:.0f} ms" in err.message
        # The hint travels in the trailing metadata and comes back on the client.
        code, message, name, fields = to_status(err)
        back = from_status(code, message, trailing_metadata(name, fields))
        assert type(back) is ResourceExhausted and back.retry_after_ms == after_ms
    assert refusal_reason(W.DeadlineExceededError("late", deadline_s=1.0, now_s=1.5)) == "expired_in_queue"
    assert refusal_reason(RuntimeError("boom")) is None


def test_readyz_reports_overload_only_when_asked():
    from cluster.metrics import GatewayMetrics

    m = GatewayMetrics()
    view = {"overloaded": False, "pools": {}}
    m.load_view = lambda: view
    http = MetricsServer(m, lambda: (True, {"pools": 1}))
    try:
        assert _get(http.url + "/readyz?load=1") == (200, {"ready": True, "pools": 1, "load": view})
        view = {"overloaded": True, "pools": {"net@1@L": {"overloaded": True}}}
        code, body = _get(http.url + "/readyz?load=1")
        assert code == 503 and body["ready"] is True and body["load"]["overloaded"] is True
        assert _get(http.url + "/readyz") == (200, {"ready": True, "pools": 1})
        assert _get(http.url + "/readyz?load=0") == (200, {"ready": True, "pools": 1})
    finally:
        http.stop()


class _WorkersPool:
    """A pool whose batcher the gateway cannot see, as a Ray pool's: a LocalPool without
    load(), whose runs wait for ``gate``."""

    def __init__(self, inner, gate: asyncio.Event) -> None:
        self._inner, self._gate = inner, gate

    async def run(self, inputs, *, deadline_s, priority):
        await self._gate.wait()
        return await self._inner.run(inputs, deadline_s=deadline_s, priority=priority)

    async def close(self) -> None:
        await self._inner.close()


def test_a_pool_without_its_own_load_reports_the_requests_inside_it(tmp_path):
    from cluster.server import RequestContext

    d = tmp_path / "repo" / "s" / "1"
    d.mkdir(parents=True)
    onnx.save(conv_stack(n_layers=1, width=8), str(d / "model.onnx"))
    (d / "model.yaml").write_text("frontier: {default_cut_count: 0}\n")
    gates: list[asyncio.Event] = []

    class Factory(LocalPoolFactory):
        def create(self, key, tail_path, config, metrics):
            gates.append(asyncio.Event())
            return _WorkersPool(super().create(key, tail_path, config, metrics), gates[-1])

    registry = Registry(str(tmp_path / "repo"))
    gateway = Gateway(registry, Factory(cache_dir=str(tmp_path / "ort")))
    registry.load_all()
    cut = next(c for c in registry.resolve("s", "1").frontier.cuts if not c.edge_layers)
    labels = {"model": "s", "version": "1", "cut": cut.cut_id}

    async def main():
        now = time.monotonic()
        ctx = RequestContext(method="Infer", received_monotonic_s=now, deadline_monotonic_s=now + 30)
        calls = [asyncio.ensure_future(gateway.infer(make_request("s", "1", cut.cut_id,
                                                                  {"x": np.ones(SHAPE, np.float32)}), ctx))
                 for _ in range(3)]
        for _ in range(5):
            await asyncio.sleep(0)
        inside = gateway.metrics.sample("splitinfer_queue_depth", labels)
        gates[0].set()
        await asyncio.gather(*calls)
        after = gateway.metrics.sample("splitinfer_queue_depth", labels)
        await gateway.close()
        return inside, after

    inside, after = asyncio.run(main())
    assert (inside, after) == (3, 0)
    assert gateway.metrics.sample("splitinfer_predicted_wait_seconds", labels) is None
