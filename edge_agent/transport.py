"""The agent's gRPC connection to the gateway: the protocol's one client, set up for a link.

`Remote` is `cluster.protocol.client.InferenceClient` with the agent's channel options
(see [Note: connect timeout]) and the answers the link monitor reads: each Infer's
bytes each way and round trip (`InferResult`), and each health check's round trip.
"""

from __future__ import annotations

import time

import grpc

from cluster.protocol.client import SERVER_TIME_KEYS, InferenceClient, InferResult
from cluster.protocol.messages import ArtifactsResponse, InferRequest

__all__ = ["AGENT_CHANNEL_OPTIONS", "Remote", "RemoteResult", "make_credentials", "SERVER_TIME_KEYS"]

RemoteResult = InferResult
"""One answered Infer and what the link monitor needs from it."""

_CONNECT_TIMEOUT_MS = 5000
"""Least time one connection attempt may take; see [Note: connect timeout]."""
AGENT_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.min_reconnect_backoff_ms", _CONNECT_TIMEOUT_MS),
)
# [Note: connect timeout]
# gRPC core reads `grpc.min_reconnect_backoff_ms` as the minimum *connect timeout* of an
# attempt (its deadline is the larger of it and the next back-off), not as a back-off.
# Set to 100 ms, a connection had to finish TCP, TLS and the HTTP/2 SETTINGS exchange
# within the back-off (100 ms at first, growing to 1 s): on a 300 ms RTT link the first
# calls failed UNAVAILABLE at once, over a handshake longer than 1 s the agent never
# connected, and on a loaded host even loopback through the link emulator missed it.
# The short initial and maximum back-offs keep retries quick after an outage (gRPC's
# defaults hold the first call after an outage for seconds); 5 s lets a slow handshake
# finish and still retries an attempt stuck in a blackhole within 5 s.


def make_credentials(ca: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials | None:
    """TLS channel credentials from PEM files; None when no CA is configured (plaintext)."""
    if ca is None:
        return None

    def read(path: str) -> bytes:
        with open(path, "rb") as fh:
            return fh.read()

    return grpc.ssl_channel_credentials(read(ca), read(key) if key else None, read(cert) if cert else None)


class Remote:
    """The gateway as the agent calls it. Create it inside the event loop that uses it."""

    def __init__(self, address: str, *, credentials: grpc.ChannelCredentials | None = None,
                 token: str | None = None) -> None:
        self.address = address
        self.client = InferenceClient(address, credentials=credentials, token=token, options=AGENT_CHANNEL_OPTIONS)

    def __repr__(self) -> str:
        return f"Remote({self.client!r})"

    async def close(self) -> None:
        await self.client.close()

    async def infer(self, request: InferRequest, *, timeout_s: float) -> InferResult:
        """One Infer; raises the cluster error the server sent (or UNAVAILABLE/DEADLINE_EXCEEDED's)."""
        return await self.client.infer_counted(request, timeout_s=timeout_s)

    async def health(self, *, timeout_s: float = 2.0) -> tuple[str, float]:
        """(serving status name, round trip ms) of grpc.health.v1 Check."""
        t0 = time.monotonic()
        status = await self.client.health(timeout_s=timeout_s)
        return status, (time.monotonic() - t0) * 1e3

    async def get_artifacts(self, model: str, version: str, *, device_id: str = "",
                            timeout_s: float = 60.0) -> ArtifactsResponse:
        return await self.client.get_artifacts(model, version, device_id=device_id, timeout_s=timeout_s)
