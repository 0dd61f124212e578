"""ReplicaPool's compiled-graph fast path (see [Note: fast path] in workers/actors.py).

A request that finds its replica idle goes over a compiled graph to the replica's
``run_direct``; busy replicas, failures and restarts go the plain way. Real local Ray,
a real SqueezeNet tail, a plain ONNX Runtime session as the reference.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from tests.integration._squeezenet_tail import reference, tail  # noqa: F401 - fixtures
from workers._pool import PoolConfig, make_segment_key
from workers.engine import EngineConfig
from workers.errors import DeadlineExceededError, InputError, ReplicaUnavailableError

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

KEY = make_segment_key("squeezenet", 1, "c28")


@pytest.fixture(scope="module")
def frames(tail):
    inits = {i.name for i in tail.graph.initializer}
    [inp] = [i for i in tail.graph.input if i.name not in inits]
    shape = [d.dim_value or 1 for d in inp.type.tensor_type.shape.dim]
    rng = np.random.default_rng(7)
    return [{inp.name: rng.standard_normal(shape).astype(np.float32)} for _ in range(6)]


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
             configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def engine_config(tmp_path_factory):
    return EngineConfig(intra_op_threads=1, cache_dir=str(tmp_path_factory.mktemp("artefacts")))


def _assert_equal(got, want):
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5)


async def _until_fast(pool, frame, *, before: int, tries: int = 300) -> None:
    """Sends lone requests until one goes over the fast path (it is built in the background)."""
    for _ in range(tries):
        await pool.infer(KEY, frame)
        if pool.stats().fast_path_calls > before:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"no request took the fast path in {tries} tries: {pool.stats()}")


def test_lone_requests_take_the_fast_path_and_errors_stay_per_request(ray_local, tail, reference, frames,
                                                                       engine_config):
    from workers.actors import ReplicaPool

    pool = ReplicaPool({KEY: tail.SerializeToString()},
                       config=PoolConfig(num_replicas=1, max_restarts=0, fast_path=True), engine_config=engine_config)
    name = next(iter(frames[0]))

    async def main():
        await pool.ready()
        await _until_fast(pool, frames[0], before=0)
        fast_before = pool.stats().fast_path_calls
        for x in frames:  # one at a time: each finds the replica idle
            out, timing = await pool.infer_timed(KEY, x)
            _assert_equal(out, reference(x))
            assert timing is not None and timing.batch_size == 1 and timing.first_in_batch
        assert pool.stats().fast_path_calls == fast_before + len(frames)
        # Domain errors come back as values: the request fails alone, the graph keeps serving.
        with pytest.raises(InputError, match=name) as bad:
            await pool.infer(KEY, {name: frames[0][name].astype(np.float64)})
        assert bad.value.input_name == name
        with pytest.raises(DeadlineExceededError, match="deadline_unix_ms"):
            await pool.infer(KEY, frames[0], deadline_unix_ms=time.time() * 1e3 - 1.0)
        _assert_equal(await pool.infer(KEY, frames[1]), reference(frames[1]))
        fast_after_errors = pool.stats().fast_path_calls
        assert fast_after_errors == fast_before + len(frames) + 3
        # Concurrent requests: the idle replica takes one over the graph, the rest go plain.
        outs = await asyncio.gather(*(pool.infer(KEY, x) for x in frames * 4))
        for x, out in zip(frames * 4, outs):
            _assert_equal(out, reference(x))
        assert pool.stats().fast_path_calls - fast_after_errors < len(frames) * 4

    try:
        asyncio.run(main())
        stats = pool.stats()
        workers = asyncio.run(pool.worker_stats())
    finally:
        pool.shutdown()
    assert stats.requests == stats.completed + stats.errors + stats.failed
    assert (stats.errors, stats.failed, stats.replica_failures, stats.in_flight) == (2, 0, 0, (0,))
    seg = workers[0].segments[0]
    assert seg.input_errors == 1 and seg.completed == stats.completed


def test_fast_path_is_off_by_default_and_then_everything_goes_the_plain_way(ray_local, tail, reference, frames,
                                                                           engine_config):
    from workers.actors import ReplicaPool

    cfg = PoolConfig(num_replicas=1, max_restarts=0)
    assert not cfg.fast_path  # opt-in: the graph's reader busy-waits in the replica
    assert PoolConfig.from_json(cfg.to_json()) == cfg
    assert PoolConfig.from_json(PoolConfig(fast_path=True).to_json()).fast_path
    pool = ReplicaPool({KEY: tail.SerializeToString()}, config=cfg, engine_config=engine_config)

    async def main():
        for x in frames:
            _assert_equal(await pool.infer(KEY, x), reference(x))
            await asyncio.sleep(0.02)

    try:
        asyncio.run(main())
        stats = pool.stats()
    finally:
        pool.shutdown()
    assert stats.fast_path_calls == 0 and stats.completed == len(frames)


@pytest.mark.chaos
def test_fast_path_falls_back_when_its_replica_dies_and_is_rebuilt_after_restart(
    ray_local, tail, reference, frames, engine_config
):
    from workers.actors import ReplicaPool

    pool = ReplicaPool({KEY: tail.SerializeToString()},
                       config=PoolConfig(num_replicas=1, max_restarts=2, max_retries=1, down_s=0.2, fast_path=True),
                       engine_config=engine_config)
    outcomes: list[object] = []

    async def main():
        [before] = await pool.ready()
        await _until_fast(pool, frames[0], before=0)
        ray.kill(pool.replicas[0], no_restart=False)
        # Lone requests right after the kill: the graph is broken, so they go the plain
        # way, which retries and fails clearly while the replica restarts.
        for k in range(40):
            try:
                outcomes.append((k, await pool.infer(KEY, frames[k % len(frames)])))
            except ReplicaUnavailableError as e:
                outcomes.append((k, e))
                await asyncio.sleep(0.1)
            if pool.stats().replica_failures and isinstance(outcomes[-1][1], dict):
                break
        [after] = await pool.ready()
        assert after["pid"] != before["pid"]
        fast = pool.stats().fast_path_calls
        await _until_fast(pool, frames[1], before=fast)  # rebuilt on the restarted replica
        _assert_equal(await pool.infer(KEY, frames[2]), reference(frames[2]))

    try:
        asyncio.run(main())
        stats = pool.stats()
    finally:
        pool.shutdown()
    assert stats.replica_failures >= 1 and stats.retries >= 1
    assert stats.requests == stats.completed + stats.failed + stats.errors and stats.errors == 0
    for k, out in outcomes:
        if isinstance(out, dict):
            _assert_equal(out, reference(frames[k % len(frames)]))
        else:
            assert out.retryable
