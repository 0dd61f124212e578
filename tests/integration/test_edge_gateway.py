"""The agent against the real gateway (cluster.gateway with in-process pools, no Ray)."""

import asyncio
import os
import shutil

import numpy as np
import onnxruntime as ort
import pytest

from cluster.protocol.errors import UnknownCutError
from partitioner import Splitter
from splitinfer.netem import LinkSetting
from tests.integration._edge_support import (
    TailBackend,
    fixed_frontier,
    gateway_and_agent,
    one_cut,
    runner_over_link,
    slow_device_profile,
    write_model,
)

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


def test_agent_loads_at_start_the_cuts_of_its_frontier_the_gateway_did_not_preload(tmp_path):
    """[Note: cuts the gateway has not loaded]: the registry preloads one chain point only (no
    profiles, no cloud-only cut), and this slow device's frontier offloads elsewhere."""
    src = write_model(tmp_path)
    vdir = tmp_path / "registry" / "chain" / "1"
    os.makedirs(vdir)
    shutil.copy(src, vdir / "model.onnx")
    (vdir / "model.yaml").write_text("frontier: {include_cloud_only: false, default_cut_count: 1}\n")
    prof = tmp_path / "device.json"
    prof.write_text(slow_device_profile(Splitter(src).graph).to_json())
    x = np.random.default_rng(0).standard_normal((1, 4, 5, 5)).astype(np.float32)

    async def go():
        async with gateway_and_agent(tmp_path, "chain", prof) as (gateway, agent):
            preloaded = {c.cut_id for lv in gateway.registry.loaded() for c in lv.frontier.cuts}
            agent_cuts = {e.plan.cut.key for e in agent.frontier.entries if e.plan.boundary}
            pools_at_start = gateway.readiness()[1]["pools"]
            answer = await agent.infer({"x": x}, None)
            return preloaded, agent_cuts, pools_at_start, gateway.readiness()[1]["pools"], answer, agent.status()

    preloaded, agent_cuts, pools_at_start, pools_after, answer, status = asyncio.run(go())
    missing = sorted(agent_cuts - preloaded)
    assert len(preloaded) == 1 and missing, (preloaded, agent_cuts)
    assert status["gateway_warmed"] == missing and status["counters"]["gateway_warmups"] == len(missing)
    # loaded before the agent was ready; the first request found its tail there
    assert pools_at_start == len(preloaded) + len(missing) == pools_after
    assert answer["served_by"] == "remote" and answer["cut_id"] in missing


def test_a_cut_the_gateway_refuses_to_load_at_start_is_not_offloaded_at(tmp_path):
    path, models, cut, _, _ = one_cut(tmp_path)

    async def go():
        async with runner_over_link(models, fixed_frontier(models.graph, cut), path, cut.key, tmp_path / "server-cache",
                                    LinkSetting.from_mbps(100, 100, 1), {"model": "chain@1"},
                                    local_ms=50.0) as (runner, backend, _):
            backend.fail = UnknownCutError(model="chain", version="1", cut_id=cut.key)
            warmed = await runner.warm_gateway(frozenset(), 5.0)
            return warmed, set(runner.unusable_cuts), backend.calls, runner.status()["warm_cuts"]

    warmed, unusable, calls, warm_cuts = asyncio.run(go())
    assert warmed == [] and unusable == {cut.key} and calls == 1 and cut.key not in warm_cuts


class _LoadingBackend(TailBackend):
    """Its first answer waits `load_s`, as a gateway's does while a tail loads, and says so in
    `timings_ms['load']` when `says` ([Note: tail load time] in cluster/gateway.py)."""

    load_s, says = 1.0, True

    async def infer(self, request, context):
        first = self.calls == 0
        if first:
            await asyncio.sleep(self.load_s)
        resp = await super().infer(request, context)
        if first and self.says:
            resp.timings_ms["load"] = self.load_s * 1e3
        return resp


class _SilentLoadingBackend(_LoadingBackend):
    says = False


def test_a_tails_load_time_is_not_learnt_as_the_links_or_the_paths(tmp_path):
    """The same second of load, said and not said: said, the link's estimate and the plan's record
    of answers (what the hedge starts from) leave it out; not said, both read it as the round trip's."""
    path, models, cut, x, _ = one_cut(tmp_path)

    async def one(backend_cls, tag):
        async with runner_over_link(models, fixed_frontier(models.graph, cut), path, cut.key,
                                    tmp_path / f"server-cache-{tag}", LinkSetting.from_mbps(100, 100, 1),
                                    {"model": "chain@1", "remoteTimeoutMs": 5000}, local_ms=5000.0,
                                    backend_cls=backend_cls) as (runner, _, _):
            answer = await runner.infer({"x": x}, request_id="r0")
            (recorded_ms,) = [ms for record in runner._answered_ms.values() for ms in record]
            return answer, recorded_ms, runner.monitor.estimate().up_bps

    async def go():
        return await one(_LoadingBackend, "said"), await one(_SilentLoadingBackend, "silent")

    (said, said_ms, said_bps), (silent, silent_ms, silent_bps) = asyncio.run(go())
    assert said.served_by == silent.served_by == "remote"
    assert said.latency_ms >= 1000 and silent.latency_ms >= 1000  # the request itself waited either way
    assert said_ms < 500 <= 1000 <= silent_ms, (said_ms, silent_ms)
    assert said_bps > 20 * silent_bps, (said_bps, silent_bps)
