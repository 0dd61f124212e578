"""The server shell over real gRPC on 127.0.0.1 with the echo backend."""

from __future__ import annotations

import asyncio
import subprocess
import time

import grpc
import msgpack
import numpy as np
import pytest

from cluster import errors as E
from cluster.protocol import status as S
from cluster.protocol.client import InferenceClient, SyncInferenceClient, make_request
from cluster.protocol.encoding import decode, encode
from cluster.protocol.messages import InferRequest, StreamFrame
from cluster.testing import EchoBackend
from cluster.server import SERVICE_NAME, serve, serve_in_thread

pytestmark = pytest.mark.grpc


@pytest.fixture
def backend():
    return EchoBackend()


@pytest.fixture
def server(backend):
    with serve_in_thread(backend, stream_window=4, max_message_bytes=4 << 20) as srv:
        yield srv


@pytest.fixture
def client(server):
    with SyncInferenceClient(server.address) as c:
        yield c


def _req(tensors=None, **kw):
    return make_request(kw.pop("model", "echo"), kw.pop("version", "1"), kw.pop("cut_id", "c0"),
                        tensors if tensors is not None else {"x": np.arange(6, dtype=np.float32)}, **kw)


def test_unary_infer_echoes_tensors_and_reports_timings(client, backend):
    x = np.random.default_rng(0).standard_normal((1, 16, 8, 8)).astype(np.float32)
    enc = encode(x, precision="int8", compression="zstd", per_channel=True)
    req = _req({"x": x, "q": enc, "ids": np.arange(5)}, priority=3, device_id="dev-1")
    resp = client.infer(req)
    assert resp.request_id == req.request_id and resp.served_by == "echo@1"
    np.testing.assert_array_equal(resp.outputs["x"], x)
    np.testing.assert_array_equal(resp.outputs["ids"], np.arange(5))
    np.testing.assert_array_equal(decode(resp.outputs["q"]), decode(enc))
    assert set(resp.timings_ms) == {"decode", "queue", "compute", "encode"}
    assert all(v >= 0 for v in resp.timings_ms.values())
    assert backend.last_context.method == "Infer" and backend.last_context.peer


@pytest.mark.parametrize("err", [
    E.ProtocolError(reason="r"), E.EncodingError(reason="r", fix="f"), E.VersionMismatch(got=[3, 0], supported=[1]),
    E.UnknownModelError(model="m"), E.UnknownVersionError(model="m", version="v"),
    E.UnknownCutError(model="m", version="v", cut_id="c"), E.DeadlineExceeded(where="w"),
    E.Unauthenticated(reason="r"), E.PermissionDenied(principal="p", action="a"),
    E.ResourceExhausted(resource="q", limit=2), E.Unavailable(reason="r"), E.NotSupported(what="w"),
    E.InternalError(detail="d"),
], ids=lambda e: type(e).__name__)
def test_every_error_class_crosses_the_wire_as_itself(err):
    backend = EchoBackend(raise_for={"bad": err})
    with serve_in_thread(backend) as srv, SyncInferenceClient(srv.address) as c:
        with pytest.raises(type(err)) as ei:
            c.infer(_req(model="bad"))
        assert ei.value.message == err.message and ei.value.fields() == err.fields()
        # And as seen by a plain gRPC client: the code from the table.
        ch = grpc.insecure_channel(srv.address)
        with pytest.raises(grpc.RpcError) as raw:
            ch.unary_unary(f"/{SERVICE_NAME}/Infer")(_req(model="bad").to_msgpack(), timeout=5)
        assert raw.value.code() == S.STATUS_OF[type(err)]
        ch.close()


def test_unknown_backend_exception_is_internal_with_a_generic_message(caplog):
    backend = EchoBackend(raise_for={"bug": ZeroDivisionError("secret stack detail")})
    with serve_in_thread(backend) as srv, SyncInferenceClient(srv.address) as c:
        with pytest.raises(E.InternalError) as ei:
            c.infer(_req(model="bug"))
        assert "secret" not in ei.value.message
        assert c.infer(_req()).served_by == "echo@1"  # still serving
    assert "secret stack detail" in caplog.text


def test_unknown_model_version_and_cut_are_not_found(client):
    with pytest.raises(E.UnknownModelError, match="'nope'"):
        client.infer(_req(model="nope"))
    with pytest.raises(E.UnknownVersionError, match="'7'"):
        client.infer(_req(version="7"))
    with pytest.raises(E.UnknownCutError, match="'c9'"):
        client.infer(_req(cut_id="c9"))


def test_bad_frames_and_versions_get_clear_codes(client):
    with pytest.raises(E.ProtocolError, match="truncated"):
        client.infer_raw(_req().to_msgpack()[:-2])
    d = msgpack.unpackb(_req().to_msgpack())
    d["v"] = [2, 0]
    with pytest.raises(E.VersionMismatch, match="this server speaks 1.x"):
        client.infer_raw(msgpack.packb(d))
    d["v"] = [1, 5]
    d["from_the_future"] = True
    assert client.infer_raw(msgpack.packb(d))


def test_oversized_messages_are_resource_exhausted(server):
    big = {"x": np.zeros(2 << 20, np.float32)}  # 8 MiB, server limit 4 MiB
    with SyncInferenceClient(server.address) as c:
        with pytest.raises(E.ResourceExhausted):
            c.infer(_req(big))
        assert c.infer(_req()).served_by == "echo@1"


def test_expired_deadline_is_rejected_before_the_backend(client, backend):
    req = _req(timeout_s=-1.0)
    with pytest.raises(E.DeadlineExceeded, match="before the request reached the backend"):
        client.infer(req, timeout_s=5.0)
    assert backend.calls == 0


def test_backend_gets_the_earlier_deadline_as_monotonic_time(client, backend):
    for request_s, grpc_s, expect_s in ((60.0, 2.0, 2.0), (1.0, 30.0, 1.0)):
        before = time.monotonic()
        client.infer(_req(timeout_s=request_s), timeout_s=grpc_s)
        elapsed = time.monotonic() - before
        left = backend.last_context.deadline_monotonic_s - before
        # Within the call's own duration (and the two clocks' rounding) of the earlier deadline.
        assert expect_s - elapsed - 0.05 < left < expect_s + elapsed + 0.05


def test_backend_that_overruns_the_deadline_is_cut_off():
    backend = EchoBackend(delay_s=lambda r: 5.0)
    with serve_in_thread(backend) as srv, SyncInferenceClient(srv.address) as c:
        t0 = time.monotonic()
        with pytest.raises(E.DeadlineExceeded):
            c.infer(_req(timeout_s=0.3))
        assert time.monotonic() - t0 < 4.0
        assert backend.in_flight == 0


def test_stream_answers_in_order_with_per_frame_errors(server, backend):
    backend.delay_s = lambda r: 0.05 * (9 - int(r.request_id)) / 9  # later frames finish first
    reqs = [_req(request_id=str(i)) for i in range(10)]
    reqs[4] = _req(request_id="4", model="missing")
    with SyncInferenceClient(server.address) as c:
        out = list(c.infer_stream(reqs))
    assert len(out) == 10
    assert isinstance(out[4], E.UnknownModelError)
    assert [o.request_id for i, o in enumerate(out) if i != 4] == [str(i) for i in range(10) if i != 4]


def test_stream_window_bounds_frames_in_flight(server, backend):
    backend.delay_s = lambda r: 0.02
    with SyncInferenceClient(server.address) as c:
        out = list(c.infer_stream(_req(request_id=str(i)) for i in range(40)))
    assert [o.request_id for o in out] == [str(i) for i in range(40)]
    assert backend.peak_in_flight == 4  # the window, reached but never passed


def test_stream_unreadable_frame_gets_an_error_in_its_place(server):
    ch = grpc.insecure_channel(server.address)
    good = StreamFrame(seq=0, request=_req()).to_msgpack()
    frames = [good, b"\xc1garbage", StreamFrame(seq=2, request=_req()).to_msgpack()]
    out = [StreamFrame.from_msgpack(r) for r in ch.stream_stream(f"/{SERVICE_NAME}/InferStream")(iter(frames), timeout=10)]
    assert [f.seq for f in out] == [0, None, 2]
    assert out[1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and out[1].error.error == "ProtocolError"
    # A server frame sent by a client is refused the same way.
    resp_frame = StreamFrame(seq=5, error=out[1].error).to_msgpack()
    out = [StreamFrame.from_msgpack(r) for r in ch.stream_stream(f"/{SERVICE_NAME}/InferStream")(iter([resp_frame]), timeout=10)]
    assert out[0].seq == 5 and "must carry 'request'" in out[0].error.message
    ch.close()


def test_async_client_stream_and_token(server, backend):
    async def main():
        async with InferenceClient(server.address, token="s3cret") as c:
            assert "s3cret" not in repr(c)

            async def gen():
                for i in range(6):
                    await asyncio.sleep(0)
                    yield _req(request_id=str(i))

            ids = [r.request_id async for r in c.infer_stream(gen())]
            assert ids == [str(i) for i in range(6)]
            one = await c.infer(_req())
            assert one.served_by == "echo@1"
            with pytest.raises(E.UnknownModelError):
                await c.infer(_req(model="zzz"))
            return await c.health(), await c.plan({"model": "echo", "version": "1"})

    status, plan = asyncio.run(main())
    assert status == "SERVING" and plan.plan == {"echo": {"model": "echo", "version": "1"}}
    assert backend.last_context.bearer_token == "s3cret"
    assert "s3cret" not in repr(backend.last_context)


def test_health_follows_readiness(server, client):
    assert client.health() == "SERVING"
    assert client.health(SERVICE_NAME) == "SERVING"
    server.set_ready(False)
    assert client.health() == "NOT_SERVING" and client.health(SERVICE_NAME) == "NOT_SERVING"
    server.set_ready(True)
    assert client.health() == "SERVING"
    with pytest.raises(E.UnknownModelError):  # NOT_FOUND for a service the server does not know
        client.health("no.such.Service")


def test_backend_sets_health_itself(backend):
    with serve_in_thread(backend, ready=False) as srv, SyncInferenceClient(srv.address) as c:
        assert c.health() == "NOT_SERVING"
        asyncio.run_coroutine_threadsafe(backend.health.set_ready(True), srv._loop).result()
        assert c.health() == "SERVING"


def test_plan_and_artifacts(client, backend):
    p = client.plan({"model": "echo", "link": {"up_bps": 1e6}})
    assert p.plan["echo"]["link"] == {"up_bps": 1e6}
    with pytest.raises(E.UnknownModelError):
        client.plan({"model": "nope"})
    backend.artifacts = {"tail.onnx": bytes(range(256)) * 20000, "model.yaml": b"name: echo\n", "empty": b""}
    got = client.get_artifacts("echo", "1")
    assert got.files == backend.artifacts and (got.model, got.version) == ("echo", "1")
    with pytest.raises(E.UnknownVersionError):
        client.get_artifacts("echo", "2")


def test_backend_without_plan_or_artifacts_is_unimplemented():
    class InferOnly:
        async def infer(self, request, context):
            raise E.Unavailable(reason="warming up")

    with serve_in_thread(InferOnly()) as srv, SyncInferenceClient(srv.address) as c:
        with pytest.raises(E.NotSupported, match="Plan"):
            c.plan({})
        with pytest.raises(E.NotSupported, match="GetArtifacts"):
            c.get_artifacts("m", "1")
        with pytest.raises(E.Unavailable, match="warming up"):
            c.infer(_req())


def test_backend_returning_the_wrong_type_is_internal():
    class Wrong(EchoBackend):
        async def infer(self, request, context):
            return {"not": "a response"}

        async def plan(self, request, context):
            return None

        async def get_artifacts(self, request, context):
            return b""

    with serve_in_thread(Wrong()) as srv, SyncInferenceClient(srv.address) as c:
        for call in (lambda: c.infer(_req()), lambda: c.plan({}), lambda: c.get_artifacts("echo", "1")):
            with pytest.raises(E.InternalError, match="internal error"):
                call()
        assert list(c.infer_stream([_req()]))[0].message.startswith("internal error")


def test_interceptors_run_and_can_refuse():
    seen = []

    class Deny(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation, details):
            seen.append(details.method)
            if dict(details.invocation_metadata).get("authorization") != "Bearer ok":
                async def deny(request, context):
                    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad token")
                return grpc.unary_unary_rpc_method_handler(deny)
            return await continuation(details)

    with serve_in_thread(EchoBackend(), interceptors=[Deny()]) as srv:
        with SyncInferenceClient(srv.address, token="ok") as c:
            assert c.infer(_req()).served_by == "echo@1"
        with SyncInferenceClient(srv.address, token="wrong") as c:
            with pytest.raises(E.Unauthenticated):
                c.infer(_req())
    assert seen == [f"/{SERVICE_NAME}/Infer"] * 2


def test_serve_rejects_bad_arguments():
    async def main(**kw):
        await serve(EchoBackend(), **kw)

    with pytest.raises(ValueError, match="stream_window=0"):
        asyncio.run(main(stream_window=0))
    with pytest.raises(ValueError, match="max_message_bytes=10"):
        asyncio.run(main(max_message_bytes=10))
    with pytest.raises(TypeError, match="no async infer"):
        asyncio.run(serve(object()))  # type: ignore[arg-type]


def _self_signed(tmp_path):
    key, crt = tmp_path / "key.pem", tmp_path / "crt.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(crt),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True,
    )
    return key.read_bytes(), crt.read_bytes()


def test_tls_on_loopback(tmp_path):
    try:
        key, crt = _self_signed(tmp_path)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("openssl is not available to make a test certificate")
    creds = grpc.ssl_server_credentials([(key, crt)])
    with serve_in_thread(EchoBackend(), credentials=creds) as srv:
        with SyncInferenceClient(srv.address, credentials=grpc.ssl_channel_credentials(crt), token="t") as c:
            assert c.infer(_req()).served_by == "echo@1"
        with SyncInferenceClient(srv.address) as plain:  # no TLS: the handshake fails
            with pytest.raises(E.Unavailable):
                plain.infer(_req(timeout_s=2.0))


def test_infer_request_built_by_hand_matches_make_request():
    r = InferRequest(request_id="a", model="m", version="1", cut_id="c", deadline_unix_ms=5, tensors={})
    assert InferRequest.from_msgpack(r.to_msgpack()).request_id == "a"


def test_big_tensors_take_the_zero_copy_path_both_ways(client):
    x = np.random.default_rng(5).standard_normal((1, 64, 64, 64)).astype(np.float32)  # 1 MiB
    resp = client.infer(_req({"x": x}))
    np.testing.assert_array_equal(resp.outputs["x"], x)
    assert set(resp.timings_ms) == {"decode", "queue", "compute", "encode"}
    out = list(client.infer_stream([_req({"x": x}, request_id="a"), _req({"y": x[:, :1]}, request_id="b")]))
    assert [o.request_id for o in out] == ["a", "b"]
    np.testing.assert_array_equal(out[0].outputs["x"], x)


def test_serving_on_a_taken_port_is_an_os_error(server):
    with pytest.raises(OSError, match="could not bind"):
        serve_in_thread(EchoBackend(), port=server.port)
