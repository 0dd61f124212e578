"""The gateway says why it is not ready (/readyz over HTTP), refuses what it cannot serve at
start, and stops cleanly on SIGTERM or SIGINT, mid-stream, as a real `splitinfer gateway` process."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import onnx
import pytest

from cluster.gateway import Gateway, LocalPoolFactory
from cluster.metrics import GatewayMetrics, MetricsServer
from cluster.errors import ClusterError
from cluster.protocol.client import InferenceClient, SyncInferenceClient, make_request
from cluster.registry import Registry
from tests.integration.test_gateway_http import ROOT, get
from tests.onnx_models import conv_bn_relu_chain

pytestmark = pytest.mark.grpc

NOISE = ("Traceback", "Task was destroyed", "never retrieved", "GeneratorExit", "SIGTERM received")


def _model(root, name: str, version: str = "1") -> None:
    d = root / name / version
    d.mkdir(parents=True)
    onnx.save(conv_bn_relu_chain(2), str(d / "model.onnx"))


class _GatedPools(LocalPoolFactory):
    """Real in-process pools whose start waits for `gate`: a load that takes as long as the test needs."""

    def __init__(self, gate: threading.Event, **kw) -> None:
        super().__init__(**kw)
        self.gate = gate

    def create(self, *args, **kw):
        assert self.gate.wait(30)
        return super().create(*args, **kw)


def test_readyz_names_each_model_loading_queued_failed_or_without_versions(tmp_path):
    repo = tmp_path / "repo"
    for name in ("broken", "m", "n"):
        _model(repo, name)
    (repo / "broken" / "1" / "model.onnx").write_bytes(b"not onnx")
    (repo / "empty").mkdir()
    registry = Registry(str(repo))
    gate = threading.Event()
    gateway = Gateway(registry, _GatedPools(gate, cache_dir=str(tmp_path / "ort")))
    http = MetricsServer(GatewayMetrics(), gateway.readiness)
    loading = threading.Thread(target=registry.load_all, kwargs={"keep_going": True})
    try:
        code, body = get(http.url + "/readyz")
        assert code == 503 and json.loads(body)["reason"] == "starting: the registry is not read yet"
        loading.start()
        deadline = time.monotonic() + 30
        while json.loads(get(http.url + "/readyz")[1])["not_ready"].get("m@1") != "loading":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        code, body = get(http.url + "/readyz")
        detail = json.loads(body)
        assert code == 503 and detail["ready"] is False
        why = detail["not_ready"]
        assert set(why) == {"broken@1", "empty", "m@1", "n@1"}
        assert why["m@1"] == "loading" and why["n@1"] == "queued"
        assert why["broken@1"].startswith("failed: ") and "is not a model the partitioner can read" in why["broken@1"]
        assert why["empty"].startswith("no versions: ")
        assert "m@1: loading" in detail["reason"] and "broken@1: failed" in detail["reason"]
        gate.set()
        loading.join(30)
        code, body = get(http.url + "/readyz")
        detail = json.loads(body)
        # m and n serve: the gateway is ready, and lists what it cannot serve with why.
        assert code == 200 and sorted(detail["versions"]) == ["m@1", "n@1"]
        assert set(detail["not_ready"]) == {"broken@1", "empty"} and detail["missing"] == []
        assert set(detail["failed"]) == {"broken@1", "empty"}
    finally:
        gate.set()
        loading.join(30) if loading.is_alive() else None
        http.stop()
        for p in gateway._pools.values():
            for e in p.engines:
                e.close()


def _start(tmp_path, registry, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "splitinfer", "gateway", "--port", "0", "--metrics-port", "0",
           "--registry", str(registry), "--cache-dir", str(tmp_path / "cache"), "--log-format", "text", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)


def _addresses(proc: subprocess.Popen) -> tuple[str, str]:
    line = proc.stdout.readline()
    m = re.match(r"gateway serving on (\S+), metrics on (\S+)", line)
    assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
    return m.group(1), m.group(2)


def test_allow_empty_starts_on_an_empty_registry_and_readyz_says_why(tmp_path):
    (tmp_path / "models").mkdir()
    proc = _start(tmp_path, tmp_path / "models", "--allow-empty", "--ray-address", "local-noray")
    try:
        _, url = _addresses(proc)
        deadline = time.monotonic() + 30
        while "starting" in json.loads(get(url + "/readyz")[1])["reason"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        code, body = get(url + "/readyz")
        detail = json.loads(body)
        assert code == 503 and detail["not_ready"] == {} and detail["versions"] == []
        assert detail["reason"].startswith(f"no model in the registry {tmp_path / 'models'}")
        assert "splitinfer registry add MODEL" in detail["reason"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        err = proc.stderr.read()
        assert "gateway not ready: no model in the registry" in err
        assert not [n for n in NOISE if n in err], err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_gateway_none_of_whose_models_loads_exits_2_naming_them(tmp_path):
    _model(tmp_path / "models", "broken")
    (tmp_path / "models" / "broken" / "1" / "model.onnx").write_bytes(b"not onnx")
    proc = _start(tmp_path, tmp_path / "models", "--ray-address", "local-noray")
    try:
        assert proc.wait(timeout=60) == 2
        err = proc.stderr.read()
        line = [x for x in err.splitlines() if x.startswith("splitinfer gateway: error:")]
        assert len(line) == 1 and "no model of --registry" in line[0]
        assert "broken@1: failed: " in line[0] and "is not a model the partitioner can read" in line[0]
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _stop_mid_stream(tmp_path, sig: int, *extra: str, until_cancelled: bool = False, zoo: str | None = None) -> str:
    """Starts the gateway, streams requests, sends `sig` while answers flow; returns stderr.

    The stream ends 20 requests after the signal, or with `until_cancelled` only when the
    server cancels it at the end of its drain (5 s). `zoo` serves that zoo model (written by
    `registry add`), slow enough that requests are in flight when the stream is cancelled."""
    if zoo is None:
        _model(tmp_path / "models", "m")
        name, x = "m", {"x": np.ones((1, 4, 5, 5), np.float32)}
    else:
        from splitinfer.registry_cmd import AddOptions, add_model

        add_model(zoo, str(tmp_path / "models"), AddOptions(edge="rpi4", cloud="t4", frontier=True), say=lambda _: None)
        with open(tmp_path / "models" / zoo / "1" / "segments" / "L" / "cut.json") as fh:
            (inp,) = json.load(fh)["inputs"]
        name, x = zoo, {inp: np.random.default_rng(0).random((1, 3, 224, 224), np.float32)}
    proc = _start(tmp_path, tmp_path / "models", *extra)
    try:
        address, _ = _addresses(proc)
        with SyncInferenceClient(address) as c:
            deadline = time.monotonic() + 120
            while c.health() != "SERVING":
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
        assert asyncio.run(_stream(address, proc, sig, name, x, until_cancelled)) >= 3
        assert proc.wait(timeout=60) == 0
        return proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def _stream(address: str, proc: subprocess.Popen, sig: int, name: str, x, until_cancelled: bool) -> int:
    """Streams requests (as the edge agent does, on grpc.aio); sends `sig` after 3 answers."""
    signalled: list[int] = []

    async def requests():
        for i in range(10_000):
            if signalled and not until_cancelled and i > signalled[0] + 20:
                return
            yield make_request(name, "", "L", x, request_id=f"r{i}")
            await asyncio.sleep(0.02)

    answers = 0
    async with InferenceClient(address) as c:
        try:
            async for _ in c.infer_stream(requests()):
                answers += 1
                if answers == 3:
                    proc.send_signal(sig)
                    signalled.append(answers)
        except ClusterError:  # the stream may end either way as the server stops
            pass
    return answers


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_gateway_cleanly_mid_stream(tmp_path, sig):
    err = _stop_mid_stream(tmp_path, sig, "--ray-address", "local-noray")
    assert "gateway stopped" in err
    assert not [n for n in NOISE if n in err], err


@pytest.mark.ray
@pytest.mark.slow
def test_sigterm_stops_the_ray_gateway_cleanly_mid_stream(tmp_path):
    err = _stop_mid_stream(tmp_path, signal.SIGTERM, "--ray-address", "local", until_cancelled=True,
                           zoo="squeezenet")
    assert "gateway stopped" in err
    assert not [n for n in NOISE if n in err], err


def test_sigterm_while_loading_stops_loading_and_exits_0(tmp_path):
    import shutil

    from splitinfer.registry_cmd import add_model

    first = add_model("squeezenet", str(tmp_path / "models"), say=lambda _: None)
    for v in range(2, 9):  # eight versions to load, each cutting its frontier tails first
        shutil.copytree(first, tmp_path / "models" / "squeezenet" / str(v))
    proc = _start(tmp_path, tmp_path / "models", "--ray-address", "local-noray", "--version-policy", "all")
    try:
        _addresses(proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        err = proc.stderr.read()
        assert "stop requested while loading the registry" in err and "gateway stopped" in err
        assert err.count("loaded squeezenet@") < 8  # the versions after the signal were not loaded
        assert not [n for n in NOISE if n in err], err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
