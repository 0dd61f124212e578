"""User-space link emulator: a TCP proxy with per-direction bandwidth, delay and outages.

`tc netem` needs root and a kernel module; neither is available on every developer
machine or CI runner, so the demo, the adaptation benchmark and the chaos tests put this
proxy between the edge agent and the gateway instead. It is a byte pipe, so gRPC/HTTP2
passes through unchanged. How bandwidth, delay and outages are modelled is in
[Note: timing model] in `splitinfer.netem.proxy`.

This package's names are its public API: the values and traces (`link`), Mahimahi
packet-delivery traces and the link that follows one (`mahimahi`), the asyncio
`LinkEmulator` (`proxy`) and its HTTP/JSON control API (`control`), a threaded runner
for synchronous callers (`threaded`), and ``main`` for ``splitinfer netem`` (`cli`).
"""

from __future__ import annotations

from splitinfer.netem.cli import main
from splitinfer.netem.link import (
    TRACE_HEADER,
    LinkSetting,
    NetemError,
    NetemStats,
    OutageMode,
    TokenBucket,
    TraceFormatError,
    TraceStep,
    load_trace,
    resolve_trace,
    setting_at,
    shipped_trace_names,
    shipped_trace_path,
    trace_position,
)
from splitinfer.netem.mahimahi import (
    DEFAULT_QUEUE_BYTES,
    PACKET_BYTES,
    MahimahiTrace,
    OpportunityLink,
    load_mahimahi_trace,
)
from splitinfer.netem.proxy import LinkEmulator
from splitinfer.netem.threaded import ThreadedLinkEmulator

__all__ = [
    "DEFAULT_QUEUE_BYTES",
    "PACKET_BYTES",
    "TRACE_HEADER",
    "LinkEmulator",
    "LinkSetting",
    "MahimahiTrace",
    "NetemError",
    "NetemStats",
    "OpportunityLink",
    "OutageMode",
    "ThreadedLinkEmulator",
    "TokenBucket",
    "TraceFormatError",
    "TraceStep",
    "load_mahimahi_trace",
    "load_trace",
    "main",
    "resolve_trace",
    "setting_at",
    "shipped_trace_names",
    "shipped_trace_path",
    "trace_position",
]
