"""The agent's gRPC connection to the gateway.

A thin client of `splitinfer.v1.Inference` built on the protocol's messages and
status table, rather than `cluster.protocol.client.InferenceClient`, for two reasons:
the link monitor needs the exact bytes each call moved (it encodes the frame here and
counts it), and the channel needs short reconnect back-off so the first call after an
outage is not held for gRPC's default seconds of back-off.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.protocol import status as _status
from cluster.protocol.errors import ClusterError
from cluster.protocol.messages import (
    SERVICE_NAME,
    ArtifactsChunk,
    ArtifactsRequest,
    ArtifactsResponse,
    InferRequest,
    InferResponse,
)

__all__ = ["Remote", "RemoteResult", "make_credentials", "SERVER_TIME_KEYS"]

#: timings_ms keys that are time spent in the server (not on the link).
SERVER_TIME_KEYS = ("decode", "decode_tensors", "queue", "compute", "encode")
_MAX_MESSAGE_BYTES = 64 << 20
_CONNECT_TIMEOUT_MS = 5000
"""Least time one connection attempt may take; see [Note: connect timeout]."""
_OPTIONS = [
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.min_reconnect_backoff_ms", _CONNECT_TIMEOUT_MS),
]
# [Note: connect timeout]
# gRPC core reads `grpc.min_reconnect_backoff_ms` as the minimum *connect timeout* of an
# attempt (its deadline is the larger of it and the next back-off), not as a back-off.
# Set to 100 ms, a connection had to finish TCP, TLS and the HTTP/2 SETTINGS exchange
# within the back-off (100 ms at first, growing to 1 s): on a 300 ms RTT link the first
# calls failed UNAVAILABLE at once, over a handshake longer than 1 s the agent never
# connected, and on a loaded host even loopback through the link emulator missed it.
# The short initial and maximum back-offs keep retries quick after an outage; 5 s lets
# a slow handshake finish and still retries an attempt stuck in a blackhole within 5 s.


def make_credentials(ca: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials | None:
    """TLS channel credentials from PEM files; None when no CA is configured (plaintext)."""
    if ca is None:
        return None

    def read(path: str) -> bytes:
        with open(path, "rb") as fh:
            return fh.read()

    return grpc.ssl_channel_credentials(read(ca), read(key) if key else None, read(cert) if cert else None)


@dataclass(frozen=True)
class RemoteResult:
    """One answered Infer and what the link monitor needs from it."""

    response: InferResponse
    up_bytes: int
    down_bytes: int
    elapsed_s: float
    server_ms: float


def _error(e: grpc.RpcError) -> ClusterError:
    return _status.from_status(e.code(), e.details(), e.trailing_metadata())


class Remote:
    """asyncio gRPC client of one gateway. Create it inside the event loop that uses it."""

    def __init__(self, address: str, *, credentials: grpc.ChannelCredentials | None = None,
                 token: str | None = None) -> None:
        self.address = address
        if credentials is not None:
            self._channel = grpc.aio.secure_channel(address, credentials, options=_OPTIONS)
        else:
            self._channel = grpc.aio.insecure_channel(address, options=_OPTIONS)
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        base = f"/{SERVICE_NAME}/"
        self._infer = self._channel.unary_unary(base + "Infer")
        self._artifacts = self._channel.unary_stream(base + "GetArtifacts")
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def __repr__(self) -> str:
        return f"Remote({self.address!r}, token={'set' if self._metadata else 'none'})"

    async def close(self) -> None:
        await self._channel.close()

    async def infer(self, request: InferRequest, *, timeout_s: float) -> RemoteResult:
        """One Infer; raises the cluster error the server sent (or UNAVAILABLE/DEADLINE_EXCEEDED's)."""
        data = request.to_msgpack()
        t0 = time.monotonic()
        try:
            raw = await self._infer(data, timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error(e) from e
        elapsed = time.monotonic() - t0
        resp = InferResponse.from_msgpack(raw)
        server_ms = sum(v for k, v in resp.timings_ms.items() if k in SERVER_TIME_KEYS)
        return RemoteResult(resp, len(data), len(raw), elapsed, server_ms)

    async def health(self, *, timeout_s: float = 2.0) -> tuple[str, float]:
        """(serving status name, round trip ms) of grpc.health.v1 Check."""
        t0 = time.monotonic()
        try:
            resp = await self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s,
                                            metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error(e) from e
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status), (time.monotonic() - t0) * 1e3

    async def get_artifacts(self, model: str, version: str, *, device_id: str = "",
                            timeout_s: float = 60.0) -> ArtifactsResponse:
        req = ArtifactsRequest(model=model, version=version, device_id=device_id)
        chunks = []
        try:
            async for raw in self._artifacts(req.to_msgpack(), timeout=timeout_s, metadata=self._metadata):
                chunks.append(ArtifactsChunk.from_msgpack(raw))
        except grpc.RpcError as e:
            raise _error(e) from e
        return ArtifactsResponse.from_chunks(chunks, model=model, version=version)
