"""/metrics, /healthz and /readyz over HTTP on 127.0.0.1, and `splitinfer gateway` as a process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import onnx
import pytest

from cluster.gateway import Gateway, LocalPoolFactory
from cluster.metrics import GatewayMetrics, MetricsServer
from cluster.protocol.client import SyncInferenceClient, make_request
from cluster.registry import Registry
from tests.onnx_models import conv_bn_relu_chain

pytestmark = pytest.mark.grpc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_repo(root) -> str:
    d = os.path.join(root, "m", "1")
    os.makedirs(d)
    onnx.save(conv_bn_relu_chain(2), os.path.join(d, "model.onnx"))
    return str(root)


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_readyz_turns_true_only_when_the_frontier_tails_are_loaded(tmp_path):
    registry = Registry(make_repo(tmp_path / "repo"))
    metrics = GatewayMetrics()
    gateway = Gateway(registry, LocalPoolFactory(cache_dir=str(tmp_path / "ort")), metrics=metrics)
    http = MetricsServer(metrics, gateway.readiness)
    try:
        assert get(http.url + "/healthz") == (200, "ok\n")
        code, body = get(http.url + "/readyz")
        assert code == 503 and json.loads(body)["ready"] is False
        registry.load_all()
        code, body = get(http.url + "/readyz")
        assert code == 200 and json.loads(body)["versions"] == ["m@1"]
        code, text = get(http.url + "/metrics")
        assert code == 200 and "splitinfer_inflight_requests 0.0" in text
        assert get(http.url + "/other")[0] == 404
    finally:
        http.stop()
        for p in gateway._pools.values():
            for e in p.engines:
                e.close()


def test_gateway_command_serves_grpc_and_metrics_and_stops_on_sigterm(tmp_path):
    root = make_repo(tmp_path / "repo")
    cmd = [sys.executable, "-c", "import sys; from splitinfer.gateway_cmd import gateway_main; "
           "sys.exit(gateway_main(sys.argv[1:]))",
           "--port", "0", "--metrics-port", "0", "--registry", root, "--ray-address", "local-noray",
           "--cache-dir", str(tmp_path / "cache"), "--log-format", "json"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        m = re.match(r"gateway serving on (\S+), metrics on (\S+)", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
        address, url = m.groups()
        with SyncInferenceClient(address) as c:
            for _ in range(200):
                if c.health() == "SERVING":
                    break
                import time

                time.sleep(0.05)
            assert c.health() == "SERVING"
            assert get(url + "/readyz")[0] == 200
            art = c.get_artifacts("m", "")
            front = json.loads(art.files["frontier.json"])
            cut = front["cuts"][0]
            x = np.ones((1, 4, 5, 5), np.float32)
            resp = c.infer(make_request("m", "", cut["cut_id"], {"x": x}, request_id="req-123"))
            assert resp.served_by == "m@1"
        _, metrics = get(url + "/metrics")
        assert 'splitinfer_requests_total{model="m",status="OK",version="1"} 1.0' in metrics
        assert 'splitinfer_batch_size_count 1.0' in metrics
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        logs = proc.stderr.read()
        lines = [json.loads(x) for x in logs.splitlines() if x.startswith("{")]
        assert any(rec["message"].startswith("gateway ready") for rec in lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
