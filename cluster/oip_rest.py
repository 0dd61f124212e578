"""The Open Inference Protocol (KServe v2) REST door of the gateway, with Triton's binary-data extension.

Served on the gateway's HTTP port (the one with /metrics) beside the native msgpack-over-gRPC
protocol, so tritonclient HTTP and curl work unchanged. Spec: the OIP REST
API, OpenAPI `info.version` 2.0 (kserve/open-inference-protocol,
specification/protocol/open_inference_rest.yaml), plus Triton's binary tensor data, model
configuration and statistics extensions (docs/protocol.md, "Open Inference Protocol (REST)").

    GET  /v2                                          server metadata
    GET  /v2/health/live | /v2/health/ready           200 {"live"|"ready": true}, or 400 {"error"} when not ready
    GET  /v2/models/{m}[/versions/{v}]                model metadata
    GET  /v2/models/{m}[/versions/{v}]/ready          200, or 4xx with {"error"}
    GET  /v2/models/{m}[/versions/{v}]/config         Triton model configuration (max_batch_size)
    GET  /v2/models[/{m}[/versions/{v}]]/stats        Triton statistics of the OIP doors' requests
    POST /v2/repository/index                         Triton's index: every model and tail, per version
    POST /v2/models/{m}[/versions/{v}]/infer          inference: JSON and/or binary tensors

What a model is on this door (cluster._oip_models, the mapping it shares with the gRPC door,
cluster.oip_grpc): `NAME` is the whole model of registry model NAME, run in the
cloud (the empty cut 'L'); `NAME.tail.<cut-id>` is the tail of a preloaded (frontier) cut of
NAME, whose inputs are that cut's boundary tensors. Without `/versions/{v}` the registry
routes the request (default version and canary) as it routes a native request with version ''.

Each handler is an adapter: decode, then the same typed call the native `Infer` handler makes
(`Gateway.infer`, on the gateway's event loop: auth with `Authorization: Bearer`, batching,
metrics, admission), then encode. Errors leave through `to_answer`, one table from the
cluster error classes' gRPC codes to HTTP statuses, with the body {"error": "<message>"}.
The `timeout` parameter is microseconds, as tritonclient sends it; a request without one
gets `DEFAULT_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import unquote

import grpc

from cluster._oip_models import (
    DEFAULT_TIMEOUT_S,
    MAX_TIMEOUT_S,
    PRIORITY_HINT,
    TAIL_MARK,
    WHOLE_MODEL_CUT,
    OipModels,
    native_priority,
)
from cluster._oip_tensors import decode_body, encode_outputs
from cluster.errors import (
    ClusterError,
    DeadlineExceeded,
    ProtocolError,
)
from cluster.protocol.messages import InferRequest
from cluster.protocol.status import status_of, to_status
from cluster.server import RequestContext

__all__ = ["OipRest", "HttpAnswer", "HTTP_STATUS_OF", "WHOLE_MODEL_CUT", "TAIL_MARK", "DEFAULT_TIMEOUT_S",
           "MAX_BODY_BYTES", "IDLE_TIMEOUT_S", "http_status", "to_answer"]

MAX_BODY_BYTES = 64 << 20
"""Largest request body; the native gRPC door's default message limit."""
IDLE_TIMEOUT_S = 120.0
"""A kept-alive connection that sends nothing for this long (or stalls inside a request) is
closed, so idle clients do not hold the server's threads."""

#: gRPC code of a cluster error -> HTTP status (the KServe and Triton HTTP servers' choices).
HTTP_STATUS_OF: Mapping[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


#: The routes under /v2/models/{m}[/versions/{v}] -> their method.
_MODEL_ROUTES: Mapping[str, str] = {"": "GET", "ready": "GET", "config": "GET", "stats": "GET", "infer": "POST"}
_MODEL_ROUTES_HINT = "a model's routes are GET [/ready|/config|/stats] and POST /infer"


@dataclass(frozen=True)
class HttpAnswer:
    """One HTTP response."""

    status: int
    body: bytes
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()


def _json(status: int, obj: Any) -> HttpAnswer:
    return HttpAnswer(status, json.dumps(obj).encode())


def to_answer(exc: BaseException, where: str) -> HttpAnswer:
    """The one place where an error becomes an HTTP status and {"error": ...} body."""
    code, message, _, fields = to_status(exc, where=where)
    headers: tuple[tuple[str, str], ...] = ()
    retry_ms = fields.get("retry_after_ms")
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and isinstance(retry_ms, (int, float)) and retry_ms > 0:
        headers = (("Retry-After", str(max(1, round(retry_ms / 1e3)))),)
    return HttpAnswer(HTTP_STATUS_OF.get(code, 500), json.dumps({"error": message}).encode(), headers=headers)


def _fail(reason: str) -> ProtocolError:
    return ProtocolError(reason=reason, where="OIP REST")


class OipRest:
    """The OIP REST routes over a `cluster.gateway.Gateway` that runs on `loop`.

    `serve(handler)` answers one request of an http.server handler thread (the gateway's
    metrics server calls it for paths under /v2); `handle(...)` is the same without sockets.
    A failed request never raises out of them: it is an HTTP answer.
    """

    def __init__(self, gateway: Any, loop: asyncio.AbstractEventLoop, *, server_name: str = "splitinfer",
                 max_body_bytes: int = MAX_BODY_BYTES, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 models: OipModels | None = None) -> None:
        self.gateway = gateway
        self.loop = loop
        self.max_body_bytes = max_body_bytes
        self.idle_timeout_s = idle_timeout_s
        self.models = models or OipModels(gateway, server_name=server_name)
        """The model mapping, shared with the gRPC door (cluster.oip_grpc) when given."""
        self.stats = self.models.stats

    # -- HTTP ---------------------------------------------------------------------------

    def serve(self, handler: BaseHTTPRequestHandler) -> bool:
        """Answers `handler`'s request when its path is under /v2; False (nothing sent) otherwise."""
        path = handler.path.split("?", 1)[0]
        if path != "/v2" and not path.startswith("/v2/"):
            return False
        headers = {k.lower(): v for k, v in handler.headers.items()}
        body, answer = b"", None
        if handler.command == "POST":
            body, answer = self._read_body(handler, headers)
        keep_alive = (answer is None and handler.request_version == "HTTP/1.1"
                      and headers.get("connection", "").lower() != "close")
        if answer is None:
            answer = self.handle(handler.command, path, headers, body, peer=handler.client_address[0])
        # [Note: keep-alive] HTTP/1.1 clients (tritonclient pools its connections) keep theirs:
        # a new connection per request costs a TCP setup and a server thread: 0.66 vs 1.11 ms
        # median per tritonclient infer on loopback (two clients alternating). Only this answer
        # is HTTP/1.1: the server's other routes stay HTTP/1.0, one request per connection.
        # Headers and body leave in two writes: without NODELAY, Nagle holds the body until
        # the client's delayed ACK (40 ms) on a kept-alive connection.
        saved = handler.protocol_version
        if keep_alive:
            handler.protocol_version = "HTTP/1.1"
            handler.close_connection = False
            handler.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            handler.connection.settimeout(self.idle_timeout_s)  # an idle kept connection frees its thread
        try:
            handler.send_response(answer.status)
            handler.send_header("Content-Type", answer.content_type)
            handler.send_header("Content-Length", str(len(answer.body)))
            for k, v in answer.headers:
                handler.send_header(k, v)
            if not keep_alive:
                handler.send_header("Connection", "close")
            handler.end_headers()
        finally:
            handler.protocol_version = saved
        handler.wfile.write(answer.body)
        return True

    def _read_body(self, handler: BaseHTTPRequestHandler,
                   headers: Mapping[str, str]) -> tuple[bytes, HttpAnswer | None]:
        keep = handler.close_connection
        handler.close_connection = True  # a refused body is left unread: never reuse the connection
        if headers.get("transfer-encoding", "identity").lower() != "identity":
            return b"", _json(411, {"error": "chunked request bodies are not accepted; send Content-Length"})
        if headers.get("content-encoding", "identity").lower() != "identity":
            return b"", _json(415, {"error": f"Content-Encoding {headers['content-encoding'][:40]!r} is not "
                                             "accepted; send the body uncompressed"})
        raw = headers.get("content-length", "0")  # neither it nor Transfer-Encoding: no body (RFC 9112 6.3)
        try:
            n = int(raw)
        except ValueError:
            n = -1
        if n < 0:
            return b"", _json(400, {"error": f"Content-Length {raw[:40]!r} is not a byte count; "
                                             "send the body's length"})
        if n > self.max_body_bytes:
            return b"", _json(413, {"error": f"the body of {n} bytes exceeds the limit of {self.max_body_bytes}; "
                                             "send fewer samples per request"})
        body = handler.rfile.read(n)
        if len(body) != n:
            return b"", _json(400, {"error": f"the body ended after {len(body)} of {n} bytes"})
        handler.close_connection = keep
        return body, None

    # -- routes -------------------------------------------------------------------------

    def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes = b"",
               *, peer: str = "") -> HttpAnswer:
        """The answer to one request; `headers` keys are lower case."""
        try:
            return self._route(method, path, headers, body, peer)
        except Exception as e:  # noqa: BLE001 - every error becomes an answer in to_answer
            return to_answer(e, f"{method} {path[:200]}")

    def _route(self, method: str, path: str, headers: Mapping[str, str], body: bytes, peer: str) -> HttpAnswer:
        parts = [unquote(p) for p in path.split("/")[2:]] if path != "/v2" else []
        if parts and parts[-1] == "":
            parts.pop()
        get = method == "GET"
        if not parts and get:
            return _json(200, self.models.server_metadata)
        # The status is the answer (tritonclient reads only it); the body is KServe's, whose
        # client reads "live" and "ready" from it.
        if parts == ["health", "live"] and get:
            return _json(200, {"live": True})
        if parts == ["health", "ready"] and get:
            ready, detail = self.gateway.readiness()
            return _json(200, {"ready": True}) if ready else _json(400, {"error": f"not ready: {detail.get('reason')}"})
        if parts == ["models", "stats"] and get:
            self.gateway.auth.authorize(headers, model=None, action="read statistics")
            return _json(200, self.stats.to_json(None, None))
        if parts == ["repository", "index"] and method == "POST":
            self.gateway.auth.authorize(headers, model=None, action="list models")
            return _json(200, self.models.index())
        if len(parts) < 2 or parts[0] != "models":
            return _json(404, {"error": f"no route {method} {path[:200]}; see GET /v2 and /v2/models/{{model}}"})
        name, version, rest = parts[1], "", parts[2:]
        if rest[:1] == ["versions"] and len(rest) >= 2:
            version, rest = rest[1], rest[2:]
        action = "/".join(rest)
        if action not in _MODEL_ROUTES:
            return _json(404, {"error": f"no route {method} {path[:200]}; {_MODEL_ROUTES_HINT}"})
        if method != _MODEL_ROUTES[action]:
            return _json(405, {"error": f"{method} is not allowed on {path[:200]}; {_MODEL_ROUTES_HINT}"})
        if action == "infer":
            # Who asks is checked before what is asked for: no model names leak to a caller
            # without a token. Gateway.infer then authorises (model, rate) as on the native door.
            self.gateway.auth.authenticate(headers)
            return self._infer(name, version, headers, body, peer)
        self.gateway.auth.authorize(headers, model=self.models.split(name)[0], action="read metadata of")
        if action == "stats":
            return _json(200, self.stats.to_json(name, version or None))
        lv, cut_id = self.models.resolve(name, version)
        if action == "ready":
            self.models.check_ready(lv, cut_id)
            return HttpAnswer(200, b"")
        # Blocking on first use (the whole model's tail is cut): on this HTTP thread, never the loop.
        sig = self.models.signature(lv, cut_id)
        if action == "config":
            return _json(200, self.models.config(name, lv, sig))
        return _json(200, self.models.metadata(name, lv, sig))

    # -- infer --------------------------------------------------------------------------

    def _infer(self, name: str, version: str, headers: Mapping[str, str], body: bytes, peer: str) -> HttpAnswer:
        received = time.monotonic()
        ok, result, samples, served = False, None, 0, ""
        try:
            raw_len = headers.get("inference-header-content-length")
            try:
                header_length = int(raw_len) if raw_len is not None else None
            except ValueError:
                raise _fail(f"Inference-Header-Content-Length {raw_len[:40]!r} is not a byte count") from None
            req, inputs = decode_body(body, header_length)
            samples = inputs[0].array.shape[0] if inputs[0].array.ndim else 1
            params = req.get("parameters", {})
            if not isinstance(params, dict):
                raise _fail(f"'parameters' is a {type(params).__name__}; give a JSON object")
            device_id = params.get("device_id", "")
            if not isinstance(device_id, str):
                raise _fail(f"parameter device_id {str(device_id)[:40]} is not a string")
            lv, cut_id = self.models.resolve(name, version, device_id)
            served = lv.version  # counted from here on: names that resolve are few, client-sent ones are not
            sig = self.models.signature(lv, cut_id)
            timeout = params.get("timeout")
            if timeout is not None and (type(timeout) is not int or timeout < 0):
                raise _fail(f"parameter timeout {str(timeout)[:40]} is not a whole number of microseconds >= 0")
            timeout_s = DEFAULT_TIMEOUT_S if timeout is None else min(timeout / 1e6, MAX_TIMEOUT_S)
            priority = native_priority(params.get("priority", 0))  # [Note: OIP priority] in cluster/_oip_models.py
            if priority is None:
                raise _fail(f"parameter priority {str(params.get('priority'))[:40]} is not one; {PRIORITY_HINT}")
            rid = req.get("id")
            request_id = rid if isinstance(rid, str) and rid else uuid.uuid4().hex
            native = self.models.to_request(name, lv, cut_id, sig, inputs, request_id=request_id,
                                            deadline_unix_ms=int((time.time() + timeout_s) * 1e3),
                                            device_id=device_id, priority=priority)
            context = RequestContext(method="Infer", received_monotonic_s=received,
                                     deadline_monotonic_s=received + timeout_s, peer=peer, metadata=headers)
            result = self._call(native, context, timeout_s)
            head = {"model_name": name, "model_version": lv.version, "id": request_id}
            out, json_length = encode_outputs(req, result.outputs, head)
            ok = True
            if json_length is None:
                return HttpAnswer(200, out)
            return HttpAnswer(200, out, "application/octet-stream",
                              (("Inference-Header-Content-Length", str(json_length)),))
        finally:
            if served:
                t = result.timings_ms if result is not None else {}
                self.stats.add(name, served, ok, time.monotonic() - received, t.get("queue", 0.0) / 1e3,
                               t.get("compute", 0.0) / 1e3, samples)

    def _call(self, request: InferRequest, context: RequestContext, timeout_s: float) -> Any:
        """`Gateway.infer` on the gateway's loop, cancelled at the deadline as the native door does."""
        if timeout_s <= 0:
            raise DeadlineExceeded(where="before the request reached the backend", overdue_ms=0.0)

        async def call() -> Any:
            try:
                return await asyncio.wait_for(self.gateway.infer(request, context),
                                              context.deadline_monotonic_s - time.monotonic())
            except TimeoutError as e:
                raise DeadlineExceeded(where="while the backend ran",
                                       overdue_ms=(time.monotonic() - context.deadline_monotonic_s) * 1e3) from e

        future = asyncio.run_coroutine_threadsafe(call(), self.loop)
        try:
            return future.result(timeout_s + 5.0)
        except concurrent.futures.TimeoutError as e:
            future.cancel()
            raise DeadlineExceeded(where="waiting for the gateway's event loop", overdue_ms=5e3) from e


def http_status(exc: ClusterError) -> int:
    """The HTTP status an error answers with (docs and tests)."""
    return HTTP_STATUS_OF.get(status_of(exc), 500)
