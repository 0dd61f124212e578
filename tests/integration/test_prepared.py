"""Prepared requests ([Note: prepared requests] in workers/_transport/framing.py): the host class
that the Ray actor runs (``_TimingHost``), with real engines, serving a real direct
channel in this process over a Unix-domain socket with shared arenas; no Ray started.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from onnx import TensorProto, helper

from workers._transport import WRITTEN, ChannelClient, open_channel_server
from workers._transport.connection import _Connection
from workers._pool import make_segment_key
from workers.batcher import BatcherRequestError
from workers.engine import EngineConfig
from workers.errors import DeadlineExceededError, EngineRunError, SegmentNotLoadedError

pytest.importorskip("ray")  # workers.actors imports it; nothing here starts it
pytestmark = pytest.mark.timeout(120)

KEY = make_segment_key("gathered", 1, "c0")
ROW = 1 << 14  # 64 KiB of float32: large enough to be pinned in the arenas


def _model(factor: float):
    """y = factor * x + table[max(x)] per row, table all zeros: a request whose row
    maximum lies outside the table fails inside ONNX Runtime's run, a real run error."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", ROW])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", ROW])
    inits = [helper.make_tensor("f", TensorProto.FLOAT, [], [factor]),
             helper.make_tensor("table", TensorProto.FLOAT, [8], [0.0] * 8),
             helper.make_tensor("one", TensorProto.INT64, [1], [1])]
    nodes = [helper.make_node("Mul", ["x", "f"], ["scaled"]),
             helper.make_node("ReduceMax", ["x"], ["top"], axes=[1], keepdims=0),
             helper.make_node("Cast", ["top"], ["index"], to=TensorProto.INT64),
             helper.make_node("Gather", ["table", "index"], ["picked"]),
             helper.make_node("Unsqueeze", ["picked", "one"], ["column"]),
             helper.make_node("Add", ["scaled", "column"], ["y"])]
    graph = helper.make_graph(nodes, "gathered", [x], [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()


def _decoded_by_worker(monkeypatch) -> list[int]:
    """Lone frames the worker's end decoded: a prepared request is served undecoded."""
    decoded: list[int] = []
    real = _Connection._decode_lone

    def counted(self, codec, meta):
        if not self._views_until_freed:  # the worker's end
            decoded.append(codec)
        return real(self, codec, meta)

    monkeypatch.setattr(_Connection, "_decode_lone", counted)
    return decoded


async def _serving(host):
    server = await open_channel_server(host.infer_batch_timed, now=host.infer_batch_now, prepare=host.prepare)
    client = await ChannelClient.connect(server.path, server.token)
    x = client.pin_array((1, ROW), np.float32)
    y = client.pin_array((1, ROW), np.float32)
    assert x is not None and y is not None
    return server, client, x, y


async def _run(client, x, y, *, deadline=None, priority=0, frame=None):
    [result] = await client.call(KEY, [{"x": x}], [deadline], [priority], outputs={"y": y}, bound=frame)
    if isinstance(result, BaseException):  # per-request errors come back as values
        raise result
    out, timing = result
    if out is not WRITTEN:  # not run at once: the outputs came back, to copy (as the pool does)
        y[...] = out["y"]
    return out, timing


async def _until_idle(host) -> None:
    """Waits for the batcher's last batch task to be done with (the test's caller shares
    the worker's event loop, so its next request can come before that): until then a
    request goes the usual way, as it should, and the counts below would differ."""
    batcher = host._get(KEY).batcher
    for _ in range(1000):
        if batcher.can_run_now():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"the batcher did not become idle: {batcher.stats()}")


def _host():
    from workers.actors import _TimingHost

    return _TimingHost({KEY: _model(2.0)}, engine_config=EngineConfig(provider="cpu", intra_op_threads=1))


def _segment(host):
    [segment] = asyncio.run(host.stats()).segments
    return segment


def test_a_stream_of_the_same_lone_request_is_served_prepared_and_counted_as_before(monkeypatch):
    decoded = _decoded_by_worker(monkeypatch)
    host = _host()

    async def main():
        server, client, x, y = await _serving(host)
        x[...] = 1.0
        await _run(client, x, y)  # the first goes through the batcher, which times lone runs
        await _until_idle(host)
        out, _ = await _run(client, x, y)  # answered at once, written in place: prepared after
        assert out is WRITTEN
        frame = client.bound_frame(KEY, {"x": x}, {"y": y})
        before = len(decoded)
        timings = []
        for i in range(2, 8):
            x[...] = float(i % 4)
            out, timing = await _run(client, x, y, frame=frame if i % 2 else None)  # either way of sending
            assert out is WRITTEN
            np.testing.assert_array_equal(y, np.full((1, ROW), 2.0 * (i % 4), np.float32))
            timings.append(timing)
        assert len(decoded) == before  # none decoded: each served as prepared
        assert all(t.batch_size == 1 and t.first_in_batch and t.compute_s > 0 and t.queue_s >= 0 for t in timings)
        client.close()
        server.close()

    asyncio.run(main())
    segment = _segment(host)
    assert (segment.requests, segment.completed, segment.failed, segment.prepared) == (8, 8, 0, 6)
    assert segment.batches_formed == 8 and segment.batch_size_histogram == {1: 8}
    batcher = host._get(KEY).batcher.stats()
    assert batcher.completed == 8 and batcher.inline_runs == 7  # all but the first ran at once


def test_what_a_prepared_request_cannot_take_goes_the_usual_way_and_fails_or_runs_there(monkeypatch):
    decoded = _decoded_by_worker(monkeypatch)
    host = _host()

    async def main():
        server, client, x, y = await _serving(host)
        x[...] = 3.0
        for _ in range(3):
            await _run(client, x, y)
            await _until_idle(host)
        n = len(decoded)
        # A deadline already passed, a priority the batcher does not have: decoded and
        # refused where every request is, with the usual errors.
        with pytest.raises(DeadlineExceededError, match="deadline"):
            await _run(client, x, y, deadline=time.time() * 1e3 - 1.0)
        with pytest.raises(BatcherRequestError, match="priority=99"):
            await _run(client, x, y, priority=99)
        assert len(decoded) == n + 2
        # Two at once: the first has company behind it, so neither runs ahead of the batcher.
        x2, y2 = client.pin_array((1, ROW), np.float32), client.pin_array((1, ROW), np.float32)
        x2[...] = 5.0
        await asyncio.gather(_run(client, x, y), _run(client, x2, y2))
        np.testing.assert_array_equal(y, np.full((1, ROW), 6.0, np.float32))
        np.testing.assert_array_equal(y2, np.full((1, ROW), 10.0, np.float32))
        assert len(decoded) == n + 4
        # A run that fails inside ONNX Runtime answers its caller; the stream goes on prepared.
        await _until_idle(host)
        n = len(decoded)
        x[0, 7] = 100.0  # the row's maximum indexes past the table
        with pytest.raises(EngineRunError, match="ONNX Runtime failed"):
            await _run(client, x, y)
        x[...] = 1.0
        await _run(client, x, y)
        np.testing.assert_array_equal(y, np.full((1, ROW), 2.0, np.float32))
        assert len(decoded) == n
        [segment] = (await host.stats()).segments
        assert (segment.requests, segment.failed) == (9, 3)  # the deadline, the priority, the run
        assert segment.prepared == 3  # the third of the first three, the failed run, the one after it
        # The segment unloaded: refused as unknown; loaded again, served by the new model.
        await host.unload(KEY)
        with pytest.raises(SegmentNotLoadedError, match="not loaded"):
            await _run(client, x, y)
        await host.load(KEY, _model(3.0))
        for _ in range(4):
            await _run(client, x, y)
            np.testing.assert_array_equal(y, np.full((1, ROW), 3.0, np.float32))
        assert not client.closed
        client.close()
        server.close()

    asyncio.run(main())
    segment = _segment(host)  # the segment as loaded again
    assert (segment.requests, segment.completed) == (4, 4)
