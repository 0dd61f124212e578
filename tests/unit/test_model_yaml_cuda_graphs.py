"""model.yaml's cuda_graphs: read, checked, and handed to the engines of both pools."""

from __future__ import annotations

import pytest

from cluster._pools import LocalPool
from cluster.metrics import GatewayMetrics
from cluster.registry import ModelConfig, RegistryError
from tests.unit._engine_models import make_small_cnn


def test_cuda_graphs_is_read_from_model_yaml(tmp_path) -> None:
    path = tmp_path / "model.yaml"
    path.write_text("cuda_graphs: true\n")
    assert ModelConfig.from_yaml_file(str(path)).cuda_graphs is True
    assert ModelConfig().cuda_graphs is None
    assert ModelConfig.from_json(ModelConfig(cuda_graphs=True).to_json()).cuda_graphs is True


@pytest.mark.parametrize("value", ["yes please", "1", "'on'"])
def test_a_cuda_graphs_that_is_not_a_boolean_is_a_clear_error(tmp_path, value) -> None:
    path = tmp_path / "model.yaml"
    path.write_text(f"cuda_graphs: {value}\n")
    with pytest.raises(RegistryError, match="cuda_graphs=.* must be true or false"):
        ModelConfig.from_yaml_file(str(path))


def test_the_in_process_pool_hands_cuda_graphs_to_its_engines(tmp_path) -> None:
    path = tmp_path / "tail.onnx"
    path.write_bytes(make_small_cnn().SerializeToString())
    # ONNX Runtime's CPU provider does not read the field: the pool still loads and serves
    pool = LocalPool("k", str(path), ModelConfig(cuda_graphs=True), GatewayMetrics(), provider="cpu")
    try:
        assert [e.config.cuda_graphs for e in pool.engines] == [True]
    finally:
        import asyncio

        asyncio.run(pool.close())
