"""The HTTP/JSON control API of the link emulator: GET /state, POST /set, POST /replay.

`LinkEmulator` serves it on ``control=(host, port)``; these functions parse a request,
call the emulator and answer JSON, so a bad request gets a 4xx naming the value and the
fix and never reaches the link.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import TYPE_CHECKING, Any

from splitinfer.netem.link import NetemError

if TYPE_CHECKING:
    from splitinfer.netem.proxy import LinkEmulator

__all__ = ["handle_control_request", "serve_control_connection"]


def handle_control_request(emu: LinkEmulator, method: str, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
    """Answer one control request: GET /state, POST /set, POST /replay. Returns (status, JSON)."""
    route = path.split("?", 1)[0].rstrip("/") or "/"
    routes = {"/state": "GET", "/set": "POST", "/replay": "POST"}
    if route not in routes:
        return 404, {"error": f"no such path {route!r}", "fix": f"use one of {sorted(routes)}"}
    if method != routes[route]:
        return 405, {"error": f"{method} not allowed on {route}", "fix": f"use {routes[route]} {route}"}
    if route == "/state":
        return 200, emu.state()
    try:
        request = json.loads(body.decode("utf-8") or "{}")
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return 400, {"error": f"body is not JSON: {e}", "fix": "send a JSON object"}
    if not isinstance(request, dict):
        return 400, {"error": f"body must be a JSON object, got {type(request).__name__}", "fix": "send {...}"}
    if route == "/replay":
        loop = request.get("loop")
        if set(request) - {"loop"} or not isinstance(loop, (bool, type(None))):
            return 400, {"error": f"bad replay request {request!r}", "fix": 'send {} or {"loop": true|false}'}
        try:
            emu.replay(loop=loop)
        except NetemError as e:
            return 409, {"error": str(e), "fix": e.fix}
        return 200, emu.state()
    allowed = {"up_mbps", "down_mbps", "rtt_ms", "up"}
    unknown = sorted(set(request) - allowed)
    if unknown:
        return 400, {"error": f"unknown field(s) {unknown}", "fix": f"send only {sorted(allowed)}"}
    up = request.get("up")
    if up is not None:
        if up not in (0, 1) or isinstance(up, float):
            return 400, {"error": f"up must be true/false or 1/0, got {up!r}", "fix": 'send "up": true'}
        up = bool(up)
    try:
        emu.set(up_bps=_mbps_to_bps(request.get("up_mbps")), down_bps=_mbps_to_bps(request.get("down_mbps")),
                 rtt_ms=request.get("rtt_ms"), up=up)
    except (NetemError, TypeError) as e:
        return 400, {"error": str(e), "fix": "send non-negative numbers: up_mbps, down_mbps, rtt_ms"}
    return 200, emu.state()

async def serve_control_connection(emu: LinkEmulator, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        status, payload = await asyncio.wait_for(_read_request(emu, reader), 10.0)
    except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
        status, payload = 400, {"error": f"malformed HTTP request: {e!r}", "fix": "send HTTP/1.1 with JSON"}
    body = json.dumps(payload).encode()
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 409: "Conflict"}
    head = (f"HTTP/1.1 {status} {reason.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    with contextlib.suppress(OSError):
        writer.write(head.encode("latin-1") + body)
        await writer.drain()
        writer.close()

async def _read_request(emu: LinkEmulator, reader: asyncio.StreamReader) -> tuple[int, dict[str, Any]]:
    method, target, _ = (await reader.readuntil(b"\r\n")).decode("latin-1").split(" ", 2)
    length = 0
    while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
        name, _, value = line.decode("latin-1").partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    if not 0 <= length <= 1 << 20:
        raise ValueError(f"Content-Length {length} out of range")
    body = await reader.readexactly(length) if length else b""
    return handle_control_request(emu, method.upper(), target, body)


def _mbps_to_bps(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a number of Mbit/s, got {value!r}")
    return float(value) * 1e6
