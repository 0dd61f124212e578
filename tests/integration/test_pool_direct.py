"""ReplicaPool's direct channel (see [Note: direct channel] in workers/_transport/framing.py).

Requests travel over a socket that the replica opens (Unix-domain on the caller's
node, TCP otherwise); until it is open, and after the replica dies, they go by plain
actor calls.
Real local Ray, a real SqueezeNet tail, a plain ONNX Runtime session as the reference.
"""

from __future__ import annotations

import asyncio
import mmap
import time

import numpy as np
import pytest

from tests.integration._squeezenet_tail import engine_config, ray_local, reference, tail  # noqa: F401 - fixtures
from workers._pool import PoolConfig, make_segment_key
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


def run_then_shut_down(pool, main):
    """`asyncio.run(main())` and then the pool's stats; the pool is shut down either way."""
    try:
        return asyncio.run(main()), pool.stats()
    finally:
        pool.shutdown()


def _assert_equal(got, want):
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5)


async def _until_direct(pool, frame, *, before: int, tries: int = 300) -> None:
    """Sends lone requests until one goes over a direct channel (it opens in the background)."""
    for _ in range(tries):
        await pool.infer(KEY, frame)
        if pool.stats().direct_calls > before:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"no request took a direct channel in {tries} tries: {pool.stats()}")


def test_requests_take_the_direct_channel_and_errors_stay_per_request(ray_local, tail, reference, frames,
                                                                      engine_config):
    from workers.actors import ReplicaPool

    pool = ReplicaPool({KEY: tail.SerializeToString()},
                       config=PoolConfig(num_replicas=2, max_restarts=0), engine_config=engine_config)
    name = next(iter(frames[0]))

    async def main():
        await pool.ready()
        await _until_direct(pool, frames[0], before=0)
        await _until_direct(pool, frames[0], before=pool.stats().direct_calls)  # both replicas' channels
        direct_before = pool.stats().direct_calls
        for x in frames:
            out, timing = await pool.infer_timed(KEY, x)
            _assert_equal(out, reference(x))
            assert timing is not None and timing.batch_size == 1 and timing.first_in_batch
            assert out[next(iter(out))].flags.writeable  # received into the caller's own memory
        assert pool.stats().direct_calls == direct_before + len(frames)
        # Domain errors come back per request; the channel keeps serving.
        with pytest.raises(InputError, match=name) as bad:
            await pool.infer(KEY, {name: frames[0][name].astype(np.float64)})
        assert bad.value.input_name == name
        with pytest.raises(DeadlineExceededError, match="deadline"):
            await pool.infer(KEY, frames[0], deadline_unix_ms=time.time() * 1e3 - 1.0)
        _assert_equal(await pool.infer(KEY, frames[1]), reference(frames[1]))
        after_errors = pool.stats().direct_calls
        # Concurrent requests all go direct, and the replicas' own batchers batch them.
        batch = frames * 6
        outs = await asyncio.gather(*(pool.infer_timed(KEY, x) for x in batch))
        for x, (out, _) in zip(batch, outs):
            _assert_equal(out, reference(x))
        assert pool.stats().direct_calls == after_errors + len(batch)
        assert max(t.batch_size for _, t in outs) > 1
        # A cancelled caller loses nothing else: its late answer is dropped.
        task = asyncio.ensure_future(pool.infer(KEY, frames[2]))
        await asyncio.sleep(0)
        task.cancel()
        _assert_equal(await pool.infer(KEY, frames[3]), reference(frames[3]))

    try:
        asyncio.run(main())
        stats = pool.stats()
        workers = asyncio.run(pool.worker_stats())
    finally:
        pool.shutdown()
    assert stats.requests == stats.completed + stats.errors + stats.failed
    # Errors: the bad dtype, the expired deadline and the cancelled request.
    assert (stats.errors, stats.failed, stats.replica_failures, stats.in_flight) == (3, 0, 0, (0, 0))
    assert min(stats.routed) >= 1
    assert sum(w.segments[0].input_errors for w in workers) == 1


def test_direct_false_sends_everything_by_plain_calls(ray_local, tail, reference, frames, engine_config):
    from workers.actors import ReplicaPool

    assert PoolConfig().direct  # the default
    cfg = PoolConfig(num_replicas=1, max_restarts=0, direct=False)
    assert PoolConfig.from_json(cfg.to_json()) == cfg
    pool = ReplicaPool({KEY: tail.SerializeToString()}, config=cfg, engine_config=engine_config)

    async def main():
        for x in frames:
            _assert_equal(await pool.infer(KEY, x), reference(x))
            await asyncio.sleep(0.02)

    _, stats = run_then_shut_down(pool, main)
    assert stats.direct_calls == 0 and stats.completed == len(frames)


@pytest.mark.chaos
def test_direct_channel_falls_back_when_its_replica_dies_and_reconnects_after_restart(
    ray_local, tail, reference, frames, engine_config
):
    from workers.actors import ReplicaPool

    pool = ReplicaPool({KEY: tail.SerializeToString()},
                       config=PoolConfig(num_replicas=1, max_restarts=2, max_retries=1, down_s=0.2),
                       engine_config=engine_config)
    outcomes: list[tuple[int, object]] = []

    async def main():
        [before] = await pool.ready()
        await _until_direct(pool, frames[0], before=0)

        async def one(k: int) -> None:
            try:
                outcomes.append((k, await pool.infer(KEY, frames[k % len(frames)])))
            except ReplicaUnavailableError as e:
                outcomes.append((k, e))

        # Requests in flight on the channel when the replica dies: each is retried by a
        # plain call or fails clearly, none is lost.
        flight = [asyncio.ensure_future(one(k)) for k in range(12)]
        await asyncio.sleep(0)
        ray.kill(pool.replicas[0], no_restart=False)
        await asyncio.gather(*flight)
        for k in range(12, 60):
            await one(k)
            if isinstance(outcomes[-1][1], dict) and pool.stats().replica_failures:
                break
            await asyncio.sleep(0.1)
        [after] = await pool.ready()
        assert after["pid"] != before["pid"]
        await _until_direct(pool, frames[1], before=pool.stats().direct_calls)  # reopened on the new replica
        _assert_equal(await pool.infer(KEY, frames[2]), reference(frames[2]))

    _, stats = run_then_shut_down(pool, main)
    assert sorted(k for k, _ in outcomes) == list(range(len(outcomes)))
    assert stats.replica_failures >= 1 and stats.retries >= 1
    assert stats.requests == stats.completed + stats.failed + stats.errors and stats.errors == 0
    for k, out in outcomes:
        if isinstance(out, dict):
            _assert_equal(out, reference(frames[k % len(frames)]))
        else:
            assert out.retryable and out.attempts == 2


def test_the_channel_over_tcp_serves_like_the_unix_socket(ray_local, tail, reference, frames, engine_config):
    # The form replicas on other nodes get; forced here on one node.
    from workers.actors import ReplicaPool

    pool = ReplicaPool({KEY: tail.SerializeToString()},
                       config=PoolConfig(num_replicas=1, max_restarts=0, direct_over_tcp=True),
                       engine_config=engine_config)

    async def main():
        await pool.ready()
        await _until_direct(pool, frames[0], before=0)
        outs = await asyncio.gather(*(pool.infer(KEY, x) for x in frames * 3))
        for x, out in zip(frames * 3, outs):
            _assert_equal(out, reference(x))
        with pytest.raises(InputError):
            await pool.infer(KEY, {k: v.astype(np.float64) for k, v in frames[0].items()})

    _, stats = run_then_shut_down(pool, main)
    assert stats.direct_calls >= len(frames) * 3 and stats.errors == 1 and stats.failed == 0
    # The error's answer needs pickle, which TCP refuses by default: it came by a plain call.
    assert stats.tcp_refused == 1


def test_with_tcp_pickle_an_error_crosses_the_tcp_channel_itself(ray_local, tail, frames, engine_config):
    # The operator's opt-in: both ends of the TCP channel then carry pickle frames.
    from workers.actors import ReplicaPool

    pool = ReplicaPool({KEY: tail.SerializeToString()},
                       config=PoolConfig(num_replicas=1, max_restarts=0, direct_over_tcp=True, tcp_pickle=True),
                       engine_config=engine_config)

    async def main():
        await pool.ready()
        await _until_direct(pool, frames[0], before=0)
        with pytest.raises(InputError):
            await pool.infer(KEY, {k: v.astype(np.float64) for k, v in frames[0].items()})

    _, stats = run_then_shut_down(pool, main)
    assert stats.tcp_refused == 0 and stats.errors == 1 and stats.failed == 0


def _doubling_model():
    """y = 2x on 256 KiB rows: large enough to go through the channel's arenas."""
    from onnx import TensorProto, helper

    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1 << 16])
    y_info = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1 << 16])
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    graph = helper.make_graph([helper.make_node("Mul", ["x", "two"], ["y"])], "double", [x_info], [y_info], [two])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    return model, make_segment_key("double", 1, "c0")


def test_large_answers_are_read_in_the_workers_arena_and_stay_intact_while_held(ray_local, engine_config):
    # [Note: channel arena]: the caller reads a 256 KiB answer where the worker put it;
    # a held answer keeps its region, so later answers never overwrite it.
    from workers.actors import ReplicaPool

    model, key = _doubling_model()
    pool = ReplicaPool({key: model.SerializeToString()}, config=PoolConfig(num_replicas=1, max_restarts=0),
                       engine_config=engine_config)
    xs = [np.full((1, 1 << 16), float(i), np.float32) for i in range(12)]

    async def main():
        await pool.ready()
        for _ in range(300):  # the channel opens in the background
            await pool.infer(key, {"x": xs[0]})
            if pool.stats().direct_calls:
                break
            await asyncio.sleep(0.02)
        held = [await pool.infer(key, {"x": x}) for x in xs]  # every answer kept
        for _ in range(3):
            dropped = [await pool.infer(key, {"x": x}) for x in xs]  # answers freed as they go
            del dropped
        return held

    held, stats = run_then_shut_down(pool, main)
    assert stats.direct_calls >= 4 * len(xs) and stats.errors == 0
    for i, out in enumerate(held):
        np.testing.assert_array_equal(out["y"], np.full((1, 1 << 16), 2.0 * i, np.float32))
        base = out["y"]
        while getattr(base, "base", None) is not None or isinstance(base, memoryview):
            base = base.obj if isinstance(base, memoryview) else base.base
        assert isinstance(base, mmap.mmap)  # a view of the worker's arena, not a copy


def test_a_shared_array_goes_to_its_replica_in_place_and_follows_its_values(ray_local, engine_config):
    # [Note: inputs kept in the arena] in workers/_transport/arena.py, through a pool of two.
    from workers.actors import ReplicaPool

    model, key = _doubling_model()
    pool = ReplicaPool({key: model.SerializeToString()}, config=PoolConfig(num_replicas=2, max_restarts=0),
                       engine_config=engine_config)

    async def main():
        await pool.ready()
        x = await pool.shared_array((1, 1 << 16), np.float32)
        (home, client, *_), = pool._shared.values()
        assert client.arena_lent_bytes == x.nbytes  # it lies in that channel's arena
        routed = pool.stats().routed[home]
        for i in range(6):  # new values, same place: each request reads what was written last
            x[...] = float(i)
            out = await pool.infer(key, {"x": x})
            np.testing.assert_array_equal(out["y"], np.full((1, 1 << 16), 2.0 * i, np.float32))
            del out
        assert pool.stats().routed[home] == routed + 6  # all to its replica, the pool being idle
        assert client.arena_lent_bytes == x.nbytes and client.arena_fallbacks == 0
        pool.free_shared_array(x)
        assert client.arena_lent_bytes == 0 and not pool._shared
        private = np.zeros(3, np.float32)
        pool.free_shared_array(private)  # not one of its arrays: nothing to do

    _, stats = run_then_shut_down(pool, main)
    assert stats.errors == 0 and stats.direct_calls >= 6
