"""Exactly one answer per request, over real gRPC on 127.0.0.1 through the link emulator.

The server is `cluster.server.serve` with `TailBackend`, which runs the real tail with
ONNX Runtime; the agent's side is the real Runner with warm head, tail and full
engines. Each test drives one failure (error, timeout, cancellation, outage) and
checks the app got exactly one correct answer and the late result was dropped.
"""

import asyncio
import contextlib
import dataclasses
import time

import numpy as np
import onnxruntime as ort
import pytest

from cluster.errors import Unavailable, UnknownCutError
from cluster.server import serve
from edge_agent.cache import ArtifactCache
from edge_agent.engines import ModelSet
from edge_agent.runner import Counters
from edge_agent.transport import connect
from partitioner import prefix_cut
from planner import Encoding
from splitinfer.netem import LinkEmulator, LinkSetting, OutageMode
from tests.integration._edge_support import MODEL, VERSION, TailBackend, fixed_frontier, runner_over_link, write_model

pytestmark = [pytest.mark.grpc, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("edge-runner")
    path = write_model(d)
    cache = ArtifactCache(str(d / "cache"))
    models = ModelSet(path, cache=cache, model=MODEL, version=VERSION)
    cut = prefix_cut(models.graph, 1)
    models.load_cut(cut)
    return d, path, models, cut


def _x(seed=0):
    return np.random.default_rng(seed).standard_normal((1, 4, 5, 5)).astype(np.float32)


def _ref(path, x):
    return ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@contextlib.asynccontextmanager
async def _stack(model_dir, *, remote_timeout_ms=400.0, outage_mode=OutageMode.BLACKHOLE, fallback="local",
                 slo_ms=None, encoding=Encoding(), rtt_ms=2):
    d, path, models, cut = model_dir
    async with runner_over_link(
            models, fixed_frontier(models.graph, cut, encoding=encoding), path, cut.key, d / "server-cache",
            LinkSetting.from_mbps(100, 100, rtt_ms),
            {"model": f"{MODEL}@{VERSION}", "remoteTimeoutMs": remote_timeout_ms, "fallback": fallback,
             "sloMs": slo_ms, "cacheDir": str(d / "cache"), "breakerFailures": 100},
            local_ms=1000.0, outage_mode=outage_mode) as (runner, backend, emu):
        # Warm the channel and connection (on a loaded 2-core machine the first call can miss a short budget).
        for _ in range(3):
            await runner.remote.infer_counted(runner._make_request(runner.decide(0.0), models.cuts[cut.key], {
                n: np.zeros((1, 4, 5, 5), np.float32) for n in models.cuts[cut.key].boundary}, "warm", 30.0),
                timeout_s=30.0)
        runner.counters = Counters()
        backend.calls = backend.served = 0
        yield runner, backend, emu


def _check_one(ans, path, x, served_by):
    assert ans.served_by == served_by
    np.testing.assert_allclose(ans.outputs["y"], _ref(path, x), rtol=1e-4, atol=1e-5)


def test_remote_answer_is_the_answer(model_dir):
    path = model_dir[1]

    async def go():
        async with _stack(model_dir) as (runner, backend, _):
            x = _x()
            ans = await runner.infer({"x": x}, request_id="ok")
            return ans, runner.counters, backend.served

    ans, c, served = asyncio.run(go())
    _check_one(ans, path, _x(), "remote")
    assert ans.cut_id == model_dir[3].key and served == 1 and ans.encoding == "fp32"
    assert (c.answered, c.remote, c.local_tail, c.late_dropped) == (1, 1, 0, 0)


def test_an_fp16_answer_says_so_and_a_local_tail_is_fp32(model_dir):
    path = model_dir[1]

    async def go():
        async with _stack(model_dir, encoding=Encoding("fp16")) as (runner, backend, _):
            remote = await runner.infer({"x": _x(3)}, request_id="half")
            backend.fail = Unavailable(reason="pool restarting")
            local = await runner.infer({"x": _x(3)}, request_id="tail")
            return remote, local

    remote, local = asyncio.run(go())
    assert (remote.served_by, remote.encoding) == ("remote", "fp16")
    # the boundary crossed in halves: close to the whole model, not necessarily equal
    np.testing.assert_allclose(remote.outputs["y"], _ref(path, _x(3)), rtol=1e-2, atol=1e-2)
    assert (local.served_by, local.encoding) == ("local_tail", "fp32")
    _check_one(local, path, _x(3), "local_tail")


def test_remote_error_finishes_locally_from_the_head_output(model_dir):
    path = model_dir[1]

    async def go():
        async with _stack(model_dir) as (runner, backend, _):
            backend.fail = Unavailable(reason="pool restarting")
            ans = await runner.infer({"x": _x(1)}, request_id="err")
            return ans, runner.counters

    ans, c = asyncio.run(go())
    _check_one(ans, path, _x(1), "local_tail")
    assert "Unavailable" in ans.fallback_reason and c.remote_errors == {"Unavailable": 1}
    assert (c.answered, c.local_tail, c.remote, c.failed) == (1, 1, 0, 0)


def test_timeout_falls_back_and_the_late_answer_is_dropped(model_dir):
    path = model_dir[1]

    async def go():
        async with _stack(model_dir, remote_timeout_ms=200) as (runner, backend, _):
            backend.delay_s = lambda req: 0.5  # answers after the 200 ms budget, before the call deadline
            ans = await runner.infer({"x": _x(2)}, request_id="slow")
            for _ in range(200):  # wait for the late answer to come in
                if runner.counters.late_dropped:
                    break
                await asyncio.sleep(0.02)
            return ans, runner.counters, backend.served

    ans, c, served = asyncio.run(go())
    _check_one(ans, path, _x(2), "local_tail")
    assert served == 1 and c.late_dropped == 1
    assert (c.answered, c.remote, c.local_tail) == (1, 0, 1)
    assert c.remote_errors == {"timeout": 1}


def test_cancelled_remote_call_finishes_locally(model_dir):
    path = model_dir[1]

    async def go():
        async with _stack(model_dir, remote_timeout_ms=5000) as (runner, backend, _):
            backend.release.clear()  # the server holds the request
            task = asyncio.ensure_future(runner.infer({"x": _x(3)}, request_id="cancel"))
            while backend.calls == 0:
                await asyncio.sleep(0.01)
            assert runner.cancel_remote() == 1
            ans = await task
            backend.release.set()
            return ans, runner.counters

    ans, c = asyncio.run(go())
    _check_one(ans, path, _x(3), "local_tail")
    assert "cancelled" in ans.fallback_reason and (c.answered, c.local_tail) == (1, 1)


@pytest.mark.parametrize("mode", [OutageMode.BLACKHOLE, OutageMode.RESET])
def test_outage_through_the_emulator_is_answered_locally_once(model_dir, mode):
    path = model_dir[1]

    async def go():
        async with _stack(model_dir, remote_timeout_ms=300, outage_mode=mode) as (runner, backend, emu):
            # The request before the outage only shows the remote path works: it waits for the
            # remote answer, however long a loaded host takes, not the outage's 300 ms.
            outage_config = runner.config
            runner.config = dataclasses.replace(outage_config, remote_timeout_ms=30_000.0)
            before = await runner.infer({"x": _x(4)}, request_id="before")
            runner.config = outage_config
            emu.set(up=False)
            during = [await runner.infer({"x": _x(5 + i)}, request_id=f"during{i}") for i in range(3)]
            emu.set(up=True)
            return before, during, runner.counters

    before, during, c = asyncio.run(go())
    _check_one(before, path, _x(4), "remote")
    # The first request in the outage times out (or is refused) and finishes from its head
    # output; the timeouts also tell the monitor the link collapsed, so later ones may go
    # local at once. Either way each gets one correct answer.
    _check_one(during[0], path, _x(5), "local_tail")
    for i, ans in enumerate(during[1:], start=1):
        _check_one(ans, path, _x(5 + i), ans.served_by)
        assert ans.served_by in ("local_tail", "local")
    assert c.answered == 4 and c.requests == 4 and c.failed == 0


def test_a_device_that_starts_where_the_link_does_not_answer_runs_its_first_request_here(model_dir, caplog):
    """The start's probe gets no answer: the estimate is the floor, not the rate assumed before
    any sample, so the first request runs locally at once instead of waiting for its hedge."""
    from edge_agent.monitor import LinkMonitor

    path = model_dir[1]
    caplog.set_level("INFO", logger="edge_agent.probing")

    async def go():
        async with _stack(model_dir) as (runner, backend, emu):
            runner.monitor = LinkMonitor()
            emu.set(up=False)
            await runner.probe()  # as the daemon starts: a health check, then a boundary
            est = runner.monitor.estimate()
            ans = await runner.infer({"x": _x(2)}, request_id="first")
            emu.set(up=True)
            return est, ans, backend.calls, runner.counters

    est, ans, calls, c = asyncio.run(go())
    assert est.unreachable == 1 and est.up_bps == pytest.approx(1e3)
    _check_one(ans, path, _x(2), "local")
    assert calls == 0 and c.answered == 1 and c.local_tail == 0
    assert "no answer before any measurement; the estimate starts at the floor" in caplog.text


def test_the_check_that_ends_an_outage_is_no_rtt_sample(model_dir):
    """A check sent into a blackhole and answered when the link returns waited for the return:
    it ends the run of failures, and the RTT sample is a second check's. Older RTT samples age
    out fast here, as they do over an outage longer than `rtt_max_age_s`, so a wait taken as
    the RTT would be the estimate's RTT."""
    from edge_agent.monitor import LinkMonitor, MonitorConfig

    async def go():
        async with _stack(model_dir) as (runner, backend, emu):
            runner.monitor = LinkMonitor(MonitorConfig(rtt_max_age_s=0.2))
            assert await runner.probe_rtt()
            rtt_before = runner.monitor.estimate().rtt_ms
            emu.set(up=False)
            assert await runner.check_reachable() is False  # blackholed: no answer within its timeout
            failed = runner.monitor.estimate().unreachable
            check = asyncio.ensure_future(runner.probe_rtt(timeout_s=10.0))
            await asyncio.sleep(0.6)
            t_back = time.monotonic()
            emu.set(up=True)
            assert await check
            waited_ms = (time.monotonic() - t_back) * 1e3 + 600.0
            return rtt_before, failed, waited_ms, runner.monitor.estimate()

    rtt_before, failed, waited_ms, est = asyncio.run(go())
    assert failed == 1 and est.unreachable == 0
    assert waited_ms >= 600.0 > 2 * rtt_before
    assert est.rtt_ms < waited_ms / 2  # the link's 2 ms and the host's delays, not the wait


def test_the_first_call_over_a_long_rtt_link_waits_for_the_handshake(model_dir):
    """A connection whose handshake (TCP, then HTTP/2 SETTINGS: about two RTTs) takes longer
    than the reconnect back-off still opens: the first call waits for it instead of failing
    UNAVAILABLE at once (gRPC's connect timeout; see [Note: connect timeout] in
    edge_agent/transport.py). With the old 100 ms this call failed."""
    d, path, _, _ = model_dir

    async def go():
        server = await serve(TailBackend(path, cache_dir=str(d / "server-cache")))
        emu = LinkEmulator(upstream=("127.0.0.1", server.port), setting=LinkSetting.from_mbps(100, 100, 400))
        await emu.start()
        remote = connect(f"127.0.0.1:{emu.port}")
        try:
            t0 = time.monotonic()
            status = await remote.health(timeout_s=30.0)
            return status, (time.monotonic() - t0) * 1e3
        finally:
            await remote.close()
            await emu.stop()
            await server.stop(None)

    status, rtt_ms = asyncio.run(go())
    assert status == "SERVING" and rtt_ms >= 400.0  # answered, through the emulated link


def test_offload_disabled_runs_locally_and_leaves_the_link_alone(model_dir):
    """`offload_enabled = False` (the adaptation benchmark's local baseline): requests run the
    whole model here, nothing reaches the gateway, no probe or check is wanted; set back, the
    next request offloads again."""
    path = model_dir[1]

    async def go():
        async with _stack(model_dir) as (runner, backend, _):
            runner.offload_enabled = False
            runner.last_remote_s = 0.0  # the link has been quiet for ages: a probe would be due
            off = [await runner.infer({"x": _x(i)}, request_id=f"off{i}") for i in range(3)]
            wants = runner.link_idle(), runner.wants_reachability_check(1e9), runner.status()["offload_enabled"]
            calls_off = backend.calls
            runner.offload_enabled = True
            on = await runner.infer({"x": _x(7)}, request_id="on")
            return off, wants, calls_off, on, backend.calls

    off, wants, calls_off, on, calls_on = asyncio.run(go())
    for i, ans in enumerate(off):
        _check_one(ans, path, _x(i), "local")
    assert wants == (False, False, False) and calls_off == 0
    _check_one(on, path, _x(7), "remote")
    assert calls_on == 1


def test_a_probe_on_the_link_keeps_it_busy_and_a_second_probe_sends_nothing(model_dir):
    """While a probe is in flight the link is not idle (the daemon's loop starts none beside it),
    and a probe asked for meanwhile returns without sending: two would share the link and each
    read it at part of its rate. Once it is done, the next probe sends again."""
    async def go():
        async with _stack(model_dir, rtt_ms=300) as (runner, backend, _):
            runner.last_action = None
            runner.last_remote_s = 0.0  # quiet for ages: a probe is due
            idle_before = runner.link_idle()
            first = asyncio.ensure_future(runner.probe())
            await asyncio.sleep(0.1)  # inside its health check or its boundary (RTT 300 ms)
            idle_during = runner.link_idle(), runner.wants_reachability_check(1e9)
            await runner.probe()
            calls_beside = backend.calls
            await first
            calls_after_first = backend.calls
            await runner.probe()
            return idle_before, idle_during, calls_beside, calls_after_first, backend.calls, runner.counters.probes

    idle_before, idle_during, beside, after_first, after_next, probes = asyncio.run(go())
    assert idle_before and idle_during == (False, False)
    assert beside == 0 and after_first == 1 and after_next == 2 and probes == 2


def test_fallback_none_returns_the_error(model_dir):
    async def go():
        async with _stack(model_dir, fallback="none") as (runner, backend, _):
            backend.fail = Unavailable(reason="down for maintenance")
            with pytest.raises(Unavailable, match="maintenance"):
                await runner.infer({"x": _x()}, request_id="none")
            return runner.counters

    c = asyncio.run(go())
    assert (c.answered, c.failed) == (0, 1)


def test_unknown_cut_is_not_used_again(model_dir):
    async def go():
        async with _stack(model_dir) as (runner, backend, _):
            cut_id = model_dir[3].key
            backend.fail = UnknownCutError(model=MODEL, version=VERSION, cut_id=cut_id, known=[])
            first = await runner.infer({"x": _x()}, request_id="u1")
            second = await runner.infer({"x": _x()}, request_id="u2")
            return first, second, backend.calls

    first, second, calls = asyncio.run(go())
    assert first.served_by == "local_tail" and second.served_by == "local" and calls == 1


def test_many_concurrent_requests_with_failures_get_one_answer_each(model_dir):
    path = model_dir[1]
    n = 24

    async def go():
        async with _stack(model_dir, remote_timeout_ms=150) as (runner, backend, _):
            # every third request stalls past the budget, every fifth fails
            def delay(req):
                return 0.35 if int(req.request_id[1:]) % 3 == 0 else 0.0
            backend.delay_s = delay
            answers = await asyncio.gather(*(runner.infer({"x": _x(i)}, request_id=f"q{i}") for i in range(n)))
            for _ in range(100):
                if runner.counters.late_dropped + runner.counters.local_dropped >= n // 3:
                    break
                await asyncio.sleep(0.02)
            return answers, runner.counters

    answers, c = asyncio.run(go())
    assert [a.request_id for a in answers] == [f"q{i}" for i in range(n)]
    for i, a in enumerate(answers):
        np.testing.assert_allclose(a.outputs["y"], _ref(path, _x(i)), rtol=1e-4, atol=1e-5)
    assert c.answered == n and c.remote + c.local_tail + c.local == n and c.failed == 0
    assert c.local_tail >= n // 3 and c.late_dropped + c.local_dropped >= n // 3


def test_idle_probe_closes_an_open_breaker_and_measures_the_link(model_dir):
    async def go():
        async with _stack(model_dir, remote_timeout_ms=2000) as (runner, backend, _):
            runner.breaker_config = type(runner.breaker_config)(2, 0.2)
            backend.fail = Unavailable(reason="restarting")
            for i in range(2):
                await runner.infer({"x": _x()}, request_id=f"f{i}")
            opened = runner.breaker.state
            backend.fail = None
            before = runner.monitor.estimate().last_sample_s or 0.0
            await runner.probe()
            after = runner.breaker.state, runner.monitor.estimate().last_sample_s
            ans = await runner.infer({"x": _x()}, request_id="back")
            return opened, before, after, ans

    opened, before, (state, samples), ans = asyncio.run(go())
    assert opened == "open" and state == "closed" and samples > before  # the probe's transfer was seen
    assert ans.served_by == "remote"


@pytest.mark.parametrize("slo_ms, fallback, priority", [(500.0, "none", 1), (500.0, "local", 0), (None, "none", 0)])
def test_a_request_that_only_the_cloud_answers_in_time_goes_with_priority(model_dir, slo_ms, fallback, priority):
    """[Note: priority under overload]: under an SLO, a request with no local answer (fallback
    'none') asks the cloud for priority; one whose local tail lands in time does not, nor does
    one without an SLO."""
    async def go():
        async with _stack(model_dir, slo_ms=slo_ms, fallback=fallback) as (runner, backend, _):
            sent = []
            call = runner.remote.infer_counted

            async def spy(request, **kw):
                sent.append(request.priority)
                return await call(request, **kw)

            runner.remote.infer_counted = spy
            ans = await runner.infer({"x": _x(4)}, request_id="prio")
            return ans, sent, backend.served

    ans, sent, served = asyncio.run(go())
    _check_one(ans, model_dir[1], _x(4), "remote")
    assert sent == [priority] and served == 1
