"""The one gRPC client: per-call byte counts, channel options, and the agent's use of it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cluster.protocol.client import SERVER_TIME_KEYS, InferenceClient, SyncInferenceClient, make_request
from cluster.protocol.errors import ResourceExhausted, UnknownModelError
from cluster.server import serve_in_thread
from cluster.testing import EchoBackend
from edge_agent.transport import AGENT_CHANNEL_OPTIONS, connect

pytestmark = pytest.mark.grpc


@pytest.fixture
def server():
    with serve_in_thread(EchoBackend(), max_message_bytes=4 << 20) as srv:
        yield srv


def _req(n: int = 1000, model: str = "echo"):
    return make_request(model, "1", "c0", {"x": np.arange(n, dtype=np.float32)})


def test_a_counted_call_reports_the_bytes_of_both_frames_and_the_server_time(server):
    req = _req()
    with SyncInferenceClient(server.address) as c:
        got = c.infer_counted(req)
    assert got.up_bytes == len(req.to_msgpack())
    # The echo answers with the request's tensor: the answer's frame holds its 4000 bytes.
    assert got.down_bytes > 4000 and got.down_bytes == len(got.response.to_msgpack())
    assert got.server_ms == pytest.approx(sum(v for k, v in got.response.timings_ms.items() if k in SERVER_TIME_KEYS))
    assert got.server_ms > 0 and got.elapsed_s * 1e3 >= got.server_ms
    np.testing.assert_array_equal(got.response.outputs["x"], req.tensors["x"])


def test_channel_options_replace_the_defaults(server):
    # 1 KiB receive limit: a 4 KB answer is refused by the client's own channel.
    with SyncInferenceClient(server.address, options=[("grpc.max_receive_message_length", 1024)]) as c:
        assert c.infer(_req(10)).outputs["x"].shape == (10,)
        with pytest.raises(ResourceExhausted):
            c.infer(_req(1000))


def test_the_async_client_counts_and_raises_as_the_sync_one(server):
    async def go():
        async with InferenceClient(server.address, options=AGENT_CHANNEL_OPTIONS) as c:
            req = _req()
            got = await c.infer_counted(req, timeout_s=5)
            with pytest.raises(UnknownModelError):
                await c.infer_counted(_req(model="nope"), timeout_s=5)
            return req, got

    req, got = asyncio.run(go())
    assert got.up_bytes == len(req.to_msgpack()) and got.down_bytes > 4000


def test_the_agent_calls_the_gateway_with_the_protocol_client(server):
    async def go():
        remote = connect(server.address, token="secret")
        try:
            got = await remote.infer_counted(_req(), timeout_s=5)
            assert isinstance(remote, InferenceClient)
            return await remote.health(timeout_s=5), got, repr(remote)
        finally:
            await remote.close()

    status, got, text = asyncio.run(go())
    assert status == "SERVING" and isinstance(got.response.outputs["x"], np.ndarray)
    assert got.down_bytes > 4000 and got.response.served_by == "echo@1"
    assert "secret" not in text and "token=set" in text
