"""Lone frames and arrays made once on the direct channel ([Note: lone frames] in
workers/_transport/framing.py, [Note: arrays made once] in workers/_transport/arena.py): both ends in one
process over a real Unix-domain socket pair with real shared arenas; no Ray."""

from __future__ import annotations

import asyncio
import socket
import struct

import numpy as np
import pytest

import workers._transport.connection as channel
from workers._transport.arena import ARENA_MIN_BYTES, Arena
from workers._transport.connection import _Connection
from workers._transport.framing import _LONE_ANSWER, _LONE_REQUEST, _LONE_REQUEST_HEAD, _lone_frame, _route_frame
from workers._pool import RequestTiming
from workers.engine import Outputs, PlacedInputs


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _pair(*, share: bool = True) -> tuple[_Connection, _Connection]:
    """A caller's end and a worker's end, their arenas shared as ChannelClient.connect
    and the server's handshake share them."""
    a, b = socket.socketpair()
    caller, worker = _Connection(a, views_until_freed=True), _Connection(b, views_until_freed=False)
    await asyncio.gather(caller.share_arenas(offer=True, share=share), worker.share_arenas(offer=False))
    return caller, worker


class _Inbox:
    """A connection's frames as they arrive."""

    def __init__(self, conn: _Connection) -> None:
        self.frames: asyncio.Queue = asyncio.Queue()
        self.lost: list[BaseException] = []
        conn.read_frames(lambda obj, held: self.frames.put_nowait((obj, held)), self._lost)

    def _lost(self, e: BaseException) -> None:
        self.lost.append(e)
        self.frames.put_nowait(None)

    async def next(self):
        return await asyncio.wait_for(self.frames.get(), 10)


def _counting(monkeypatch) -> dict[str, int]:
    """Counts route declarations and lone frames decoded, on either end."""
    seen = {"routes": 0, "lone": 0}
    declare, decode = _Connection._declare, _Connection._decode_lone

    def counted_declare(self, meta):
        seen["routes"] += 1
        return declare(self, meta)

    def counted_decode(self, codec, meta):
        seen["lone"] += 1
        return decode(self, codec, meta)

    monkeypatch.setattr(_Connection, "_declare", counted_declare)
    monkeypatch.setattr(_Connection, "_decode_lone", counted_decode)
    return seen


def _outputs(arrays: dict[str, np.ndarray]) -> Outputs:
    out = Outputs(arrays)
    out.described = (tuple(arrays), tuple(a.dtype.str for a in arrays.values()),
                     tuple(a.shape for a in arrays.values()))
    return out


def test_requests_and_answers_of_one_go_as_lone_frames_by_route(monkeypatch):
    seen = _counting(monkeypatch)

    async def main():
        caller, worker = await _pair()
        to_worker, to_caller = _Inbox(worker), _Inbox(caller)
        kept = caller.arena.pin_array((4, 1024), np.float32)  # 16 KiB is below the arena's minimum...
        assert kept is None
        kept = caller.arena.pin_array((16, 1024), np.float32)  # ...64 KiB is not
        kept[...] = np.arange(kept.size, dtype=np.float32).reshape(kept.shape)
        small = np.arange(3, dtype=np.int64)  # copied into the arena, small as it is

        caller.send((1, ("m@1@c", [{"x": kept, "k": small}], [None], [2])))
        (request_id, (key, [first], deadlines, priorities)), held = await to_worker.next()
        assert (request_id, key, deadlines, priorities) == (1, "m@1@c", [None], [2])
        assert seen == {"routes": 1, "lone": 1}
        assert type(first) is PlacedInputs and list(first) == ["x", "k"]
        np.testing.assert_array_equal(first["x"], kept)
        np.testing.assert_array_equal(first["k"], small)
        assert first.addresses == {name: a.ctypes.data for name, a in first.items()}
        assert len(held) == 2  # both regions go back with the answer

        caller.send((2, ("m@1@c", [{"x": kept, "k": small}], [3.5], [0])))
        (_, (_, [second], deadlines, _)), held2 = await to_worker.next()
        assert deadlines == [3.5] and seen == {"routes": 1, "lone": 2}  # the route is declared once
        assert second.route is first.route  # checked once by an engine ([Note: routes checked once])
        assert second["x"] is first["x"]  # the kept input's array, made once over its region
        assert held2[0] == held[0] and held2[1] != held[1]  # the kept region, a second copy

        # The answer: an engine's outputs placed in the worker's arena, sent as they lie.
        y, at = worker.arena.place(np.empty((16, 1024), np.float32))
        assert at == y.ctypes.data
        np.multiply(first["x"], 2, out=y)
        worker.hand_back(held + held2)
        worker.send((1, True, [(_outputs({"y": y}), RequestTiming(0.5, 0.25, 1, True))]))
        (answer_id, ok, [(out, timing)]), _ = await to_caller.next()
        assert (answer_id, ok, timing) == (1, True, RequestTiming(0.5, 0.25, 1, True))
        assert seen == {"routes": 2, "lone": 3}
        np.testing.assert_array_equal(out["y"], kept * 2)
        y[0, 0] = -1.0  # the caller reads the worker's memory: no copy on either side
        assert out["y"][0, 0] == -1.0
        assert caller.arena.lent_bytes == kept.nbytes  # the copies came back; the kept region stays
        lent = worker.arena.lent_bytes
        assert lent == y.nbytes

        # A view of the answer's array holds its region after the array itself is gone
        # (numpy makes a view's base the first array that owns its memory or lies over a
        # buffer, so the answer's arrays must be such arrays, not views of one kept made).
        part = out["y"][:2]
        del out
        caller.send((3, ("m@1@c", [{"x": kept, "k": small}], [None], [0])))
        await to_worker.next()
        assert worker.arena.lent_bytes == lent
        np.testing.assert_array_equal(part[0, 1:], kept[0, 1:] * 2)
        # Freed by the caller, the answer's region goes back with its next frame.
        del part
        caller.send((4, ("m@1@c", [{"x": kept, "k": small}], [None], [0])))
        await to_worker.next()
        assert worker.arena.lent_bytes == 0
        # An answer of a batch, or without an engine's description, goes the usual way.
        worker.send((3, True, [({"y": np.ones(3)}, RequestTiming(0.0, 0.1, 2, False))]))
        (_, _, [(out, timing)]), _ = await to_caller.next()
        assert timing.batch_size == 2 and seen["lone"] == 5
        assert not to_worker.lost and not to_caller.lost
        caller.close()
        worker.close()

    _run(main())


def test_what_does_not_fit_a_lone_frame_goes_the_usual_way(monkeypatch):
    seen = _counting(monkeypatch)
    x = np.arange(64 << 10, dtype=np.float32)

    async def main():
        caller, worker = await _pair()
        inbox = _Inbox(worker)
        for request in ((1, ("m", [{"x": x}, {"x": x}], [None, None], [0, 0])),  # two requests
                        (2, ("m", [{"x": x[::2]}], [None], [0])),  # not contiguous
                        (3, ("m", [{"x": x}], [np.float64(1.0)], [0])),  # not a float deadline
                        (4, ("m", [{"x": [1, 2]}], [None], [0]))):  # not an array
            caller.send(request)
            got, _ = await inbox.next()
            assert got[0] == request[0]
            for sent, came in zip(request[1][1], got[1][1]):
                np.testing.assert_array_equal(came["x"], sent["x"])
        assert seen == {"routes": 0, "lone": 0}
        # Over a socket without shared arenas (TCP, or shared memory off): no lone frames.
        plain_caller, plain_worker = await _pair(share=False)
        plain = _Inbox(plain_worker)
        plain_caller.send((5, ("m", [{"x": x}], [None], [0])))
        got, _ = await plain.next()
        np.testing.assert_array_equal(got[1][1][0]["x"], x)
        assert seen == {"routes": 0, "lone": 0}
        for conn in (caller, worker, plain_caller, plain_worker):
            conn.close()

    _run(main())


def test_a_full_arena_sends_a_request_of_one_in_the_frame_and_its_route_is_declared_later(monkeypatch):
    monkeypatch.setattr(channel, "Arena", lambda: Arena(size_bytes=1 << 20))
    seen = _counting(monkeypatch)

    async def main():
        caller, worker = await _pair()
        to_worker, to_caller = _Inbox(worker), _Inbox(caller)
        kept = caller.arena.pin_array((600 << 8,), np.float32)  # 600 KiB of the 1 MiB arena
        quarter = np.ones(64 << 10, np.float32)  # 256 KiB
        caller.send((1, ("m", [{"a": quarter, "b": quarter * 2}], [None], [0])))  # "b" does not fit
        (_, (_, [got], _, _)), held = await to_worker.next()
        np.testing.assert_array_equal(got["b"], quarter * 2)
        assert seen["lone"] == 0 and caller.arena.fallbacks == 1
        worker.hand_back(held)
        worker.send((1, True, [({"y": np.ones(1)}, None)]))
        await to_caller.next()
        caller.arena.unpin(kept)
        assert caller.arena.lent_bytes == 0
        # With room again, the same route goes lone, declared first: it was not declared
        # by the request that did not fit.
        caller.send((2, ("m", [{"a": quarter, "b": quarter * 2}], [None], [0])))
        (_, (_, [got], _, _)), _ = await to_worker.next()
        np.testing.assert_array_equal(got["b"], quarter * 2)
        assert seen == {"routes": 1, "lone": 1} and not to_worker.lost
        caller.close()
        worker.close()

    _run(main())


async def _send_raw_to_worker(*frames: bytes) -> BaseException | None:
    """Frames written straight to a worker's end that shares arenas; why it stopped reading."""
    caller, worker = await _pair()
    inbox = _Inbox(worker)
    caller.sock.sendall(b"".join(frames))
    got = await inbox.next()
    caller.close()
    worker.close()
    return inbox.lost[0] if got is None else None


_ROUTE = (("x",), ("<f4",), ((16, 1024),))


def _lone(route_id: int, *offsets: int, meta_tail: bytes = b"") -> bytes:
    layout = struct.Struct(_LONE_REQUEST_HEAD.format + "Q" * len(offsets))
    return _lone_frame(_LONE_REQUEST, layout.pack(route_id, 9, float("nan"), 0, *offsets) + meta_tail, [])


@pytest.mark.parametrize("frames, message", [
    ((_lone(0, 0),), "undeclared"),
    ((_route_frame(0, "m", _ROUTE), _lone(0, 0, 64)), "undeclared or other route"),  # one offset too many
    ((_route_frame(0, "m", _ROUTE), _lone(0, 1 << 40)), "outside"),
    ((_route_frame(0, "m", _ROUTE), _lone(0, 96)), "outside"),  # not where a region starts
    ((_route_frame(0, "m", (("x",), ("|O",), ((2,),))),), "declares"),  # objects: pointers, refused
    ((_route_frame(0, "m", (("x",), ("<f4",), ((-1,),))),), "declares"),
    ((_route_frame(0, "m", (("x",), ("nonsense",), ((2,),))),), "declares"),
    ((_route_frame(0, "m", (("x", "y"), ("<f4",), ((2,),))),), "malformed"),
    ((_route_frame(1 << 20, "m", _ROUTE),), "malformed"),
    ((_route_frame(0, None, _ROUTE), _lone(0, 0)), "undeclared or other route"),  # an answer's route
    ((_lone_frame(_LONE_ANSWER, b"\x00" * 3, []),), "undeclared"),
    # Outputs to write in place ([Note: outputs written in place]): over an input, or
    # over one another, or declared for an answer.
    ((_route_frame(0, "m", _ROUTE, (("y",), ("<f4",), ((16, 1024),))), _lone(0, 0, 0)), "overlaps"),
    ((_route_frame(0, "m", _ROUTE, (("y",), ("<f4",), ((16, 1024),))), _lone(0, 0, (64 << 10) - 64)), "overlaps"),
    ((_route_frame(0, "m", _ROUTE, (("y",), ("<f4",), ((16, 1024),))), _lone(0, 0, 1 << 40)), "outside"),
    ((_route_frame(0, "m", _ROUTE, (("y", "z"), ("<f4", "<f4"), ((16, 1024), (16, 1024)))),
      _lone(0, 0, 64 << 10, (96 << 10))), "overlaps"),  # two outputs over one another
    ((_route_frame(0, None, _ROUTE, (("y",), ("<f4",), ((16, 1024),))),), "malformed"),
    ((_route_frame(0, "m", _ROUTE, (("y",), ("<f4",))),), "malformed"),
])
def test_garbled_lone_frames_and_routes_end_only_their_connection(frames, message):
    why = _run(_send_raw_to_worker(*frames))
    assert isinstance(why, ValueError) and message in str(why)


def test_a_prepared_frame_goes_to_its_serve_until_it_declines_or_its_route_is_declared_again():
    # [Note: prepared requests]; the serves here record what they are given (the
    # worker's, SegmentHost.prepare, is tested in tests/integration/test_prepared.py).
    import math

    out_route = (("y",), ("<f4",), ((16, 1024),))
    frame = _lone(0, 0, 64 << 10)

    async def main():
        caller, worker = await _pair()
        worker.prepared = {}
        inbox = _Inbox(worker)
        caller.sock.sendall(_route_frame(0, "m", _ROUTE, out_route) + frame)
        (_, (key, [inputs], _, _)), _ = await inbox.next()
        assert key == "m" and inputs.frame_key == struct.pack("<qQQ", 0, 0, 64 << 10)  # route, offsets
        served, failed, answers = [], [], iter([True, RuntimeError("run failed"), False, None])

        def serve(request_id, deadline, priority):
            served.append((request_id, math.isnan(deadline), priority))
            answer = next(answers)
            if isinstance(answer, Exception):
                raise answer
            return answer

        worker.prepared[inputs.frame_key] = (serve, lambda request_id, e: failed.append((request_id, str(e))))

        async def sent(n_served):
            caller.sock.sendall(frame)
            for _ in range(1000):
                if len(served) == n_served:
                    return
                await asyncio.sleep(0.001)
            raise AssertionError(f"served {len(served)}, not {n_served}")

        await sent(1)  # taken: served, never decoded
        await sent(2)  # its run failed: the error goes to its caller
        assert served == [(9, True, 0)] * 2 and failed == [(9, "run failed")]
        assert inbox.frames.empty()
        await sent(3)  # declined: decoded and handed on as usual, and kept for the next
        (request_id, (key, _, _, _)), _ = await inbox.next()
        assert (request_id, key) == (9, "m") and inputs.frame_key in worker.prepared
        await sent(4)  # its segment went away: handed on, and forgotten
        await inbox.next()
        assert worker.prepared == {}
        # A route declared again may mean something else: what was prepared is forgotten.
        worker.prepared[inputs.frame_key] = (serve, None)
        caller.sock.sendall(_route_frame(0, "other", _ROUTE, out_route) + frame)
        (_, (key, _, _, _)), _ = await inbox.next()
        assert key == "other" and worker.prepared == {} and len(served) == 4
        assert not inbox.lost
        caller.close()
        worker.close()

    _run(main())


def test_outputs_pinned_by_the_caller_are_written_in_place_and_answered_without_arrays():
    # [Note: outputs written in place], [Note: bound requests]
    from workers._transport import WRITTEN
    from workers._transport.server import _in_place

    async def main():
        caller, worker = await _pair()
        to_worker, to_caller = _Inbox(worker), _Inbox(caller)
        x = caller.arena.pin_array((16, 1024), np.float32)
        y = caller.arena.pin_array((16, 1024), np.float32)
        x[...] = 3.0
        caller.send((1, ("m@1@c", [{"x": x}], [None], [0])), {"y": y})
        (_, (_, [inputs], _, _)), held = await to_worker.next()
        assert held == [inputs.addresses["x"] - worker.peer.base]  # not the output's: the caller's to keep
        [(name, (array, at))] = inputs.outputs.items()
        assert name == "y" and at == y.ctypes.data - caller.arena._base + worker.peer.base
        np.multiply(inputs["x"], 2, out=array)  # what the engine does, binding that address
        np.testing.assert_array_equal(y, 6.0)  # the caller's own array
        timing = RequestTiming(0.1, 0.2, 1, True)
        answer = _in_place([(_outputs({"y": array}), timing)], inputs.outputs)
        assert answer == [(WRITTEN, timing)]
        assert _in_place([(_outputs({"y": array.copy()}), timing)], inputs.outputs)[0][0] is not WRITTEN
        worker.send((1, True, answer))
        (answer_id, ok, [(out, got_timing)]), _ = await to_caller.next()
        assert (answer_id, ok, out, got_timing) == (1, True, WRITTEN, timing)

        # The frame made once: sent as it stands, the same as send() makes it...
        frame = caller.bound_frame("m@1@c", {"x": x}, {"y": y})
        assert frame is not None
        assert caller.send_bound(frame, 2, 1.5, 3)
        (request_id, (key, [again], deadlines, priorities)), _ = await to_worker.next()
        assert (request_id, key, deadlines, priorities) == (2, "m@1@c", [1.5], [3])
        assert again.route is inputs.route and again.outputs["y"][1] == at
        # ...but not while regions wait to go back (send() carries them), nor for arrays
        # that are not pinned, nor before the route is declared.
        lent, _ = worker.arena.place(np.empty((16, 1024), np.float32))
        lent_at = worker.arena.take(lent)  # as if an answer had lain there
        caller.hand_back([lent_at])
        assert not caller.send_bound(frame, 3, None, 0)
        assert caller.bound_frame("m@1@c", {"x": x}, {"y": np.zeros_like(y)}) is None
        assert caller.bound_frame("m@1@c", {"x": y}, {"y": x}) is not None  # same route, other places
        assert caller.bound_frame("other@1@c", {"x": x}, {"y": y}) is None
        # Nor once a region was unpinned since the frame was made: it might be lent again.
        caller._releases.clear()
        assert caller.send_bound(frame, 3, None, 0)
        await to_worker.next()
        caller.arena.unpin(caller.arena.pin_array((16, 1024), np.float32))
        assert not caller.send_bound(frame, 3, None, 0)
        caller.hand_back([lent_at])
        # Outputs that are not all pinned, or pinned twice, go with the request as usual.
        caller.send((4, ("m@1@c", [{"x": x}], [None], [0])), {"y": np.zeros_like(y)})
        (_, (_, [plain], _, _)), _ = await to_worker.next()
        assert plain.outputs is None and worker.arena.lent_bytes == 0  # the region came back with it
        # Inputs may share a region; outputs are written in place all the same.
        caller.send((5, ("two@1@c", [{"a": x, "b": x}], [None], [0])), {"y": y})
        (_, (_, [shared], _, _)), _ = await to_worker.next()
        assert shared["a"] is shared["b"] and shared.outputs["y"][1] == at
        assert not to_worker.lost and not to_caller.lost
        caller.close()
        worker.close()

    _run(main())


def test_arrays_placed_or_pinned_are_found_by_identity_and_made_once():
    arena = Arena(size_bytes=4 << 20)
    try:
        like = np.empty((256, 256), np.float32)  # 256 KiB
        assert arena.place(np.empty(ARENA_MIN_BYTES // 8, np.float32)) is None  # small: in the frame
        placed, at = arena.place(like)
        assert placed.shape == like.shape and placed.dtype == like.dtype and at == placed.ctypes.data
        assert arena.take(placed) == 0 and arena.take(placed) is None  # sent once, then it is not reserved
        arena.release(0)
        again, _ = arena.place(like)
        assert again is placed  # the same region, dtype and shape: the same array
        arena.unreserve()
        kept = arena.pin_array((1024, 64), np.float32)
        assert arena.take(kept) == arena.take(kept) == 0  # as often as it is sent
        assert arena.take(kept.reshape(-1)) is None  # another object: put() finds it by address
        assert arena.put(memoryview(kept.reshape(-1)).cast("B")) == 0
        assert arena.take(np.zeros(3)) is None
        arena.unpin(kept)
        assert arena.take(kept) is None and arena.lent_bytes == 0
    finally:
        arena.close()
