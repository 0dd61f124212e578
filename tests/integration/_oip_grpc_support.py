"""A real gateway with its OIP gRPC door on loopback: in-process pools, its own event loop thread."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import onnx
import pytest

from cluster._oip_models import OipModels
from cluster.auth import Authorizer, TokenTable
from cluster.gateway import Gateway, LocalPoolFactory
from cluster.metrics import GatewayMetrics
from cluster.oip_grpc import oip_service
from cluster.registry import Registry, VersionPolicy
from cluster.server import new_event_loop, serve
from tests.onnx_models import conv_bn_relu_chain

TOKEN = "oip-grpc-test-token-0123456789"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def import_tritonclient_grpc() -> Any:
    """tritonclient.grpc, or a skip naming what is missing: tritonclient[grpc] needs grpcio>=1.81.1,
    and its generated stubs raise RuntimeError (not ImportError) on an older grpcio."""
    try:
        import tritonclient.grpc as triton
    except (ImportError, RuntimeError) as e:
        pytest.skip(f"needs tritonclient[grpc] with grpcio>=1.81.1 ({str(e).splitlines()[0][:120]})",
                    allow_module_level=True)
    return triton


async def _collect() -> None:
    gc.collect()


@dataclass
class GrpcDoor:
    host: str
    """127.0.0.1:<port>, as tritonclient.grpc takes it."""
    gateway: Gateway
    models: OipModels
    model_path: str
    """The registry's model.onnx of m@<the first version>."""


@contextmanager
def oip_grpc_door(root: str, versions: tuple[str, ...] = ("1",), model_yaml: str = "",
                  credentials: Any = None, model: onnx.ModelProto | None = None) -> Iterator[GrpcDoor]:
    """Registry m@versions (conv chains, each with its own weights, or `model`; `model_yaml`; all
    loaded), a gateway that wants TOKEN, and its gRPC port (TLS with `credentials`) with the native
    and the OIP services."""
    for i, v in enumerate(versions):
        d = os.path.join(root, "repo", "m", v)
        os.makedirs(d)
        onnx.save(model if model is not None else conv_bn_relu_chain(2, seed=i), os.path.join(d, "model.onnx"))
        if model_yaml:
            with open(os.path.join(d, "model.yaml"), "w") as f:
                f.write(model_yaml)
    loop = new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="oip-grpc-gateway-loop", daemon=True)
    thread.start()
    gateway = Gateway(Registry(os.path.join(root, "repo"), policy=VersionPolicy.parse("all")),
                      LocalPoolFactory(cache_dir=os.path.join(root, "ort")), metrics=GatewayMetrics(),
                      authorizer=Authorizer(TokenTable.from_dicts([{"name": "dev", "token": TOKEN}])))
    models = OipModels(gateway)
    server = None
    try:
        asyncio.run_coroutine_threadsafe(gateway.start(), loop).result(60)
        server = asyncio.run_coroutine_threadsafe(
            serve(gateway, host="127.0.0.1", port=0, credentials=credentials, services=[oip_service(models)]), loop).result(30)
        yield GrpcDoor(server.address, gateway, models, os.path.join(root, "repo", "m", versions[0], "model.onnx"))
    finally:
        if server is not None:
            asyncio.run_coroutine_threadsafe(server.stop(0.5), loop).result(30)
            # As ThreadedServer.stop: gRPC call state held by cycles is freed while the loop runs.
            asyncio.run_coroutine_threadsafe(_collect(), loop).result(30)
        asyncio.run_coroutine_threadsafe(gateway.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
