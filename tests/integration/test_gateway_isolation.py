"""A gateway that isolates failures, over real gRPC on 127.0.0.1 with in-process pools: a
model that cannot load (a corrupt file) and a tail that ONNX Runtime refuses are marked
failed with their cause, the others serve, and /readyz, the health service, GetArtifacts,
the metric and the requests themselves say which failed and why."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import onnx
import pytest

from cluster.errors import FailedPrecondition
from cluster.gateway import Gateway, LocalPoolFactory
from cluster.metrics import GatewayMetrics, MetricsServer
from cluster.oip_rest import TAIL_MARK, OipRest
from cluster.protocol.client import SyncInferenceClient, make_request
from cluster.registry import Registry
from tests.integration._gateway_support import serving, write_version
from tests.integration.test_gateway_http import get
from tests.onnx_models import conv_bn_relu_chain
from tests.serving_models import any_hw_model, refused_model

pytestmark = pytest.mark.grpc


def _version(root, name: str, model: onnx.ModelProto | bytes) -> None:
    write_version(root, name, "1", model, "frontier: {default_cut_count: 2}\n")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    _version(root, "good", conv_bn_relu_chain(2))
    _version(root, "corrupt", b"\x08\x07 this is not an onnx model")
    _version(root, "partial", refused_model())
    registry = Registry(str(root), cache_dir=str(tmp_path_factory.mktemp("cache")))
    metrics = GatewayMetrics()
    gateway = Gateway(registry, LocalPoolFactory(cache_dir=str(tmp_path_factory.mktemp("ort"))), metrics=metrics)
    http = MetricsServer(metrics, gateway.readiness)
    try:
        with serving(gateway, start_timeout_s=120) as server:
            yield gateway, server, http
    finally:
        http.stop()


def test_the_good_models_serve_while_the_failed_ones_are_listed_with_their_cause(stack):
    gateway, server, http = stack
    code, body = get(http.url + "/readyz")
    detail = json.loads(body)
    assert code == 200 and detail["ready"] is True, detail
    assert sorted(detail["versions"]) == ["good@1", "partial@1"]
    failed = detail["failed"]
    assert set(failed) == {"corrupt@1", "partial@1@L"}, failed
    assert "cannot be parsed as ONNX" in failed["corrupt@1"] or "partitioner" in failed["corrupt@1"]
    assert "Tan" in failed["partial@1@L"]
    x = np.random.default_rng(0).standard_normal((1, 4, 5, 5)).astype(np.float32)
    with SyncInferenceClient(server.address) as c:
        assert c.infer(make_request("good", "1", "L", {"x": x})).outputs["y"].shape == (1, 3)
        # The tails after the refused operator load and serve.
        partial = gateway.registry.resolve("partial", "1")
        assert [cut for cut in partial.frontier.cut_ids if cut != "L"]
        for cut in partial.frontier.cuts:
            if cut.cut_id == "L":
                continue
            boundary = {name: np.ones((1, 4), np.float32) for name in cut.boundary}
            assert c.infer(make_request("partial", "1", cut.cut_id, boundary)).outputs["y"].shape == (1, 4)


def test_a_request_for_a_failed_model_or_tail_gets_failed_precondition_with_the_cause(stack):
    _, server, _ = stack
    with SyncInferenceClient(server.address) as c:
        with pytest.raises(FailedPrecondition) as e:
            c.infer(make_request("corrupt", "1", "L", {"x": np.zeros((1, 4), np.float32)}))
        assert "corrupt@1 is not served: failed: " in str(e.value)
        with pytest.raises(FailedPrecondition) as e:
            c.infer(make_request("corrupt", "", "L", {"x": np.zeros((1, 4), np.float32)}))
        assert "corrupt@1" in str(e.value)
        with pytest.raises(FailedPrecondition) as e:
            c.infer(make_request("partial", "1", "L", {"x": np.zeros((1, 4), np.float64)}))
        assert "the tail partial@1@L failed to load" in str(e.value) and "Tan" in str(e.value)
        # The server keeps serving after them.
        x = np.zeros((1, 4, 5, 5), np.float32)
        assert c.infer(make_request("good", "1", "L", {"x": x})).outputs["y"].shape == (1, 3)


def test_health_names_each_model_and_failed_tail(stack):
    _, server, _ = stack
    with SyncInferenceClient(server.address) as c:
        assert c.health() == "SERVING"
        assert c.health("good") == "SERVING" and c.health("good@1") == "SERVING"
        assert c.health("corrupt") == "NOT_SERVING" and c.health("corrupt@1") == "NOT_SERVING"
        assert c.health("partial@1") == "SERVING" and c.health("partial@1@L") == "NOT_SERVING"


def test_get_artifacts_says_which_tails_failed_and_why(stack):
    _, server, _ = stack
    with SyncInferenceClient(server.address) as c:
        files = c.get_artifacts("partial", "1").files
        failed = json.loads(files["failed_tails.json"])
        assert set(failed) == {"L"} and "Tan" in failed["L"]
        assert "failed_tails.json" not in c.get_artifacts("good", "1").files
        with pytest.raises(FailedPrecondition) as e:
            c.get_artifacts("corrupt", "1")
        assert "corrupt@1 is not served" in str(e.value)


def test_the_open_inference_protocol_door_reports_the_failed_tail_not_ready(stack):
    gateway, _, _ = stack
    oip = OipRest(gateway, loop=None)
    answer = oip.handle("GET", "/v2/models/partial/versions/1/ready", {})
    assert answer.status == 400 and "the tail partial@1@L failed to load" in json.loads(answer.body)["error"]
    later = [c for c in gateway.registry.resolve("partial", "1").frontier.cut_ids if c != "L"][0]
    assert oip.handle("GET", f"/v2/models/partial{TAIL_MARK}{later}/versions/1/ready", {}).status == 200
    index = {(m["name"], m["version"]): m for m in json.loads(oip.handle("POST", "/v2/repository/index", {}).body)}
    assert index[("partial", "1")]["state"] == "UNAVAILABLE" and "Tan" in index[("partial", "1")]["reason"]
    assert index[("good", "1")]["state"] == "READY"


def test_the_metric_counts_each_load_failure_by_reason(stack):
    _, _, http = stack
    _, text = get(http.url + "/metrics")
    lines = [line for line in text.splitlines() if line.startswith("splitinfer_model_load_failures_total{")]
    assert 'splitinfer_model_load_failures_total{model="corrupt",reason="registry",version="1"} 1.0' in lines, lines
    assert 'splitinfer_model_load_failures_total{model="partial",reason="optimise",version="1"} 1.0' in lines, lines
    assert not [line for line in lines if 'model="good"' in line]


def test_a_version_none_of_whose_tails_loads_fails_as_a_whole(tmp_path):
    d = tmp_path / "repo" / "bad" / "1"
    d.mkdir(parents=True)
    onnx.save(refused_model(), str(d / "model.onnx"))
    # Only the cloud-only cut: the one tail there is holds the refused operator.
    (d / "model.yaml").write_text("frontier: {default_cut_count: 0}\n")
    gateway, metrics, detail = start_beside_a_good_version(tmp_path)
    assert detail["failed"]["bad@1"].startswith("failed: ") and "no tail of bad@1 could be loaded" in \
        detail["failed"]["bad@1"]
    assert gateway.failed_tails() == {}  # listed once, as the version
    _, text = get_metrics(metrics)
    assert 'splitinfer_model_load_failures_total{model="bad",reason="optimise",version="1"} 1.0' in text


def test_sample_inputs_that_do_not_fit_the_model_fail_its_version_and_the_reason_says_so(tmp_path):
    d = tmp_path / "repo" / "hw" / "1"
    d.mkdir(parents=True)
    onnx.save(any_hw_model(), str(d / "model.onnx"))
    # Three channels where the model takes four: the registry refuses the version when it
    # sizes the model's graph at its sample inputs, before any tail is cut.
    np.savez(d / "inputs.npz", x=np.ones((1, 3, 4, 4), np.float32))
    (d / "model.yaml").write_text("sample_inputs: inputs.npz\nfrontier: {default_cut_count: 0}\n")
    gateway, metrics, detail = start_beside_a_good_version(tmp_path)
    reason = detail["failed"]["hw@1"]
    assert "input 'x'" in reason and "fixed at 4" in reason and "1x3x4x4" in reason
    _, text = get_metrics(metrics)
    assert 'splitinfer_model_load_failures_total{model="hw",reason="registry",version="1"} 1.0' in text


def start_beside_a_good_version(tmp_path) -> tuple[Gateway, GatewayMetrics, dict]:
    """Adds the good model `good@1` to the repository in `tmp_path / "repo"`, starts a gateway
    on it with keep_going and closes it again: the gateway, its metrics and its readiness
    detail, which must list `good@1` as the one version that serves."""
    _version(tmp_path / "repo", "good", conv_bn_relu_chain(2))
    registry = Registry(str(tmp_path / "repo"), cache_dir=str(tmp_path / "cache"))
    metrics = GatewayMetrics()
    gateway = Gateway(registry, LocalPoolFactory(cache_dir=str(tmp_path / "ort")), metrics=metrics)

    async def main():
        await gateway.start(keep_going=True)
        try:
            return gateway.readiness()
        finally:
            await gateway.close()

    ready, detail = asyncio.run(main())
    assert ready and detail["versions"] == ["good@1"]
    return gateway, metrics, detail


def get_metrics(metrics: GatewayMetrics) -> tuple[int, str]:
    http = MetricsServer(metrics, lambda: (True, {}))
    try:
        return get(http.url + "/metrics")
    finally:
        http.stop()
