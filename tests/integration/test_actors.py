"""SegmentWorker, ReplicaPool and Pipeline on a real local Ray, serving real zoo tails.

One Ray start for the whole module (it costs seconds on a small machine). The tail is
SqueezeNet cut at a late chain point, with random weights so a wrong wiring shows; the
reference is a plain ONNX Runtime session on the same tail.
"""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest

import partitioner
from tests.integration._squeezenet_tail import engine_config, ray_local, reference, tail  # noqa: F401 - fixtures
from workers._pool import PoolConfig, check_inputs, make_segment_key, pick_replica, to_monotonic_deadline
from workers.engine import TensorSpec
from workers.errors import (
    ActorConfigError,
    DeadlineExceededError,
    InputError,
    ReplicaUnavailableError,
    SegmentNotLoadedError,
)
from workers.pipeline import StageSpan, count_overlaps, make_stage_cuts, make_stages

ray = pytest.importorskip("ray")

KEY = make_segment_key("squeezenet", 1, "c28")
RTOL, ATOL = 1e-4, 1e-5


# -- pure helpers (no Ray) -------------------------------------------------------------


def test_pick_replica_least_loaded_skips_down_and_excluded():
    assert pick_replica([3, 1, 2], [0, 0, 0], 10.0) == 1
    # replica 1 is down until t=20: the next least loaded wins
    assert pick_replica([3, 1, 2], [0, 20.0, 0], 10.0) == 2
    # ties go to the first from the rotating start
    assert pick_replica([0, 0, 0], [0, 0, 0], 0.0, start=2) == 2
    # the excluded replica is taken only when it is the only one
    assert pick_replica([0, 5], [0, 0], 0.0, exclude=0) == 1
    assert pick_replica([0], [0], 0.0, exclude=0) == 0
    # all down: still route (Ray queues calls to a restarting actor)
    assert pick_replica([2, 1], [99.0, 99.0], 0.0) == 1
    assert pick_replica([], [], 0.0) is None


def test_deadline_takes_the_earlier_of_wall_clock_and_budget():
    d = to_monotonic_deadline(deadline_unix_ms=1_000_500.0, budget_ms=None, now_unix_s=1000.0, now_monotonic_s=5.0)
    assert d == pytest.approx(5.5)
    d = to_monotonic_deadline(deadline_unix_ms=1_000_500.0, budget_ms=100.0, now_unix_s=1000.0, now_monotonic_s=5.0)
    assert d == pytest.approx(5.1)
    assert to_monotonic_deadline(deadline_unix_ms=None, budget_ms=None, now_unix_s=0, now_monotonic_s=0) is None
    with pytest.raises(ActorConfigError, match="budget_ms=-1"):
        to_monotonic_deadline(deadline_unix_ms=None, budget_ms=-1, now_unix_s=0, now_monotonic_s=0)


def test_check_inputs_names_the_bad_value():
    specs = (TensorSpec("x", "float32", (None, 4)),)
    assert check_inputs(specs, {"x": np.zeros((3, 4), np.float32)}, max_batch=8, name="s") == 3
    with pytest.raises(InputError, match="dtype float64") as e:
        check_inputs(specs, {"x": np.zeros((1, 4))}, max_batch=8, name="s")
    assert e.value.input_name == "x" and e.value.expected == "float32[N,4] with N in 1..8"
    with pytest.raises(InputError, match="reshape"):
        check_inputs(specs, {"x": np.zeros((1, 5), np.float32)}, max_batch=8, name="s")
    with pytest.raises(InputError, match="at most 8 rows"):
        check_inputs(specs, {"x": np.zeros((9, 4), np.float32)}, max_batch=8, name="s")
    with pytest.raises(InputError, match="missing \\['x'\\], unexpected \\['y'\\]"):
        check_inputs(specs, {"y": np.zeros((1, 4), np.float32)}, max_batch=8, name="s")
    with pytest.raises(InputError, match="numpy array"):
        check_inputs(specs, {"x": [[0.0] * 4]}, max_batch=8, name="s")


def test_configs_round_trip_and_refuse_bad_values():
    cfg = PoolConfig(num_replicas=3, max_restarts=-1, down_s=0.5, resources={"tail-tier": 0.5})
    assert PoolConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ActorConfigError, match="num_replicas=0") as e:
        PoolConfig(num_replicas=0)
    assert e.value.field_name == "num_replicas"
    for bad in ({"tail-tier": 0}, {"": 1}, {"tail-tier": True}, ["tail-tier"], {"GPU": 1}):
        with pytest.raises(ActorConfigError, match="resource name -> amount") as e:
            PoolConfig(resources=bad)
        assert e.value.field_name == "resources"
    with pytest.raises(ActorConfigError, match="contains '@'"):
        make_segment_key("a@b", 1, 2)


def test_count_overlaps_reads_event_order():
    serial = [StageSpan(0, 0, 0, 1), StageSpan(0, 1, 1, 2), StageSpan(1, 0, 2, 3), StageSpan(1, 1, 3, 4)]
    assert count_overlaps(serial) == 0
    piped = [StageSpan(0, 0, 0, 1), StageSpan(0, 1, 1, 3), StageSpan(1, 0, 1, 2), StageSpan(1, 1, 3, 4)]
    assert count_overlaps(piped) == 1


def test_registry_paths_stay_inside_the_registry(tmp_path):
    from workers._worker import SegmentHost

    host = SegmentHost(registry_dir=str(tmp_path))
    assert host._resolve("m/1/tail.onnx") == str(tmp_path.resolve() / "m" / "1" / "tail.onnx")
    with pytest.raises(ActorConfigError, match="outside the registry"):
        host._resolve("../elsewhere.onnx")
    assert host._resolve(b"abc") == b"abc"


# -- models -----------------------------------------------------------------------------


def _data_inputs(model):
    inits = {i.name for i in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in inits]


def _frames(tail, n, seed=0):
    rng = np.random.default_rng(seed)
    [inp] = [i for i in tail.graph.input if i.name in _data_inputs(tail)]
    shape = [d.dim_value or 1 for d in inp.type.tensor_type.shape.dim]
    return [{inp.name: rng.standard_normal(shape).astype(np.float32)} for _ in range(n)]


def _assert_equal(got, want):
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=RTOL, atol=ATOL)


def test_make_stages_cuts_at_chain_points(tail):
    graph = partitioner.build_graph(tail)
    points = make_stage_cuts(graph, 2)
    assert len(points) == 1 and points[0] in partitioner.chain_points(graph)
    stages = make_stages(tail, 2)
    assert _data_inputs(stages[1]) == [o.name for o in stages[0].graph.output]
    with pytest.raises(ActorConfigError, match="too few to cut"):
        make_stage_cuts(graph, 100)


# -- Ray --------------------------------------------------------------------------------


def test_host_serves_a_frame_of_requests_and_lone_ones_at_once_counting_each(tail, reference, engine_config):
    # No Ray: the SegmentHost class that the actor runs, on this process's event loop.
    from workers._worker import SegmentHost
    from workers.batcher import NOT_NOW

    host = SegmentHost({KEY: tail.SerializeToString()}, engine_config=engine_config)
    x1, x2, x3 = _frames(tail, 3, seed=7)
    [name] = x1
    bad = {name: x1[name].astype(np.float64)}

    async def main():
        frame = await host.infer_batch(KEY, [x1, bad, x2, x3], [None, None, None, time.time() * 1e3 - 1.0],
                                       [0, 0, 1, 0])
        missing = await host.infer_batch("nope@1@c0", [x1, x2], [None, None], [0, 0])
        before_lone = host.infer_now(KEY, x1, None, 0)  # no lone run timed yet: the batcher decides
        await host.infer(KEY, x1)
        now = host.infer_now(KEY, x2, None, 0)
        views = host.infer_now(KEY, x3, None, 0, views=True)
        placed = host.infer_now(KEY, x1, None, 0, views=True, place=place)  # [Note: outputs placed]
        with pytest.raises(InputError):
            host.infer_now(KEY, bad, None, 0)
        return frame, missing, before_lone, now, views, placed, (await host.stats()).segments[0]

    regions: list[np.ndarray] = []

    def place(like: np.ndarray) -> tuple[np.ndarray, int]:
        regions.append(np.empty_like(like))
        return regions[-1], regions[-1].ctypes.data

    frame, missing, before_lone, now, views, placed, stats = asyncio.run(main())
    _assert_equal(frame[0], reference(x1))
    assert isinstance(frame[1], InputError) and "float64" in str(frame[1])
    _assert_equal(frame[2], reference(x2))
    assert isinstance(frame[3], DeadlineExceededError)
    assert all(isinstance(e, SegmentNotLoadedError) for e in missing) and len(missing) == 2
    assert before_lone is NOT_NOW
    _assert_equal(now, reference(x2))
    _assert_equal(views, reference(x3))
    engine = host._hosted[KEY].engine
    assert all(np.shares_memory(v, engine.output_buffer(k, 1)) for k, v in views.items())
    _assert_equal(placed, reference(x1))
    assert len(regions) == len(placed) and all(np.shares_memory(v, r) for v, r in zip(placed.values(), regions))
    # Every request counted once: 4 in the frame, the lone infer, three now, one bad now.
    assert stats.requests == 9 == stats.completed + stats.input_errors + stats.failed
    assert (stats.completed, stats.input_errors, stats.failed) == (6, 2, 1)


def test_host_instances_run_batches_side_by_side_and_lone_requests_on_all_threads(tail, reference, engine_config):
    # No Ray: [Note: engine instances] on this process's event loop.
    import dataclasses

    from tests.integration._barrier import meet_at_a_barrier
    from workers._worker import DEFAULT_BATCHER_CONFIG, SegmentHost

    host = SegmentHost({KEY: tail.SerializeToString()}, engine_config=dataclasses.replace(engine_config, intra_op_threads=2),
                       batcher_config=dataclasses.replace(DEFAULT_BATCHER_CONFIG, max_batch_size=2), instances=2)
    hosted = host._hosted[KEY]
    assert [i.config.intra_op_threads for i in hosted.instances] == [1, 1]
    assert hosted.engine.config.intra_op_threads == 2
    assert hosted.batcher.config.max_concurrent_batches == 2
    weights = {e.shared_weight_bytes for e in (hosted.engine, *hosted.instances)}
    assert len(weights) == 1 and weights.pop() > 0  # one set of weights for all three
    used = meet_at_a_barrier(hosted.instances)  # two batches at once, each on an instance of its own
    frames = _frames(tail, 5, seed=11)

    async def main():
        both = await host.infer_batch(KEY, frames[:4], [None] * 4, [0] * 4)  # two batches of two
        runs = hosted.engine.stats().run_count
        lone = await host.infer(KEY, frames[4])
        now = host.infer_now(KEY, frames[4], None, 0)
        return both, hosted.engine.stats().run_count - runs, lone, now, (await host.stats()).segments[0]

    both, engine_runs, lone, now, stats = asyncio.run(main())
    for got, x in zip(both, frames):
        _assert_equal(got, reference(x))
    assert sorted(used) == sorted(id(i) for i in hosted.instances)
    _assert_equal(lone, reference(frames[4]))
    _assert_equal(now, reference(frames[4]))
    assert engine_runs == 2 and len(used) == 2  # the lone requests ran on the engine with both threads
    assert stats.instances == 2 and stats.completed == 6
    with pytest.raises(ActorConfigError, match="instances=0"):
        SegmentHost(instances=0)
    with pytest.raises(ActorConfigError, match="instances=1.5"):
        PoolConfig(instances=1.5)


@pytest.fixture(scope="module")
def worker(ray_local, tail, engine_config):
    from workers.actors import make_worker

    w = make_worker({KEY: tail.SerializeToString()}, engine_config=engine_config)
    ray.get(w.health.remote())
    yield w
    ray.kill(w)


@pytest.mark.ray
def test_worker_serves_tail_equal_to_ort(worker, tail, reference):
    health = ray.get(worker.health.remote())
    assert health["ok"] and health["segments"] == [KEY]
    for x in _frames(tail, 3, seed=1):
        _assert_equal(ray.get(worker.infer.remote(KEY, x)), reference(x))


@pytest.mark.ray
def test_worker_batches_concurrent_requests(worker, tail, reference):
    frames = _frames(tail, 48, seed=2)
    before = ray.get(worker.stats.remote()).segments[0]

    async def burst():
        return await asyncio.gather(*(worker.infer.remote(KEY, x) for x in frames))

    outs = asyncio.run(burst())
    for x, out in zip(frames, outs):
        _assert_equal(out, reference(x))
    after = ray.get(worker.stats.remote()).segments[0]
    assert after.completed - before.completed == len(frames)
    new_batches = {k: v - before.batch_size_histogram.get(k, 0) for k, v in after.batch_size_histogram.items()}
    assert sum(k * v for k, v in new_batches.items()) == len(frames)
    assert max(k for k, v in new_batches.items() if v) > 1, new_batches
    assert after.batches_formed - before.batches_formed < len(frames)


@pytest.mark.ray
def test_bad_input_gets_a_clear_error_and_the_worker_keeps_serving(worker, tail, reference):
    [x] = _frames(tail, 1, seed=3)
    name = next(iter(x))
    before = ray.get(worker.stats.remote()).segments[0].input_errors
    with pytest.raises(InputError, match="dtype float64") as e:
        ray.get(worker.infer.remote(KEY, {name: x[name].astype(np.float64)}))
    assert e.value.input_name == name and "float32" in e.value.expected
    with pytest.raises(InputError, match="reshape it") as e:
        ray.get(worker.infer.remote(KEY, {name: x[name][:, :, :5]}))
    assert e.value.given.startswith("float32[1,")
    with pytest.raises(InputError, match="missing"):
        ray.get(worker.infer.remote(KEY, {"nope": x[name]}))
    with pytest.raises(SegmentNotLoadedError, match="load it first") as e:
        ray.get(worker.infer.remote("other@1@c1", x))
    assert e.value.loaded == (KEY,)
    with pytest.raises(DeadlineExceededError):
        ray.get(worker.infer.remote(KEY, x, budget_ms=0.0))
    assert ray.get(worker.health.remote())["ok"]
    _assert_equal(ray.get(worker.infer.remote(KEY, x)), reference(x))
    assert ray.get(worker.stats.remote()).segments[0].input_errors == before + 3


@pytest.mark.ray
def test_worker_loads_and_unloads_segments_by_path(worker, tail, reference, tmp_path):
    path = tmp_path / "tail.onnx"
    path.write_bytes(tail.SerializeToString())
    key = make_segment_key("squeezenet", 2, "c28")
    spec = ray.get(worker.load.remote(key, str(path)))
    assert spec["batch_safe"] and spec["max_batch"] == 8
    [x] = _frames(tail, 1, seed=7)
    _assert_equal(ray.get(worker.infer.remote(key, x, priority=3)), reference(x))
    with pytest.raises(ActorConfigError, match="no registry_dir"):
        ray.get(worker.load.remote(key, "tail.onnx"))
    assert ray.get(worker.unload.remote(key)) is True
    with pytest.raises(SegmentNotLoadedError):
        ray.get(worker.infer.remote(key, x))
    assert ray.get(worker.unload.remote(key)) is False
    assert ray.get(worker.health.remote())["segments"] == [KEY]


@pytest.mark.ray
def test_pool_routes_batches_and_counts_errors(ray_local, tail, reference, engine_config):
    from workers.actors import ReplicaPool

    # Plain actor calls, batched on the caller's side (the direct channel has its own tests).
    pool = ReplicaPool({KEY: tail.SerializeToString()},
                       config=PoolConfig(num_replicas=2, max_restarts=0, direct=False), engine_config=engine_config)
    frames = _frames(tail, 32, seed=6)
    name = next(iter(frames[0]))
    bad = {name: frames[0][name].astype(np.float16)}

    async def main():
        await pool.ready()
        return await asyncio.gather(*(pool.infer(KEY, x) for x in frames), pool.infer(KEY, bad),
                                    return_exceptions=True)

    try:
        outs = asyncio.run(main())
        stats = pool.stats()
    finally:
        pool.shutdown()
    for x, out in zip(frames, outs):
        _assert_equal(out, reference(x))
    assert isinstance(outs[-1], InputError) and outs[-1].input_name == name
    assert (stats.requests, stats.completed, stats.errors, stats.failed) == (33, 32, 1, 0)
    # Caller-side batching: fewer actor calls than requests, and both replicas used.
    assert sum(stats.routed) < stats.requests and min(stats.routed) >= 1
    assert stats.in_flight == (0, 0)


@pytest.mark.ray
@pytest.mark.chaos
@pytest.mark.parametrize("direct", [True, False], ids=["direct-channel", "plain-calls"])
def test_replica_killed_mid_load_loses_no_request(ray_local, tail, reference, engine_config, direct):
    from workers.actors import ReplicaPool

    pool = ReplicaPool({KEY: tail.SerializeToString()},
                       config=PoolConfig(num_replicas=2, max_restarts=2, max_retries=1, down_s=5.0, direct=direct),
                       engine_config=engine_config)
    frames = _frames(tail, 8, seed=4)
    refs = [reference(x) for x in frames]
    n_requests, concurrency = 96, 12
    outcomes: list[tuple[int, object]] = []

    async def main():
        pids_before = [h["pid"] for h in await pool.ready()]
        sent = iter(range(n_requests))
        killed = asyncio.Event()

        async def client():
            for k in sent:
                try:
                    outcomes.append((k, await pool.infer(KEY, frames[k % len(frames)])))
                except ReplicaUnavailableError as e:  # the clear, retry-able failure
                    outcomes.append((k, e))

        async def killer():
            # Kill replica 0 while it holds requests, after the pool has warmed up.
            while pool.stats().completed < 12 or pool.stats().in_flight[0] == 0:
                if len(outcomes) == n_requests:
                    return  # everything finished first: the assertion below says so
                await asyncio.sleep(0.001)
            ray.kill(pool.replicas[0], no_restart=False)
            killed.set()

        await asyncio.gather(killer(), *(client() for _ in range(concurrency)))
        assert killed.is_set()
        # Ray restarts the killed replica, and it serves again with its segment.
        health, last_error = None, None
        for _ in range(600):
            try:
                health = await pool.replicas[0].health.remote()
                if health["pid"] != pids_before[0]:
                    break
            except ray.exceptions.RayActorError as e:
                last_error = e
            await asyncio.sleep(0.1)
        assert health is not None and health["pid"] != pids_before[0], last_error
        assert health["segments"] == [KEY]
        _assert_equal(await pool.replicas[0].infer.remote(KEY, frames[0]), refs[0])

    try:
        asyncio.run(main())
        stats = pool.stats()
    finally:
        pool.shutdown()
    # Every request is accounted for: answered correctly, or failed clearly and counted.
    assert sorted(k for k, _ in outcomes) == list(range(n_requests))
    ok = [(k, o) for k, o in outcomes if isinstance(o, dict)]
    failed = [o for _, o in outcomes if isinstance(o, ReplicaUnavailableError)]
    for k, out in ok:
        _assert_equal(out, refs[k % len(frames)])
    assert all(e.retryable and e.attempts == 2 for e in failed)
    assert stats.requests == n_requests
    assert stats.completed == len(ok) and stats.failed == len(failed) and stats.errors == 0
    assert stats.completed + stats.failed == n_requests
    assert stats.replica_failures >= 1 and stats.retries >= 1
    assert stats.in_flight == (0, 0)
    assert (stats.direct_calls > 0) == direct


def _graph_semaphores() -> set[str]:
    """The POSIX semaphores of this session's compiled-graph channels: Ray names them after
    the raylet that created them (sem.hdr<pid>-<ns>, sem.obj<pid>-<ns>), so other clusters'
    files on the machine are not counted. See [Note: channel semaphores] in workers/actors.py."""
    from ray._private import worker as ray_worker

    pid = ray_worker._global_node.all_processes["raylet"][0].process.pid
    if not os.path.isdir("/dev/shm"):
        return set()
    return {n for n in os.listdir("/dev/shm") if n.startswith((f"sem.hdr{pid}-", f"sem.obj{pid}-"))}


@pytest.mark.ray
@pytest.mark.parametrize("transport", ["compiled", "calls"])
def test_pipeline_equals_unsplit_tail_and_overlaps(ray_local, tail, reference, engine_config, transport):
    from workers.actors import Pipeline

    stages = [s.SerializeToString() for s in make_stages(tail, 2)]
    before = _graph_semaphores()
    pipe = Pipeline(stages, engine_configs=[engine_config] * 2, transport=transport, max_inflight=4)
    try:
        frames = _frames(tail, 12, seed=5)
        outs = pipe.run_many(frames)
        spans = pipe.spans()
        made = _graph_semaphores() - before
    finally:
        pipe.shutdown()
    # The stages exit gracefully, and their exits unlink the channels' semaphores (a
    # killed stage left them in /dev/shm for good); the exits finish a moment after
    # shutdown() returns, so wait for them.
    if transport == "compiled" and os.path.isdir("/dev/shm"):
        assert made, "a compiled graph's channels should hold semaphores in /dev/shm"
        for _ in range(600):
            if not made & _graph_semaphores():
                break
            time.sleep(0.05)
        assert not made & _graph_semaphores()
    for x, out in zip(frames, outs):
        _assert_equal(out, reference(x))
    assert sorted((s.frame, s.stage) for s in spans) == [(f, s) for f in range(12) for s in (0, 1)]
    # Stage 0 started frame k+1 while stage 1 was still on frame k, for some k.
    assert count_overlaps(spans) >= 1

