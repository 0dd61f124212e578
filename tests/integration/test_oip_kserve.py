"""The OIP doors with the KServe Python client (kserve.InferenceRESTClient and InferenceGRPCClient),
unchanged, against a real gateway.

KServe's clients cover health, model readiness and inference (they have no metadata or
configuration calls; tritonclient's tests cover those). Every answer is compared with ONNX
Runtime on the same model: the whole model as `m`, and each preloaded tail as `m.tail.<cut>` fed
the boundary tensors the head (run by ONNX Runtime) computes. `pip install splitinfer[test]`
installs kserve; without it the module skips.
"""

from __future__ import annotations

import asyncio

import grpc
import httpx
import numpy as np
import pytest

from tests.integration import _oip_grpc_support, _oip_support

kserve = pytest.importorskip("kserve", reason="the test extra installs kserve (pip install splitinfer[test])")

pytestmark = pytest.mark.grpc

REST_AUTH = dict(_oip_support.AUTH)
GRPC_AUTH = tuple(_oip_grpc_support.AUTH.items())


@pytest.fixture(scope="module")
def rest_door(tmp_path_factory):
    with _oip_support.oip_door(str(tmp_path_factory.mktemp("kserve-rest"))) as d:
        yield d


@pytest.fixture(scope="module")
def grpc_door(tmp_path_factory):
    with _oip_grpc_support.oip_grpc_door(str(tmp_path_factory.mktemp("kserve-grpc"))) as d:
        yield d


def ort_run(model, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def tail_cases(door, models, x: np.ndarray) -> list[tuple[str, dict[str, np.ndarray]]]:
    """(OIP model name, its inputs) of each preloaded tail, fed the head's boundary tensors for `x`."""
    lv = door.gateway.registry.resolve("m", "")
    out = []
    for cut in [c for c in lv.frontier.cut_ids if c != "L"]:
        head, _ = lv.files.splitter().split(lv.files.resolve_cut(cut))
        boundary = ort_run(head.model.SerializeToString(), {"x": x})
        name = f"m.tail.{cut}"
        tail_lv, cut_id = models.resolve(name, "")
        meta = models.metadata(name, tail_lv, models.signature(tail_lv, cut_id))
        out.append((name, {i["name"]: boundary[i["name"]] for i in meta["inputs"]}))
    assert out, "the default frontier preloads chain cuts besides the empty one"
    return out


def request(model: str, arrays: dict[str, np.ndarray], *, binary: bool = True):
    inputs = []
    for name, a in arrays.items():
        i = kserve.InferInput(name, list(a.shape), "FP32")
        i.set_data_from_numpy(a, binary_data=binary)
        inputs.append(i)
    return kserve.InferRequest(model_name=model, infer_inputs=inputs)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_rest_client_health_readiness_and_infer_on_the_whole_model_and_each_tail(rest_door, binary):
    x = np.random.default_rng(7).random((1, 4, 5, 5), dtype=np.float32)
    want = ort_run(rest_door.model_path, {"x": x})["y"]
    cases = [("m", {"x": x})] + tail_cases(rest_door, rest_door.oip.models, x)

    async def run() -> None:
        client = kserve.InferenceRESTClient(kserve.RESTConfig(protocol="v2", retries=0))
        try:
            assert await client.is_server_live(rest_door.url)
            assert await client.is_server_ready(rest_door.url)
            for name, feeds in cases:
                assert await client.is_model_ready(rest_door.url, name, headers=REST_AUTH)
                r = await client.infer(rest_door.url, request(name, feeds, binary=binary), model_name=name,
                                       headers=dict(REST_AUTH))
                np.testing.assert_allclose(r.get_output_by_name("y").as_numpy(), want, rtol=1e-5, atol=1e-5,
                                           err_msg=name)
            with pytest.raises(httpx.HTTPStatusError) as e:
                await client.infer(rest_door.url, request("nope", {"x": x}), model_name="nope",
                                   headers=dict(REST_AUTH))
            assert e.value.response.status_code == 404 and "nope" in e.value.response.json()["error"]
            with pytest.raises(httpx.HTTPStatusError) as e:
                await client.infer(rest_door.url, request("m", {"x": x[:, :3]}), model_name="m",
                                   headers=dict(REST_AUTH))
            assert e.value.response.status_code == 400
        finally:
            await client.close()

    asyncio.run(run())


def test_grpc_client_health_readiness_and_infer_on_the_whole_model_and_each_tail(grpc_door):
    x = np.random.default_rng(8).random((1, 4, 5, 5), dtype=np.float32)
    want = ort_run(grpc_door.model_path, {"x": x})["y"]
    cases = [("m", {"x": x})] + tail_cases(grpc_door, grpc_door.models, x)

    async def run() -> None:
        client = kserve.InferenceGRPCClient(grpc_door.host, retries=0)
        try:
            assert await client.is_server_live(headers=GRPC_AUTH)
            assert await client.is_server_ready(headers=GRPC_AUTH)
            for name, feeds in cases:
                assert await client.is_model_ready(name, headers=GRPC_AUTH)
                r = await client.infer(request(name, feeds), headers=GRPC_AUTH)
                np.testing.assert_allclose(r.get_output_by_name("y").as_numpy(), want, rtol=1e-5, atol=1e-5,
                                           err_msg=name)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.infer(request("nope", {"x": x}), headers=GRPC_AUTH)
            assert e.value.code() is grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.infer(request("m", {"x": x[:, :3]}), headers=GRPC_AUTH)
            assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        finally:
            await client.close()

    asyncio.run(run())
