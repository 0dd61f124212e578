"""The agent under a loaded cloud, over real gRPC on 127.0.0.1.

The server is `cluster.server.serve` with a `TailBackend` that can refuse with
RESOURCE_EXHAUSTED and a retry-after (as the gateway's admission control does) and
report a predicted queue wait in `timings_ms` (as every gateway answer does). The agent
is the real Runner with warm head, tail and full engines. A refusal is answered here at
once, exactly once, and holds offloading off for the retry-after; a reported queue wait
longer than local execution moves the agent local, and it offloads again as the wait falls.
"""

import asyncio
import contextlib
import logging
import time

import numpy as np
import pytest

from cluster.errors import ResourceExhausted
from cluster.server import serve
from edge_agent.cache import ArtifactCache
from edge_agent.config import config_from_dict
from edge_agent.engines import ModelSet
from edge_agent.runner import Counters, Runner
from edge_agent.transport import connect
from partitioner import prefix_cut
from tests.integration._edge_support import MODEL, VERSION, TailBackend, fixed_frontier, write_model
from tests.integration.test_edge_runner import _ref, _x

pytestmark = [pytest.mark.grpc, pytest.mark.timeout(120)]

_TIMEOUT_MS = 20_000.0
"""The remote budget: far above anything these tests wait, so a local answer is never the timeout's."""


class _LoadedBackend(TailBackend):
    """A TailBackend whose answers carry `predicted_wait_ms` as the gateway's timings do."""

    predicted_wait_ms: float | None = None

    async def infer(self, request, context):
        resp = await super().infer(request, context)
        if self.predicted_wait_ms is not None:
            resp.timings_ms["predicted_wait"] = self.predicted_wait_ms
        return resp


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("edge-overload")
    path = write_model(d)
    models = ModelSet(path, cache=ArtifactCache(str(d / "cache")), model=MODEL, version=VERSION)
    cut = prefix_cut(models.graph, 1)
    models.load_cut(cut)
    return d, path, models, cut


@contextlib.asynccontextmanager
async def _stack(model_dir, *, local_ms=1000.0):
    d, path, models, cut = model_dir
    backend = _LoadedBackend(path, cache_dir=str(d / "server-cache"))
    backend._engine(cut.key)
    server = await serve(backend)
    cfg = config_from_dict({"gateway": f"127.0.0.1:{server.port}", "model": f"{MODEL}@{VERSION}",
                            "remoteTimeoutMs": _TIMEOUT_MS, "fallback": "local", "cacheDir": str(d / "cache"),
                            "breakerFailures": 1})
    remote = connect(cfg.gateway)
    runner = Runner(models, fixed_frontier(models.graph, cut), remote, cfg, local_ms=local_ms)
    try:
        warm = await runner.infer({"x": _x()}, request_id="warm")  # channel and connection up
        assert warm.served_by == "remote"
        runner.counters = Counters()
        backend.calls = backend.served = 0
        yield runner, backend
    finally:
        runner.cancel_remote()
        await remote.close()
        await server.stop(None)
        runner.close()


def test_a_refusal_is_answered_here_at_once_and_holds_offloading_off_for_the_retry_after(model_dir, caplog):
    caplog.set_level(logging.INFO, logger="edge_agent.runner")
    path = model_dir[1]
    retry_ms = 1500.0

    async def go():
        async with _stack(model_dir) as (runner, backend):
            backend.fail = ResourceExhausted(resource="capacity of chain@1", retry_after_ms=retry_ms)
            refused = await runner.infer({"x": _x(1)}, request_id="refused")
            refused_s = time.monotonic()
            calls_after_refusal = backend.calls
            backend.fail = None  # the cloud has room again, but asked for retry_ms of quiet
            held = await runner.infer({"x": _x(2)}, request_id="held")
            held_within_s = time.monotonic() - refused_s
            calls_while_held = backend.calls
            breaker = runner.breaker.state
            await asyncio.sleep(retry_ms / 1e3 - held_within_s + 0.1)
            back = await runner.infer({"x": _x(3)}, request_id="back")
            return refused, held, held_within_s, back, runner.counters, calls_after_refusal, calls_while_held, \
                breaker, backend.served

    refused, held, held_within_s, back, c, calls1, calls2, breaker, served = asyncio.run(go())
    assert held_within_s < retry_ms / 1e3  # else the hold-off check below says nothing
    # Answered here from the head's output, by the refusal (not the 20 s budget), exactly once.
    assert refused.served_by == "local_tail" and "ResourceExhausted" in refused.fallback_reason
    assert refused.latency_ms < _TIMEOUT_MS and "timeout" not in c.remote_errors
    np.testing.assert_allclose(refused.outputs["y"], _ref(path, _x(1)), rtol=1e-4, atol=1e-5)
    # Within the retry-after the agent does not ask again: the whole model runs here.
    assert held.served_by == "local" and calls2 == calls1 == 1
    np.testing.assert_allclose(held.outputs["y"], _ref(path, _x(2)), rtol=1e-4, atol=1e-5)
    # A refusal is an answer from a live gateway, not a link failure: the breaker (1 failure opens it) stays closed.
    assert breaker == "closed"
    assert back.served_by == "remote" and served == 1
    assert c.remote_errors == {"ResourceExhausted": 1}
    # The hint crossed the wire and set the hold-off (not the agent's default for a refusal without one).
    assert any("refused cut" in r.message and "for 1500 ms" in r.message for r in caplog.records)
    assert (c.requests, c.answered, c.failed, c.local_tail, c.local, c.remote) == (3, 3, 0, 1, 1, 1)


def test_a_reported_queue_wait_over_local_moves_the_agent_local_and_back_as_it_drains(model_dir):
    async def go():
        async with _stack(model_dir, local_ms=400.0) as (runner, backend):
            backend.predicted_wait_ms = 1200.0  # three times local: the cloud is loaded
            first = await runner.infer({"x": _x(4)}, request_id="loaded")  # planned before the wait was known
            seen_s = time.monotonic()
            backend.predicted_wait_ms = 0.0
            kept = await runner.infer({"x": _x(5)}, request_id="kept")
            kept_within_s = time.monotonic() - seen_s
            wait_ms = runner.status()["cloud"]["queue_ms"]
            # The reported backlog drains at 1 ms a ms: below local within ~1.2 s, so offloading resumes.
            await asyncio.sleep(1.2 - kept_within_s + 0.2)
            back = await runner.infer({"x": _x(6)}, request_id="back")
            return first, kept, kept_within_s, wait_ms, back, runner.counters, runner.switch_events

    first, kept, kept_within_s, wait_ms, back, c, switches = asyncio.run(go())
    assert kept_within_s < 0.8  # else the wait had drained below local before `kept` was planned
    assert first.served_by == "remote"
    assert kept.served_by == "local" and wait_ms and max(wait_ms.values()) > 400.0
    assert back.served_by == "remote"
    (_, to_local, why), (_, to_back, _) = list(switches)[-2:]
    assert to_local == "local" and to_back != "local" and "cloud queue" in why
    assert (c.answered, c.failed, c.remote_errors) == (3, 0, {})
