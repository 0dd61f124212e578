"""A server stopped while a stream's requests wait in a pool ends that stream's handler before
stop() returns: its requests are cancelled before the gateway closes the pools under them, and
the event loop ends without a traceback from grpc ([Note: calls outlive stop] in cluster/server.py)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import numpy as np
import pytest

from cluster.errors import ClusterError
from cluster.gateway import Gateway, LocalPool, LocalPoolFactory
from cluster.protocol.client import SyncInferenceClient, make_request
from cluster.registry import Registry
from cluster.server import new_event_loop, serve
from tests.integration._gateway_support import write_version
from tests.onnx_models import conv_bn_relu_chain

pytestmark = pytest.mark.grpc


class _HeldPool(LocalPool):
    """A real in-process pool (its tail loaded in ONNX Runtime) whose requests stay in it until
    cancelled, as on a replica too slow to answer before the server's drain runs out."""

    held: list[asyncio.Task]

    async def run(self, inputs, *, deadline_s, priority):
        self.held.append(asyncio.current_task())
        await asyncio.Event().wait()
        raise AssertionError("a held request only ends cancelled")


class _HeldPools(LocalPoolFactory):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.held: list[asyncio.Task] = []

    def create(self, key, tail_path, config, metrics, *, sample_inputs=None):
        pool = _HeldPool(key, tail_path, config, metrics, cache_dir=self.cache_dir, provider=self.provider,
                         sample_inputs=sample_inputs)
        pool.held = self.held
        return pool


ROUNDS = 4
"""Servers started and stopped in turn. Left to grpc, whether a handler outlives stop() is a
race (grpc's own cancellation of a call sometimes reaches the handler before stop() returns):
each round runs it again."""
STREAMS = 2
PER_STREAM = 2


def test_stop_ends_the_streams_whose_requests_wait_in_a_pool(tmp_path, capfd, caplog):
    write_version(tmp_path / "repo", "m", "1", conv_bn_relu_chain(2))
    pools = _HeldPools(cache_dir=str(tmp_path / "ort"))
    gateway = Gateway(Registry(str(tmp_path / "repo")), pools)
    x = {"x": np.ones((1, 4, 5, 5), np.float32)}
    left_running: list[int] = []
    answered: list[object] = []

    def stream(address: str, open_until: threading.Event) -> object:
        def requests():
            for i in range(PER_STREAM):
                yield make_request("m", "", "L", x, request_id=f"r{i}", timeout_s=60.0)
            open_until.wait(60)  # the stream stays open past the drain

        # On the blocking client, in a thread: the client's calls do not share the server's loop.
        with SyncInferenceClient(address) as c:
            try:
                return list(c.infer_stream(requests()))
            except ClusterError as e:
                return e

    async def one_round() -> None:
        running = await serve(gateway)
        open_until = threading.Event()
        held = len(pools.held) + STREAMS * PER_STREAM
        clients = [asyncio.ensure_future(asyncio.to_thread(stream, running.address, open_until))
                   for _ in range(STREAMS)]
        deadline = time.monotonic() + 30
        while len(pools.held) < held:
            assert time.monotonic() < deadline and not any(c.done() for c in clients)
            await asyncio.sleep(0.01)
        await running.stop(grace_s=0.2)
        # Read before anything else runs: the requests that stop() left running in the pool.
        left_running.append(sum(t.cancelling() == 0 and not t.done() for t in pools.held))
        open_until.set()
        answered.extend(await asyncio.gather(*clients))

    async def main() -> None:
        await gateway.start(keep_going=True)
        try:
            for _ in range(ROUNDS):
                await one_round()
        finally:
            await gateway.close()

    with caplog.at_level(logging.DEBUG), asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(main())
    assert left_running == [0] * ROUNDS
    assert len(pools.held) == ROUNDS * STREAMS * PER_STREAM and all(t.cancelled() for t in pools.held)
    # Each client learns that its stream ended, with a status.
    assert all(isinstance(a, ClusterError) for a in answered), answered
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith(("grpc", "cluster"))]
    assert not loud, [r.getMessage() for r in loud]
