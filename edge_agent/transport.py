"""The agent's gRPC connection to the gateway: the protocol's one client, set up for a link.

`connect` makes a `cluster.protocol.client.InferenceClient` with the agent's channel
options (see [Note: connect timeout]). The link monitor reads each call's bytes each way
and round trip from its `infer_counted`.
"""

from __future__ import annotations

import grpc

from cluster.protocol.client import InferenceClient

__all__ = ["AGENT_CHANNEL_OPTIONS", "connect", "make_credentials"]

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


def connect(address: str, *, credentials: grpc.ChannelCredentials | None = None,
            token: str | None = None) -> InferenceClient:
    """The agent's client of the gateway at `address`. Create it inside the event loop that uses it."""
    return InferenceClient(address, credentials=credentials, token=token, options=AGENT_CHANNEL_OPTIONS)
