"""The gateway's --direct-tcp-pickle reaches a real Ray pool's ReplicaPool, which serves with it."""

from __future__ import annotations

import asyncio

import numpy as np
import onnxruntime as ort
import pytest

from tests.integration._edge_support import write_model
from tests.integration._squeezenet_tail import ray_local  # noqa: F401 - fixture

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]


@pytest.mark.parametrize("flags, want", [(["--direct-tcp-pickle"], True), ([], False)])
def test_the_flag_reaches_the_replica_pool_of_a_served_tail(ray_local, tmp_path, flags, want):
    from cluster.gateway import PoolKey
    from cluster.metrics import GatewayMetrics
    from cluster.registry import ModelConfig
    from splitinfer.gateway_cmd import make_parser, ray_pool_factory

    path = write_model(tmp_path)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    x = np.random.default_rng(0).standard_normal([d if isinstance(d, int) else 1 for d in
                                                  sess.get_inputs()[0].shape]).astype(np.float32)
    factory = ray_pool_factory(make_parser().parse_args(["--registry", str(tmp_path), "--ray-address", "auto",
                                                         *flags]))
    pool = factory.create(PoolKey("chain", "1", "full"), path, ModelConfig(replicas=1, max_batch_size=4),
                          GatewayMetrics())
    assert pool.pool.config.tcp_pickle is want

    async def main():
        try:
            return await pool.run({name: x}, deadline_s=None, priority=0)
        finally:
            await pool.close()

    out = asyncio.run(main())
    np.testing.assert_allclose(next(iter(out.outputs.values())), sess.run(None, {name: x})[0], rtol=1e-4, atol=1e-5)
