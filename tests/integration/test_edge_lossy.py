"""The agent within an accuracy budget against the real gateway: edge.yaml's min_agreement,
the registry's accuracy.json shipped by GetArtifacts, and the frame sent as a JPEG."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from cluster.protocol.encoding import decode, encode
from partitioner import Splitter
from planner.accuracy import AccuracyEntry, AccuracyTable
from tests.integration._edge_support import gateway_and_agent, slow_device_profile
from tests.integration.test_gateway_lossy import frame, image_model

pytestmark = [pytest.mark.grpc, pytest.mark.timeout(180)]


def test_the_agent_sends_the_frame_as_a_jpeg_within_its_budget(tmp_path):
    d = tmp_path / "registry" / "img" / "1"
    os.makedirs(d)
    src = str(d / "model.onnx")
    onnx.save(image_model(), src)
    x = frame()
    jpeg = encode(x, precision="jpeg", level=90)
    # What calibrate would record: the frame as jpeg@90 at the empty cut, its bytes and a small codec time.
    table = AccuracyTable("img", "f", 4, (AccuracyEntry("L", "jpeg@90", 0.995, "y", "rel_l2", 4,
                                                        float(jpeg.wire_bytes), 0.01),))
    (d / "accuracy.json").write_text(table.to_json())
    prof = tmp_path / "device.json"
    prof.write_text(slow_device_profile(Splitter(src).graph).to_json())

    async def go():
        async with gateway_and_agent(tmp_path, "img", prof, minAgreement=0.99) as (gateway, agent):
            keys = {e.plan.encoding.key for e in agent.frontier.entries}
            answers = [await agent.infer({"x": x}, None) for _ in range(3)]
            return keys, answers

    keys, answers = asyncio.run(go())
    assert keys == {"jpeg@90"}
    sess = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    on_decoded = sess.run(None, {"x": decode(jpeg)})[0]
    for a in answers:
        assert (a["served_by"], a["cut_id"], a["encoding"]) == ("remote", "L", "jpeg@90")
        np.testing.assert_allclose(a["outputs"]["y"], on_decoded, rtol=1e-4, atol=1e-4)
