"""The direct channel between a pool and a worker (workers/_channel.py), both ends in
one process over a real Unix-domain socket; no Ray."""

from __future__ import annotations

import asyncio
import os
import socket
import stat

import numpy as np
import pytest

from workers._channel import ChannelClient, ChannelClosedError, open_channel_server
from workers.errors import InputError, WorkerError


async def _echo(key, inputs, deadline_unix_ms, priority):
    if key == "slow":
        await asyncio.sleep(0.05 * (3 - priority))
    if key == "bad":
        raise InputError(f"input 'x' of {key} is wrong; send float32", model=key, input_name="x",
                         expected="float32[1]", given="float64[1]")
    if key == "unpicklable":
        return {"f": lambda: None}, None
    return dict(inputs), (key, deadline_unix_ms, priority)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def round_trip_arrays(over: str) -> None:
    """Also run over TCP by tests/integration/test_channel_tcp.py (unit tests use no network)."""
    async def main():
        server = await open_channel_server(_echo, tcp_host="127.0.0.1" if over == "tcp" else None)
        address = server.path if over == "unix" else server.tcp_address
        client = await ChannelClient.connect(address, server.token)
        rng = np.random.default_rng(0)
        inputs = {
            "big": rng.standard_normal((2, 512, 512)).astype(np.float32),  # 2 MiB: received in place
            "small": np.arange(5, dtype=np.int64),
            "empty": np.zeros((0, 3), np.float16),
            "strided": rng.standard_normal((8, 8))[:, ::2],  # not contiguous: pickled in band
        }
        out, meta = await client.call("m@1@c", inputs, 123.5, 2)
        assert meta == ("m@1@c", 123.5, 2)
        for k, v in inputs.items():
            assert out[k].dtype == v.dtype and out[k].shape == v.shape
            np.testing.assert_array_equal(out[k], v)
        assert out["big"].flags.writeable
        # Frames larger than the socket buffer wait in the backlog, in order.
        huge = [np.full((3 << 20,), i, np.float32) for i in range(3)]  # 12 MiB each
        outs = await asyncio.gather(*(client.call("m", {"x": h}, None, 0) for h in huge))
        assert [float(o[0]["x"][-1]) for o in outs] == [0.0, 1.0, 2.0]
        many = {f"x{i}": np.full(2, i) for i in range(300)}  # more parts than one sendmsg takes
        out, _ = await client.call("m", many, None, 0)
        assert all(int(out[k][0]) == int(k[1:]) for k in many)
        # Many in flight at once, answered out of order (priority 2 sleeps least).
        results = await asyncio.gather(*(client.call("slow", {"x": np.full(3, i)}, None, i % 3) for i in range(9)))
        assert [int(r[0]["x"][0]) for r in results] == list(range(9))
        client.close()
        server.close()

    _run(main())


def test_arrays_round_trip_and_answers_match_their_requests():
    round_trip_arrays("unix")


def test_worker_errors_come_back_with_their_fields_and_the_channel_keeps_serving():
    async def main():
        server = await open_channel_server(_echo)
        client = await ChannelClient.connect(server.path, server.token)
        with pytest.raises(InputError, match="send float32") as e:
            await client.call("bad", {}, None, 0)
        assert (e.value.input_name, e.value.given, e.value.model) == ("x", "float64[1]", "bad")
        with pytest.raises(WorkerError, match="could not be sent") as e:
            await client.call("unpicklable", {}, None, 0)
        assert e.value.model == "unpicklable"
        out, _ = await client.call("ok", {"x": np.ones(2)}, None, 0)
        np.testing.assert_array_equal(out["x"], np.ones(2))
        server.close()

    _run(main())


def test_garbage_on_the_socket_closes_only_that_connection():
    async def main():
        server = await open_channel_server(_echo)
        good = await ChannelClient.connect(server.path, server.token)
        loop = asyncio.get_running_loop()
        for garbage in (b"\x05\x00\x00\x00\x00\x00\x00\x00hello",  # not a pickle
                        b"\x02\x00\x00\x00\x01\x00\x00\x00" + b"\x00" * 8,  # a pickle too short
                        b"\xff" * 8,  # 4 GiB of metadata declared: refused before allocating
                        b"\x01\x00\x00\x00\x01\x00\x00\x00" + b"\xff" * 8):  # an 18 EB buffer
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            raw.setblocking(False)
            await loop.sock_connect(raw, server.path)
            await loop.sock_sendall(raw, server.token + garbage + b"\x00" * 64)
            try:  # the worker hangs up: end of stream, or a reset when our bytes were left unread
                assert await asyncio.wait_for(loop.sock_recv(raw, 16), 10) == b""
            except ConnectionResetError:
                pass
            raw.close()
        out, _ = await good.call("ok", {"x": np.arange(3)}, None, 0)
        np.testing.assert_array_equal(out["x"], np.arange(3))
        server.close()

    _run(main())


def test_a_lost_worker_fails_calls_in_flight_with_a_retryable_error():
    async def main():
        server = await open_channel_server(_echo)
        directory = os.path.dirname(server.path)
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700  # only this user may connect
        client = await ChannelClient.connect(server.path, server.token)
        in_flight = asyncio.ensure_future(client.call("slow", {"x": np.ones(1)}, None, 0))
        await asyncio.sleep(0.01)
        server.close()  # as if the worker died: its connections close with the answer unsent
        with pytest.raises(ChannelClosedError, match="retry-able") as e:
            await in_flight
        assert e.value.path == server.path
        assert not os.path.exists(directory)
        await asyncio.sleep(0)
        assert client.closed
        with pytest.raises(ChannelClosedError):
            await client.call("ok", {}, None, 0)

    _run(main())


def refuses_a_wrong_token(over: str) -> None:
    async def main():
        seen = []

        async def handler(*args):
            seen.append(args)
            return None

        server = await open_channel_server(handler, tcp_host="127.0.0.1" if over == "tcp" else None)
        assert len(server.token) == 32
        address = server.path if over == "unix" else server.tcp_address
        with pytest.raises(ChannelClosedError):
            client = await ChannelClient.connect(address, bytes(32))
            await client.call("k", {"x": np.ones(1)}, None, 0)
        assert seen == []  # nothing reached the worker
        good = await ChannelClient.connect(address, server.token)
        await good.call("k")
        assert seen == [("k",)]
        server.close()

    _run(main())


def test_a_connection_without_the_token_is_closed_before_any_frame_is_read():
    refuses_a_wrong_token("unix")
