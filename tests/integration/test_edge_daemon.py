"""The daemon end to end: artifacts from a real gRPC server, the local API and EdgeClient,
start-up failures with clear messages, offline start from the cache, and graceful stop."""

import asyncio
import contextlib
import os
import socket

import numpy as np
import onnxruntime as ort
import pytest

from cluster.server import serve
from edge_agent.client import EdgeClient, EdgeClientError
from edge_agent.config import config_from_dict
from edge_agent.daemon import EdgeAgent, run_agent
from edge_agent.errors import ConfigError, StartupError
from partitioner import Splitter
from splitinfer.edge_cmd import edge_main
from tests.integration._edge_support import MODEL, VERSION, TailBackend, slow_device_profile, write_model

pytestmark = [pytest.mark.grpc, pytest.mark.timeout(120)]


def _x(seed=0):
    return np.random.default_rng(seed).standard_normal((1, 4, 5, 5)).astype(np.float32)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def setup(tmp_path):
    path = write_model(tmp_path)
    prof = tmp_path / "device.json"
    prof.write_text(slow_device_profile(Splitter(path).graph).to_json())
    return tmp_path, path, str(prof)


def _cfg(tmp_path, gateway, **extra):
    return config_from_dict({"gateway": gateway, "model": f"{MODEL}@{VERSION}", "cacheDir": str(tmp_path / "cache"),
                             "apiPort": 0, "startupTimeoutS": 3.0, **extra})


@contextlib.asynccontextmanager
async def _server(path, tmp_path, token=None):
    backend = TailBackend(path, token=token, cache_dir=str(tmp_path / "server-cache"))
    server = await serve(backend)
    try:
        yield backend, server
    finally:
        await server.stop(None)


def _ref(path, x):
    return ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_serves_apps_through_the_local_api_and_client(setup):
    tmp_path, path, prof = setup

    async def go():
        async with _server(path, tmp_path) as (backend, server):
            agent = EdgeAgent(_cfg(tmp_path, server.address, deviceProfile=prof))
            await agent.start()
            url = f"http://127.0.0.1:{agent.api.port}"

            def app():
                with EdgeClient(url) as c:
                    one = c.infer_full({"x": _x(0)})
                    stream = list(c.infer_stream([{"x": _x(i)} for i in range(5)]))
                    return (c.health(), c.ready(), c.model(), one, stream, c.status(), c.metrics())

            try:
                return await asyncio.to_thread(app), backend.served
            finally:
                await agent.stop()

    (health, ready, model, one, stream, status, metrics), served = asyncio.run(go())
    assert health and ready and model["inputs"] == [{"name": "x", "dtype": "float32", "shape": [1, 4, 5, 5]}]
    assert one["served_by"] == "remote"
    np.testing.assert_allclose(one["outputs"]["y"], _ref(path, _x(0)), rtol=1e-3, atol=1e-4)
    assert [a["id"] for a in stream] == [str(i) for i in range(5)]
    for i, a in enumerate(stream):
        np.testing.assert_allclose(a["outputs"]["y"], _ref(path, _x(i)), rtol=1e-3, atol=1e-4)
    # the start-up probe (one zero boundary, to measure the link) is the only other call
    assert served == 6 + status["counters"]["probes"] and status["counters"]["probes"] == 1
    assert status["artifacts"] == "gateway" and status["counters"]["answered"] == 6
    assert 'splitinfer_edge_answers_total{served_by="remote"} 6' in metrics


def test_bad_request_gets_400_and_the_agent_keeps_serving(setup):
    tmp_path, path, prof = setup

    async def go():
        async with _server(path, tmp_path) as (_, server):
            agent = EdgeAgent(_cfg(tmp_path, server.address, deviceProfile=prof))
            await agent.start()

            def app():
                with EdgeClient(f"http://127.0.0.1:{agent.api.port}") as c:
                    with pytest.raises(EdgeClientError) as e:
                        c.infer({"wrong": _x()})
                    missing = c._request("GET", "/v1/nope")
                    wrong_method = c._request("GET", "/v1/infer")
                    assert (missing[0], wrong_method[0]) == (404, 405) and b"/v1/infer" in missing[2]
                    return e.value, c.infer({"x": _x()})

            try:
                return await asyncio.to_thread(app)
            finally:
                await agent.stop()

    err, ok = asyncio.run(go())
    assert err.status == 400 and "wrong" in str(err) and ok["y"].shape == (1, 3)


def test_unknown_model_without_cache_is_a_clear_startup_error(setup):
    tmp_path, path, _ = setup

    async def go():
        async with _server(path, tmp_path) as (_, server):
            await EdgeAgent(_cfg(tmp_path, server.address, model="nosuch@1")).start()

    with pytest.raises(StartupError) as e:
        asyncio.run(go())
    assert "nosuch" in str(e.value) and "check 'model'" in str(e.value)


def test_unreachable_gateway_without_cache_names_the_gateway(setup):
    tmp_path, _, _ = setup
    gw = f"127.0.0.1:{_free_port()}"
    with pytest.raises(StartupError) as e:
        asyncio.run(EdgeAgent(_cfg(tmp_path, gw, startupTimeoutS=1.0)).start())
    assert gw in str(e.value) and "no copy" in str(e.value)


def _start_once_then(tmp_path, path, prof, then):
    """Starts once with the gateway (caching the model), then runs `then()` offline."""
    async def first():
        async with _server(path, tmp_path) as (_, server):
            agent = EdgeAgent(_cfg(tmp_path, server.address, deviceProfile=prof))
            await agent.start()
            await agent.stop()

    asyncio.run(first())
    return asyncio.run(then())


def test_unreachable_gateway_with_cache_serves_locally(setup):
    tmp_path, path, prof = setup

    async def offline():
        agent = EdgeAgent(_cfg(tmp_path, f"127.0.0.1:{_free_port()}", deviceProfile=prof, startupTimeoutS=1.0,
                               remoteTimeoutMs=300))
        await agent.start()
        try:
            out = [await agent.infer({"x": _x(i)}, None) for i in range(4)]
            return out, agent.status()
        finally:
            await agent.stop()

    out, status = _start_once_then(tmp_path, path, prof, offline)
    assert status["artifacts"] == "cache" and "serving chain@1 from the cache" in status["warning"]
    for i, a in enumerate(out):
        assert a["served_by"] in ("local", "local_tail")
        np.testing.assert_allclose(a["outputs"]["y"], _ref(path, _x(i)), rtol=1e-4, atol=1e-5)
    assert out[-1]["served_by"] == "local"  # the breaker opened: no more network attempts


def test_corrupt_cache_and_no_gateway_says_what_to_do(setup):
    tmp_path, path, prof = setup

    async def offline():
        await EdgeAgent(_cfg(tmp_path, f"127.0.0.1:{_free_port()}", startupTimeoutS=1.0)).start()

    def corrupt_then():
        d = tmp_path / "cache" / "models" / MODEL / VERSION / "model.onnx"
        d.write_bytes(d.read_bytes()[:-10] + b"0123456789")
        return offline()

    with pytest.raises(StartupError) as e:
        _start_once_then(tmp_path, path, prof, corrupt_then)
    assert "SHA-256" in str(e.value) and "delete" in str(e.value)


def test_wrong_token(setup):
    tmp_path, path, prof = setup

    async def go(cached: bool):
        async with _server(path, tmp_path, token="tok-A1") as (_, server):
            agent = EdgeAgent(_cfg(tmp_path, server.address, token="tok-B2", deviceProfile=prof))
            await agent.start()
            try:
                return await agent.infer({"x": _x()}, None), agent.status()
            finally:
                await agent.stop()

    with pytest.raises(StartupError) as e:
        asyncio.run(go(False))
    assert "token" in str(e.value) and "tok-B2" not in str(e.value)

    async def seed():
        async with _server(path, tmp_path, token="tok-A1") as (_, server):
            agent = EdgeAgent(_cfg(tmp_path, server.address, token="tok-A1", deviceProfile=prof))
            await agent.start()
            await agent.stop()

    asyncio.run(seed())
    ans, status = asyncio.run(go(True))
    assert ans["served_by"] in ("local", "local_tail") and "token" in status["warning"]


def test_sigterm_style_stop_finishes_in_flight_and_refuses_new(setup):
    tmp_path, path, prof = setup

    async def go():
        async with _server(path, tmp_path) as (backend, server):
            agent = EdgeAgent(_cfg(tmp_path, server.address, deviceProfile=prof, remoteTimeoutMs=5000))
            await agent.start()
            backend.release.clear()
            inflight = asyncio.ensure_future(agent.infer({"x": _x()}, "held"))
            while backend.calls == 0:
                await asyncio.sleep(0.01)
            stopping = asyncio.ensure_future(agent.stop(grace_s=10))
            await asyncio.sleep(0.05)
            ready = agent.is_ready()
            with pytest.raises(Exception) as refused:
                await agent.infer({"x": _x()}, "late")
            backend.release.set()
            ans = await inflight
            await stopping
            return ans, ready, refused.value

    ans, ready, refused = asyncio.run(go())
    assert ans["served_by"] == "remote" and not ready and "shutting down" in str(refused)


def test_unix_socket_api_and_run_agent(setup):
    tmp_path, path, prof = setup
    sock = str(tmp_path / "edge.sock")

    async def go():
        async with _server(path, tmp_path) as (_, server):
            stop = asyncio.Event()
            runner = asyncio.ensure_future(run_agent(_cfg(tmp_path, server.address, deviceProfile=prof,
                                                          apiSocket=sock), stop=stop))

            def app():
                import time
                for _ in range(300):
                    if os.path.exists(sock):
                        break
                    time.sleep(0.05)
                with EdgeClient(unix_socket=sock) as c:
                    for _ in range(100):
                        if c.ready():
                            break
                        time.sleep(0.05)
                    return c.infer({"x": _x()})

            out = await asyncio.to_thread(app)
            stop.set()
            return out, await runner

    out, code = asyncio.run(go())
    np.testing.assert_allclose(out["y"], _ref(path, _x()), rtol=1e-3, atol=1e-4)
    assert code == 0 and not os.path.exists(sock)


def test_edge_cmd_check_and_bad_config(tmp_path, capsys):
    good = tmp_path / "edge.yaml"
    good.write_text("gateway: 127.0.0.1:50051\nmodel: chain@1\ntoken: hush\n")
    assert edge_main(["check", "--config", str(good)]) == 0
    out = capsys.readouterr().out
    assert '"gateway": "127.0.0.1:50051"' in out and "hush" not in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("gateway: 127.0.0.1:50051\nmodel: chain@1\nobjectiv: latency\n")
    with pytest.raises(ConfigError, match="did you mean 'objective'"):
        edge_main(["run", "--config", str(bad)])


def test_unreadable_tls_file_names_the_key(tmp_path):
    cfg = _cfg(tmp_path, "127.0.0.1:1", tls_ca=str(tmp_path / "missing-ca.pem"))
    with pytest.raises(ConfigError) as e:
        asyncio.run(EdgeAgent(cfg).start())
    assert e.value.key == "tls_ca" and "missing-ca.pem" in str(e.value)
