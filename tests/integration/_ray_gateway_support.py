"""Shared by the tests of a gateway whose tails run on Ray workers: a local Ray cluster
started through `cluster.ray_cluster` for the module, and the conv stack of
test_gateway_overload served by such a gateway over gRPC on 127.0.0.1."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cluster.gateway import Gateway
from cluster.registry import Registry
from cluster.server import serve_in_thread
from tests.integration._gateway_support import write_version
from tests.integration.test_gateway_overload import conv_stack


@pytest.fixture(scope="module")
def ray_local():
    """`cluster.ray_cluster`, connected to a local 2-CPU Ray; shut down after the module
    when the fixture started it."""
    from cluster import ray_cluster

    started = not __import__("ray").is_initialized()
    ray_cluster.connect("local", num_cpus=2)
    try:
        yield ray_cluster
    finally:
        if started:
            ray_cluster.shutdown()


@dataclass
class Served:
    """Model `s` version `1` (the conv stack, no cut but the whole) behind a gateway on Ray."""

    model_dir: Path
    registry: Registry
    gateway: Gateway
    server: Any
    cut: Any


def serve_conv_stack(tmp_path: Path, ray_cluster: Any, model_yaml: str, model: Any = None) -> Served:
    """Writes the conv stack (or `model`) as `s/1` with `model_yaml`, loads it in a gateway whose
    pools are Ray workers on the CPU, and serves it in a thread."""
    d = write_version(tmp_path / "repo", "s", "1", conv_stack() if model is None else model, model_yaml)
    registry = Registry(str(tmp_path / "repo"))
    gateway = Gateway(registry, ray_cluster.RayPoolFactory(provider="cpu"))
    registry.load_all()
    server = serve_in_thread(gateway)
    return Served(d, registry, gateway, server, registry.resolve("s", "1").frontier.cuts[0])
