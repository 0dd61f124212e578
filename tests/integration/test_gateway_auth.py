"""Auth and TLS of the gateway over real gRPC on 127.0.0.1.

Rejected calls never reach a worker: the tests count the calls that got past auth
and the batches the pools ran. Certificates are generated here, in tmp_path, with the
`cryptography` package; no key is ever committed.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import os

import numpy as np
import onnx
import pytest

from cluster.auth import Authorizer, TokenTable, load_channel_credentials, load_server_credentials
from cluster.errors import PermissionDenied, ResourceExhausted, Unauthenticated, Unavailable
from cluster.gateway import Gateway, LocalPoolFactory
from cluster.protocol.client import SyncInferenceClient, make_request
from cluster.registry import Registry
from cluster.server import serve_in_thread
from tests.onnx_models import conv_bn_relu_chain

pytestmark = pytest.mark.grpc

CAM = "camera-token-4f9a8b7c6d5e4f3a"
OPS = "ops-token-0a1b2c3d4e5f6a7b8c"


def make_repo(root) -> str:
    for model in ("m", "other"):
        d = os.path.join(root, model, "1")
        os.makedirs(d)
        onnx.save(conv_bn_relu_chain(2), os.path.join(d, "model.onnx"))
        with open(os.path.join(d, "model.yaml"), "w") as fh:
            fh.write("frontier: {default_cut_count: 0}\n")
    return str(root)


def tokens() -> TokenTable:
    return TokenTable.from_dicts([
        {"name": "camera", "token": CAM, "models": ["m"], "rate_limit_rps": 1000, "burst": 1000},
        {"name": "ops", "token": OPS},
    ])


def start(tmp_path, **serve_kwargs):
    registry = Registry(make_repo(tmp_path / "repo"))
    gateway = Gateway(registry, LocalPoolFactory(cache_dir=str(tmp_path / "ort")), authorizer=Authorizer(tokens()))
    registry.load_all()
    return registry, gateway, serve_in_thread(gateway, **serve_kwargs)


def stop(server, gateway) -> None:
    asyncio.run_coroutine_threadsafe(gateway.close(), server._loop).result()
    server.stop()


def batches(gateway) -> int:
    return sum(p.batches for p in gateway._pools.values())


def request(registry, model="m", **kw):
    cut = registry.resolve(model, "1").frontier.cuts[0]
    return make_request(model, "1", cut.cut_id, {"x": np.ones((1, 4, 5, 5), np.float32)}, **kw)


def test_tokens_and_allow_lists_over_grpc_never_reach_a_worker(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    registry, gateway, server = start(tmp_path)
    try:
        with SyncInferenceClient(server.address) as anon:
            with pytest.raises(Unauthenticated, match="no authorization"):
                anon.infer(request(registry))
            with pytest.raises(Unauthenticated):
                anon.get_artifacts("m", "1")
            # Health stays open: probes carry no token.
            assert anon.health() == "SERVING"
        with SyncInferenceClient(server.address, token="not-a-valid-token-at-all") as wrong:
            with pytest.raises(Unauthenticated, match="not known"):
                wrong.infer(request(registry))
        with SyncInferenceClient(server.address, token=CAM) as cam:
            with pytest.raises(PermissionDenied, match="'camera' may not infer model 'other'"):
                cam.infer(request(registry, "other"))
            with pytest.raises(PermissionDenied):
                cam.get_artifacts("other", "1")
            assert gateway.backend_calls == 0 and batches(gateway) == 0
            assert cam.infer(request(registry)).served_by == "m@1"
            assert cam.get_artifacts("m", "1").version == "1"
        with SyncInferenceClient(server.address, token=OPS) as ops:
            assert ops.infer(request(registry, "other")).served_by == "other@1"
        assert gateway.backend_calls == 2 and batches(gateway) == 2
        m = gateway.metrics
        assert m.sample("splitinfer_requests_total", {"model": "m", "version": "1", "status": "UNAUTHENTICATED"}) == 2
        assert m.sample("splitinfer_requests_total", {"model": "other", "version": "1", "status": "PERMISSION_DENIED"}) == 1
    finally:
        stop(server, gateway)
    assert CAM not in caplog.text and OPS not in caplog.text


def test_rate_limit_over_grpc(tmp_path):
    registry = Registry(make_repo(tmp_path / "repo"))
    table = TokenTable.from_dicts([{"name": "cam", "token": CAM, "rate_limit_rps": 0.001, "burst": 2}])
    gateway = Gateway(registry, LocalPoolFactory(cache_dir=str(tmp_path / "ort")), authorizer=Authorizer(table))
    registry.load_all()
    server = serve_in_thread(gateway)
    try:
        with SyncInferenceClient(server.address, token=CAM) as cam:
            cam.infer(request(registry, device_id="a"))
            cam.infer(request(registry, device_id="a"))
            with pytest.raises(ResourceExhausted, match="request rate of cam/a"):
                cam.infer(request(registry, device_id="a"))
            cam.infer(request(registry, device_id="b"))
        assert gateway.backend_calls == 3
    finally:
        stop(server, gateway)


def test_oversized_messages_are_refused(tmp_path):
    registry, gateway, server = start(tmp_path, max_message_bytes=4096)
    try:
        cut = registry.resolve("m", "1").frontier.cuts[0]
        big = make_request("m", "1", cut.cut_id, {"x": np.ones((4, 4, 16, 16), np.float32)})
        with SyncInferenceClient(server.address, token=CAM) as cam:
            with pytest.raises(ResourceExhausted):
                cam.infer(big)
        assert gateway.backend_calls == 0
    finally:
        stop(server, gateway)


# -- TLS ---------------------------------------------------------------------------------


def _certs(tmp_path, tag: str):
    """A CA, a server cert for 127.0.0.1 and a client cert, all signed by that CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(stem: str, key, cert) -> tuple[str, str]:
        kp, cp = tmp_path / f"{tag}-{stem}.key", tmp_path / f"{tag}-{stem}.crt"
        kp.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()))
        cp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return str(cp), str(kp)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name(f"{tag} test CA")).issuer_name(name(f"{tag} test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(hours=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))

    def leaf(cn: str, san: list) -> tuple:
        key = ec.generate_private_key(ec.SECP256R1())
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca.subject).public_key(key.public_key())
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(hours=1)))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return key, b.sign(ca_key, hashes.SHA256())

    ca_path, _ = write("ca", ca_key, ca)
    server = write("server", *leaf("localhost", [x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                 x509.DNSName("localhost")]))
    client = write("client", *leaf("device-1", []))
    return ca_path, server, client


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    return _certs(d, "good"), _certs(d, "evil")


def test_mutual_tls_accepts_only_clients_with_a_cert_from_the_ca(tmp_path, pki):
    (ca, (srv_crt, srv_key), (cli_crt, cli_key)), (evil_ca, _, (evil_crt, evil_key)) = pki
    creds = load_server_credentials(srv_crt, srv_key, client_ca_file=ca)
    registry, gateway, server = start(tmp_path, credentials=creds)
    try:
        good = load_channel_credentials(ca, cli_crt, cli_key)
        with SyncInferenceClient(server.address, credentials=good, token=CAM) as c:
            assert c.infer(request(registry)).served_by == "m@1"
        cases = {
            "no client cert": load_channel_credentials(ca),
            "client cert from another CA": load_channel_credentials(ca, evil_crt, evil_key),
            "server not trusted (wrong CA)": load_channel_credentials(evil_ca, cli_crt, cli_key),
            "server not trusted (system roots)": load_channel_credentials(None, cli_crt, cli_key),
        }
        for why, creds_c in cases.items():
            with SyncInferenceClient(server.address, credentials=creds_c, token=CAM) as c:
                with pytest.raises(Unavailable):
                    c.infer(request(registry), timeout_s=5)
                    pytest.fail(f"accepted: {why}")
        with SyncInferenceClient(server.address, token=CAM) as plain:
            with pytest.raises(Unavailable):
                plain.infer(request(registry), timeout_s=5)
        assert gateway.backend_calls == 1
    finally:
        stop(server, gateway)


def test_server_only_tls_with_token(tmp_path, pki):
    (ca, (srv_crt, srv_key), _), _ = pki
    registry, gateway, server = start(tmp_path, credentials=load_server_credentials(srv_crt, srv_key))
    try:
        with SyncInferenceClient(server.address, credentials=load_channel_credentials(ca), token=CAM) as c:
            assert c.infer(request(registry)).served_by == "m@1"
        with SyncInferenceClient(server.address, credentials=load_channel_credentials(ca)) as c:
            with pytest.raises(Unauthenticated):
                c.infer(request(registry))
    finally:
        stop(server, gateway)


class _Recording(LocalPoolFactory):
    """Real in-process pools that also record the priority each request is run at."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.priorities: list[int] = []

    def create(self, key, tail_path, config, metrics, *, sample_inputs=None):
        pool = super().create(key, tail_path, config, metrics, sample_inputs=sample_inputs)
        run, seen = pool.run, self.priorities

        async def recorded(inputs, *, deadline_s, priority):
            seen.append(priority)
            return await run(inputs, deadline_s=deadline_s, priority=priority)

        pool.run = recorded
        return pool


def test_a_tokens_max_priority_caps_the_priority_its_requests_are_run_at(tmp_path):
    """[Note: priority claims] in cluster/auth.py: the claim of a token capped at 0 is run at 0."""
    registry = Registry(make_repo(tmp_path / "repo"))
    table = TokenTable.from_dicts([{"name": "cam", "token": CAM, "max_priority": 0}, {"name": "ops", "token": OPS}])
    pools = _Recording(cache_dir=str(tmp_path / "ort"))
    gateway = Gateway(registry, pools, authorizer=Authorizer(table))
    registry.load_all()
    server = serve_in_thread(gateway)
    try:
        for token in (CAM, OPS):
            with SyncInferenceClient(server.address, token=token) as c:
                for claimed in (1, 0):
                    assert c.infer(request(registry, priority=claimed)).served_by == "m@1"
    finally:
        stop(server, gateway)
    assert pools.priorities == [0, 0, 1, 0]
