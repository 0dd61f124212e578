"""The direct channel's TCP form (workers/_transport/), both ends in this process over
127.0.0.1: the unit tests' cases, across the loopback network, and pickle refused over
TCP unless both ends opt in ([Note: no pickle over TCP] in workers/_transport/framing.py)."""

from __future__ import annotations

import asyncio
import pickle
import socket

import numpy as np
import pytest

from tests.unit.test_channel import refuses_a_wrong_token, round_trip_arrays
from workers._transport import ChannelClient, ChannelRefusedError, open_channel_server
from workers._transport.framing import _HEAD, _PICKLE, _REFUSED, decode_refusal
from workers.errors import InputError

RAN: list[str] = []


class _Runs:
    """Unpickling this runs code: what a pickle frame from a stranger could do."""

    def __reduce__(self):
        return RAN.append, ("unpickled",)


async def _serve(key, inputs, deadlines, priorities):
    if key == "bad":
        raise InputError("input 'x' of bad is wrong; send float32", model=key, input_name="x",
                         expected="float32[1]", given="float64[1]")
    return [({"y": x["x"] * 2}, None) for x in inputs]


def _tensors(value: float) -> tuple:
    """A pool's request of one, as the pool sends it: a tensor frame over TCP."""
    return ("m", [{"x": np.full(4, value, np.float32)}], [None], [0])


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_arrays_round_trip_over_tcp_when_both_ends_opt_in_to_pickle():
    round_trip_arrays("tcp", tcp_pickle=True)


def test_a_tcp_connection_with_a_wrong_token_reaches_nothing():
    refuses_a_wrong_token("tcp")


def test_tensor_frames_cross_tcp_without_pickle():
    async def main():
        server = await open_channel_server(_serve, tcp_host="127.0.0.1")
        client = await ChannelClient.connect(server.tcp_address, server.token)
        [(out, _)] = await client.call(*_tensors(3.0))
        np.testing.assert_array_equal(out["y"], np.full(4, 6.0, np.float32))
        client.close()
        server.close()

    _run(main())


def test_a_pickle_frame_over_tcp_is_refused_unread_and_the_worker_stays_up():
    RAN.clear()
    seen = []

    async def handler(*args):
        seen.append(args)
        return []

    async def main():
        server = await open_channel_server(handler, tcp_host="127.0.0.1")
        loop = asyncio.get_running_loop()
        sock = socket.create_connection(server.tcp_address)
        sock.setblocking(False)
        await loop.sock_sendall(sock, server.token)
        meta = pickle.dumps((0, ("k", _Runs())), protocol=5)
        await loop.sock_sendall(sock, _HEAD.pack(len(meta), 0, 0, _PICKLE) + meta)
        head = await loop.sock_recv(sock, _HEAD.size)
        meta_bytes, _, _, codec = _HEAD.unpack(head)
        assert codec == _REFUSED
        body = b""
        while len(body) < meta_bytes:
            body += await loop.sock_recv(sock, meta_bytes - len(body))
        refusal = decode_refusal(memoryview(body))
        assert refusal.request_id == -1
        assert "pickle" in str(refusal) and "never unpickled" in str(refusal) and "tcp_pickle" in str(refusal)
        assert await loop.sock_recv(sock, 1) == b""  # that connection is closed
        sock.close()
        # The worker still serves: a client that may send pickle is refused as a whole, ...
        rogue = await ChannelClient.connect(server.tcp_address, server.token, tcp_pickle=True)
        with pytest.raises(ChannelRefusedError, match="tcp_pickle"):
            await rogue.call("k", _Runs())
        # ... and tensors cross on a new connection.
        client = await ChannelClient.connect(server.tcp_address, server.token)
        await client.call("k", [{"x": np.ones(2, np.float32)}], [None], [0])
        server.close()

    _run(main())
    assert RAN == [] and len(seen) == 1


def test_a_request_that_needs_pickle_is_refused_before_it_is_sent_and_the_channel_stays_open():
    async def main():
        server = await open_channel_server(_serve, tcp_host="127.0.0.1")
        client = await ChannelClient.connect(server.tcp_address, server.token)
        strided = np.arange(8, dtype=np.float32)[::2]  # not contiguous: only pickle carries it
        with pytest.raises(ChannelRefusedError, match=r"request 0 for m .*plain Ray call.*tcp_pickle=True"):
            await client.call("m", [{"x": strided}], [None], [0])
        assert not client.closed
        [(out, _)] = await client.call(*_tensors(1.0))
        assert float(out["y"][0]) == 2.0
        client.close()
        server.close()

    _run(main())


def test_an_answer_that_needs_pickle_is_refused_for_its_request_alone():
    async def main():
        server = await open_channel_server(_serve, tcp_host="127.0.0.1")
        client = await ChannelClient.connect(server.tcp_address, server.token)
        bad = ("bad", [{"x": np.ones(1)}], [None], [0])
        with pytest.raises(ChannelRefusedError, match="the answer to request 0") as refused:
            await client.call(*bad)
        assert refused.value.request_id == 0
        [(out, _)] = await client.call(*_tensors(2.0))  # the connection serves on
        assert float(out["y"][0]) == 4.0
        client.close()
        server.close()

    _run(main())


def test_with_both_ends_opted_in_an_error_crosses_tcp_as_itself():
    async def main():
        server = await open_channel_server(_serve, tcp_host="127.0.0.1", tcp_pickle=True)
        client = await ChannelClient.connect(server.tcp_address, server.token, tcp_pickle=True)
        with pytest.raises(InputError, match="send float32"):
            await client.call("bad", [{"x": np.ones(1)}], [None], [0])
        client.close()
        server.close()

    _run(main())
