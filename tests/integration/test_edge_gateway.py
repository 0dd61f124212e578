"""The agent against the real gateway (cluster.gateway with in-process pools, no Ray)."""

import asyncio
import os
import shutil

import numpy as np
import onnxruntime as ort
import pytest

from partitioner import Splitter
from tests.integration._edge_support import gateway_and_agent, slow_device_profile, write_model

pytestmark = [pytest.mark.grpc, pytest.mark.timeout(180)]


def test_agent_fetches_from_and_offloads_to_the_gateway(tmp_path):
    src = write_model(tmp_path)
    os.makedirs(tmp_path / "registry" / "chain" / "1")
    shutil.copy(src, tmp_path / "registry" / "chain" / "1" / "model.onnx")
    prof = tmp_path / "device.json"
    prof.write_text(slow_device_profile(Splitter(src).graph).to_json())
    x = np.random.default_rng(0).standard_normal((1, 4, 5, 5)).astype(np.float32)

    async def go():
        async with gateway_and_agent(tmp_path, "chain", prof) as (gateway, agent):
            answers = [await agent.infer({"x": x}, None) for _ in range(3)]
            return answers, agent.status(), gateway.backend_calls

    answers, status, calls = asyncio.run(go())
    ref = ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert status["model"] == "chain@1" and status["artifacts"] == "gateway"
    assert [a["served_by"] for a in answers] == ["remote"] * 3
    assert calls == 3 + status["counters"]["probes"]  # plus the start-up link probe
    for a in answers:
        np.testing.assert_allclose(a["outputs"]["y"], ref, rtol=1e-3, atol=1e-4)
