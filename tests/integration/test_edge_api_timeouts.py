"""The local API's connection timeouts over real TCP ([Note: connection timeouts] in edge_agent.api).

An idle keep-alive connection is closed; a request whose head or body stalls gets 408 and
the connection closes; a connection in use is not cut.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
from typing import Any

import pytest

from edge_agent.api import LocalApi

pytestmark = pytest.mark.timeout(120)

# The server's timeouts, short so the tests are quick; the socket's bounds a hang only.
IDLE_S, READ_S = 0.3, 0.3
SOCKET_TIMEOUT_S = 30.0


class _Agent:
    def is_ready(self) -> bool:
        return True

    async def infer(self, inputs: dict[str, Any], request_id: str | None) -> dict[str, Any]:
        return {"outputs": {}, "id": request_id}

    def status(self) -> dict[str, Any]:
        return {}

    def model_info(self) -> dict[str, Any]:
        return {}

    def metrics_text(self) -> str:
        return ""


def _with_api(check) -> Any:
    async def go():
        api = LocalApi(_Agent(), port=0, idle_timeout_s=IDLE_S, read_timeout_s=READ_S)
        await api.start()
        try:
            return await asyncio.to_thread(check, api.port)
        finally:
            await api.stop(1.0)

    return asyncio.run(go())


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S)


def _answer(sock: socket.socket) -> tuple[int, dict[str, Any], str]:
    resp = http.client.HTTPResponse(sock, method="GET")
    resp.begin()
    return resp.status, json.loads(resp.read()), resp.getheader("Connection", "")


def test_an_idle_connection_is_closed_without_an_answer():
    def check(port: int) -> bytes:
        with _connect(port) as sock:
            return sock.recv(1024)  # b"" once the server closes; the socket timeout bounds a hang

    assert _with_api(check) == b""


def test_a_keep_alive_connection_serves_requests_until_it_idles():
    def check(port: int) -> tuple[list[int], bytes]:
        with _connect(port) as sock:
            statuses = []
            for _ in range(3):
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                statuses.append(_answer(sock)[0])
            return statuses, sock.recv(1024)

    statuses, after = _with_api(check)
    assert statuses == [200, 200, 200]
    assert after == b""


def test_a_head_that_stalls_is_answered_408_naming_the_wait():
    def check(port: int) -> tuple[int, dict[str, Any], str]:
        with _connect(port) as sock:
            sock.sendall(b"POST /v1/infer HTTP/1.1\r\nContent-")
            return _answer(sock)

    status, body, connection = _with_api(check)
    assert status == 408
    assert body["error"] == "RequestTimeout" and body["status"] == 408
    assert f"did not arrive within {READ_S:g} s" in body["message"] and "head" in body["message"]
    assert connection == "close"


def test_a_body_that_stalls_is_answered_408_naming_its_length():
    def check(port: int) -> tuple[int, dict[str, Any], str]:
        with _connect(port) as sock:
            sock.sendall(b"POST /v1/infer HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                         b'{"inputs"')
            return _answer(sock)

    status, body, _ = _with_api(check)
    assert status == 408
    assert "100 bytes were announced" in body["message"], body


def test_a_request_sent_slowly_but_within_the_read_timeout_is_served():
    def check(port: int) -> int:
        with _connect(port) as sock:
            for part in (b"GET /heal", b"thz HTTP/1.1\r\n", b"Host: x\r\n\r\n"):
                sock.sendall(part)
                time.sleep(READ_S / 20)
            return _answer(sock)[0]

    assert _with_api(check) == 200
