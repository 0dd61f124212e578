"""The direct channel between a pool and a worker (workers/_transport/), both ends in
one process over a real Unix-domain socket; no Ray."""

from __future__ import annotations

import asyncio
import marshal
import os
import socket
import stat
import struct

import numpy as np
import pytest

from workers._transport.arena import ARENA_KEEP_BYTES, ARENA_MIN_BYTES, Arena
from workers._transport import ChannelClient, ChannelClosedError, open_channel_server
from workers._transport.connection import _Connection
from workers._transport.framing import encode_frame
from workers.batcher import NOT_NOW
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


def round_trip_arrays(over: str, *, tcp_pickle: bool = False) -> None:
    """Also run over TCP by tests/integration/test_channel_tcp.py (unit tests use no network),
    where the frames this sends need ``tcp_pickle``."""
    async def main():
        server = await open_channel_server(_echo, tcp_host="127.0.0.1" if over == "tcp" else None,
                                           tcp_pickle=tcp_pickle)
        address = server.path if over == "unix" else server.tcp_address
        client = await ChannelClient.connect(address, server.token, tcp_pickle=tcp_pickle)
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


def test_a_request_with_nothing_behind_it_is_answered_at_once_by_the_now_handler():
    # [Note: answered at once]
    seen: list[tuple[str, str]] = []

    def now(key, inputs, deadline_unix_ms, priority, place=None):
        seen.append(("now", key))
        if key == "later":
            return NOT_NOW
        if key == "bad":
            raise InputError(f"input 'x' of {key} is wrong", model=key, input_name="x")
        return dict(inputs), "now"

    async def handler(key, inputs, deadline_unix_ms, priority):
        seen.append(("handler", key))
        return dict(inputs), "handler"

    async def main():
        server = await open_channel_server(handler, now=now)
        client = await ChannelClient.connect(server.path, server.token)
        x = {"x": np.arange(4)}
        alone = await client.call("alone", x, None, 0)
        later = await client.call("later", x, None, 0)
        with pytest.raises(InputError, match="is wrong"):
            await client.call("bad", x, None, 0)
        seen_before_burst = list(seen)
        seen.clear()
        # Three frames in the socket before the server reads: the first two have company
        # behind them and go to the handler, so that a batcher could batch them.
        burst = await asyncio.gather(*(client.call(f"b{i}", {"x": np.full(2, i)}, None, 0) for i in range(3)))
        client.close()
        server.close()
        return alone, later, seen_before_burst, burst, seen

    alone, later, before, burst, seen = _run(main())
    assert alone[1] == "now" and later[1] == "handler"
    np.testing.assert_array_equal(alone[0]["x"], np.arange(4))
    assert before == [("now", "alone"), ("now", "later"), ("handler", "later"), ("now", "bad")]
    assert [b[1] for b in burst] == ["handler", "handler", "now"]
    assert [int(b[0]["x"][0]) for b in burst] == [0, 1, 2]
    assert sorted(seen) == [("handler", "b0"), ("handler", "b1"), ("now", "b2")]


def test_a_frame_left_in_the_backlog_keeps_its_bytes_when_the_sender_reuses_the_buffer():
    # What the kernel does not take waits in the backlog; a view of a buffer that its
    # owner reuses at once (an engine's output, [Note: answered at once]) must not change it.
    async def main():
        a, b = socket.socketpair()
        sender, receiver = _Connection(a, views_until_freed=True), _Connection(b, views_until_freed=True)
        buffer = np.full(3 << 20, 7.0, np.float32)  # 12 MiB: more than the socket buffers hold
        sender.send({"y": buffer})
        assert sender._backlog  # the case under test
        buffer[:] = -1.0  # reused before the backlog drains
        frame = asyncio.get_running_loop().create_future()
        receiver.read_frames(lambda obj, held: frame.set_result(obj), frame.set_exception)
        got = await frame
        sender.close()
        receiver.close()
        return got

    got = _run(main())
    assert got["y"].shape == (3 << 20,) and bool((got["y"] == 7.0).all())


def test_frames_are_read_whatever_pieces_the_socket_delivers_them_in():
    # [Note: frames in the reader]: the reader is a state machine over the socket's
    # reads, so a frame may arrive a byte at a time, and several may arrive at once.
    from workers._transport.framing import encode_frame

    frames = [(0, {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}),
              (1, {"empty": np.zeros((0, 4), np.int8), "s": "text"}),
              (2, {"big": np.full(70_000, 3, np.uint16)})]  # a buffer of its own in the frame
    wire = b"".join(bytes(memoryview(p).cast("B")) for f in frames for p in encode_frame(f))

    async def main(pieces: list[bytes]):
        a, b = socket.socketpair()
        receiver = _Connection(b, views_until_freed=True)
        got, lost = [], asyncio.get_running_loop().create_future()
        receiver.read_frames(lambda obj, held: got.append((obj, held)), lost.set_result)
        for piece in pieces:
            a.sendall(piece)
            await asyncio.sleep(0)  # let the reader see each piece on its own
        a.close()
        why = await lost
        receiver.close()
        return got, why

    for pieces in ([wire[i:i + 1] for i in range(0, 300)] + [wire[300:]],  # dribbled, then the rest
                   [wire]):  # all three frames in one write
        got, why = _run(main(pieces))
        assert isinstance(why, ConnectionResetError)
        assert [g[0][0] for g in got] == [0, 1, 2] and all(held == [] for _, held in got)
        np.testing.assert_array_equal(got[0][0][1]["x"], frames[0][1]["x"])
        assert got[1][0][1]["empty"].shape == (0, 4) and got[1][0][1]["s"] == "text"
        np.testing.assert_array_equal(got[2][0][1]["big"], frames[2][1]["big"])


def test_garbage_on_the_socket_closes_only_that_connection():
    async def main():
        server = await open_channel_server(_echo)
        good = await ChannelClient.connect(server.path, server.token)
        loop = asyncio.get_running_loop()
        head = struct.Struct("<IIII").pack
        request = marshal.dumps((0, "m@1@c", ((("x",), ("<f4",), ((2, 2),)),), [None], [0]))  # one array of 16 B
        for garbage in (b"N" + head(5, 0, 0, 0) + b"hello",  # not a pickle
                        b"N" + head(5, 0, 0, 1) + b"hello",  # not a tensor request
                        b"N" + head(len(request), 0, 0, 1) + request,  # its array missing
                        b"N" + head(len(request), 1, 0, 1) + struct.pack("<QQ", 12, 2**64 - 1) + request
                        + b"\x00" * 12,  # 12 bytes for a float32[2,2]
                        b"N" + head(1, 0, 0, 7),  # no such codec
                        b"N" + head(2, 1, 0, 0) + struct.pack("<QQ", 8, 2**64 - 1) + b"\x00" * 8,  # too short
                        b"N" + b"\xff" * 16,  # 4 GiB of metadata declared: refused before allocating
                        b"N" + head(1, 1, 0, 0) + struct.pack("<QQ", 2**64 - 2, 2**64 - 1),  # an 18 EB buffer
                        b"N" + head(1, 1, 0, 0) + struct.pack("<QQ", 64, 0),  # in an arena never shared
                        b"N" + head(1, 0, 1, 0) + struct.pack("<Q", 0),  # releases what was never lent
                        b"X"):  # not an arena handshake
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            raw.setblocking(False)
            await loop.sock_connect(raw, server.path)
            await loop.sock_sendall(raw, server.token + garbage + b"\x00" * 64)
            got = b""
            try:  # the worker hangs up: end of stream, or a reset when our bytes were left unread
                while chunk := await asyncio.wait_for(loop.sock_recv(raw, 16), 10):
                    got += chunk
            except ConnectionResetError:
                pass
            assert got in (b"", b"N")  # at most its half of the handshake ("no arena"), then nothing
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
            return []  # an answer of no results: a tensor frame

        server = await open_channel_server(handler, tcp_host="127.0.0.1" if over == "tcp" else None)
        assert len(server.token) == 32
        address = server.path if over == "unix" else server.tcp_address
        with pytest.raises(ChannelClosedError):
            client = await ChannelClient.connect(address, bytes(32))
            await client.call("k", [{"x": np.ones(1)}], [None], [0])
        assert seen == []  # nothing reached the worker
        good = await ChannelClient.connect(address, server.token)
        await good.call("k", [], [], [])  # a pool's request (of none): a tensor frame, over TCP too
        assert seen == [("k", [], [], [])]
        server.close()

    _run(main())


def test_a_connection_without_the_token_is_closed_before_any_frame_is_read():
    refuses_a_wrong_token("unix")


# -- shared arenas (see [Note: channel arena] in workers/_transport/arena.py) ------------------------


def test_arena_lends_first_fit_merges_what_comes_back_and_refuses_strangers():
    arena = Arena(size_bytes=1 << 20)
    try:
        a = arena.put(memoryview(bytes(300 << 10)))
        b = arena.put(memoryview(b"\x01" * (300 << 10)))
        c = arena.put(memoryview(bytes(300 << 10)))
        assert (a, b) == (0, 300 << 10) and c == 600 << 10
        assert arena.put(memoryview(bytes(300 << 10))) is None and arena.fallbacks == 1  # full: in the frame
        arena.release(b)
        assert arena.put(memoryview(bytes(400 << 10))) is None  # the hole is 300 KiB
        arena.release(a)
        assert arena.put(memoryview(bytes(600 << 10))) == 0  # a and b merged into one region
        arena.release(0)
        arena.release(c)
        assert arena.lent_bytes == 0 and arena.put(memoryview(bytes(1 << 20))) == 0  # all of it, whole again
        with pytest.raises(ValueError, match="not lent"):
            arena.release(12345)
    finally:
        arena.close()


def test_a_pinned_region_goes_in_place_and_stays_lent_until_unpinned():
    # [Note: inputs kept in the arena]
    arena = Arena(size_bytes=1 << 20)
    try:
        assert arena.pin_array((ARENA_MIN_BYTES - 1,), np.uint8) is None  # small arrays go in the frame anyway
        region = arena.pin_array((256 << 10,), np.uint8)
        x = region.view(np.float32)
        x[:] = 3.0
        offset = arena.put(memoryview(x).cast("B"))
        assert offset == 0 and arena.put(memoryview(x).cast("B")) == 0  # as often as it is sent
        assert arena.lent_bytes == 256 << 10  # no copy was lent beside it
        arena.release(offset)  # the peer hands it back: still the caller's
        assert arena.lent_bytes == 256 << 10 and arena.pinned_bytes == 256 << 10
        assert arena.put(memoryview(x[1:]).cast("B")) == 256 << 10  # not its start: copied
        arena.release(256 << 10)
        arena.unpin(region)
        assert arena.lent_bytes == 0 and arena.pinned_bytes == 0
        with pytest.raises(ValueError, match="not a region"):
            arena.unpin(region)
    finally:
        arena.close()


def test_inputs_written_in_a_pinned_region_reach_the_worker_without_a_copy():
    # [Note: inputs kept in the arena], through the channel.
    async def main():
        async def doubled(key, inputs, *_):
            return {k: v * 2 for k, v in inputs.items()}, None

        server = await open_channel_server(doubled)
        client = await ChannelClient.connect(server.path, server.token)
        region = client.pin_array((1 << 20,), np.uint8)
        x = region.view(np.float32)
        allocated = []
        real = client._conn.arena._allocate
        client._conn.arena._allocate = lambda n: allocated.append(n) or real(n)
        for i in range(3):  # new values each time, in the same place
            x[:] = i
            out, _ = await client.call("double", {"x": x}, None, 0)
            np.testing.assert_array_equal(out["x"], np.full(1 << 18, 2.0 * i, np.float32))
        assert allocated == [] and client.arena_lent_bytes == 1 << 20
        client.unpin(region)
        assert client.arena_lent_bytes == 0
        out, _ = await client.call("double", {"x": np.ones(1 << 18, np.float32)}, None, 0)
        assert allocated == [1 << 20]  # an array of its own is copied, as before
        client.close()
        server.close()

    _run(main())


def test_an_idle_arena_gives_back_what_a_burst_took():
    arena = Arena(size_bytes=128 << 20)
    try:
        burst = [arena.put(memoryview(np.full(1 << 20, i, np.float64)).cast("B")) for i in range(8)]  # 64 MiB
        assert None not in burst and arena.resident_bytes >= 64 << 20
        for offset in burst[:-1]:
            arena.release(offset)
        assert arena.resident_bytes >= 64 << 20  # one region still lent: nothing given back yet
        arena.release(burst[-1])
        assert arena.resident_bytes <= ARENA_KEEP_BYTES
        again = arena.put(memoryview(np.full(1 << 20, 7.0)).cast("B"))
        assert again == 0 and arena.resident_bytes >= 8 << 20  # reused from the bottom
    finally:
        arena.close()


def test_large_arrays_go_through_the_arenas_and_every_region_comes_back():
    async def main():
        gate = asyncio.Event()
        lent_during_call = []

        async def handler(key, inputs, *_):
            if key == "hold":
                await gate.wait()
            return {k: v * 2 for k, v in inputs.items()}, None

        server = await open_channel_server(handler)
        client = await ChannelClient.connect(server.path, server.token)
        x = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: placed in the client's arena
        call = asyncio.ensure_future(client.call("hold", {"x": x, "small": np.ones(3)}, None, 0))
        await asyncio.sleep(0.05)
        lent_during_call.append(client.arena_lent_bytes)
        gate.set()
        first, _ = await call
        assert lent_during_call == [x.nbytes]  # only the large array went into the arena
        assert client.arena_lent_bytes == 0  # the worker handed it back with its answer
        assert server.arena_lent_bytes == x.nbytes  # the answer's array reads the worker's region in place
        np.testing.assert_array_equal(first["x"], x * 2)
        assert first["x"].flags.writeable
        # Later answers take other regions while the caller holds the first one's arrays,
        # and a freed answer's region goes back with the next frame.
        for i in range(3):
            out, _ = await client.call("ok", {"x": np.full(1 << 18, i, np.float32)}, None, 0)
            np.testing.assert_array_equal(out["x"], np.full(1 << 18, 2 * i, np.float32))
            # The first answer's, this one's and, from the second on, the last one's (freed
            # when `out` was rebound, after this call's frame had left).
            assert server.arena_lent_bytes == (2 if i == 0 else 3) * x.nbytes
        np.testing.assert_array_equal(first["x"], x * 2)
        part = first["x"][:8]  # a view of a view still holds the region
        del first, out, call  # the future holds its result too
        await asyncio.sleep(0)  # and the loop holds that future until its current iteration ends
        await client.call("ok", {"small": np.ones(3)}, None, 0)
        assert server.arena_lent_bytes == x.nbytes
        np.testing.assert_array_equal(part, (x * 2)[:8])
        del part
        await asyncio.sleep(0)
        await client.call("ok", {"small": np.ones(3)}, None, 0)
        assert client.arena_lent_bytes == 0 and server.arena_lent_bytes == 0
        # Many in flight, answered out of order: every answer matches its request.
        outs = await asyncio.gather(*(client.call("ok", {"x": np.full(1 << 16, i, np.float32)}, None, 0)
                                      for i in range(24)))
        assert [float(o[0]["x"][-1]) for o in outs] == [2.0 * i for i in range(24)]
        client.close()
        server.close()

    _run(main())


def _echo_one_mib(**connect_kwargs) -> tuple:
    """Echoes 1 MiB on a fresh server and client; returns what the client's connection
    shares (its arena, the worker's) and the bytes the worker's arenas still lend."""
    async def main():
        server = await open_channel_server(_echo)
        client = await ChannelClient.connect(server.path, server.token, **connect_kwargs)
        try:
            x = np.arange(1 << 18, dtype=np.float32)
            out, _ = await client.call("ok", {"x": x}, None, 0)
            np.testing.assert_array_equal(out["x"], x)
            return client._conn.arena, client._conn.peer, server.arena_lent_bytes
        finally:
            client.close()
            server.close()

    return _run(main())


def test_a_caller_that_declines_shared_memory_sends_every_byte_through_the_socket():
    assert _echo_one_mib(shared_memory=False) == (None, None, 0)  # neither end shared one


def test_an_arena_the_worker_cannot_map_is_not_used(monkeypatch):
    import workers._transport.connection as channel

    def refuse(fd):
        os.close(fd)
        raise OSError("mmap refused")

    monkeypatch.setattr(channel, "PeerArena", refuse)
    assert _echo_one_mib() == (None, None, 0)  # both ends fell back to the socket


def test_a_sandbox_without_memfd_serves_through_the_socket(monkeypatch):
    import workers._transport.connection as channel

    def no_memfd():
        raise PermissionError("memfd_create: operation not permitted")

    monkeypatch.setattr(channel, "Arena", no_memfd)
    assert _echo_one_mib() == (None, None, 0)


def test_a_full_arena_sends_in_the_frame(monkeypatch):
    import workers._transport.connection as channel

    monkeypatch.setattr(channel, "Arena", lambda: Arena(size_bytes=1 << 20))  # room for two 512 KiB arrays

    async def main():
        gate = asyncio.Event()

        async def handler(key, inputs, *_):
            await gate.wait()
            return dict(inputs), None

        server = await open_channel_server(handler)
        client = await ChannelClient.connect(server.path, server.token)
        calls = [asyncio.ensure_future(client.call("k", {"x": np.full(1 << 17, i, np.float32)}, None, 0))
                 for i in range(5)]
        await asyncio.sleep(0.05)
        assert client.arena_lent_bytes == 1 << 20
        gate.set()
        outs = await asyncio.gather(*calls)
        assert [float(o[0]["x"][0]) for o in outs] == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert client.arena_fallbacks == 3 and client.arena_lent_bytes == 0
        client.close()
        server.close()

    _run(main())


def test_frames_that_point_outside_the_shared_arena_close_only_that_connection():
    async def main():
        server = await open_channel_server(_echo)
        good = await ChannelClient.connect(server.path, server.token)
        head = struct.Struct("<IIII").pack
        for garbage in (head(1, 1, 0, 0) + struct.pack("<QQ", 1 << 20, 64 << 10),  # past the arena's end
                        head(1, 1, 0, 0) + struct.pack("<QQ", 64, 3),  # not where a region starts
                        head(0, 0, 1, 0) + struct.pack("<Q", 0)):  # hands back a region never lent
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            arena = Arena(size_bytes=1 << 20)
            try:
                # Blocking calls on a thread: the worker answers on this loop.
                raw.settimeout(10)
                await asyncio.to_thread(raw.connect, server.path)
                await asyncio.to_thread(raw.sendall, server.token)
                await asyncio.to_thread(socket.send_fds, raw, [b"A"], [arena.fd])
                marker, fds, _, _ = await asyncio.to_thread(socket.recv_fds, raw, 1, 1)
                assert marker == b"A" and len(fds) == 1  # the worker shared its arena back
                os.close(fds[0])
                await asyncio.to_thread(raw.sendall, garbage + b"\x00" * 64)
                try:
                    assert await asyncio.to_thread(raw.recv, 16) == b""
                except ConnectionResetError:
                    pass
            finally:
                raw.close()
                arena.close()
        out, _ = await good.call("ok", {"x": np.arange(1 << 16)}, None, 0)
        np.testing.assert_array_equal(out["x"], np.arange(1 << 16))
        server.close()

    _run(main())


def test_arrays_of_every_kind_decode_as_they_were_sent():
    # [Note: lean array pickling]: plain dtypes travel as a dtype string and a shape;
    # the others take NumPy's own reduction and must come back alike.
    rng = np.random.default_rng(1)
    arrays = {
        "f32": rng.standard_normal((2, 3)).astype(np.float32),
        "f16": np.arange(6, dtype=np.float16).reshape(3, 2),
        "bool": np.array([True, False, True]),
        "u8": np.arange(250, dtype=np.uint8),
        "c64": np.array([1 + 2j], np.complex64),
        "scalar": np.array(3.5),
        "empty": np.zeros((0, 4), np.int32),
        "swapped": np.arange(4, dtype=">i4"),
        "fortran": np.asfortranarray(rng.standard_normal((3, 4))),
        "strided": np.arange(20)[::3],
        "structured": np.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")]),
        "datetime": np.array(["2026-11-22"], dtype="datetime64[D]"),
        "objects": np.array([{"k": 1}, None], dtype=object),
        "large": rng.standard_normal(1 << 16).astype(np.float32),  # 256 KiB: through the arena
    }

    async def main():
        a, b = socket.socketpair()
        sender, receiver = _Connection(a, views_until_freed=True), _Connection(b, views_until_freed=True)
        frame = asyncio.get_running_loop().create_future()
        receiver.read_frames(lambda obj, held: frame.set_result(obj), frame.set_exception)
        sender.send((7, arrays))
        got = await frame
        sender.close()
        receiver.close()
        return got

    request_id, got = _run(main())
    assert request_id == 7 and set(got) == set(arrays)
    for name, sent in arrays.items():
        assert got[name].dtype == sent.dtype and got[name].shape == sent.shape, name
        if sent.dtype.hasobject:
            assert got[name].tolist() == sent.tolist()
        else:
            np.testing.assert_array_equal(got[name], sent, err_msg=name)


def test_a_region_placed_and_written_goes_in_a_frame_without_a_copy():
    arena = Arena(size_bytes=1 << 20)
    try:
        assert arena.place(np.empty(25, np.float32)) is None  # small buffers travel in the frame
        first, _ = arena.place(np.empty((256, 256), np.float32))
        other, _ = arena.place(np.empty(128 << 10, np.uint8))
        assert arena.lent_bytes == 384 << 10
        first[:] = 9
        # The usual frame finds it by where it lies (put), a lone frame by identity (take).
        assert arena.put(memoryview(first).cast("B")) == 0  # its own region, not a new one
        assert arena.fallbacks == 0
        # Data elsewhere is copied into a new region, as before.
        copied = arena.put(memoryview(np.ones(64 << 10, np.uint8)))
        assert copied not in (None, 0)
        assert arena.place(np.empty(1 << 20, np.uint8)) is None and arena.fallbacks == 0  # no room, not counted
        arena.unreserve()  # `other` was never sent: free again
        assert arena.lent_bytes == (256 << 10) + (64 << 10)
        arena.release(0)
        arena.release(copied)
        assert arena.lent_bytes == 0
        assert arena.put(memoryview(np.zeros(1 << 20, np.uint8))) == 0  # whole again
    finally:
        arena.close()


def test_a_now_handler_writes_its_answer_where_the_arena_placed_it():
    # [Note: outputs placed] in workers/engine.py, through the channel.
    placed: list[np.ndarray] = []

    def now(key, inputs, deadline_unix_ms, priority, place=None):
        assert place is not None  # a Unix socket with shared arenas
        spot = place(inputs["x"])
        if spot is None:  # too small for the arena: an answer of its own
            return {"y": inputs["x"] * 3}, None
        out, at = spot
        assert out.shape == inputs["x"].shape and out.dtype == inputs["x"].dtype and at == out.ctypes.data
        spare = place(np.empty(64 << 10, np.uint8))  # reserved and never sent: freed after the answer
        assert spare is not None
        np.multiply(inputs["x"], 3, out=out)
        placed.append(out)
        if key == "fail":
            raise InputError("input 'x' of fail is wrong", model=key, input_name="x")
        return {"y": out}, None

    async def handler(key, inputs, deadline_unix_ms, priority):
        raise AssertionError("a lone request goes to the now handler")

    async def main():
        server = await open_channel_server(handler, now=now)
        client = await ChannelClient.connect(server.path, server.token)
        x = np.arange(1 << 18, dtype=np.float32)
        out, _ = await client.call("ok", {"x": x}, None, 0)
        np.testing.assert_array_equal(out["y"], x * 3)
        placed[0][5] = -1.0  # the caller reads the very memory the handler wrote: no copy
        assert out["y"][5] == -1.0
        lent_with_answer = server.arena_lent_bytes
        fallbacks = server._connections.copy().pop().arena.fallbacks
        with pytest.raises(InputError, match="is wrong"):
            await client.call("fail", {"x": x}, None, 0)
        del out
        await asyncio.sleep(0)
        small, _ = await client.call("ok", {"x": np.ones(4, np.float32)}, None, 0)
        np.testing.assert_array_equal(small["y"], np.full(4, 3, np.float32))
        lent_after = server.arena_lent_bytes
        client.close()
        server.close()
        return lent_with_answer, fallbacks, lent_after

    lent_with_answer, fallbacks, lent_after = _run(main())
    assert lent_with_answer == 1 << 20  # only the answer's region: the spare went back
    assert fallbacks == 0
    assert lent_after == 0  # the failed call's regions too, and the freed answer's
    assert len(placed) == 2
    placed.clear()


def test_requests_and_answers_of_plain_arrays_go_as_tensor_frames_and_the_rest_pickled():
    # [Note: tensor frames]
    from workers._pool import RequestTiming

    class Outputs(dict):
        pass

    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    timing = RequestTiming(0.001, 0.01, 2, True)
    engine_outputs = Outputs({"y": x * 2, "ids": np.arange(3, dtype=np.int64)})
    frames = {
        "request": ((1, ("m@1@c", [{"x": x, "ids": np.arange(3)}, {"x": x[:1]}], [None, 12.5], [0, 1])), 1),
        "answer": ((2, True, [({"y": x * 2}, timing), ({"y": np.zeros((0, 4), np.float16)}, None)]), 2),
        "an engine's outputs (a dict's subclass)": ((2, True, [(engine_outputs, RequestTiming(0.5, 0.25, 1, True))]),
                                                    2),
        "an answer without timing": ((3, True, [(engine_outputs, None)]), 2),
        "an error in the answer": ((3, True, [({"y": x}, None), InputError("bad", model="m")]), 0),
        "a failed call": ((4, False, InputError("bad", model="m")), 0),
        "a numpy integer priority": ((5, ("m@1@c", [{"x": x}], [None], [np.int64(1)])), 0),
        "a numpy float deadline": ((5, ("m@1@c", [{"x": x}], [np.float64(2.5)], [0])), 0),
        "a name that is not a string": ((5, True, [({7: x}, None)]), 0),
        "a strided array": ((6, ("m@1@c", [{"x": x[:, ::2]}], [None], [0])), 0),
        "an object array": ((7, True, [({"y": np.array([None])}, None)]), 0),
        "not a pool's request": ((8, ("echo", x, None, 0)), 0),
    }

    async def main():
        a, b = socket.socketpair()
        sender, receiver = _Connection(a, views_until_freed=True), _Connection(b, views_until_freed=True)
        got = []
        done = asyncio.get_running_loop().create_future()

        def on_frame(obj, held):
            got.append(obj)
            if len(got) == len(frames):
                done.set_result(None)

        receiver.read_frames(on_frame, done.set_exception)
        for obj, _ in frames.values():
            sender.send(obj)
        await done
        sender.close()
        receiver.close()
        return got

    for (name, (obj, codec)), got in zip(frames.items(), _run(main())):
        assert struct.unpack("<IIII", encode_frame(obj)[0][:16])[3] == codec, name
        _assert_same(got, obj, name)


def _read_one(frame: bytes):
    """What a caller's end makes of ``frame``: the decoded frame, or why it gave up."""
    async def main():
        a, b = socket.socketpair()
        sender, receiver = _Connection(a, views_until_freed=True), _Connection(b, views_until_freed=True)
        done = asyncio.get_running_loop().create_future()
        receiver.read_frames(lambda obj, held: done.done() or done.set_result(obj),
                             lambda e: done.done() or done.set_result(e))
        sender.sock.sendall(frame)
        try:
            return await done
        finally:
            sender.close()
            receiver.close()

    return _run(main())


def _answer_frame(items: list, buffers: list[bytes]) -> bytes:
    """An answer frame of ``items``, each (names, dtype strings, shapes, timing), with
    ``buffers`` in the frame ([Note: tensor frames])."""
    meta = marshal.dumps((7, tuple(item[:3] for item in items), [item[3] for item in items]))
    places = b"".join(struct.pack("<QQ", len(x), (1 << 64) - 1) for x in buffers)
    return struct.pack("<IIII", len(meta), len(buffers), 0, 2) + places + meta + b"".join(buffers)


def test_a_tensor_frame_whose_metadata_does_not_match_its_buffers_is_refused():
    # [Note: tensor frames]: a garbled frame closes the connection (the reader's
    # on_lost), never builds arrays from the wrong bytes.
    two = [(("y", "z"), ("<f4", "<f4"), ((2,), (2,)), None)]
    got = _read_one(_answer_frame(two, [bytes(8), bytes(8)]))
    assert got[0] == 7 and list(got[2][0][0]) == ["y", "z"] and got[2][0][0]["z"].shape == (2,)
    for items, buffers, message in [
        (two, [bytes(8)], "do not match"),  # fewer buffers than arrays
        (two, [bytes(8)] * 3, "do not match"),  # more
        ([(("y",), ("<f4",), ((3,),), None)], [bytes(8)], "match"),  # 8 bytes are not 3 float32s
        ([(("y", "z"), ("<f4",), ((2,), (2,)), None)], [bytes(8)] * 2, "differ in number"),
        ([(("y",), ("nonsense",), ((2,),), None)], [bytes(8)], ""),  # numpy's TypeError
        ([(("y",), ("O",), ((1,),), None)], [bytes(8)], "declares 'y' as 'O'"),  # pointers: never
        ([(("y",), ("<f4",), ((-2,),), None)], [bytes(8)], "declares 'y'"),
        ([(("y",), ("<f4",), ((2,),), (1.0, 2.0))], [bytes(8)], "no RequestTiming"),
    ]:
        got = _read_one(_answer_frame(items, buffers))
        assert isinstance(got, (ValueError, TypeError)) and message in str(got), (items, got)


def _assert_same(got, want, where: str) -> None:
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape, where
        assert got.tolist() == want.tolist(), where
    elif isinstance(want, BaseException):
        assert type(got) is type(want) and str(got) == str(want), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            _assert_same(got[k], want[k], where)
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for g, w in zip(got, want):
            _assert_same(g, w, where)
    else:
        assert got == want and type(got) is type(want), where


def test_a_reader_knows_whether_more_waits_behind_a_frame():
    # [Note: reading ahead]: frames read together, or still in the socket behind a
    # large buffer that was read straight into its own memory.
    async def main():
        a, b = socket.socketpair()
        sender, receiver = _Connection(a, views_until_freed=True), _Connection(b, views_until_freed=True)
        seen: list[tuple[int, bool]] = []
        done = asyncio.Event()

        def on_frame(obj, held):
            seen.append((obj[0], receiver.more_waiting))
            if obj[0] in (1, 3, 5):
                done.set()

        receiver.read_frames(on_frame, lambda e: done.set())
        sender.send((0, {"x": np.arange(3)}))
        sender.send((1, {"x": np.arange(3)}))  # both in the socket before the reader runs
        await done.wait()
        done.clear()
        sender.send((2, {"x": np.arange(3)}))  # alone
        await asyncio.sleep(0.05)
        sender.send((3, {"x": np.arange(3)}))
        await done.wait()
        done.clear()
        # 160 KiB in the frame (no arenas here): its last 96 KiB are read straight into
        # its buffer, so only the kernel knows that frame 5 waits behind it. Both fit
        # in the socket's buffer, so both are sent before the reader runs.
        big = np.ones(40 << 10, np.float32)
        sender.send((4, {"x": big}))
        sender.send((5, {"x": np.arange(3)}))
        assert not sender._backlog
        await done.wait()
        sender.close()
        receiver.close()
        return seen

    seen = _run(main())
    assert seen[:4] == [(0, True), (1, False), (2, False), (3, False)]
    assert seen[4:] == [(4, True), (5, False)]


class _CountingSocket:
    """A socket whose reads into a buffer are counted (socket objects take no new attributes)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.reads = 0

    def recv_into(self, *args):
        self.reads += 1
        return self._sock.recv_into(*args)

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


def test_a_reader_that_emptied_the_socket_does_not_read_again_and_misses_nothing_that_comes_later():
    # [Note: no read that would block]: once a short read has emptied the socket and its
    # frames are handed on, the reader returns without the read that would raise
    # BlockingIOError; frames sent later are read when the loop calls it again.
    async def main():
        a, b = socket.socketpair()
        sender, receiver = _Connection(a, views_until_freed=True), _Connection(b, views_until_freed=True)
        counting = receiver.sock = _CountingSocket(receiver.sock)
        got: asyncio.Queue = asyncio.Queue()
        receiver.read_frames(lambda obj, held: got.put_nowait(obj), lambda e: got.put_nowait(e))
        reads = []
        for i in range(3):
            sender.send((i, {"x": np.arange(3) + i}))
            obj = await asyncio.wait_for(got.get(), 10)
            assert obj[0] == i
            np.testing.assert_array_equal(obj[1]["x"], np.arange(3) + i)
            await asyncio.sleep(0.01)  # the loop goes back to waiting on the socket
            reads.append(counting.reads)
        sender.send((3, {"x": np.arange(3)}))
        sender.send((4, {"x": np.arange(3)}))  # two at once: one read takes both
        assert [(await asyncio.wait_for(got.get(), 10))[0] for _ in range(2)] == [3, 4]
        await asyncio.sleep(0.01)
        reads.append(counting.reads)
        sender.close()
        why = await asyncio.wait_for(got.get(), 10)
        receiver.close()
        return reads, why

    reads, why = _run(main())
    assert reads == [1, 2, 3, 4], f"reads after each frame: {reads} (one read per wake-up, none that would block)"
    assert isinstance(why, ConnectionResetError)


def test_an_end_without_pickle_refuses_a_pickle_frame_at_its_head_and_sends_none():
    # [Note: no pickle over TCP]: an end with pickle_ok=False (TCP without opt-in) never
    # unpickles a frame, and never sends one; tensor frames pass both ways.
    from workers._transport import ChannelRefusedError
    from workers._transport.framing import decode_refusal, refusal_frame

    async def main():
        a, b = socket.socketpair()
        sender = _Connection(a, views_until_freed=True)  # may send pickle
        strict = _Connection(b, views_until_freed=False, pickle_ok=False)
        frames, lost = [], asyncio.get_running_loop().create_future()
        strict.read_frames(lambda obj, held: frames.append(obj), lost.set_result)
        sender.send((0, ("k", [{"x": np.ones(2, np.float32)}], [None], [0])))  # a tensor frame
        sender.send((1, ("k", np.float32(1.0))))  # only pickle carries a numpy scalar
        why = await lost
        with pytest.raises(ChannelRefusedError, match=r"the answer to request 1 .*tcp_pickle=True"):
            strict.send((1, False, ValueError("an error's answer needs pickle")))
        sender.close()
        strict.close()
        return frames, why

    frames, why = _run(main())
    assert [f[0] for f in frames] == [0]  # the tensor frame was read; the pickle frame was not
    assert isinstance(why, ChannelRefusedError) and "never unpickled" in str(why)
    refusal = decode_refusal(memoryview(refusal_frame(7, "why")[16:]))
    assert refusal.request_id == 7 and str(refusal) == "why"
