"""Shared by the gateway's integration tests: a model version written into a registry
directory, and a gateway served over gRPC on 127.0.0.1 in a thread of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import onnx

from cluster.gateway import Gateway
from cluster.server import serve_in_thread


def write_version(root: str | Path, name: str, version: str, model: onnx.ModelProto | bytes,
                  model_yaml: str | None = None) -> Path:
    """`root/name/version/model.onnx` (`model` as given where it is bytes) and, where given,
    its `model.yaml`: the version's directory."""
    d = Path(root) / name / version
    d.mkdir(parents=True)
    if isinstance(model, bytes):
        (d / "model.onnx").write_bytes(model)
    else:
        onnx.save(model, str(d / "model.onnx"))
    if model_yaml is not None:
        (d / "model.yaml").write_text(model_yaml)
    return d


@contextmanager
def serving(gateway: Gateway, *, start_timeout_s: float | None = None) -> Iterator[Any]:
    """The gateway served in a thread (`serve_in_thread`): the running server. Given
    `start_timeout_s`, the gateway starts first, keeping going past versions that fail.
    On exit the gateway is closed and the server stopped."""
    server = serve_in_thread(gateway)
    try:
        if start_timeout_s is not None:
            asyncio.run_coroutine_threadsafe(gateway.start(keep_going=True), server._loop).result(start_timeout_s)
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(gateway.close(), server._loop).result()
        server.stop()
