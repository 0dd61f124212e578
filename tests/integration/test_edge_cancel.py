"""Local runs nobody needs are cancelled, over real gRPC on 127.0.0.1 and real ONNX Runtime
runs on an emulated slow device: a local tail whose remote answer won, and a whole-model run
started early while the plan was local that the policy then sent to the cloud. Exactly one
answer either way, the cloud's."""

import asyncio

import numpy as np
import pytest

from edge_agent.runner import Counters
from splitinfer.netem import LinkSetting
from tests.integration._edge_support import MODEL, VERSION, fixed_frontier, one_cut, runner_over_link

pytestmark = [pytest.mark.grpc, pytest.mark.timeout(120)]

TAIL_DEVICE_MS = 2000.0
"""What the emulated device takes for the cut's tail: far longer than the cloud's answer."""


def _runner(tmp_path, models, cut, path, remote_timeout_ms: float):
    """A runner over a 100 Mbit/s link to a tail backend; the whole model claimed at 1 s, so it offloads."""
    return runner_over_link(models, fixed_frontier(models.graph, cut), path, cut.key, tmp_path / "server-cache",
                            LinkSetting.from_mbps(100, 100, 2),
                            {"model": f"{MODEL}@{VERSION}", "remoteTimeoutMs": remote_timeout_ms,
                             "cacheDir": str(tmp_path / "cache"), "breakerFailures": 100}, local_ms=1000.0)


async def _settled(counters: Counters, name: str) -> int:
    for _ in range(250):
        if getattr(counters, name):
            break
        await asyncio.sleep(0.02)
    return getattr(counters, name)


def test_a_local_tail_is_cancelled_when_the_remote_answer_wins(tmp_path):
    path, models, cut, x, ref = one_cut(tmp_path)
    ce = models.cuts[cut.key]
    for _ in range(9):  # the head's and the tail's reference times at this host's speed
        head = ce.head.run({"x": x}, copy=True)
        ce.tail.run({n: head[n] for n in ce.boundary}, copy=True)

    async def go():
        async with _runner(tmp_path, models, cut, path, 200) as (runner, backend, _):
            await runner.infer({"x": x}, request_id="warm")
            runner.counters = Counters()
            # Every device run now takes TAIL_DEVICE_MS / the tail's reference CPU time x its own reference.
            models.device.set_factor(max(1.0, TAIL_DEVICE_MS / ce.tail.reference_cpu_ms()))
            # No answer within the 200 ms budget: the tail starts here; the cloud answers at 500 ms.
            backend.delay_s = lambda req: 0.5
            ans = await runner.infer({"x": x}, request_id="raced")
            cancelled = await _settled(runner.counters, "local_cancelled")
            return ans, cancelled, runner.counters

    ans, cancelled, c = asyncio.run(go())
    assert ans.served_by == "remote"
    np.testing.assert_allclose(ans.outputs["y"], ref, rtol=1e-4, atol=1e-5)
    assert c.remote_errors == {"timeout": 1}  # the tail was started by the budget, not by a hedge
    assert cancelled == 1 and c.local_dropped == 0 and c.late_dropped == 0
    assert (c.answered, c.failed, c.remote, c.local_tail) == (1, 0, 1, 0)


def test_an_early_local_run_is_cancelled_when_the_policy_offloads(tmp_path):
    path, models, cut, x, ref = one_cut(tmp_path)

    async def go():
        async with _runner(tmp_path, models, cut, path, 5000) as (runner, _, _):
            runner.offload_enabled = False  # the plan in use becomes local
            local = await runner.infer({"x": x}, request_id="local")
            early_after_local = runner.counters.local_cancelled
            assert runner.last_action is not None and runner.last_action.kind == "local"
            runner.offload_enabled = True  # the next request starts the model early, then goes remote
            models.device.set_factor(max(1.0, TAIL_DEVICE_MS / models.full.reference_cpu_ms()))
            remote = await runner.infer({"x": x}, request_id="offloaded")
            cancelled = await _settled(runner.counters, "local_cancelled")
            return local, early_after_local, remote, cancelled, runner.counters

    local, early_after_local, remote, cancelled, c = asyncio.run(go())
    assert local.served_by == "local" and early_after_local == 0
    np.testing.assert_allclose(local.outputs["y"], ref, rtol=1e-4, atol=1e-5)
    assert remote.served_by == "remote"
    np.testing.assert_allclose(remote.outputs["y"], ref, rtol=1e-4, atol=1e-5)
    assert cancelled == 1
    assert (c.answered, c.failed, c.local, c.remote, c.local_tail) == (2, 0, 1, 1, 0)
