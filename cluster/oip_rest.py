"""The Open Inference Protocol (KServe v2) REST door of the gateway, with Triton's binary-data extension.

Served on the gateway's HTTP port (the one with /metrics) beside the native msgpack-over-gRPC
protocol, so tritonclient HTTP and curl work unchanged. Spec: the OIP REST
API, OpenAPI `info.version` 2.0 (kserve/open-inference-protocol,
specification/protocol/open_inference_rest.yaml), plus Triton's binary tensor data, model
configuration and statistics extensions (docs/protocol.md, "Open Inference Protocol (REST)").

    GET  /v2                                          server metadata
    GET  /v2/health/live | /v2/health/ready           200, or 400 with {"error"} when not ready
    GET  /v2/models/{m}[/versions/{v}]                model metadata
    GET  /v2/models/{m}[/versions/{v}]/ready          200, or 4xx with {"error"}
    GET  /v2/models/{m}[/versions/{v}]/config         Triton model configuration (max_batch_size)
    GET  /v2/models[/{m}[/versions/{v}]]/stats        Triton statistics of this door's requests
    POST /v2/repository/index                         Triton's index: every model and tail, per version
    POST /v2/models/{m}[/versions/{v}]/infer          inference: JSON and/or binary tensors

What a model is on this door: `NAME` is the whole model of registry model NAME, run in the
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
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import unquote

import grpc

from cluster._load_failures import failed_tail
from cluster._oip_tensors import check_inputs, datatype_of, decode_body, encode_outputs
from cluster.errors import (
    ClusterError,
    DeadlineExceeded,
    ProtocolError,
    UnknownCutError,
    UnknownModelError,
)
from cluster.protocol.messages import InferRequest
from cluster.protocol.status import status_of, to_status
from cluster.server import RequestContext

__all__ = ["OipRest", "HttpAnswer", "HTTP_STATUS_OF", "WHOLE_MODEL_CUT", "TAIL_MARK", "DEFAULT_TIMEOUT_S",
           "MAX_BODY_BYTES", "IDLE_TIMEOUT_S", "http_status", "to_answer"]

WHOLE_MODEL_CUT = "L"
"""The empty cut: the device runs nothing and the cloud runs the whole model."""
TAIL_MARK = ".tail."
"""`NAME.tail.<cut-id>` names the tail of a preloaded cut of NAME."""
DEFAULT_TIMEOUT_S = 60.0
"""Deadline of an infer request that gives no `timeout` parameter."""
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


def _package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("splitinfer")
    except PackageNotFoundError:
        return "0+unknown"


@dataclass(frozen=True)
class _Signature:
    """A tail's inputs and outputs as OIP metadata: (name, datatype, shape with -1 for free dims)."""

    inputs: tuple[tuple[str, str, tuple[int, ...]], ...]
    outputs: tuple[tuple[str, str, tuple[int, ...]], ...]


def _read_signature(path: str) -> _Signature:
    import onnx
    from onnx.helper import tensor_dtype_to_np_dtype

    graph = onnx.load(path, load_external_data=False).graph
    weights = {t.name for t in graph.initializer}

    def spec(v: Any) -> tuple[str, str, tuple[int, ...]]:
        t = v.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim)
        return v.name, datatype_of(tensor_dtype_to_np_dtype(t.elem_type)), (-1,) + dims[1:] if dims else dims

    return _Signature(tuple(spec(v) for v in graph.input if v.name not in weights),
                      tuple(spec(v) for v in graph.output))


def _bump(count_ns: list[int], seconds: float) -> None:
    count_ns[0] += 1
    count_ns[1] += int(seconds * 1e9)


class _Stats:
    """Triton-style statistics of the requests this door served, per model name and version."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[tuple[str, str], dict[str, Any]] = {}

    def add(self, name: str, version: str, ok: bool, total_s: float, queue_s: float = 0.0,
            compute_s: float = 0.0, batch: int = 0) -> None:
        with self._lock:
            s = self._by_key.setdefault((name, version), {
                "success": [0, 0], "fail": [0, 0], "queue": [0, 0], "compute_infer": [0, 0], "last": 0,
                "inference_count": 0})
            if not ok:
                _bump(s["fail"], total_s)
                return
            _bump(s["success"], total_s)
            _bump(s["queue"], queue_s)
            _bump(s["compute_infer"], compute_s)
            s["inference_count"] += batch
            s["last"] = int(time.time() * 1e3)

    def to_json(self, name: str | None, version: str | None) -> dict[str, Any]:
        with self._lock:
            items = sorted(self._by_key.items())
        zero = {"count": 0, "ns": 0}
        out = []
        for (n, v), s in items:
            if (name is not None and n != name) or (version is not None and v != version):
                continue
            out.append({"name": n, "version": v, "last_inference": s["last"],
                        "inference_count": s["inference_count"], "execution_count": s["success"][0],
                        "inference_stats": {**{k: {"count": s[k][0], "ns": s[k][1]}
                                               for k in ("success", "fail", "queue", "compute_infer")},
                                            "compute_input": zero, "compute_output": zero},
                        "batch_stats": []})
        return {"model_stats": out}


class OipRest:
    """The OIP REST routes over a `cluster.gateway.Gateway` that runs on `loop`.

    `serve(handler)` answers one request of an http.server handler thread (the gateway's
    metrics server calls it for paths under /v2); `handle(...)` is the same without sockets.
    A failed request never raises out of them: it is an HTTP answer.
    """

    def __init__(self, gateway: Any, loop: asyncio.AbstractEventLoop, *, server_name: str = "splitinfer",
                 max_body_bytes: int = MAX_BODY_BYTES, idle_timeout_s: float = IDLE_TIMEOUT_S) -> None:
        self.gateway = gateway
        self.loop = loop
        self.max_body_bytes = max_body_bytes
        self.idle_timeout_s = idle_timeout_s
        self._server_meta = {"name": server_name, "version": _package_version(),
                             "extensions": ["binary_tensor_data", "model_configuration", "statistics"]}
        self._signatures: dict[tuple[str, str, str], _Signature] = {}
        self._lock = threading.Lock()
        self.stats = _Stats()

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
            return _json(200, self._server_meta)
        if parts == ["health", "live"] and get:
            return HttpAnswer(200, b"")
        if parts == ["health", "ready"] and get:
            ready, detail = self.gateway.readiness()
            return HttpAnswer(200, b"") if ready else _json(400, {"error": f"not ready: {detail.get('reason')}"})
        if parts == ["models", "stats"] and get:
            self.gateway.auth.authorize(headers, model=None, action="read statistics")
            return _json(200, self.stats.to_json(None, None))
        if parts == ["repository", "index"] and method == "POST":
            self.gateway.auth.authorize(headers, model=None, action="list models")
            return _json(200, self._index())
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
        self.gateway.auth.authorize(headers, model=self._split(name)[0], action="read metadata of")
        if action == "stats":
            return _json(200, self.stats.to_json(name, version or None))
        lv, cut_id = self._resolve(name, version)
        if action == "ready":
            why = self.gateway.failed_tails(lv.model, lv.version).get(f"{lv.key}@{cut_id}")
            if why is not None:  # [Note: failed tails] in cluster/gateway.py
                raise failed_tail(f"{lv.key}@{cut_id}", why)
            return HttpAnswer(200, b"")
        sig = self._signature(lv, cut_id)
        if action == "config":
            return _json(200, self._config(name, lv, sig))
        tensors = lambda specs: [{"name": n, "datatype": d, "shape": list(s)} for n, d, s in specs]  # noqa: E731
        return _json(200, {"name": name, "versions": self.gateway.registry.describe()[lv.model]["versions"],
                           "platform": "onnxruntime_onnx", "inputs": tensors(sig.inputs),
                           "outputs": tensors(sig.outputs)})

    def _index(self) -> list[dict[str, str]]:
        """Every model this door serves: each loaded version of NAME and of each of its tails."""
        out = []
        failed = self.gateway.failed_tails()
        for lv in sorted(self.gateway.registry.loaded(), key=lambda v: (v.model, v.version)):
            for cut_id in lv.frontier.cut_ids if WHOLE_MODEL_CUT in lv.frontier.cut_ids else (
                    WHOLE_MODEL_CUT, *lv.frontier.cut_ids):
                name = lv.model if cut_id == WHOLE_MODEL_CUT else f"{lv.model}{TAIL_MARK}{cut_id}"
                why = failed.get(f"{lv.key}@{cut_id}")
                out.append({"name": name, "version": lv.version, "state": "READY"} if why is None else
                           {"name": name, "version": lv.version, "state": "UNAVAILABLE", "reason": why})
        return out

    @staticmethod
    def _split(name: str) -> tuple[str, str]:
        """(registry model, cut id) of a door model name."""
        model, mark, cut_id = name.partition(TAIL_MARK)
        return (model, cut_id) if mark else (name, WHOLE_MODEL_CUT)

    def _resolve(self, name: str, version: str, device_id: str = "") -> tuple[Any, str]:
        """(the loaded version, cut id) a door model name and version go to (routed for `device_id`
        when the version is ''); 404 errors otherwise."""
        model, cut_id = self._split(name)
        lv = self.gateway.registry.resolve(model, version, device_id)
        tails = [c for c in lv.frontier.cut_ids if c != WHOLE_MODEL_CUT]
        if cut_id != WHOLE_MODEL_CUT and cut_id not in tails:
            if not cut_id:
                raise UnknownModelError(model=name, known=[model] + [f"{model}{TAIL_MARK}{c}" for c in tails])
            raise UnknownCutError(model=model, version=lv.version, cut_id=cut_id,
                                  known=[f"{model}{TAIL_MARK}{c}" for c in tails])
        return lv, cut_id

    def _signature(self, lv: Any, cut_id: str) -> _Signature:
        key = (lv.model, lv.version, cut_id)
        sig = self._signatures.get(key)
        if sig is None:
            # Blocking (the tail of the whole model is cut on first use): on this HTTP thread, never the loop.
            sig = _read_signature(lv.files.tail_path(cut_id, lv.frontier.cut_ids))
            with self._lock:
                self._signatures[key] = sig
        return sig

    @staticmethod
    def _config(name: str, lv: Any, sig: _Signature) -> dict[str, Any]:
        c = lv.config
        batched = all(s and s[0] == -1 for _, _, s in sig.inputs)

        def dims(specs: Any) -> list[dict[str, Any]]:
            return [{"name": n, "data_type": f"TYPE_{d}", "dims": list(s[1:] if batched else s)} for n, d, s in specs]

        return {"name": name, "platform": "onnxruntime_onnx", "backend": "onnxruntime", "version_policy": {
                    "specific": {"versions": [lv.version]}},
                "max_batch_size": c.max_batch_size if batched else 0, "input": dims(sig.inputs),
                "output": dims(sig.outputs),
                "dynamic_batching": {"max_queue_delay_microseconds": int(c.max_queue_delay_ms * 1e3)},
                "instance_group": [{"count": c.replicas, "kind": "KIND_AUTO"}]}

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
            lv, cut_id = self._resolve(name, version, device_id)
            served = lv.version  # counted from here on: names that resolve are few, client-sent ones are not
            check_inputs(inputs, self._signature(lv, cut_id).inputs, name)
            timeout = params.get("timeout")
            if timeout is not None and (type(timeout) is not int or timeout < 0):
                raise _fail(f"parameter timeout {str(timeout)[:40]} is not a whole number of microseconds >= 0")
            timeout_s = DEFAULT_TIMEOUT_S if timeout is None else timeout / 1e6
            rid = req.get("id")
            request_id = rid if isinstance(rid, str) and rid else uuid.uuid4().hex
            native = InferRequest(request_id, self._split(name)[0], lv.version, cut_id,
                                  int((time.time() + timeout_s) * 1e3), {t.name: t.array for t in inputs},
                                  device_id=device_id)
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
