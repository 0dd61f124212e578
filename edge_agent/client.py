"""`EdgeClient`: the Python client local apps use to call the agent (stdlib http.client only).

    with EdgeClient() as c:                      # http://127.0.0.1:8500
        y = c.infer({"x": x})["y"]
    with EdgeClient(unix_socket="/run/splitinfer/edge.sock") as c:
        for answer in c.infer_stream(frames):    # one answer per frame, in order
            ...

Tensors travel as msgpack (raw bytes) for `infer` and as JSON with base64 for the stream.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from edge_agent import wire
from edge_agent.errors import EdgeError

__all__ = ["EdgeClient", "EdgeClientError"]


class EdgeClientError(EdgeError):
    """The agent answered with an error status."""

    def __init__(self, *, status: int, error: str, message: str) -> None:
        self.status = status
        self.error = error
        super().__init__(f"the edge agent answered {status} {error}: {message}")


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self._path)
        self.sock = s


class EdgeClient:
    """Blocking client; one connection, kept alive. Not thread-safe: one per thread."""

    def __init__(self, url: str = "http://127.0.0.1:8500", *, unix_socket: str | None = None,
                 timeout_s: float = 30.0) -> None:
        self.url, self.unix_socket, self.timeout_s = url, unix_socket, timeout_s
        u = urllib.parse.urlparse(url)
        self._host, self._port = u.hostname or "127.0.0.1", u.port or 8500
        self._conn: http.client.HTTPConnection | None = None

    def _new_conn(self) -> http.client.HTTPConnection:
        if self.unix_socket:
            return _UnixConnection(self.unix_socket, self.timeout_s)
        return http.client.HTTPConnection(self._host, self._port, timeout=self.timeout_s)

    def _request(self, method: str, path: str, body: bytes | None = None,
                 headers: Mapping[str, str] | None = None) -> tuple[int, str, bytes]:
        for attempt in (0, 1):
            if self._conn is None:
                self._conn = self._new_conn()
            try:
                self._conn.request(method, path, body=body, headers=dict(headers or {}))
                resp = self._conn.getresponse()
                data = resp.read()
                if resp.getheader("Connection", "").lower() == "close":
                    self.close()
                return resp.status, resp.getheader("Content-Type", ""), data
            except (ConnectionError, http.client.RemoteDisconnected, http.client.CannotSendRequest):
                self.close()
                if attempt:  # a kept-alive connection the server closed: retry once on a new one
                    raise
        raise AssertionError("unreachable")

    def _json(self, path: str) -> tuple[int, Any]:
        status, _, data = self._request("GET", path)
        return status, json.loads(data)

    def infer_full(self, inputs: Mapping[str, np.ndarray], *, request_id: str | None = None) -> dict[str, Any]:
        """The whole answer: outputs, served_by, cut_id, latency_ms, id."""
        body: dict[str, Any] = {"inputs": wire.encode_tensors(inputs, True)}
        if request_id is not None:
            body["id"] = request_id
        status, ctype, data = self._request("POST", "/v1/infer", wire.dumps(body, wire.MSGPACK),
                                            {"Content-Type": wire.MSGPACK, "Accept": wire.MSGPACK})
        obj = wire.loads(data, ctype or wire.JSON)
        if status != 200:
            raise EdgeClientError(status=status, error=obj.get("error", ""), message=obj.get("message", ""))
        obj["outputs"], _ = wire.decode_tensors({"inputs": obj["outputs"]}, ctype.startswith(wire.MSGPACK))
        return obj

    def infer(self, inputs: Mapping[str, np.ndarray], *, request_id: str | None = None) -> dict[str, np.ndarray]:
        """The model's outputs for one request."""
        return self.infer_full(inputs, request_id=request_id)["outputs"]

    def infer_stream(self, requests: Iterable[Mapping[str, np.ndarray]]) -> Iterator[dict[str, Any]]:
        """One answer (as `infer_full` returns, or {"error", ...}) per request, in order, while sending."""
        conn = self._new_conn()
        conn.connect()
        sock = conn.sock
        assert sock is not None
        head = (f"POST /v1/stream HTTP/1.1\r\nHost: {self._host}\r\nContent-Type: {wire.NDJSON}\r\n"
                "Transfer-Encoding: chunked\r\n\r\n").encode()
        errors: list[BaseException] = []

        def send() -> None:
            try:
                sock.sendall(head)
                for i, inputs in enumerate(requests):
                    line = json.dumps({"inputs": wire.encode_tensors(inputs, False), "id": str(i)}).encode() + b"\n"
                    sock.sendall(b"%x\r\n%s\r\n" % (len(line), line))
                sock.sendall(b"0\r\n\r\n")
            except BaseException as e:  # noqa: BLE001 - re-raised in the reading thread
                errors.append(e)

        writer = threading.Thread(target=send, name="edge-client-stream", daemon=True)
        writer.start()
        resp = http.client.HTTPResponse(sock)
        try:
            resp.begin()
            if resp.status != 200:
                raise EdgeClientError(status=resp.status, error="", message=resp.read().decode(errors="replace"))
            buf = b""
            while True:
                piece = resp.read1(1 << 16) if hasattr(resp, "read1") else resp.read(1 << 16)
                if not piece:
                    break
                buf += piece
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    obj = json.loads(line)
                    if "outputs" in obj:
                        obj["outputs"], _ = wire.decode_tensors({"inputs": obj["outputs"]}, False)
                    yield obj
        finally:
            writer.join(timeout=self.timeout_s)
            resp.close()
            conn.close()
        if errors:
            raise errors[0]

    def health(self) -> bool:
        return self._request("GET", "/healthz")[0] == 200

    def ready(self) -> bool:
        return self._request("GET", "/readyz")[0] == 200

    def status(self) -> dict[str, Any]:
        return self._json("/v1/status")[1]

    def model(self) -> dict[str, Any]:
        return self._json("/v1/model")[1]

    def metrics(self) -> str:
        return self._request("GET", "/metrics")[2].decode()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> EdgeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
