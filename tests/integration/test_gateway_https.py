"""HTTPS on the gateway's HTTP port: the gRPC port's certificate and key serve /metrics, the
probes and the OIP REST door, with tritonclient HTTP and the standard library as clients.

Certificates are made at test time (tests.integration.test_gateway_auth._certs); with a client
CA the port asks for a client certificate and refuses, with 403, a request without one on all
paths but /healthz and /readyz (kubelet's probes send none).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest

from cluster.auth import AuthConfigError, load_http_tls_context
from tests.integration._oip_support import AUTH, oip_door
from tests.integration.test_gateway_auth import _certs
from tests.onnx_models import conv_bn_relu_chain

triton = pytest.importorskip("tritonclient.http", reason="the test extra installs tritonclient[http]")

pytestmark = pytest.mark.grpc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    return _certs(d, "good"), _certs(d, "evil")


def client_context(ca: str, cert: tuple[str, str] | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=ca)
    if cert is not None:
        ctx.load_cert_chain(*cert)
    return ctx


def get(host: str, path: str, ctx: ssl.SSLContext, method: str = "GET", body: bytes | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPSConnection(host, timeout=10, context=ctx)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def ort_run(model: str, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_https_serves_metrics_probes_and_the_oip_door_to_tritonclient(tmp_path, pki):
    (ca, server, _), _ = pki
    with oip_door(str(tmp_path), tls=load_http_tls_context(*server)) as d:
        assert d.url.startswith("https://")
        ctx = client_context(ca)
        for path in ("/healthz", "/readyz", "/metrics"):
            assert get(d.host, path, ctx)[0] == 200, path
        x = np.random.default_rng(3).random((1, 4, 5, 5), dtype=np.float32)
        c = triton.InferenceServerClient(d.host, ssl=True, ssl_options={"ca_certs": ca})
        try:
            assert c.is_server_live() and c.is_model_ready("m", headers=dict(AUTH))
            for binary in (True, False):
                i = triton.InferInput("x", list(x.shape), "FP32")
                i.set_data_from_numpy(x, binary_data=binary)
                r = c.infer("m", [i], headers=dict(AUTH))
                np.testing.assert_allclose(r.as_numpy("y"), ort_run(d.model_path, x), rtol=1e-5, atol=1e-5)
        finally:
            c.close()
        # Nothing in clear: a plain HTTP request is a failed handshake, and the port lives on.
        plain = http.client.HTTPConnection(d.host, timeout=10)
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            plain.request("GET", "/healthz")
            plain.getresponse()
        plain.close()
        # A client that trusts another CA refuses the server's certificate.
        with pytest.raises(ssl.SSLCertVerificationError):
            get(d.host, "/healthz", client_context(pki[1][0]))
        assert get(d.host, "/healthz", ctx)[0] == 200


def test_a_client_stalled_in_its_handshake_holds_no_one_else(tmp_path, pki):
    (ca, server, _), _ = pki
    with oip_door(str(tmp_path), tls=load_http_tls_context(*server)) as d:
        host, port = d.host.split(":")
        stalled = [socket.create_connection((host, int(port))) for _ in range(3)]  # never say hello
        try:
            t0 = time.monotonic()
            assert get(d.host, "/healthz", client_context(ca))[0] == 200
            assert time.monotonic() - t0 < 5.0  # not behind the stalled clients' 10 s handshake limit
        finally:
            for s in stalled:
                s.close()


def test_mutual_tls_answers_probes_without_a_client_certificate_and_nothing_else(tmp_path, pki):
    (ca, server, client), (_, _, evil_client) = pki
    with oip_door(str(tmp_path), tls=load_http_tls_context(*server, client_ca_file=ca)) as d:
        anonymous = client_context(ca)
        assert get(d.host, "/healthz", anonymous)[0] == 200
        assert get(d.host, "/readyz?load=1", anonymous)[0] == 200
        status, body = get(d.host, "/metrics", anonymous)
        assert status == 403 and b"--tls-client-ca" in body
        good = json.dumps({"inputs": [{"name": "x", "shape": [1, 4, 5, 5], "datatype": "FP32",
                                       "data": [0.5] * 100}]}).encode()
        for method, path, body in (("GET", "/v2/models/m", None), ("POST", "/v2/models/m/infer", good)):
            status, out = get(d.host, path, anonymous, method, body, dict(AUTH))
            assert status == 403 and "client certificate" in json.loads(out)["error"], (path, out)
        signed = client_context(ca, client)
        assert get(d.host, "/metrics", signed)[0] == 200
        status, out = get(d.host, "/v2/models/m/infer", signed, "POST", good, dict(AUTH))
        assert status == 200 and len(json.loads(out)["outputs"][0]["data"]) == 3
        c = triton.InferenceServerClient(d.host, ssl=True, ssl_options={
            "ca_certs": ca, "certfile": client[0], "keyfile": client[1]})
        try:
            assert c.get_model_metadata("m", headers=dict(AUTH))["name"] == "m"
        finally:
            c.close()
        # A certificate from another CA fails the handshake: the request never reaches a handler.
        with pytest.raises((ssl.SSLError, ConnectionError)):
            get(d.host, "/healthz", client_context(ca, evil_client))
        assert get(d.host, "/healthz", anonymous)[0] == 200


def test_a_key_that_does_not_match_the_certificate_is_an_error_naming_the_file(tmp_path, pki):
    (ca, (crt, _), (_, client_key)), _ = pki
    with pytest.raises(AuthConfigError, match="do not load") as e:
        load_http_tls_context(crt, client_key)
    assert e.value.path == crt
    with pytest.raises(AuthConfigError, match="not PEM"):
        (tmp_path / "x.crt").write_text("hello")
        load_http_tls_context(str(tmp_path / "x.crt"), client_key)


def test_the_gateway_command_with_a_certificate_serves_https_on_its_metrics_port(tmp_path, pki):
    (ca, (crt, key), _), _ = pki
    root = tmp_path / "repo" / "m" / "1"
    root.mkdir(parents=True)
    onnx.save(conv_bn_relu_chain(2), str(root / "model.onnx"))
    cmd = [sys.executable, "-c", "import sys; from splitinfer.gateway_cmd import gateway_main; "
           "sys.exit(gateway_main(sys.argv[1:]))",
           "--port", "0", "--metrics-port", "0", "--registry", str(tmp_path / "repo"), "--ray-address", "local-noray",
           "--cache-dir", str(tmp_path / "cache"), "--tls-cert", crt, "--tls-key", key]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        line = proc.stdout.readline()
        m = re.match(r"gateway serving on (\S+), metrics on https://(\S+)", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
        host = m.group(2)
        deadline = time.monotonic() + 60
        while get(host, "/readyz", client_context(ca))[0] != 200:
            assert time.monotonic() < deadline and proc.poll() is None, "the gateway did not turn ready"
            time.sleep(0.1)
        status, out = get(host, "/v2/models/m", client_context(ca))
        assert status == 200 and json.loads(out)["inputs"][0]["name"] == "x"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
