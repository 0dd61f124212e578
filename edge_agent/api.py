"""The local API: a small HTTP/1.1 server on localhost (or a unix socket) for local apps.

    GET  /healthz       200 while the process runs (liveness)
    GET  /readyz        200 once the local model is loaded and until shutdown begins
    GET  /metrics       Prometheus text: requests by path, fallbacks, late drops, link estimate
    GET  /v1/status     JSON: current plan and why, link estimate, breaker, counters
    GET  /v1/model      JSON: the model's name, version, inputs and outputs
    POST /v1/infer      one request (JSON with base64 tensors, or msgpack; see edge_agent.wire)
    POST /v1/stream     NDJSON requests in (one per line, Transfer-Encoding: chunked welcome),
                        NDJSON answers out as chunks, in request order, as each is ready

Apps see one model server: the split, the cut and the fallback are invisible except in
the `served_by` field. Written on asyncio streams (no web framework on the device).
Shutdown (`stop`): the listener closes, new requests get 503, requests in flight finish.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from cluster.errors import ClusterError
from edge_agent import wire
from edge_agent.errors import EdgeError, NotReadyError, RequestError

__all__ = ["LocalApi", "AgentApi"]

logger = logging.getLogger(__name__)

_MAX_HEADER_BYTES = 64 << 10
_MAX_BODY_BYTES = 256 << 20
_STREAM_WINDOW = 8
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 413: "Payload Too Large",
            500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable", 504: "Gateway Timeout"}


class AgentApi(Protocol):
    """What the API needs from the agent."""

    def is_ready(self) -> bool: ...

    async def infer(self, inputs: dict[str, Any], request_id: str | None) -> dict[str, Any]: ...

    def status(self) -> dict[str, Any]: ...

    def model_info(self) -> dict[str, Any]: ...

    def metrics_text(self) -> str: ...


class _BadHttp(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def _read_head(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str]] | None:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    except asyncio.LimitOverrunError as e:
        raise _BadHttp(413, "request headers are too large") from e
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        raise _BadHttp(400, f"bad request line {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return parts[0], parts[1].split("?", 1)[0], headers


async def _body_chunks(reader: asyncio.StreamReader, headers: dict[str, str]):
    """Yields the body's pieces (Content-Length or chunked)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        total = 0
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return
            total += size
            if total > _MAX_BODY_BYTES:
                raise _BadHttp(413, f"body over {_MAX_BODY_BYTES} bytes")
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data
        return
    n = int(headers.get("content-length", "0") or 0)
    if n > _MAX_BODY_BYTES:
        raise _BadHttp(413, f"body of {n} bytes is over {_MAX_BODY_BYTES}")
    if n:
        yield await reader.readexactly(n)


def _response(status: int, body: bytes, content_type: str, *, keep_alive: bool = True) -> bytes:
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n")
    return head.encode() + body


def _error_body(status: int, e: BaseException) -> dict[str, Any]:
    return {"error": type(e).__name__, "message": str(e), "status": status}


def _status_of(e: BaseException) -> int:
    if isinstance(e, (RequestError, _BadHttp)):
        return getattr(e, "status", 400)
    if isinstance(e, NotReadyError):
        return 503
    if isinstance(e, TimeoutError):
        return 504
    if isinstance(e, ClusterError):  # the gateway's error, returned as is with fallback 'none'
        return 502
    return 500 if not isinstance(e, EdgeError) else 503


class LocalApi:
    def __init__(self, agent: AgentApi, *, host: str = "127.0.0.1", port: int = 8500,
                 socket_path: str | None = None, max_inflight: int = 64) -> None:
        self.agent = agent
        self.host, self.port, self.socket_path = host, port, socket_path
        self._server: asyncio.base_events.Server | None = None
        self._sem = asyncio.Semaphore(max_inflight)
        self._draining = False
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._conns: set[asyncio.StreamWriter] = set()
        self.requests: collections.Counter[str] = collections.Counter()

    @property
    def address(self) -> str:
        return f"unix:{self.socket_path}" if self.socket_path else f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        if self.socket_path:
            if os.path.exists(self.socket_path):
                os.unlink(self.socket_path)  # a stale socket from a crash
            self._server = await asyncio.start_unix_server(self._serve, path=self.socket_path, limit=_MAX_HEADER_BYTES)
        else:
            self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=_MAX_HEADER_BYTES)
            self.port = self._server.sockets[0].getsockname()[1]
        logger.info("local API listening on %s", self.address)

    async def stop(self, grace_s: float = 30.0) -> None:
        """Stop accepting, let requests in flight finish (up to grace_s), then close."""
        self._draining = True
        if self._server is not None:
            self._server.close()
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
        except TimeoutError:
            logger.warning("%d requests still running after %.0f s of shutdown grace", self._inflight, grace_s)
        for w in list(self._conns):
            w.close()
        if self._server is not None:
            await self._server.wait_closed()
        if self.socket_path and os.path.exists(self.socket_path):
            os.unlink(self.socket_path)

    def _enter(self) -> None:
        self._inflight += 1
        self._idle.clear()

    def _leave(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        try:
            while True:
                try:
                    head = await _read_head(reader)
                except _BadHttp as e:
                    writer.write(_response(e.status, wire.dumps(_error_body(e.status, e), wire.JSON), wire.JSON,
                                           keep_alive=False))
                    await writer.drain()
                    return
                if head is None:
                    return
                method, path, headers = head
                keep = headers.get("connection", "").lower() != "close" and not self._draining
                self.requests[path] += 1
                self._enter()
                try:
                    await self._dispatch(method, path, headers, reader, writer, keep)
                finally:
                    self._leave()
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        except asyncio.CancelledError:
            raise
        finally:
            self._conns.discard(writer)
            try:
                writer.close()
            except RuntimeError:  # the loop is closing
                pass

    async def _dispatch(self, method: str, path: str, headers: dict[str, str], reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter, keep: bool) -> None:
        ctype = headers.get("content-type", wire.JSON)
        accept = headers.get("accept", ctype)
        out_type = wire.MSGPACK if accept.startswith(wire.MSGPACK) else wire.JSON
        routes: dict[tuple[str, str], Callable[[], Awaitable[tuple[int, Any, str]]]] = {
            ("GET", "/healthz"): self._healthz,
            ("GET", "/readyz"): self._readyz,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/v1/status"): self._status,
            ("GET", "/v1/model"): self._model,
        }
        try:
            if (method, path) in routes:
                status, body, btype = await routes[(method, path)]()
                data = body if isinstance(body, bytes) else wire.dumps(body, btype)
                writer.write(_response(status, data, btype, keep_alive=keep))
            elif method == "POST" and path == "/v1/infer":
                body = b"".join([c async for c in _body_chunks(reader, headers)])
                status, obj = await self._infer(wire.loads(body, ctype), ctype.startswith(wire.MSGPACK),
                                                out_type == wire.MSGPACK)
                writer.write(_response(status, wire.dumps(obj, out_type), out_type, keep_alive=keep))
            elif method == "POST" and path == "/v1/stream":
                await self._stream(reader, writer, headers)
                return
            else:
                known = {p for _, p in routes} | {"/v1/infer", "/v1/stream"}
                code = 405 if path in known else 404
                async for _ in _body_chunks(reader, headers):
                    pass
                writer.write(_response(code, wire.dumps({"error": "NotFound", "status": code, "message": (
                    f"{method} {path} is not served; paths: {sorted(known)}")}, wire.JSON), wire.JSON, keep_alive=keep))
            await writer.drain()
        except _BadHttp as e:
            writer.write(_response(e.status, wire.dumps(_error_body(e.status, e), wire.JSON), wire.JSON,
                                   keep_alive=False))
            await writer.drain()

    # -- routes -------------------------------------------------------------------------

    async def _healthz(self) -> tuple[int, Any, str]:
        return 200, {"status": "alive"}, wire.JSON

    async def _readyz(self) -> tuple[int, Any, str]:
        ready = self.agent.is_ready() and not self._draining
        state = "draining" if self._draining else ("ready" if ready else "starting")
        return (200 if ready else 503), {"status": state}, wire.JSON

    async def _metrics(self) -> tuple[int, Any, str]:
        lines = [self.agent.metrics_text().rstrip("\n"),
                 "# HELP splitinfer_edge_api_requests_total HTTP requests to the local API by path.",
                 "# TYPE splitinfer_edge_api_requests_total counter"]
        lines += [f'splitinfer_edge_api_requests_total{{path="{p}"}} {n}' for p, n in sorted(self.requests.items())
                  if p.startswith(("/v1/", "/healthz", "/readyz", "/metrics"))]
        return 200, ("\n".join(lines) + "\n").encode(), "text/plain; version=0.0.4"

    async def _status(self) -> tuple[int, Any, str]:
        return 200, self.agent.status(), wire.JSON

    async def _model(self) -> tuple[int, Any, str]:
        return 200, self.agent.model_info(), wire.JSON

    async def _infer(self, obj: Any, binary_in: bool, binary_out: bool) -> tuple[int, dict[str, Any]]:
        try:
            if self._draining or not self.agent.is_ready():
                raise NotReadyError(state="shutting down" if self._draining else "starting")
            inputs, rid = wire.decode_tensors(obj, binary_in)
            async with self._sem:
                ans = await self.agent.infer(inputs, rid)
            ans["outputs"] = wire.encode_tensors(ans["outputs"], binary_out)
            return 200, ans
        except Exception as e:  # noqa: BLE001 - every failure is an HTTP status with the message
            code = _status_of(e)
            if code >= 500 and not isinstance(e, (NotReadyError, TimeoutError, ClusterError)):
                logger.warning("request failed: %s", e, exc_info=not isinstance(e, EdgeError))
            return code, _error_body(code, e)

    async def _stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, headers: dict[str, str]) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n"
                     b"Connection: close\r\n\r\n")
        pending: collections.deque[asyncio.Task[tuple[int, dict[str, Any]]]] = collections.deque()

        async def flush(block: bool) -> None:
            while pending and (block or pending[0].done()):
                _, obj = await pending.popleft()
                line = json.dumps(obj, separators=(",", ":")).encode() + b"\n"
                writer.write(b"%x\r\n%s\r\n" % (len(line), line))
                await writer.drain()

        buf = b""
        t0 = time.monotonic()
        async for chunk in _body_chunks(reader, headers):
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.strip():
                    pending.append(asyncio.ensure_future(self._stream_one(line)))
                if len(pending) >= _STREAM_WINDOW:
                    await asyncio.wait([pending[0]])
                await flush(False)
        if buf.strip():
            pending.append(asyncio.ensure_future(self._stream_one(buf)))
        await flush(True)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        logger.debug("stream closed after %.1f s", time.monotonic() - t0)

    async def _stream_one(self, line: bytes) -> tuple[int, dict[str, Any]]:
        try:
            obj = wire.loads(line, wire.JSON)
        except RequestError as e:
            return 400, _error_body(400, e)
        return await self._infer(obj, False, False)
