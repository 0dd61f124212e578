"""An OIP ModelStreamInfer call that ends early takes its requests waiting in a pool with it, quietly.

A client that cancels while the door writes it an answer: the client reads nothing and its receive
window is HTTP/2's 64 KiB, so the write of a 1 MiB answer waits on flow control when the
cancellation comes ([Note: failed writes] in cluster/oip_grpc.py). A server stopped while a
stream's requests wait in a pool: stop() cancels them through the native Infer path the door runs
on ([Note: calls outlive stop] in cluster/server.py)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import grpc
import numpy as np
import pytest
from onnx import TensorProto, helper

from cluster._oip_models import OipModels
from cluster._oip_pb import oip_pb2 as pb
from cluster.gateway import Gateway, LocalPool, LocalPoolFactory
from cluster.oip_grpc import oip_service
from cluster.registry import Registry
from cluster.server import new_event_loop, serve
from tests.integration._gateway_support import write_version

pytestmark = pytest.mark.grpc

SHAPE = (1, 4, 256, 256)
"""1 MiB of float32 each way: one answer is 16 times the client's receive window."""
ROUNDS = 4
"""Calls made in turn. Which of grpc's two notices of the end of a call comes first (the failed
write or the cancellation) varies: each round runs it again."""
_STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"


def _relu() -> object:
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(SHAPE))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(SHAPE))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


class _HeldPool(LocalPool):
    """A real in-process pool (the model loaded in ONNX Runtime) that holds a request whose input
    starts with a negative value until cancelled, and runs the others once one is held, so that
    a stream's requests are all in the door before its first answer is written."""

    pools: _HeldPools

    async def run(self, inputs, *, deadline_s, priority):
        if inputs["x"].flat[0] < 0:
            self.pools.held.append(asyncio.current_task())
            self.pools.arrived.set()
            await asyncio.Event().wait()
            raise AssertionError("a held request only ends cancelled")
        await self.pools.arrived.wait()
        result = await super().run(inputs, deadline_s=deadline_s, priority=priority)
        self.pools.answered += 1
        return result


class _HeldPools(LocalPoolFactory):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.held: list[asyncio.Task] = []
        self.answered = 0
        self.arrived = asyncio.Event()

    def create(self, key, tail_path, config, metrics, *, sample_inputs=None):
        pool = _HeldPool(key, tail_path, config, metrics, cache_dir=self.cache_dir, provider=self.provider,
                         sample_inputs=sample_inputs)
        pool.pools = self
        return pool


def _request(sign: float) -> pb.ModelInferRequest:
    x = np.full(SHAPE, sign, np.float32)
    req = pb.ModelInferRequest(model_name="m")
    req.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    req.raw_input_contents.append(x.tobytes())
    return req


def stream_call(address: str, method: str, messages: list, until: threading.Event, *, read: bool,
                serializer=None, deserializer=None) -> grpc.StatusCode:
    """A stream call of `method` sending `messages`, kept open until `until`; where it does not
    `read`, it reads no answer and cancels the call at `until`. The status the call ended with."""

    def requests():
        yield from messages
        until.wait(60)

    # Without BDP probing the receive window stays at HTTP/2's default 64 KiB.
    with grpc.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        call = channel.stream_stream(method, request_serializer=serializer,
                                     response_deserializer=deserializer)(requests(), timeout=60)
        if not read:
            until.wait(60)
            call.cancel()
        try:
            for _ in call:
                pass
        except grpc.RpcError as e:
            return e.code()
        return grpc.StatusCode.OK


def _stream(address: str, signs: list[float], until: threading.Event, *, read: bool) -> grpc.StatusCode:
    """A ModelStreamInfer call of one request per sign (`stream_call`)."""
    return stream_call(address, _STREAM, [_request(sign) for sign in signs], until, read=read,
                       serializer=pb.ModelInferRequest.SerializeToString,
                       deserializer=pb.ModelStreamInferResponse.FromString)


async def _wait_until(done, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


def _run_rounds(root, one_round) -> _HeldPools:
    """Runs `one_round(pools, gateway)` ROUNDS times on a started gateway over m (the Relu model)."""
    write_version(root / "repo", "m", "1", _relu(), "max_batch_size: 1\nintra_op_threads: 1\n")
    pools = _HeldPools(cache_dir=str(root / "ort"))
    gateway = Gateway(Registry(str(root / "repo")), pools)

    async def main() -> None:
        await gateway.start(keep_going=True)
        try:
            for _ in range(ROUNDS):
                await one_round(pools, gateway)
        finally:
            await gateway.close()

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(main())
    return pools


def _assert_quiet(capfd, caplog) -> None:
    """No traceback reached stderr, and neither grpc nor the gateway logged at WARNING or above."""
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith(("grpc", "cluster"))]
    assert not loud, [r.getMessage() for r in loud]


def check_cancel_during_write(tmp_path, capfd, caplog, services, client) -> None:
    """A stream of two answered requests and one held, whose client reads nothing and cancels once
    the server's first 1 MiB write waits on it, takes the held request with it, quietly, in every
    round. `services(gateway)`: the doors served beside the native one; `client(address, signs,
    cancel)`: such a stream of one request per sign, cancelled at `cancel`, and its status."""
    ended: list[grpc.StatusCode] = []

    async def one_round(pools: _HeldPools, gateway: Gateway) -> None:
        running = await serve(gateway, services=services(gateway))
        try:
            pools.arrived.clear()
            answered, held = pools.answered + 2, len(pools.held) + 1
            cancel = threading.Event()
            call = asyncio.ensure_future(asyncio.to_thread(client, running.address, [1.0, 1.0, -1.0], cancel))
            await _wait_until(lambda: call.done() or (pools.answered >= answered and len(pools.held) >= held),
                              "the stream's requests did not reach the pool")
            assert not call.done(), call.result()
            await asyncio.sleep(0.2)  # the server reaches its first write, which waits on the client
            cancel.set()
            await _wait_until(pools.held[-1].done, "the held request still runs after its call was cancelled")
            assert pools.held[-1].cancelled()
            ended.append(await call)
        finally:
            await running.stop(grace_s=0.2)

    with caplog.at_level(logging.DEBUG):
        pools = _run_rounds(tmp_path, one_round)
    _assert_quiet(capfd, caplog)
    assert len(pools.held) == ROUNDS
    assert ended == [grpc.StatusCode.CANCELLED] * ROUNDS


def test_a_client_that_cancels_during_a_write_cancels_the_requests_in_the_pool(tmp_path, capfd, caplog):
    check_cancel_during_write(tmp_path, capfd, caplog, lambda gateway: [oip_service(OipModels(gateway))],
                              lambda address, signs, cancel: _stream(address, signs, cancel, read=False))


def test_stop_ends_the_streams_whose_requests_wait_in_a_pool(tmp_path, capfd, caplog):
    streams, per_stream = 2, 2
    left_running: list[int] = []
    ended: list[grpc.StatusCode] = []

    async def one_round(pools: _HeldPools, gateway: Gateway) -> None:
        running = await serve(gateway, services=[oip_service(OipModels(gateway))])
        until = threading.Event()
        held = len(pools.held) + streams * per_stream
        clients = [asyncio.ensure_future(asyncio.to_thread(
            _stream, running.address, [-1.0] * per_stream, until, read=True)) for _ in range(streams)]
        await _wait_until(lambda: any(c.done() for c in clients) or len(pools.held) >= held,
                          "the streams' requests did not reach the pool")
        assert not any(c.done() for c in clients), [c.result() for c in clients if c.done()]
        await running.stop(grace_s=0.2)
        # Read before anything else runs: the requests that stop() left running in the pool.
        left_running.append(sum(t.cancelling() == 0 and not t.done() for t in pools.held))
        until.set()
        ended.extend(await asyncio.gather(*clients))

    with caplog.at_level(logging.DEBUG):
        pools = _run_rounds(tmp_path, one_round)
    _assert_quiet(capfd, caplog)
    assert left_running == [0] * ROUNDS
    assert len(pools.held) == ROUNDS * streams * per_stream and all(t.cancelled() for t in pools.held)
    assert all(code is not grpc.StatusCode.OK for code in ended), ended
