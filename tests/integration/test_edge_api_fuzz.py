"""The edge agent's local API answers every malformed request, over real TCP.

A real agent (artifacts from a real gRPC server, ONNX Runtime engines) serves its
local API on loopback. Raw sockets send what no HTTP client library would: broken
framing, garbage request lines, bad bodies. Every request must get a parseable HTTP
answer (no dropped connection), never a 5xx, and every error answer is JSON naming
what was wrong; the agent still serves a valid request afterwards. The fuzz sends
5,000 seeded malformed requests (half to each path); the tests before it pin one
behaviour each.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import json
import logging
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import msgpack
import numpy as np
import pytest

from cluster.server import serve
from edge_agent.api import LocalApi
from edge_agent.config import config_from_dict
from edge_agent.daemon import EdgeAgent
from partitioner import Splitter
from tests.integration._edge_support import MODEL, VERSION, TailBackend, slow_device_profile, write_model

pytestmark = [pytest.mark.grpc, pytest.mark.timeout(300)]

SEED = 25
CASES_PER_PATH = 2500
# Bounds a hang only (a request nobody answers fails the test instead of stalling it).
SOCKET_TIMEOUT_S = 30.0
SHAPE = [1, 4, 5, 5]


# -- a real agent on loopback, shared by the tests of this module ---------------------------

@dataclass
class _Served:
    port: int
    loop: asyncio.AbstractEventLoop
    api: LocalApi


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[_Served]:
    """An EdgeAgent whose gateway is a real gRPC server, run on its own event loop thread."""
    tmp_path = tmp_path_factory.mktemp("edge-api-fuzz")
    path = write_model(tmp_path)
    prof = tmp_path / "device.json"
    prof.write_text(slow_device_profile(Splitter(path).graph).to_json())
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="edge-api-fuzz-loop", daemon=True)
    thread.start()

    async def start():
        backend = TailBackend(path, cache_dir=str(tmp_path / "server-cache"))
        server = await serve(backend)
        cfg = config_from_dict({"gateway": server.address, "model": f"{MODEL}@{VERSION}", "apiPort": 0,
                                "cacheDir": str(tmp_path / "cache"), "deviceProfile": str(prof),
                                "startupTimeoutS": 5.0})
        agent = EdgeAgent(cfg)
        await agent.start()
        return server, agent

    server, agent = asyncio.run_coroutine_threadsafe(start(), loop).result(60)
    try:
        yield _Served(agent.api.port, loop, agent.api)
    finally:
        async def stop():
            await agent.stop()
            await server.stop(None)

        asyncio.run_coroutine_threadsafe(stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@dataclass
class _Answer:
    status: int | None
    """None: no parseable status line came back (the connection was dropped)."""
    ctype: str
    body: bytes
    failure: str = ""


def _read_answer(sock: socket.socket, method: str = "POST") -> _Answer:
    resp = http.client.HTTPResponse(sock, method=method)
    try:
        resp.begin()  # skips a 100 Continue
        body = resp.read()
    except (http.client.HTTPException, OSError) as e:
        return _Answer(None, "", b"", repr(e))
    return _Answer(resp.status, resp.getheader("Content-Type", ""), body)


def _send(port: int, raw: bytes, *, method: str = "POST") -> _Answer:
    """Sends `raw`, ends the sending side (so a body cut short is seen as cut), reads one answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S) as sock:
        with contextlib.suppress(OSError):  # an early answer may close the connection first
            sock.sendall(raw)
            sock.shutdown(socket.SHUT_WR)
        return _read_answer(sock, method)


def _x(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)


def _tensor_json(x: np.ndarray) -> dict:
    return {"dtype": str(x.dtype), "shape": list(x.shape), "data": base64.b64encode(x.tobytes()).decode()}


def _valid_obj(rid: str = "ok") -> dict:
    return {"inputs": {"x": _tensor_json(_x())}, "id": rid}


def _http(path: str, body: bytes, *, ctype: str = "application/json", method: str = "POST",
          headers: tuple[str, ...] = (), length: str | None = None) -> bytes:
    head = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Type: {ctype}",
            f"Content-Length: {len(body) if length is None else length}", *headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _chunked(path: str, chunks: list[bytes], *, end: bytes = b"0\r\n\r\n") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    return head + b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + end


def _json_error(answer: _Answer) -> dict:
    assert answer.ctype.startswith("application/json"), answer
    obj = json.loads(answer.body)
    assert isinstance(obj.get("error"), str) and isinstance(obj.get("message"), str) and obj["message"], obj
    return obj


def _ndjson(answer: _Answer) -> list[dict]:
    return [json.loads(line) for line in answer.body.splitlines() if line.strip()]


# -- one test per behaviour -----------------------------------------------------------------

def test_infer_with_invalid_json_body_answers_400(served):
    answer = _send(served.port, _http("/v1/infer", b"not json"))
    assert answer.status == 400 and "not valid JSON" in _json_error(answer)["message"]


def test_infer_with_invalid_msgpack_body_answers_400(served):
    answer = _send(served.port, _http("/v1/infer", b"\xc1\x81", ctype="application/msgpack"))
    assert answer.status == 400 and "not valid msgpack" in _json_error(answer)["message"]


def test_infer_with_deeply_nested_json_answers_400(served):
    answer = _send(served.port, _http("/v1/infer", b"[" * 100_000 + b"]" * 100_000))
    assert answer.status == 400 and "nested too deeply" in _json_error(answer)["message"]


def test_infer_with_shape_that_does_not_match_the_bytes_answers_400_naming_both(served):
    obj = _valid_obj()
    obj["inputs"]["x"]["shape"] = [2**40, 2**40]
    message = _json_error(answer := _send(served.port, _http("/v1/infer", json.dumps(obj).encode())))["message"]
    assert answer.status == 400 and "elements" in message


def test_infer_with_a_wrong_input_dtype_for_the_model_answers_400(served):
    obj = {"inputs": {"x": _tensor_json(_x().astype(np.float64))}}
    answer = _send(served.port, _http("/v1/infer", json.dumps(obj).encode()))
    assert answer.status == 400 and "float64" in _json_error(answer)["message"]


def test_bad_body_keeps_the_connection_serving(served):
    good = json.dumps(_valid_obj("after")).encode()
    with socket.create_connection(("127.0.0.1", served.port), timeout=SOCKET_TIMEOUT_S) as sock:
        sock.sendall(_http("/v1/infer", b"{broken"))
        first = _read_answer(sock)
        sock.sendall(_http("/v1/infer", good))
        second = _read_answer(sock)
    assert first.status == 400 and second.status == 200 and json.loads(second.body)["id"] == "after"


@pytest.mark.parametrize("length,status", [("-5", 400), ("abc", 400), ("1_0", 400), ("+3", 400),
                                           (str(1 << 40), 413), ("9" * 5000, 413)])
def test_bad_content_length_answers_4xx_naming_it(served, length, status):
    answer = _send(served.port, _http("/v1/infer", b"{}", length=length))
    assert answer.status == status and "Content-Length" in _json_error(answer)["message"]


def test_body_shorter_than_its_content_length_answers_400(served):
    answer = _send(served.port, _http("/v1/infer", b'{"inputs": {}}', length="100"))
    assert answer.status == 400 and "ended early" in _json_error(answer)["message"]


def test_garbage_request_line_answers_400(served):
    answer = _send(served.port, b"\x16\x03\x01 hello there\r\n\r\n")
    assert answer.status == 400 and "request line" in _json_error(answer)["message"]


def test_request_line_with_lf_only_is_read(served):
    answer = _send(served.port, b"GET /healthz HTTP/1.1\nHost: x\n\n", method="GET")
    assert answer.status == 200


def test_header_without_colon_answers_400(served):
    answer = _send(served.port, _http("/v1/infer", b"{}", headers=("no colon here",)))
    assert answer.status == 400 and "Name: value" in _json_error(answer)["message"]


def test_oversized_headers_answer_413(served):
    answer = _send(served.port, _http("/v1/infer", b"{}", headers=("X-Big: " + "a" * (70 << 10),)))
    assert answer.status == 413 and _json_error(answer)["status"] == 413


@pytest.mark.parametrize("method,status", [("PUT", 405), ("TRACE", 405), ("FOO", 405), ("GET", 405)])
def test_other_methods_on_infer_answer_405_json(served, method, status):
    answer = _send(served.port, _http("/v1/infer", b"", method=method))
    assert answer.status == status and "use POST /v1/infer" in _json_error(answer)["message"]


def test_head_gets_the_status_without_a_body(served):
    answer = _send(served.port, b"HEAD /healthz HTTP/1.1\r\nHost: x\r\n\r\n", method="HEAD")
    assert answer.status == 200 and answer.body == b""


def test_unsupported_transfer_encoding_answers_400(served):
    raw = _http("/v1/infer", b"{}", headers=("Transfer-Encoding: gzip",))
    answer = _send(served.port, raw)
    assert answer.status == 400 and "Transfer-Encoding" in _json_error(answer)["message"]


def test_expect_100_continue_gets_the_final_answer(served):
    answer = _send(served.port, _http("/v1/infer", b"{bad", headers=("Expect: 100-continue",)))
    assert answer.status == 400
    answer = _send(served.port, _http("/v1/infer", b"{}", headers=("Expect: telepathy",)))
    assert answer.status == 417 and "Expect" in _json_error(answer)["message"]


def test_stream_with_bad_chunk_size_before_any_line_answers_400(served):
    answer = _send(served.port, _chunked("/v1/stream", [], end=b"zz\r\n"))
    assert answer.status == 400 and "chunk size" in _json_error(answer)["message"]


def test_stream_with_bad_chunk_after_a_line_ends_with_an_error_line(served):
    good = json.dumps(_valid_obj("s0")).encode() + b"\n"
    answer = _send(served.port, _chunked("/v1/stream", [good], end=b"5\r\nabc\r\n"))
    lines = _ndjson(answer)
    assert answer.status == 200 and [line.get("id") for line in lines] == ["s0", None]
    assert lines[1]["status"] == 400 and "chunk" in lines[1]["message"]


def test_stream_garbage_lines_get_400_lines_in_order(served):
    body = b"garbage\n" + json.dumps(_valid_obj("s1")).encode() + b"\n" + b'{"inputs": 3, "id": "s2"}\n'
    lines = _ndjson(answer := _send(served.port, _http("/v1/stream", body, ctype="application/x-ndjson")))
    assert answer.status == 200 and [line["status"] for line in (lines[0], lines[2])] == [400, 400]
    assert "outputs" in lines[1] and lines[1]["id"] == "s1" and lines[2]["id"] == "s2"


def test_stream_answers_each_line_before_the_next_arrives(served):
    """An app may wait for each answer before it sends the next line."""
    head = b"POST /v1/stream HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    with socket.create_connection(("127.0.0.1", served.port), timeout=SOCKET_TIMEOUT_S) as sock:
        reader = sock.makefile("rb")
        sock.sendall(head)
        ids = []
        for i in range(3):
            line = json.dumps(_valid_obj(f"w{i}")).encode() + b"\n"
            sock.sendall(b"%x\r\n%s\r\n" % (len(line), line))
            if i == 0:
                assert reader.readline().startswith(b"HTTP/1.1 200")
                while reader.readline() != b"\r\n":
                    pass
            size = int(reader.readline(), 16)
            ids.append(json.loads(reader.read(size + 2))["id"])
        sock.sendall(b"0\r\n\r\n")
        assert reader.readline() == b"0\r\n"
    assert ids == ["w0", "w1", "w2"]


class _BrokenAgent:
    """An agent whose every call fails the way a bug would (not the client's fault)."""

    def is_ready(self) -> bool:
        return True

    async def infer(self, inputs, request_id):
        raise RuntimeError("boom in infer")

    def status(self):
        raise RuntimeError("boom in status")

    def model_info(self):
        return {}

    def metrics_text(self) -> str:
        return ""


def test_unexpected_errors_in_handlers_answer_500_json_and_are_logged(caplog):
    async def go():
        api = LocalApi(_BrokenAgent(), port=0)
        await api.start()
        try:
            body = json.dumps(_valid_obj()).encode()
            return (await asyncio.to_thread(_send, api.port, _http("/v1/infer", body)),
                    await asyncio.to_thread(_send, api.port, b"GET /v1/status HTTP/1.1\r\n\r\n", method="GET"))
        finally:
            await api.stop(1.0)

    with caplog.at_level(logging.ERROR, logger="edge_agent.api"):
        infer, status = asyncio.run(go())
    assert (infer.status, status.status) == (500, 500)
    assert "boom in infer" in _json_error(infer)["message"] and _json_error(status)["error"] == "InternalError"
    logged = "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records)
    assert "boom in infer" in logged and "/v1/status" in logged


# -- the fuzz -------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Case:
    kind: str
    raw: bytes
    must_fail: bool
    """False where the mutation can leave a valid request (a flipped base64 digit)."""


_JUNK_DTYPES = ["complex64", "float", "FLOAT32", "", " float32", "float32\x00", "object", "<f4", "str", 1, 1.5,
                None, [], {}, ["float32"], True]
_JUNK_SHAPES = [[-1, 4, 5, 5], [1.5], ["1"], "1,4,5,5", None, [], [[1]], [True, 4, 5, 5], [2**40, 2**40], [2**70],
                [1] * 40, {}, [1, 4, 5, -5], [1, 4, 5, 6], [4, 5, 5], [1, 4, 25], [1, 4, 5, 5, 1], -3]
_JUNK_DATA = ["!!!", "a", base64.b64encode(bytes(399)).decode(), base64.b64encode(bytes(401)).decode(), 5, None,
              [1, 2], "\u00e9" * 4, "AAAA AAAA", {"b64": "AAAA"}]
_JUNK_VALUES = [[[1, 2], [3]], "abc", {"a": 1}, [1, 2, 3], [[["x"]]], [2**80], [None], [[[[[[[[[[[1]]]]]]]]]]]]
_JUNK_IDS = [5, [], {}, 1.5, True, {"id": "x"}]
_JUNK_TOPS = [b"[]", b"1", b'"x"', b"null", b"true", b"{}", b'{"inputs": []}', b'{"inputs": null}', b'{"inputs": "x"}',
              b"\xef\xbb\xbf{}", b'{"inputs": {}}', b"\xff\xfe{\x00}\x00", b"NaN", b"{" * 3]
_BAD_LENGTHS = ["-5", "abc", "", "+10", "1_0", "0x10", "5 5", "1e3", "9" * 30, str(300 << 20), "\u0661\u0662",
                "10, 10", "4294967296"]
_BAD_REQUEST_LINES = [b"POST /v1/infer", b"POST /v1/infer HTTP/2.0", b"POST  /v1/infer HTTP/1.1",
                      b"POST v1/infer HTTP/1.1", b"PO\x00ST /v1/infer HTTP/1.1", b"POST /v1/infer HTTP/1.1 x",
                      b"POST /v1/infer http/1.1", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
                      b"POST * HTTP/1.1", b"POST http://x/v1/infer HTTP/1.1", b" POST /v1/infer HTTP/1.1"]
_BAD_HEADERS = ["no colon here", "Bad Header: x", " folded: x", "X-\x00: y", ": empty name", "Content-Length: 3",
                "Transfer-Encoding: gzip", "Transfer-Encoding: chunked, gzip", "Expect: telepathy"]
_METHODS = ["PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT", "GET", "FOO", "post"]


def _mutated_obj(rng: random.Random, binary: bool) -> tuple[str, object]:
    """A request with one field made wrong, and the name of that field."""
    x = _x(rng.randrange(1000))
    tensor: dict = {"dtype": "float32", "shape": list(SHAPE), "data": x.tobytes() if binary else
                    base64.b64encode(x.tobytes()).decode()}
    obj: dict = {"inputs": {"x": tensor}, "id": "fuzz"}
    field = rng.choice(["dtype", "shape", "data", "values", "id", "name", "extra", "tensor", "model-dtype",
                        "model-shape"])
    if field == "dtype":
        tensor["dtype"] = rng.choice(_JUNK_DTYPES)
    elif field == "shape":
        tensor["shape"] = rng.choice(_JUNK_SHAPES)
    elif field == "data":
        tensor["data"] = rng.choice(_JUNK_DATA + ([x.tobytes()[:-1]] if binary else []))
    elif field == "values":
        del tensor["data"]
        tensor["values"] = rng.choice(_JUNK_VALUES)
    elif field == "id":
        obj["id"] = rng.choice(_JUNK_IDS)
    elif field == "name":
        obj["inputs"] = {rng.choice(["y", "", "X", "x ", "\u00e9", "1" * 300]): tensor}
    elif field == "extra":
        obj["inputs"]["z"] = dict(tensor)
    elif field == "tensor":
        obj["inputs"]["x"] = rng.choice([3, "x", [], None, [1, 2, 3], True])
    elif field == "model-shape":  # a shape the model does not take, with bytes that match it
        shape = rng.choice([[1, 4, 5, 6], [1, 4, 25], [4, 5, 5], [1, 4, 5, 5, 1], [1, 5, 4, 5], [0, 4, 5, 5]])
        raw = np.zeros(shape, dtype=np.float32).tobytes()
        tensor.update(shape=shape, data=raw if binary else base64.b64encode(raw).decode())
    else:  # a dtype the model does not take, with bytes that match it
        dt = rng.choice(["float64", "float16", "int8", "int64", "uint8", "bool"])
        raw = np.zeros(SHAPE, dtype=dt).tobytes()
        tensor.update(dtype=dt, data=raw if binary else base64.b64encode(raw).decode())
    return field, obj


def _pack_msgpack(obj: object) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True)
    except OverflowError:  # msgpack holds 64-bit ints: send the huge ones as floats
        return msgpack.packb(_floats_for_huge_ints(obj), use_bin_type=True)


def _floats_for_huge_ints(obj: object) -> object:
    if isinstance(obj, dict):
        return {k: _floats_for_huge_ints(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_floats_for_huge_ints(v) for v in obj]
    return float(obj) if isinstance(obj, int) and abs(obj) >= 2**63 else obj


def _bad_body(rng: random.Random, binary: bool) -> tuple[str, bytes, bool]:
    """(kind, body, must_fail) for one malformed JSON or msgpack body."""
    pack = _pack_msgpack if binary else (lambda o: json.dumps(o).encode())
    kind = rng.choice(["random", "truncated", "flipped", "top", "deep", "field", "field", "field", "other-format"])
    valid = pack({"inputs": {"x": {"dtype": "float32", "shape": SHAPE,
                                   "data": _x().tobytes() if binary else base64.b64encode(_x().tobytes()).decode()}}})
    if kind == "random":
        return kind, rng.randbytes(rng.randrange(300)), True
    if kind == "truncated":
        return kind, valid[:rng.randrange(len(valid))], True
    if kind == "flipped":
        i = rng.randrange(len(valid))
        return kind, valid[:i] + bytes([rng.randrange(256)]) + valid[i + 1:], False
    if kind == "top":
        if binary:
            return kind, rng.choice([b"\x81\x91\x01\x02", b"\xd4\xff\x00", b"\xc1", b"\x91" * 5000 + b"\x00",
                                     b"\xdd\xff\xff\xff\xff", msgpack.packb([1, 2]), msgpack.packb(None),
                                     msgpack.packb({"inputs": {"x": msgpack.ExtType(5, b"xx")}}),
                                     msgpack.packb({b"inputs": {}})]), True
        return kind, rng.choice(_JUNK_TOPS), True
    if kind == "deep":
        n = rng.choice([100, 1000, 30_000])
        return kind, (b"\x91" * n + b"\xc0") if binary else b"[" * n + b"]" * n, True
    if kind == "other-format":
        other = json.dumps(_valid_obj()).encode() if binary else msgpack.packb({"inputs": {}}, use_bin_type=True)
        return kind, other, True
    field, obj = _mutated_obj(rng, binary)
    return f"field:{field}", pack(obj), True


def _bad_framing(rng: random.Random, path: str, body: bytes) -> tuple[str, bytes]:
    """(kind, raw request) whose HTTP framing, not its body, is wrong."""
    kind = rng.choice(["length", "short", "chunked", "request-line", "method", "header", "eof-in-head", "big-head"])
    if kind == "length":
        return kind, _http(path, body, length=rng.choice(_BAD_LENGTHS))
    if kind == "short":
        return kind, _http(path, body, length=str(len(body) + rng.randrange(1, 1000)))
    if kind == "chunked":
        line = json.dumps(_valid_obj("c")).encode() + b"\n"
        good = rng.choice([[], [line]])
        end = rng.choice([b"zz\r\n", b"-5\r\n", b"5\r\nabcdefgh\r\n", b"10\r\nabc", b"", b"fffffffffffffff\r\n",
                          b"1ffffffffffffffff\r\n", b"5\r\nabcde", b"3;ext\r\nabc\r\nq\r\n", b"\r\n\r\n"])
        return kind, _chunked(path, good, end=end)
    if kind == "request-line":
        return kind, rng.choice(_BAD_REQUEST_LINES) + b"\r\nContent-Length: 2\r\n\r\n{}"
    if kind == "method":
        return kind, _http(path, body, method=rng.choice(_METHODS))
    if kind == "header":
        return kind, _http(path, body, headers=(rng.choice(_BAD_HEADERS),))
    if kind == "eof-in-head":
        return kind, f"POST {path} HTTP/1.1\r\nContent-Length: 2".encode()
    return kind, _http(path, body, headers=("X-Big: " + "a" * rng.choice([70 << 10, 200 << 10]),))


def _fuzz_cases(rng: random.Random, path: str, n: int) -> Iterator[_Case]:
    stream = path == "/v1/stream"
    for _ in range(n):
        binary = not stream and rng.random() < 0.35
        kind, body, must_fail = _bad_body(rng, binary)
        if stream:  # a few NDJSON lines: bad ones, now and then a good one among them
            lines = [body.replace(b"\n", b" ")]
            must_fail = must_fail and lines[0].strip() != b""  # a blank line is skipped, not an error
            for _ in range(rng.randrange(3)):
                extra_kind, extra, _ = _bad_body(rng, False)
                lines.append(json.dumps(_valid_obj("g")).encode() if rng.random() < 0.3 else extra.replace(b"\n", b" "))
            rng.shuffle(lines)
            body = b"\n".join(lines) + b"\n"
        if rng.random() < 0.3:
            kind, raw = _bad_framing(rng, path, body)
            yield _Case(f"http:{kind}", raw, True)
        else:
            ctype = "application/msgpack" if binary else ("application/x-ndjson" if stream else "application/json")
            yield _Case(f"body:{kind}", _http(path, body, ctype=ctype), must_fail)


def _check(case: _Case, answer: _Answer, stream: bool) -> str:
    """What is wrong with the answer to `case` ('' when nothing is)."""
    if answer.status is None:
        return f"dropped ({answer.failure})"
    if answer.status >= 500:
        return f"answered {answer.status}: {answer.body[:300]!r}"
    try:
        if answer.status != 200:
            _json_error(answer)
            return ""
        if not stream:
            msgpack_out = answer.ctype.startswith("application/msgpack")
            ok = "outputs" in (msgpack.unpackb(answer.body) if msgpack_out else json.loads(answer.body))
            return "" if ok and not case.must_fail else f"answered 200 to a malformed request: {answer.body[:200]!r}"
        lines = _ndjson(answer)
        for line in lines:
            if "outputs" not in line and not (isinstance(line.get("message"), str) and 400 <= line["status"] < 500):
                return f"stream line is neither an answer nor a 4xx error: {line}"
        if case.must_fail and all("outputs" in line for line in lines):
            return f"no error line for a malformed stream: {answer.body[:200]!r}"
    except (ValueError, AssertionError, KeyError, TypeError) as e:
        return f"answer body is not the JSON expected ({e!r}): {answer.body[:300]!r}"
    return ""


def _fuzz(port: int, path: str, rng: random.Random, n: int) -> tuple[Counter, list[str]]:
    statuses: Counter = Counter()
    problems: list[str] = []
    for i, case in enumerate(_fuzz_cases(rng, path, n)):
        answer = _send(port, case.raw)
        statuses[answer.status] += 1
        problem = _check(case, answer, path == "/v1/stream")
        if problem:
            problems.append(f"{path} #{i} {case.kind}: {problem[:400]}; request {case.raw[:200]!r}")
    return statuses, problems


def test_fuzz_malformed_requests_are_all_answered_4xx_and_the_agent_keeps_serving(served, caplog):
    rng = random.Random(SEED)
    run: Callable[[str], tuple[Counter, list[str]]] = lambda p: _fuzz(served.port, p, rng, CASES_PER_PATH)  # noqa: E731
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        infer_statuses, infer_problems = run("/v1/infer")
        stream_statuses, stream_problems = run("/v1/stream")
    elapsed_s = time.monotonic() - t0
    problems = infer_problems + stream_problems
    sent = sum(infer_statuses.values()) + sum(stream_statuses.values())
    print(f"fuzz: {sent} requests in {elapsed_s:.1f} s; /v1/infer {dict(infer_statuses)}; "
          f"/v1/stream {dict(stream_statuses)}")
    assert sent >= 2000
    assert not problems, f"{len(problems)} of {sent} malformed requests were mishandled:\n" + "\n".join(problems[:20])
    assert infer_statuses[400] > CASES_PER_PATH // 2 and stream_statuses[200] > CASES_PER_PATH // 4
    # nothing crashed in the agent, and no malformed input reached the gateway and failed there
    crashes = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR
               and (r.name == "asyncio" or r.name.startswith(("edge_agent", "cluster")))]
    assert not crashes, crashes[:5]
    good = json.dumps(_valid_obj("last")).encode()
    answer = _send(served.port, _http("/v1/infer", good))
    assert answer.status == 200 and json.loads(answer.body)["id"] == "last"
    stream = _send(served.port, _http("/v1/stream", good + b"\n", ctype="application/x-ndjson"))
    assert stream.status == 200 and [line["id"] for line in _ndjson(stream)] == ["last"]
