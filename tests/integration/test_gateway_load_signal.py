"""The gateway's load keys over real gRPC on 127.0.0.1 with an in-process pool (real ONNX
Runtime): an answer carries `timings_ms['utilisation']` and `timings_ms['expected_wait']`
beside `predicted_wait`, the same of a priority-1 request, and the agent's `CloudLoad` reads
them from the decoded answer."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import onnx
import pytest

from cluster.gateway import Gateway, LocalPoolFactory
from cluster.protocol.client import InferenceClient, make_request
from cluster.registry import Registry
from cluster.server import serve_in_thread
from edge_agent.cloud_load import CloudLoad
from tests.integration.test_gateway_overload import SHAPE, conv_stack

pytestmark = pytest.mark.grpc


def test_every_answer_carries_the_pools_utilisation_and_expected_wait(tmp_path):
    d = tmp_path / "repo" / "s" / "1"
    os.makedirs(d)
    onnx.save(conv_stack(n_layers=2, width=16), str(d / "model.onnx"))
    (d / "model.yaml").write_text("max_batch_size: 4\nmax_queue_delay_ms: 0\nintra_op_threads: 1\n"
                                  "frontier: {default_cut_count: 1}\n")
    registry = Registry(str(tmp_path / "repo"), cache_dir=str(tmp_path / "cache"))
    gateway = Gateway(registry, LocalPoolFactory(cache_dir=str(tmp_path / "ort")))
    registry.load("s", "1")
    server = serve_in_thread(gateway)
    cut = next(c for c in registry.resolve("s", "1").frontier.cuts if not c.edge_layers)
    x = {"x": np.ones(SHAPE, np.float32)}

    async def main():
        async with InferenceClient(server.address) as c:
            return [await c.infer(make_request("s", "1", cut.cut_id, x, timeout_s=30.0)) for _ in range(4)]

    try:
        results = asyncio.run(main())
    finally:
        asyncio.run_coroutine_threadsafe(gateway.close(), server._loop).result()
        server.stop()
    # The first answer comes from the first batch timed: from then on the pool has an estimate.
    last = results[-1].timings_ms
    assert {"predicted_wait", "utilisation", "expected_wait"} <= set(last), last
    assert last["utilisation"] >= 0 and last["expected_wait"] >= 0
    # The same for a request of priority 1, which waits behind its own class only: never longer.
    assert 0 <= last["urgent_predicted_wait"] <= last["predicted_wait"]
    assert 0 <= last["urgent_expected_wait"] <= last["expected_wait"]
    load = CloudLoad()
    load.observe_timings(cut.cut_id, last, 0.0)
    assert load.queue_ms(0.0).get(cut.cut_id, 0.0) == pytest.approx(max(last["expected_wait"], last["predicted_wait"]))
    assert load.to_dict(0.0)["utilisation"] == {cut.cut_id: pytest.approx(last["utilisation"])}
