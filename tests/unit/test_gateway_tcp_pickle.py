"""`splitinfer gateway --direct-tcp-pickle`: the opt-in reaches the Ray pools' PoolConfig, off by default."""

from __future__ import annotations

import pytest

from cluster.ray_cluster import pool_config
from cluster.registry import ModelConfig
from splitinfer.cli import main
from splitinfer.gateway_cmd import make_parser, ray_pool_factory

_ARGS = ["--registry", "/models", "--ray-address", "auto"]


def test_the_flag_reaches_pool_config() -> None:
    factory = ray_pool_factory(make_parser().parse_args([*_ARGS, "--direct-tcp-pickle"]))
    assert factory.tcp_pickle is True
    config = pool_config(ModelConfig(replicas=3, instances=2), direct=factory.direct, tcp_pickle=factory.tcp_pickle)
    assert config.tcp_pickle is True and config.direct is True
    assert (config.num_replicas, config.instances) == (3, 2)


def test_without_the_flag_tcp_channels_carry_tensors_only() -> None:
    factory = ray_pool_factory(make_parser().parse_args(_ARGS))
    assert factory.tcp_pickle is False
    assert pool_config(ModelConfig(), direct=factory.direct, tcp_pickle=factory.tcp_pickle).tcp_pickle is False


def test_help_says_what_the_flag_trades(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--direct-tcp-pickle" in text and "pickle runs whatever it reads" in text and "TLS" in text


def test_the_flag_without_ray_is_refused_in_one_line(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["gateway", "--registry", str(tmp_path), "--allow-empty", "--port", "0", "--metrics-port", "-1",
              "--direct-tcp-pickle"])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("splitinfer gateway: error:")]
    assert exit_.value.code == 2 and len(lines) == 1, err
    assert "--direct-tcp-pickle" in lines[0] and "local-noray" in lines[0] and "give a Ray address" in lines[0]
