"""A running gateway (real gRPC on 127.0.0.1, real ORT pools) follows policy files that
change under it in a directory laid out as the kubelet lays out a mounted ConfigMap:
canary 0% -> 10% -> rollback without a restart, routing by the stable device hash,
in-flight requests finishing on their version, a malformed file keeping the last good
policy, and the policy text written by `splitinfer cluster rollout` through the FAKE
Kubernetes API server of _fake_k8s.py (no real cluster here)."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster._k8s_policy import compute_rollback, compute_rollout
from cluster.gateway import Gateway, LocalPoolFactory, PoolKey
from cluster.protocol.client import InferenceClient, SyncInferenceClient, make_request
from cluster.registry import Canary, Registry, route
from cluster.server import serve_in_thread
from tests.integration.test_gateway import make_repo, x_input
from tests.unit.test_registry_policy import write_configmap_dir

pytestmark = pytest.mark.grpc

BASE = "version_policy: {specific: ['1']}\ndefault_version: '1'\n"
# v2 holds a batch up to 1.5 s: canary requests stay in flight while the rollback lands.
SLOW_BATCH = "max_batch_size: 64\nmax_queue_delay_ms: 1500\n"
DEVICES = [f"cam-{i}" for i in range(40)]
POLL_S = 0.05


class Stack:
    def __init__(self, tmp_path, initial: dict[str, str]) -> None:
        self.policy_dir = tmp_path / "policies"
        write_configmap_dir(self.policy_dir, initial)
        root = make_repo(tmp_path / "repo", versions=(("1", ""), ("2", SLOW_BATCH)))
        self.registry = Registry(root, cache_dir=str(tmp_path / "cache"), policy_dir=str(self.policy_dir))
        self.gateway = Gateway(self.registry, LocalPoolFactory(cache_dir=str(tmp_path / "ort")), policy_poll_s=POLL_S)
        self.server = serve_in_thread(self.gateway)
        self.on_loop(self.gateway.start())
        self.cut_id = self.registry.resolve("m", "").frontier.cuts[0].cut_id

    def on_loop(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.server._loop).result(timeout=60)

    def write(self, data: dict[str, str]) -> None:
        """Changes the directory, then waits for two full polls after it (a timeout, not a measure)."""
        seen = self.gateway.policy_polls
        write_configmap_dir(self.policy_dir, data)
        deadline = time.monotonic() + 60
        while self.gateway.policy_polls < seen + 2:
            assert time.monotonic() < deadline, "the gateway stopped polling its policy directory"
            time.sleep(POLL_S / 2)

    def served_by(self, devices=DEVICES) -> dict[str, str]:
        async def run() -> dict[str, str]:
            async with InferenceClient(self.server.address) as c:
                rs = await asyncio.gather(*(c.infer(make_request("m", "", self.cut_id, {"x": x_input()}, device_id=d))
                                            for d in devices))
            return {d: r.served_by for d, r in zip(devices, rs)}

        return asyncio.run(run())

    def close(self) -> None:
        self.on_loop(self.gateway.close())
        self.server.stop()


@pytest.fixture()
def stack(tmp_path):
    s = Stack(tmp_path, {"m.policy.yaml": BASE})
    yield s
    s.close()


def test_rollout_and_rollback_reach_a_running_gateway(stack):
    reg, gw = stack.registry, stack.gateway
    assert reg.describe()["m"] == {"versions": ["1"], "default": "1", "canary": None}
    assert set(stack.served_by().values()) == {"m@1"}

    zero = compute_rollout("m", BASE, "2", 0.0)
    stack.write({"m.policy.yaml": zero})
    assert reg.canary("m") == Canary("2", 0.0)
    # v2's frontier tails were loaded before it joined routing, so readiness never dropped.
    assert PoolKey("m", "2", stack.cut_id) in gw._pools
    assert gw.readiness()[0]
    assert set(stack.served_by().values()) == {"m@1"}

    ten = compute_rollout("m", zero, "2", 10.0)
    stack.write({"m.policy.yaml": ten})
    want = {d: f"m@{route('m', '1', Canary('2', 10.0), d)}" for d in DEVICES}
    assert "m@2" in want.values() and "m@1" in want.values()
    assert stack.served_by() == want

    # Rollback with the canary devices' requests held in v2's batcher.
    canary_devs = [d for d, v in want.items() if v == "m@2"]
    v2 = reg.resolve("m", "2")

    async def in_flight_rollback() -> tuple[list, int, str]:
        async with InferenceClient(stack.server.address) as c:
            tasks = [asyncio.ensure_future(c.infer(make_request("m", "", stack.cut_id, {"x": x_input()},
                                                                device_id=d, timeout_s=30))) for d in canary_devs]
            while v2.in_flight < len(canary_devs):
                await asyncio.sleep(0.005)
            write_configmap_dir(stack.policy_dir, {"m.policy.yaml": compute_rollback("m", ten)[0]})
            while reg.canary("m") is not None:
                await asyncio.sleep(0.005)
            held = v2.in_flight
            after = await c.infer(make_request("m", "", stack.cut_id, {"x": x_input()}, device_id=canary_devs[0]))
            return list(await asyncio.gather(*tasks)), held, after.served_by

    results, held, after = asyncio.run(in_flight_rollback())
    assert held == len(canary_devs)  # the rollback landed while they were in flight
    assert [r.served_by for r in results] == ["m@2"] * len(canary_devs)
    assert after == "m@1"
    assert v2.drained.wait(10)
    assert set(stack.served_by().values()) == {"m@1"}
    for _ in range(500):
        if not any(k.version == "2" for k in gw._pools):
            break
        time.sleep(0.01)
    assert not any(k.version == "2" for k in gw._pools)
    assert gw.readiness()[0]


def test_a_malformed_file_keeps_the_last_good_policy_and_readiness(stack):
    reg, gw = stack.registry, stack.gateway
    ten = compute_rollout("m", BASE, "2", 10.0)
    stack.write({"m.policy.yaml": ten})
    before = reg.describe()
    want = stack.served_by()
    for bad in ("canary: [", "version_policy: {specific: ['1', '9']}\ncanary: {version: '9', percent: 50}\n"):
        stack.write({"m.policy.yaml": bad})
        assert reg.describe() == before
        assert stack.served_by() == want
        ready, detail = gw.readiness()
        assert ready, detail
        assert "m.policy.yaml" in detail["policy_errors"]["m"]
        with SyncInferenceClient(stack.server.address) as c:
            assert c.health() == "SERVING"
    # A fixed file applies again, and the error clears.
    stack.write({"m.policy.yaml": compute_rollback("m", ten)[0]})
    assert reg.describe()["m"] == {"versions": ["1"], "default": "1", "canary": None}
    assert gw.readiness()[1]["policy_errors"] == {}


def test_a_policy_written_by_cluster_rollout_lands_in_the_gateway(tmp_path):
    pytest.importorskip("kubernetes")
    from cluster.k8s import ClusterTarget, KubeOps, connect, make_policy_files
    from tests.integration._fake_k8s import FakeKubeApi, write_kubeconfig

    ns, release = "ml", "demo"
    api = FakeKubeApi().start()
    stack = None
    try:
        cm_path = api.add_configmap(ns, f"{release}-registry")  # the chart creates it empty
        kubeconfig = write_kubeconfig(str(tmp_path / "kubeconfig"), api.url, namespace=ns)
        ops = KubeOps(connect("kubeconfig", kubeconfig=kubeconfig), ClusterTarget(namespace=ns, release=release),
                      sleep=lambda s: None)

        def kubelet_sync() -> None:
            """What the kubelet does with the ConfigMap volume: its data, key by key, into the directory."""
            data = api.objects[cm_path].get("data") or {}
            assert set(make_policy_files(data)) == {f"{k[:-len('.policy.yaml')]}/policy.yaml" for k in data}
            stack.write(dict(data))

        stack = Stack(tmp_path, {})
        assert stack.registry.describe()["m"]["versions"] == ["2"]  # no policy yet: --version-policy latest:1
        ops.rollout("m", "2", 10.0, default_version="1")
        kubelet_sync()
        want = {d: f"m@{route('m', '1', Canary('2', 10.0), d)}" for d in DEVICES}
        assert stack.served_by() == want
        assert ops.rollback("m") == "2"
        kubelet_sync()
        assert stack.registry.describe()["m"] == {"versions": ["1"], "default": "1", "canary": None}
        assert set(stack.served_by().values()) == {"m@1"}
    finally:
        if stack is not None:
            stack.close()
        api.stop()


def test_gateway_command_applies_a_rollout_from_its_policy_dir(tmp_path):
    import json
    import os
    import re
    import signal
    import subprocess
    import sys

    from tests.integration.test_gateway_http import ROOT, get

    policy_dir = tmp_path / "policies"
    write_configmap_dir(policy_dir, {"m.policy.yaml": BASE})
    root = make_repo(tmp_path / "repo")
    cmd = [sys.executable, "-c", "import sys; from splitinfer.gateway_cmd import gateway_main; "
           "sys.exit(gateway_main(sys.argv[1:]))",
           "--port", "0", "--metrics-port", "0", "--registry", root, "--ray-address", "local-noray",
           "--cache-dir", str(tmp_path / "cache"), "--policy-dir", str(policy_dir), "--policy-poll-s", "0.1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
    try:
        m = re.match(r"gateway serving on (\S+), metrics on (\S+)", proc.stdout.readline())
        assert m, proc.stderr.read() if proc.poll() is not None else ""
        address, url = m.groups()

        def wait_for(check) -> None:
            deadline = time.monotonic() + 60
            while not check():
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)

        def readyz() -> dict:
            return json.loads(get(url + "/readyz")[1])

        wait_for(lambda: get(url + "/readyz")[0] == 200)
        assert readyz()["versions"] == ["m@1"]
        write_configmap_dir(policy_dir, {"m.policy.yaml": compute_rollout("m", BASE, "2", 50.0)})
        wait_for(lambda: sorted(readyz()["versions"]) == ["m@1", "m@2"])
        with SyncInferenceClient(address) as c:
            assert c.health() == "SERVING"
            for d in DEVICES[:10]:
                assert c.get_artifacts("m", "", device_id=d).version == route("m", "1", Canary("2", 50.0), d)
        write_configmap_dir(policy_dir, {"m.policy.yaml": "canary: ["})
        wait_for(lambda: "m" in readyz().get("policy_errors", {}))
        assert get(url + "/readyz")[0] == 200 and sorted(readyz()["versions"]) == ["m@1", "m@2"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert "keeping the last good one" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(("extra", "needle"), [
    (["--policy-dir", "/nonexistent/policies"], "--policy-dir '/nonexistent/policies' is not a directory"),
    (["--policy-dir", ".", "--policy-poll-s", "0"], "--policy-poll-s 0.0 must be > 0"),
])
def test_gateway_command_rejects_a_bad_policy_flag(tmp_path, capsys, extra, needle):
    from splitinfer.gateway_cmd import _check_args, make_parser

    p = make_parser()
    with pytest.raises(SystemExit):
        _check_args(p, p.parse_args(["--registry", str(tmp_path), *extra]))
    assert needle in capsys.readouterr().err


def test_gateway_rejects_a_non_positive_poll_interval(tmp_path):
    with pytest.raises(ValueError, match="policy_poll_s 0 must be > 0"):
        Gateway(Registry(str(tmp_path)), LocalPoolFactory(), policy_poll_s=0)
