"""A real gateway with its OIP REST door on loopback (in-process pools, its own event loop
thread), and the ONNX Runtime references that the tests of both OIP doors compare with."""

from __future__ import annotations

import asyncio
import os
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from cluster.auth import Authorizer, TokenTable
from cluster.gateway import Gateway, LocalPoolFactory
from cluster.metrics import GatewayMetrics, MetricsServer
from cluster.oip_rest import OipRest
from cluster.registry import Registry, VersionPolicy
from cluster.server import new_event_loop
from tests.onnx_models import conv_bn_relu_chain

TOKEN = "oip-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class Door:
    url: str
    """http://127.0.0.1:<port> (https:// with TLS)"""
    host: str
    """127.0.0.1:<port>, as tritonclient takes it."""
    gateway: Gateway
    oip: OipRest
    model_path: str
    """The registry's model.onnx of m@<the first version>."""


def ort_run(model: str | bytes, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`model` (a path or serialized bytes) run by ONNX Runtime on the CPU: output name -> array."""
    import onnxruntime as ort

    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


def ort_per_sample(model: str, x: np.ndarray) -> np.ndarray:
    """The model's output for a batch: the registry model has batch 1 fixed, the gateway batches."""
    return np.concatenate([ort_run(model, {"x": x[i:i + 1]})["y"] for i in range(len(x))])


def tails(door: Any) -> list[str]:
    """The cut ids of m's preloaded tails, the empty cut `L` left out."""
    return [c for c in door.gateway.registry.resolve("m", "").frontier.cut_ids if c != "L"]


def head_boundaries(door: Any, x: np.ndarray) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
    """For each preloaded tail of m: its cut id and the tensors its head (run by ONNX
    Runtime) computes from `x`."""
    lv = door.gateway.registry.resolve("m", "")
    for cut in tails(door):
        head, _ = lv.files.splitter().split(lv.files.resolve_cut(cut))
        yield cut, ort_run(head.model.SerializeToString(), {"x": x})


@contextmanager
def oip_door(root: str, versions: tuple[str, ...] = ("1",), tls: ssl.SSLContext | None = None) -> Iterator[Door]:
    """Registry m@versions (conv chains, each with its own weights; all loaded), a gateway that
    wants TOKEN, and its HTTP port (HTTPS with `tls`) with the OIP routes."""
    for i, v in enumerate(versions):
        d = os.path.join(root, "repo", "m", v)
        os.makedirs(d)
        onnx.save(conv_bn_relu_chain(2, seed=i), os.path.join(d, "model.onnx"))
    model_path = os.path.join(root, "repo", "m", versions[0], "model.onnx")
    loop = new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="oip-gateway-loop", daemon=True)
    thread.start()
    metrics = GatewayMetrics()
    gateway = Gateway(Registry(os.path.join(root, "repo"), policy=VersionPolicy.parse("all")), LocalPoolFactory(cache_dir=os.path.join(root, "ort")),
                      metrics=metrics,
                      authorizer=Authorizer(TokenTable.from_dicts([{"name": "dev", "token": TOKEN}])))
    http = None
    try:
        asyncio.run_coroutine_threadsafe(gateway.start(), loop).result(60)
        oip = OipRest(gateway, loop)
        http = MetricsServer(metrics, gateway.readiness, routes=oip.serve, tls=tls)
        yield Door(http.url, f"127.0.0.1:{http.port}", gateway, oip, model_path)
    finally:
        if http is not None:
            http.stop()
        asyncio.run_coroutine_threadsafe(gateway.close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
