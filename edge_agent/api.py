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

Every request gets an answer. One that cannot be read as HTTP, or whose body is not a
valid request, gets a 4xx (413 over the size limits) with the JSON error body
`{"error", "message", "status"}`, whose message names the bad value and the fix; a
failure of the agent itself is a 500 of the same shape, and its traceback goes to the
log. Error bodies are JSON whatever `Accept` asks for.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from cluster.protocol.errors import ClusterError
from edge_agent import wire
from edge_agent.errors import EdgeError, NotReadyError, RequestError

__all__ = ["LocalApi", "AgentApi"]

logger = logging.getLogger(__name__)

_MAX_HEADER_BYTES = 64 << 10
_MAX_BODY_BYTES = 256 << 20
_STREAM_WINDOW = 8
_LINGER_S = 1.0
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
            413: "Payload Too Large",
            417: "Expectation Failed", 500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable",
            504: "Gateway Timeout"}
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # RFC 9110 token: methods and header names
_REQUEST_LINE = re.compile(rf"({_TOKEN.pattern}) (/\S*) HTTP/1\.([01])")
_DIGITS = re.compile(r"[0-9]+")
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,15})[ \t]*(;[^\r\n]*)?\r?\n")
_GET_PATHS = ("/healthz", "/readyz", "/metrics", "/v1/status", "/v1/model")
_POST_PATHS = ("/v1/infer", "/v1/stream")
_STREAM_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nTransfer-Encoding: chunked\r\n"
                b"Connection: close\r\n\r\n")


class AgentApi(Protocol):
    """What the API needs from the agent."""

    def is_ready(self) -> bool: ...

    async def infer(self, inputs: dict[str, Any], request_id: str | None) -> dict[str, Any]: ...

    def status(self) -> dict[str, Any]: ...

    def model_info(self) -> dict[str, Any]: ...

    def metrics_text(self) -> str: ...


class _BadHttp(Exception):
    """A request the server cannot read as HTTP: answered with `status`, then the connection closes."""

    def __init__(self, status: int, *, reason: str, fix: str) -> None:
        self.status = status
        self.reason = reason
        self.fix = fix
        super().__init__(f"bad request: {reason}; {fix}")


@dataclass(frozen=True)
class _Request:
    method: str
    path: str
    headers: dict[str, str]
    body_bytes: int | None
    """Content-Length, or None for a chunked body."""
    keep_alive: bool


def _short(raw: bytes | str, limit: int = 60) -> str:
    """repr of the first `limit` characters: an error names the bad value without echoing a whole body."""
    text = raw.decode("latin-1") if isinstance(raw, bytes) else raw
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


async def _read_line(reader: asyncio.StreamReader, what: str) -> bytes:
    try:
        return await reader.readuntil(b"\n")
    except asyncio.LimitOverrunError as e:
        raise _BadHttp(413 if what == "header" else 400, reason=f"a {what} line is over {_MAX_HEADER_BYTES} bytes",
                       fix=f"end each {what} line with CRLF, and keep it short") from e


async def _read_request(reader: asyncio.StreamReader, first: bytes) -> _Request | None:
    """The head of the request that begins with the byte `first`; None when the app closed the
    connection between requests."""
    lines: list[str] = []
    seen_bytes = 0
    while True:
        try:
            if first:
                raw, first = (first if first == b"\n" else first + await _read_line(reader, "header")), b""
            else:
                raw = await _read_line(reader, "header")
        except asyncio.IncompleteReadError as e:
            partial = first + e.partial
            if lines or partial.strip():
                raise _BadHttp(400, reason=f"the request ended inside its head ({_short(partial)})",
                               fix="end the request line and headers with an empty line (CRLF CRLF)") from e
            return None
        seen_bytes += len(raw)
        if seen_bytes > _MAX_HEADER_BYTES:
            raise _BadHttp(413, reason=f"the request's head is over {_MAX_HEADER_BYTES} bytes",
                           fix="send fewer or shorter headers")
        line = raw.rstrip(b"\r\n").decode("latin-1")
        if line:
            lines.append(line)
        elif lines:  # the empty line that ends the head; empty lines before a request line are skipped
            break
    m = _REQUEST_LINE.fullmatch(lines[0])
    if m is None:
        raise _BadHttp(400, reason=f"the request line {_short(lines[0])} is not 'METHOD /path HTTP/1.1'",
                       fix="start with e.g. 'POST /v1/infer HTTP/1.1'")
    method, target, minor = m.groups()
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not _TOKEN.fullmatch(name):
            raise _BadHttp(400, reason=f"the header line {_short(line)} is not 'Name: value'",
                           fix="write each header as 'Name: value' on one line")
        name, value = name.lower(), value.strip(" \t")
        if name in ("content-length", "transfer-encoding") and headers.get(name, value) != value:
            raise _BadHttp(400, reason=f"{name} is given twice ({_short(headers[name])} and {_short(value)})",
                           fix=f"send one {name} header")
        headers[name] = value
    connection = headers.get("connection", "").lower()
    keep = connection != "close" if minor == "1" else connection == "keep-alive"
    return _Request(method, target.split("?", 1)[0], headers, _body_bytes(headers), keep)


def _body_bytes(headers: dict[str, str]) -> int | None:
    encoding = headers.get("transfer-encoding")
    if encoding is not None:
        if encoding.lower() != "chunked":
            raise _BadHttp(400, reason=f"Transfer-Encoding {_short(encoding)} is not supported",
                           fix="send Transfer-Encoding: chunked, or a Content-Length")
        return None
    length = headers.get("content-length", "0")
    if not _DIGITS.fullmatch(length):
        raise _BadHttp(400, reason=f"Content-Length {_short(length)} is not a number of bytes",
                       fix="give the body's length in bytes, as decimal digits")
    if len(length) > 12 or int(length) > _MAX_BODY_BYTES:
        raise _BadHttp(413, reason=f"Content-Length {_short(length)} is over {_MAX_BODY_BYTES} bytes",
                       fix="send a smaller body (many requests go one per line to /v1/stream)")
    return int(length)


async def _body_chunks(reader: asyncio.StreamReader, body_bytes: int | None) -> AsyncIterator[bytes]:
    """Yields the body's pieces (Content-Length, or chunked when `body_bytes` is None)."""
    try:
        if body_bytes is not None:
            if body_bytes:
                yield await reader.readexactly(body_bytes)
            return
        total = 0
        while True:
            line = await _read_line(reader, "chunk size")
            m = _CHUNK_SIZE.fullmatch(line)
            if m is None:
                raise _BadHttp(400, reason=f"the chunk size line {_short(line)} is not a hex number",
                               fix="start each chunk with its size in hex and CRLF, and end the body with 0 CRLF CRLF")
            size = int(m[1], 16)
            if size == 0:
                while (await _read_line(reader, "trailer")).strip(b"\r\n"):
                    pass  # trailers carry nothing the API uses
                return
            total += size
            if total > _MAX_BODY_BYTES:
                raise _BadHttp(413, reason=f"the chunked body is over {_MAX_BODY_BYTES} bytes",
                               fix="send a smaller body, or split the stream over several requests")
            data = await reader.readexactly(size)
            after = await _read_line(reader, "chunk end")
            if after.strip(b"\r\n"):
                raise _BadHttp(400, reason=f"a chunk of {size} bytes is followed by {_short(after)}, not CRLF",
                               fix="give each chunk's exact length in hex in its size line")
            yield data
    except asyncio.IncompleteReadError as e:
        where = f"{len(e.partial)} of {e.expected} bytes into a piece" if e.expected else "inside a chunk's framing"
        raise _BadHttp(400, reason=f"the body ended early, {where}",
                       fix="send as many bytes as Content-Length says, or end a chunked body with 0 CRLF CRLF") from e


async def _read_body(reader: asyncio.StreamReader, body_bytes: int | None) -> bytes:
    return b"".join([c async for c in _body_chunks(reader, body_bytes)])


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Sends what is written, then reads and drops what the app still sends, for up to `_LINGER_S`.

    Called before closing a connection whose request may not have been read to its end:
    closing a socket with unread bytes resets the connection, and the reset can destroy
    the answer before the app reads it.
    """
    await writer.drain()
    if writer.can_write_eof():
        writer.write_eof()
    try:
        async with asyncio.timeout(_LINGER_S):
            while await reader.read(1 << 16):
                pass
    except (TimeoutError, ConnectionError):
        pass


def _response(status: int, body: bytes, content_type: str, *, keep_alive: bool = True) -> bytes:
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n")
    return head.encode() + body


def _error_body(status: int, e: BaseException) -> dict[str, Any]:
    """{"error", "message", "status"}: every error answer is JSON of this shape."""
    if isinstance(e, _BadHttp):
        return {"error": _REASONS[status].replace(" ", ""), "message": str(e), "status": status}
    if status == 500 and not isinstance(e, EdgeError):
        return {"error": "InternalError", "status": status,
                "message": f"the edge agent failed on this request ({type(e).__name__}: {e}); its log has the details"}
    return {"error": type(e).__name__, "message": str(e), "status": status}


def _status_of(e: BaseException) -> int:
    if isinstance(e, RequestError):
        return 400
    if isinstance(e, NotReadyError):
        return 503
    if isinstance(e, TimeoutError):
        return 504
    if isinstance(e, ClusterError):  # the gateway's error, returned as is with fallback 'none'
        return 502
    return 500 if not isinstance(e, EdgeError) else 503


class LocalApi:
    """The local API server.

    [Note: connection timeouts] A keep-alive connection on which no request begins within
    `idle_timeout_s` is closed without an answer, as no request was made. Once a request's
    first byte arrives, its head must arrive within `read_timeout_s`, and then its body
    within `read_timeout_s` again; one that does not is answered 408 and the connection
    closes. So an app that opens connections and stalls cannot hold the server's
    connections forever. `/v1/stream` bodies are exempt: a stream's lines come at the
    app's pace.
    """

    def __init__(self, agent: AgentApi, *, host: str = "127.0.0.1", port: int = 8500,
                 socket_path: str | None = None, max_inflight: int = 64, idle_timeout_s: float = 60.0,
                 read_timeout_s: float = 30.0) -> None:
        self.agent = agent
        self.idle_timeout_s, self.read_timeout_s = idle_timeout_s, read_timeout_s
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
            while await self._exchange(reader, writer):
                pass
        except ConnectionError:  # the app went away while its answer was being written
            return
        finally:
            self._conns.discard(writer)
            try:
                writer.close()
            except RuntimeError:  # the loop is closing
                pass

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Reads one request and answers it, whatever it holds; False once the connection is done.

        [Note: every request is answered] Client garbage (bad framing, bad bodies) is a 4xx
        JSON answer naming what was wrong; any other failure is a logged 500 JSON answer.
        Only an app that is gone goes unanswered.
        """
        try:  # [Note: connection timeouts]
            async with asyncio.timeout(self.idle_timeout_s):
                first = await reader.read(1)
        except TimeoutError:
            return False
        try:
            try:
                async with asyncio.timeout(self.read_timeout_s):
                    req = await _read_request(reader, first)
            except TimeoutError as e:
                raise _BadHttp(408, reason=f"the request's head did not arrive within {self.read_timeout_s:g} s "
                                           "of its first byte",
                               fix="send the request line and headers at once, ended by an empty line") from e
        except _BadHttp as e:
            await self._answer_error(reader, writer, e.status, e)
            return False
        if req is None:
            return False
        keep = req.keep_alive and not self._draining
        self.requests[req.path if req.path in _GET_PATHS + _POST_PATHS else "other"] += 1
        self._enter()
        try:
            return await self._dispatch(req, reader, writer, keep)
        except _BadHttp as e:
            await self._answer_error(reader, writer, e.status, e)
            return False
        except ConnectionError:
            raise
        except Exception as e:  # noqa: BLE001 - see [Note: every request is answered]
            code = _status_of(e)
            if code == 500:
                logger.exception("local API: %s %s failed", req.method[:20], req.path[:80])
            await self._answer_error(reader, writer, code, e)
            return False
        finally:
            self._leave()

    @staticmethod
    async def _answer_error(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status: int,
                            e: BaseException) -> None:
        """An error answer; the connection closes after it, as what follows on it may not be a request."""
        writer.write(_response(status, wire.dumps(_error_body(status, e), wire.JSON), wire.JSON, keep_alive=False))
        await _linger(reader, writer)

    async def _dispatch(self, req: _Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        keep: bool) -> bool:
        expect = req.headers.get("expect", "").lower()
        if expect not in ("", "100-continue"):
            raise _BadHttp(417, reason=f"Expect {_short(expect)} is not supported", fix="send Expect: 100-continue or none")
        if expect and req.body_bytes != 0:
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if req.method == "POST" and req.path == "/v1/stream":
            await self._stream(req, reader, writer)
            return False
        try:
            async with asyncio.timeout(self.read_timeout_s):
                body = await _read_body(reader, req.body_bytes)
        except TimeoutError as e:
            raise _BadHttp(408, reason=f"the body did not arrive within {self.read_timeout_s:g} s of the head "
                                       f"({req.body_bytes} bytes were announced)" if req.body_bytes is not None
                           else f"the chunked body did not end within {self.read_timeout_s:g} s of the head",
                           fix="send the whole body right after the head") from e
        routes: dict[str, Callable[[], Awaitable[tuple[int, Any, str]]]] = {
            "/healthz": self._healthz, "/readyz": self._readyz, "/metrics": self._metrics,
            "/v1/status": self._status, "/v1/model": self._model,
        }
        method = "GET" if req.method == "HEAD" else req.method  # HEAD: GET's status and headers, no body
        if method == "GET" and req.path in routes:
            status, obj, ctype = await routes[req.path]()
            data = obj if isinstance(obj, bytes) else wire.dumps(obj, ctype)
        elif method == "POST" and req.path == "/v1/infer":
            in_type = req.headers.get("content-type", wire.JSON)
            binary_out = req.headers.get("accept", in_type).startswith(wire.MSGPACK)
            status, obj = await self._infer(body, in_type, binary_out)
            ctype = wire.MSGPACK if binary_out and status == 200 else wire.JSON
            data = wire.dumps(obj, ctype)
        else:
            allowed = "GET" if req.path in routes else "POST" if req.path in _POST_PATHS else ""
            status, ctype = (405 if allowed else 404), wire.JSON
            served = [f"GET {p}" for p in _GET_PATHS] + [f"POST {p}" for p in _POST_PATHS]
            fix = f"use {allowed} {req.path}" if allowed else f"paths served: {', '.join(served)}"
            data = wire.dumps({"error": _REASONS[status].replace(" ", ""), "status": status,
                               "message": f"{req.method[:20]} {req.path[:80]} is not served; {fix}"}, ctype)
        answer = _response(status, data, ctype, keep_alive=keep)
        writer.write(answer[:len(answer) - len(data)] if req.method == "HEAD" else answer)
        await writer.drain()
        return keep

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

    async def _infer(self, body: bytes, content_type: str, binary_out: bool) -> tuple[int, dict[str, Any]]:
        """(status, answer or error body) of one request body; never raises."""
        obj: Any = None
        try:
            if self._draining or not self.agent.is_ready():
                raise NotReadyError(state="shutting down" if self._draining else "starting")
            obj = wire.loads(body, content_type)
            inputs, rid = wire.decode_tensors(obj, content_type.startswith(wire.MSGPACK))
            async with self._sem:
                ans = await self.agent.infer(inputs, rid)
            ans["outputs"] = wire.encode_tensors(ans["outputs"], binary_out)
            return 200, ans
        except Exception as e:  # noqa: BLE001 - every failure is an HTTP status with the message
            code = _status_of(e)
            if code == 500:
                logger.error("local API: a request failed: %s", e, exc_info=not isinstance(e, EdgeError))
            err = _error_body(code, e)
            if isinstance(obj, Mapping) and isinstance(obj.get("id"), str):
                err["id"] = obj["id"]
            return code, err

    async def _stream(self, req: _Request, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """NDJSON requests in, NDJSON answers out in request order, each sent once it and those before it are.

        Lines are read while answers are written, so an app may wait for each answer before
        it sends the next line. A body that stops being readable (bad chunking, cut short)
        ends the stream with an error line after the answers to the lines before it; with
        no line read yet, it is a plain 4xx answer instead.
        """
        queue: asyncio.Queue[asyncio.Future[tuple[int, dict[str, Any]]] | None] = asyncio.Queue(_STREAM_WINDOW)
        sender = asyncio.ensure_future(self._send_answers(queue, writer))
        lines = 0
        failure: tuple[int, BaseException] | None = None
        try:
            buf = b""
            async for chunk in _body_chunks(reader, req.body_bytes):
                buf += chunk
                *complete, buf = buf.split(b"\n")
                for line in complete:
                    if line.strip():
                        lines += 1
                        await queue.put(asyncio.ensure_future(self._infer(line, wire.JSON, False)))
            if buf.strip():
                lines += 1
                await queue.put(asyncio.ensure_future(self._infer(buf, wire.JSON, False)))
        except _BadHttp as e:
            failure = (e.status, e)
        except Exception as e:  # noqa: BLE001 - see [Note: every request is answered]
            logger.exception("local API: POST /v1/stream failed")
            failure = (500, e)
        except BaseException:
            sender.cancel()
            raise
        if failure is not None and lines == 0:
            await queue.put(None)
            await sender
            await self._answer_error(reader, writer, failure[0], failure[1])
            return
        if failure is not None:
            done: asyncio.Future[tuple[int, dict[str, Any]]] = asyncio.get_running_loop().create_future()
            done.set_result((failure[0], _error_body(*failure)))
            await queue.put(done)
        await queue.put(None)
        writer.write((b"" if await sender else _STREAM_HEAD) + b"0\r\n\r\n")
        await (writer.drain() if failure is None else _linger(reader, writer))

    @staticmethod
    async def _send_answers(queue: asyncio.Queue[asyncio.Future[tuple[int, dict[str, Any]]] | None],
                            writer: asyncio.StreamWriter) -> bool:
        """Writes each answer as a chunk, in queue order; True once the stream's head is written."""
        started = False
        try:
            while (answer := await queue.get()) is not None:
                _, obj = await answer
                line = json.dumps(obj, separators=(",", ":")).encode() + b"\n"
                writer.write((b"" if started else _STREAM_HEAD) + b"%x\r\n%s\r\n" % (len(line), line))
                started = True
                await writer.drain()
            return started
        except ConnectionError:
            while (answer := await queue.get()) is not None:  # the app is gone: free the reader's window
                answer.cancel()
            raise
