"""A replica pool on a Ray cluster of two nodes on this machine.

``ray.cluster_utils.Cluster`` starts two raylets, each with its own object store and
node id, as on two machines; only the network between them is the loopback. The
replica asks for a resource only the second node has (``PoolConfig.resources``), so
the pool on the head node reaches it over the direct channel's TCP form, the way a
gateway pod reaches workers on other nodes. Real Ray, a real SqueezeNet tail, a plain
ONNX Runtime session as the reference.
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


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=True, head_node_args=dict(
        num_cpus=1, include_dashboard=False, object_store_memory=_STORE_BYTES))
    try:
        far = cluster.add_node(num_cpus=1, resources={"far": 1}, object_store_memory=_STORE_BYTES)
        cluster.wait_for_nodes()
        yield far
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_a_replica_on_another_node_is_reached_over_tcp(two_nodes, tail, reference, engine_config):
    from workers.actors import ReplicaPool

    inits = {i.name for i in tail.graph.initializer}
    [inp] = [i for i in tail.graph.input if i.name not in inits]
    shape = [d.dim_value or 1 for d in inp.type.tensor_type.shape.dim]
    rng = np.random.default_rng(3)
    frames = [{inp.name: rng.standard_normal(shape).astype(np.float32)} for _ in range(12)]
    pool = ReplicaPool({KEY: tail.SerializeToString()}, engine_config=engine_config,
                       config=PoolConfig(num_replicas=1, max_restarts=0, resources={"far": 1}))

    async def main():
        await pool.ready()
        for _ in range(300):  # the channel opens in the background; plain calls meanwhile
            await pool.infer(KEY, frames[0])
            if pool.stats().direct_calls:
                break
            await asyncio.sleep(0.02)
        before = pool.stats().direct_calls
        lone = [await pool.infer(KEY, x) for x in frames[:3]]
        together = await asyncio.gather(*(pool.infer_timed(KEY, x) for x in frames))
        info = await pool.replicas[0].open_channel.remote()
        return lone, together, pool.stats().direct_calls - before, info, pool._links[0]._client.path

    try:
        lone, together, direct, info, path = asyncio.run(main())
    finally:
        pool.shutdown()
    assert info["node_id"] == two_nodes.node_id != ray.get_runtime_context().get_node_id()
    assert path == f"{info['tcp'][0]}:{info['tcp'][1]}"  # the TCP form, not the replica's Unix socket
    assert direct == 3 + len(frames)
    for got, x in zip(lone + [out for out, _ in together], frames[:3] + frames):
        assert set(got) == set(reference(x))
        for k, want in reference(x).items():
            np.testing.assert_allclose(got[k], want, rtol=1e-4, atol=1e-5)
    assert max(timing.batch_size for _, timing in together) > 1  # batched on the far node


def test_model_yaml_ray_resources_place_the_gateways_workers(two_nodes, tail, reference, tmp_path):
    """The gateway's Ray pool for a model whose model.yaml asks for ``ray_resources``
    puts its workers on the node that declares them (a Helm worker group's
    ``rayResources``) and serves from there."""
    from cluster.gateway import PoolKey
    from cluster.ray_cluster import RayPool
    from cluster.registry import ModelConfig

    path = tmp_path / "tail.onnx"
    path.write_bytes(tail.SerializeToString())
    config = ModelConfig(max_batch_size=4, intra_op_threads=1, ray_resources={"far": 1})
    inits = {i.name for i in tail.graph.initializer}
    [inp] = [i for i in tail.graph.input if i.name not in inits]
    x = {inp.name: np.random.default_rng(5).standard_normal([d.dim_value or 1 for d in inp.type.tensor_type.shape.dim])
         .astype(np.float32)}
    pool = RayPool(PoolKey("squeezenet", "1", "c28"), str(path), config, provider="cpu")

    async def main():
        result = await pool.run(x, deadline_s=None, priority=0)
        info = await pool.pool.replicas[0].open_channel.remote()
        await pool.close()
        return result, info

    result, info = asyncio.run(main())
    assert info["node_id"] == two_nodes.node_id != ray.get_runtime_context().get_node_id()
    for k, want in reference(x).items():
        np.testing.assert_allclose(result.outputs[k], want, rtol=1e-4, atol=1e-5)
