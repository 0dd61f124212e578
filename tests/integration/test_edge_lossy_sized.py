"""The agent against the real gateway on a model with symbolic input dims: it plans at
model.yaml's input_shapes (shipped by GetArtifacts), so within its budget it places the
jpeg the registry's accuracy.json measured, and encodes the frame with the table's image
normalisation, so the bytes it sends are those the table measured."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from cluster.protocol.encoding import decode, encode
from cluster.protocol.lossy import ImageNorm
from partitioner import build_graph
from planner.accuracy import AccuracyEntry, AccuracyTable
from tests.integration._edge_support import gateway_and_agent, slow_device_profile
from tests.integration.test_gateway_lossy import frame
from tests.unit.test_edge_planning_graph import symbolic_image_model

pytestmark = [pytest.mark.grpc, pytest.mark.timeout(180)]


@pytest.mark.parametrize("declared", ["input_shapes", "sample_inputs", ""])
def test_the_agent_sizes_a_symbolic_model_and_sends_the_measured_jpeg(tmp_path, declared):
    d = tmp_path / "registry" / "img" / "1"
    os.makedirs(d)
    src = str(d / "model.onnx")
    onnx.save(symbolic_image_model(), src)
    x, norm = frame(), ImageNorm.imagenet()
    if declared == "input_shapes":
        (d / "model.yaml").write_text("input_shapes: {x: [1, 3, 32, 32]}\n")
    elif declared == "sample_inputs":  # GetArtifacts ships the file with model.yaml
        np.savez(d / "inputs.npz", x=x)
        (d / "model.yaml").write_text("sample_inputs: inputs.npz\n")
    jpeg = encode(x, precision="jpeg", level=90, norm=norm)  # what calibrate measures with the declared norm
    table = AccuracyTable("img", "f", 4, (AccuracyEntry("L", "jpeg@90", 0.995, "y", "rel_l2", 4,
                                                        float(jpeg.wire_bytes), 0.01),), image_norm=norm.to_dict())
    (d / "accuracy.json").write_text(table.to_json())
    prof = tmp_path / "device.json"
    prof.write_text(slow_device_profile(build_graph(src, input_shapes={"x": (1, 3, 32, 32)})).to_json())

    async def go():
        async with gateway_and_agent(tmp_path, "img", prof, minAgreement=0.99) as (gateway, agent):
            keys = {e.plan.encoding.key for e in agent.frontier.entries}
            answers = [await agent.infer({"x": x}, None) for _ in range(2)] if declared else []
            return keys, agent.image_norm, answers

    keys, agent_norm, answers = asyncio.run(go())
    assert agent_norm == norm
    if not declared:
        assert "jpeg@90" not in keys  # an unknown frame size cannot be priced through a codec
        return
    assert keys == {"jpeg@90"}
    on_decoded = ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, {"x": decode(jpeg)})[0]
    for a in answers:
        assert (a["served_by"], a["cut_id"], a["encoding"]) == ("remote", "L", "jpeg@90")
        np.testing.assert_allclose(a["outputs"]["y"], on_decoded, rtol=1e-4, atol=1e-4)
