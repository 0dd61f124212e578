"""The agent's first start downloads the model over a slow link for as long as its pieces keep
coming, and gives up on a link that stops, naming the stall (real gRPC through the project's
link emulator)."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from cluster.server import serve
from edge_agent.config import config_from_dict
from edge_agent.daemon import EdgeAgent
from edge_agent.errors import StartupError
from partitioner import Splitter
from splitinfer.netem import LinkSetting, ThreadedLinkEmulator
from tests.integration._edge_support import MODEL, VERSION, TailBackend, slow_device_profile, write_model

pytestmark = [pytest.mark.grpc, pytest.mark.timeout(120)]

STARTUP_S = 0.5
DOWN_BPS = 16e3
"""The download of the test model (about 3 kB) takes over a second here: longer than STARTUP_S."""


@contextlib.contextmanager
def _linked_gateway(tmp_path):
    path = write_model(tmp_path)
    loop = asyncio.new_event_loop()
    backend = TailBackend(path, cache_dir=str(tmp_path / "server-cache"))
    server = loop.run_until_complete(serve(backend))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    emu = ThreadedLinkEmulator(upstream=("127.0.0.1", server.port),
                               setting=LinkSetting(up_bps=1e6, down_bps=DOWN_BPS, rtt_ms=10.0)).start()
    try:
        yield path, emu
    finally:
        emu.stop()
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _cfg(tmp_path, port, prof, **extra):
    return config_from_dict({"gateway": f"127.0.0.1:{port}", "model": f"{MODEL}@{VERSION}",
                             "cacheDir": str(tmp_path / "cache"), "apiPort": 0, "deviceProfile": prof,
                             "startupTimeoutS": STARTUP_S, **extra})


def _profile(tmp_path, path) -> str:
    prof = tmp_path / "device.json"
    prof.write_text(slow_device_profile(Splitter(path).graph).to_json())
    return str(prof)


def test_a_download_longer_than_the_startup_timeout_completes(tmp_path):
    with _linked_gateway(tmp_path) as (path, emu):
        async def go():
            agent = EdgeAgent(_cfg(tmp_path, emu.port, _profile(tmp_path, path)))
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await agent.start()
            took = loop.time() - t0
            try:
                return took, agent.status()
            finally:
                await agent.stop()

        took, status = asyncio.run(go())
    assert status["artifacts"] == "gateway"
    assert took > 2 * STARTUP_S, took  # the premise: the download outlasted the start-up timeout


def test_a_download_that_stalls_fails_naming_the_stall(tmp_path):
    with _linked_gateway(tmp_path) as (path, emu):
        async def go():
            agent = EdgeAgent(_cfg(tmp_path, emu.port, _profile(tmp_path, path), downloadStallS=0.5,
                                   startupTimeoutS=10.0))
            start = asyncio.ensure_future(agent.start())
            while emu.stats().bytes_down < 1000 and not start.done():  # past the health check, inside the download
                await asyncio.sleep(0.02)
            emu.set(LinkSetting(up_bps=1e6, down_bps=DOWN_BPS, rtt_ms=10.0, up=False))
            await start

        with pytest.raises(StartupError) as e:
            asyncio.run(go())
    msg = str(e.value)
    assert "no data for 0.5 s" in msg and "while downloading" in msg, msg
