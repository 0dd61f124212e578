"""The cloud tier on a Ray cluster of three nodes on this machine.

``ray.cluster_utils.Cluster`` starts a head and two worker raylets, each with its own
object store and node id, as on three machines; only the network between them is the
loopback. The worker nodes stand for the Helm chart's worker groups: one declares the GPU
group's custom resource (``rayCluster.gpuWorkers.rayResources``), the other the CPU
group's, and both one unit of a resource that puts one replica on each. The caller (the
gateway's side) runs on the head, so every replica is reached over the direct channel's
TCP form, the way a gateway pod reaches workers on other nodes. Real Ray, a real
SqueezeNet tail, a plain ONNX Runtime session as the reference.

The node removal comes last: the cluster has two nodes after it.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.integration._squeezenet_tail import engine_config, reference, tail  # noqa: F401 - fixtures
from workers._pool import PoolConfig, make_segment_key

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

KEY = make_segment_key("squeezenet", 1, "c28")
_STORE_BYTES = 100 << 20
GPU_TIER, CPU_TIER, SPREAD = "splitinfer-gpu-tier", "splitinfer-cpu-tier", "splitinfer-one-per-node"
# The GCS declares a node dead after 3 missed health checks 0.5 s apart (default 5 x 3 s):
# calls to a removed node's actors then fail in seconds, not in 15.
_FAST_NODE_DEATH = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}


def _start_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster()
    try:
        cluster.add_node(num_cpus=1, include_dashboard=False, object_store_memory=_STORE_BYTES,
                         _system_config=_FAST_NODE_DEATH)  # the first node is the head
        gpu = cluster.add_node(num_cpus=1, resources={GPU_TIER: 1000, SPREAD: 1}, object_store_memory=_STORE_BYTES)
        cpu = cluster.add_node(num_cpus=1, resources={CPU_TIER: 1000, SPREAD: 1}, object_store_memory=_STORE_BYTES)
        cluster.wait_for_nodes()
        cluster.connect()
    except BaseException:
        ray.shutdown()
        cluster.shutdown()
        raise
    return cluster, gpu, cpu


@pytest.fixture(scope="module")
def nodes():
    try:
        started = _start_cluster()
    except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception for a node's start
        # Seen on the loaded 2-core machine: a raylet or the GCS did not write its port file
        # within Ray's wait (RuntimeError "Timed out waiting for file"), or a node did not
        # register within 30 s ("The current node timed out during startup"). A second
        # start begins a new Ray cluster from scratch.
        if "timed out" not in str(e).lower():
            raise
        started = _start_cluster()
    cluster = started[0]
    try:
        yield started
    finally:
        ray.shutdown()
        cluster.shutdown()


def _frames(tail, n: int, seed: int) -> list[dict[str, np.ndarray]]:
    inits = {i.name for i in tail.graph.initializer}
    [inp] = [i for i in tail.graph.input if i.name not in inits]
    shape = [d.dim_value or 1 for d in inp.type.tensor_type.shape.dim]
    rng = np.random.default_rng(seed)
    return [{inp.name: rng.standard_normal(shape).astype(np.float32)} for _ in range(n)]


def _assert_equal(got, want) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-4, atol=1e-5)


async def _until_direct(pool, x) -> None:
    for _ in range(300):  # the channel opens in the background; plain calls meanwhile
        await pool.infer(KEY, x)
        if pool.stats().direct_calls:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the direct channel never opened")


@pytest.mark.parametrize("tcp_pickle", [False, True], ids=["tensor-frames-only", "pickle-allowed"])
def test_a_replica_on_another_node_is_reached_over_tcp(nodes, tail, reference, engine_config, tcp_pickle):
    """Requests and answers cross nodes over TCP. An answer that needs pickle (an error) is
    refused on the channel and comes by a plain Ray call, unless the operator allowed pickle
    over TCP ([Note: no pickle over TCP] in workers/_transport/framing.py)."""
    from workers.actors import ReplicaPool
    from workers.errors import InputError

    _, gpu, _ = nodes
    frames = _frames(tail, 12, seed=3)
    pool = ReplicaPool({KEY: tail.SerializeToString()}, engine_config=engine_config,
                       config=PoolConfig(num_replicas=1, max_restarts=0, resources={GPU_TIER: 1},
                                         tcp_pickle=tcp_pickle))

    async def main():
        await pool.ready()
        await _until_direct(pool, frames[0])
        before = pool.stats().direct_calls
        lone = [await pool.infer(KEY, x) for x in frames[:3]]
        together = await asyncio.gather(*(pool.infer_timed(KEY, x) for x in frames))
        with pytest.raises(InputError):
            await pool.infer(KEY, {k: v.astype(np.float64) for k, v in frames[0].items()})
        info = await pool.replicas[0].open_channel.remote()
        return lone, together, pool.stats().direct_calls - before, info, pool._links[0]._client.path

    try:
        lone, together, direct, info, path = asyncio.run(main())
        stats = pool.stats()
    finally:
        pool.shutdown()
    assert info["node_id"] == gpu.node_id != ray.get_runtime_context().get_node_id()
    assert path == f"{info['tcp'][0]}:{info['tcp'][1]}"  # the TCP form, not the replica's Unix socket
    assert direct >= 3 + len(frames)
    for got, x in zip(lone + [out for out, _ in together], frames[:3] + frames):
        _assert_equal(got, reference(x))
    assert max(timing.batch_size for _, timing in together) > 1  # batched on the far node
    assert stats.errors == 1 and stats.failed == 0
    assert stats.tcp_refused == (0 if tcp_pickle else 1)


def test_model_yaml_ray_resources_place_the_gateways_workers(nodes, tail, reference, tmp_path):
    """The gateway's Ray pool of a model whose model.yaml asks for a worker group's
    ``ray_resources`` puts its workers on the node that declares them, and serves from there."""
    from cluster.gateway import PoolKey
    from cluster.ray_cluster import RayPool
    from cluster.registry import ModelConfig

    _, gpu, cpu = nodes
    path = tmp_path / "tail.onnx"
    path.write_bytes(tail.SerializeToString())
    [x] = _frames(tail, 1, seed=5)
    placed = {}
    for tier, want in ((GPU_TIER, gpu.node_id), (CPU_TIER, cpu.node_id)):
        config = ModelConfig(max_batch_size=4, intra_op_threads=1, ray_resources={tier: 1})
        pool = RayPool(PoolKey("squeezenet", "1", f"c28-{tier}"), str(path), config, provider="cpu")

        async def main(pool=pool):
            try:
                result = await pool.run(x, deadline_s=None, priority=0)
                return result, await pool.pool.replicas[0].open_channel.remote()
            finally:
                await pool.close()

        result, info = asyncio.run(main())
        placed[tier] = info["node_id"]
        assert info["node_id"] == want, tier
        _assert_equal(result.outputs, reference(x))
    assert ray.get_runtime_context().get_node_id() not in placed.values()


def test_removing_a_worker_node_under_load_loses_and_doubles_nothing(nodes, tail, reference, engine_config):
    """One replica on each worker node; the CPU group's node is removed (its raylet and its
    workers killed) while requests are in flight there. Every request gets exactly one
    answer, its own: a correct result, or the clear, retry-able ReplicaUnavailableError."""
    from workers.actors import ReplicaPool
    from workers.errors import ReplicaUnavailableError

    cluster, _, cpu = nodes
    frames = _frames(tail, 8, seed=11)
    refs = [reference(x) for x in frames]
    # down_s outlasts the test: the removed node's replica is not tried again.
    pool = ReplicaPool({KEY: tail.SerializeToString()}, engine_config=engine_config,
                       config=PoolConfig(num_replicas=2, max_restarts=0, max_retries=1, down_s=60.0,
                                         resources={SPREAD: 1}))
    n_requests, concurrency = 96, 8
    outcomes: list[tuple[int, object]] = []

    async def main():
        await pool.ready()
        where = [(await r.open_channel.remote())["node_id"] for r in pool.replicas]
        assert sorted(where) == sorted([nodes[1].node_id, cpu.node_id])  # one replica on each
        doomed = where.index(cpu.node_id)
        await _until_direct(pool, frames[0])
        warm = pool.stats()
        sent = iter(range(n_requests))
        removed = asyncio.Event()
        first_failure: list = []

        async def client():
            for k in sent:
                try:
                    outcomes.append((k, await pool.infer(KEY, frames[k % len(frames)])))
                except ReplicaUnavailableError as e:
                    outcomes.append((k, e))

        async def remover():
            while pool.stats().completed < 16 or pool.stats().in_flight[doomed] == 0:
                if len(outcomes) == n_requests:
                    return  # everything finished first: the assertion below says so
                await asyncio.sleep(0.001)
            # Blocking (it kills processes and waits): off the loop, so requests go on meanwhile.
            await asyncio.get_running_loop().run_in_executor(None, cluster.remove_node, cpu)
            removed.set()

        async def watcher():
            while not first_failure and len(outcomes) < n_requests:
                if pool.stats().replica_failures:
                    first_failure.append(pool.stats())
                await asyncio.sleep(0.001)

        await asyncio.gather(remover(), watcher(), *(client() for _ in range(concurrency)))
        assert removed.is_set() and first_failure, "the removed node's replica never failed a call"
        return doomed, warm, first_failure[0]

    try:
        doomed, warm, failure = asyncio.run(main())
        stats = pool.stats()
    finally:
        pool.shutdown()
    keys = sorted(k for k, _ in outcomes)
    assert keys == list(range(n_requests))  # every request once: none lost, none answered twice
    ok = [(k, o) for k, o in outcomes if isinstance(o, dict)]
    failed = [o for _, o in outcomes if isinstance(o, ReplicaUnavailableError)]
    for k, out in ok:
        _assert_equal(out, refs[k % len(frames)])  # its own answer
    assert all(e.retryable for e in failed)
    assert stats.requests - warm.requests == n_requests
    assert stats.completed - warm.completed == len(ok) and stats.failed == len(failed) and stats.errors == 0
    assert stats.replica_failures >= 1 and stats.retries >= 1
    assert stats.in_flight == (0, 0)
    # Once a call finds the removed replica dead, it is never routed to again, and the
    # survivor takes every call after. (Totals say less: the removal takes seconds, and the
    # doomed replica serves until its process dies; one run read 20 calls against 20.)
    assert stats.routed[doomed] == failure.routed[doomed]
    assert (stats.routed[1 - doomed] > failure.routed[1 - doomed]) == (stats.requests > failure.requests)
