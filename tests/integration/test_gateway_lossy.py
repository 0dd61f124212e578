"""A real gateway on loopback receiving the model input as a JPEG (the cloud-only cut).

The gateway decodes the lossy record before the tail runs, so its answer equals the
whole model run on the decoded input; bad lossy records are INVALID_ARGUMENT and the
server keeps serving.
"""

from __future__ import annotations

import os
import struct

import grpc
import msgpack
import numpy as np
import onnx
import pytest

from cluster.errors import ProtocolError
from cluster.gateway import Gateway, LocalPoolFactory
from cluster.protocol.client import SyncInferenceClient, make_request
from cluster.protocol.encoding import decode, encode
from cluster.protocol.lossy import ImageNorm
from cluster.protocol.tensors import EXT_ENCODED, read_ext
from cluster.registry import Registry
from tests.integration._gateway_support import serving, write_version
from tests.onnx_models import image_classifier

pytestmark = pytest.mark.grpc

H = W = 32


def image_model() -> onnx.ModelProto:
    """x [1, 3, 32, 32] -> Conv(3->8) -> Relu -> GlobalAveragePool -> Flatten -> Gemm -> y [1, 5]."""
    return image_classifier(H, W)


def frame() -> np.ndarray:
    """A smooth camera-like frame, ImageNet-normalised."""
    yy, xx = np.mgrid[0:H, 0:W] / H
    pixels = np.stack([0.5 + 0.4 * np.sin(4 * xx + k) * np.cos(3 * yy - k) for k in range(3)])[None]
    mean, std = np.array((0.485, 0.456, 0.406)), np.array((0.229, 0.224, 0.225))
    return ((pixels - mean[None, :, None, None]) / std[None, :, None, None]).astype(np.float32)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    d = write_version(root, "img", "1", image_model(), "frontier: {default_cut_count: 1}\n")
    registry = Registry(str(root), cache_dir=str(tmp_path_factory.mktemp("cache")))
    gateway = Gateway(registry, LocalPoolFactory(cache_dir=str(tmp_path_factory.mktemp("ort"))))
    registry.load("img", "1")
    with serving(gateway) as server:
        yield os.path.join(d, "model.onnx"), server


def whole_model(path: str, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    return ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("precision,level,norm", [("jpeg", 90, ImageNorm.imagenet()), ("webp", 80, None)])
def test_a_jpeg_model_input_is_decoded_before_the_tail_runs(served, precision, level, norm) -> None:
    path, server = served
    x = frame()
    t = encode(x, precision=precision, level=level, norm=norm)
    assert t.wire_bytes < x.nbytes / 4  # what a camera app sends instead of the tensor
    decoded = decode(t)
    want = whole_model(path, decoded)
    with SyncInferenceClient(server.address) as c:
        resp = c.infer(make_request("img", "1", "L", {"x": t}, timeout_s=30.0))
    np.testing.assert_allclose(resp.outputs["y"], want, rtol=1e-4, atol=1e-4)
    # ...and within the codec's error of the model on the original frame.
    exact = whole_model(path, x)
    assert np.abs(resp.outputs["y"] - exact).max() < 0.05 * np.abs(exact).max()


def _bad_jpeg_request(body: bytes, level: int = 90) -> bytes:
    good = make_request("img", "1", "L", {"x": encode(frame(), precision="jpeg")}, timeout_s=30.0).to_msgpack()
    shape = (1, 3, H, W)
    rec = (struct.pack("<BBBBbBH", 1, 3, 0, 4, 1, 0, level) + struct.pack("<4Q", *shape)
           + struct.pack("<BBHI", 1, 0, 0, 1) + np.zeros(6, "<f4").tobytes() + struct.pack("<I", len(body)) + body)
    if 1 <= level <= 100:
        read_ext(EXT_ENCODED, memoryview(rec), 0)  # the header is valid: only the frame is bad
    d = msgpack.unpackb(good, ext_hook=lambda c, b: msgpack.ExtType(c, b), raw=False)
    d["tensors"]["x"] = msgpack.ExtType(EXT_ENCODED, rec)
    return msgpack.packb(d)


@pytest.mark.parametrize("body,level,match", [
    (b"garbage, not an image", 90, "does not decode"),
    (b"", 90, "does not decode"),
    (b"\xff\xd8\xff" + bytes(40), 90, "does not decode"),
    (b"xx", 0, "quality 0, outside 1..100"),
])
def test_bad_lossy_inputs_are_invalid_argument_and_the_server_lives(served, body, level, match) -> None:
    path, server = served
    channel = grpc.insecure_channel(server.address)
    infer = channel.unary_unary("/splitinfer.v1.Inference/Infer")
    with pytest.raises(grpc.RpcError) as e:
        infer(_bad_jpeg_request(body, level), timeout=30.0)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert match in e.value.details()
    channel.close()
    # A JPEG of another size is refused too, naming both sizes.
    other = encode(np.zeros((1, 3, 8, 8), np.float32), precision="jpeg")
    with SyncInferenceClient(server.address) as c:
        with pytest.raises(ProtocolError, match="8x8, the shape needs 32x32"):
            c.infer(make_request("img", "1", "L", {"x": _resized(other)}, timeout_s=30.0))
        ok = c.infer(make_request("img", "1", "L", {"x": encode(frame(), precision="jpeg")}, timeout_s=30.0))
    assert ok.outputs["y"].shape == (1, 5)


def _resized(t):
    import dataclasses

    return dataclasses.replace(t, shape=(1, 3, H, W))
