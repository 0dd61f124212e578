"""Clients of `splitinfer.v1.Inference`: `InferenceClient` (asyncio) and
`SyncInferenceClient` (blocking, for scripts and threads).

Both send frames as bytes and decode them here, and both turn a failed call
into the `cluster.protocol.errors` class the server raised (see `status.from_status`).
The bearer token rides in `authorization` metadata; it is never logged or shown
in a repr. `options` adds or overrides gRPC channel options (the edge agent sets its
reconnect back-off there), and `infer_counted` returns, with the answer, the bytes the
call moved each way and its round trip, which is what a link estimator needs.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.protocol import status as _status
from cluster.protocol.errors import ClusterError, DeadlineExceeded
from cluster.protocol.messages import (
    ArtifactsChunk,
    ArtifactsRequest,
    ArtifactsResponse,
    InferRequest,
    InferResponse,
    PlanRequest,
    SERVICE_NAME,
    PlanResponse,
    StreamFrame,
    Tensor,
)

__all__ = ["InferenceClient", "SyncInferenceClient", "InferResult", "make_request", "new_request_id", "SERVICE_NAME",
           "SERVER_TIME_KEYS"]

#: timings_ms keys that are time spent in the server (not on the link).
SERVER_TIME_KEYS = ("decode", "decode_tensors", "queue", "compute", "encode", "load")

_DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
#: Extra time the gRPC deadline gets beyond the request's own deadline, so the
#: server's DEADLINE_EXCEEDED (which says where the time went) usually arrives first.
DEADLINE_GRACE_S = 0.1


_ID_PREFIX = uuid.uuid4().hex[:16]
_ids = itertools.count()


def new_request_id() -> str:
    """A process-unique id: a random prefix and a counter (uuid4 per request costs a syscall)."""
    return f"{_ID_PREFIX}-{next(_ids)}"


def make_request(
    model: str,
    version: str,
    cut_id: str,
    tensors: Mapping[str, Tensor],
    *,
    timeout_s: float = 5.0,
    priority: int = 0,
    device_id: str = "",
    request_id: str | None = None,
) -> InferRequest:
    """An InferRequest with a fresh id and a deadline `timeout_s` from now."""
    return InferRequest(
        request_id or f"{_ID_PREFIX}-{next(_ids)}",
        model,
        version,
        cut_id,
        int((time.time() + timeout_s) * 1000),
        dict(tensors),
        priority,
        device_id,
    )


def _grpc_timeout(req: InferRequest, timeout_s: float | None) -> float:
    if timeout_s is not None:
        return timeout_s
    return max(DEADLINE_GRACE_S, req.deadline_unix_ms / 1000.0 - time.time() + DEADLINE_GRACE_S)


def _options(max_message_bytes: int, extra: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """The message size limits both ways, then `extra`; a key in `extra` replaces the default."""
    options = {
        "grpc.max_receive_message_length": max_message_bytes,
        "grpc.max_send_message_length": max_message_bytes,
    }
    options.update(extra)
    return list(options.items())


@dataclass(frozen=True)
class InferResult:
    """One answered Infer and what the call cost on the link."""

    response: InferResponse
    up_bytes: int
    """Bytes of the request frame sent."""
    down_bytes: int
    """Bytes of the response frame received."""
    elapsed_s: float
    """Round trip of the call as the client saw it (time.monotonic)."""
    server_ms: float
    """Time the server says it spent (the SERVER_TIME_KEYS of its timings_ms)."""

    @classmethod
    def of(cls, raw: bytes, up_bytes: int, elapsed_s: float) -> InferResult:
        resp = InferResponse.from_msgpack(raw)
        server_ms = sum(v for k, v in resp.timings_ms.items() if k in SERVER_TIME_KEYS)
        return cls(resp, up_bytes, len(raw), elapsed_s, server_ms)


def _error_of_rpc(e: grpc.RpcError) -> ClusterError:
    return _status.from_status(e.code(), e.details(), e.trailing_metadata())


def _frame_result(frame: StreamFrame) -> InferResponse | ClusterError:
    if frame.response is not None:
        return frame.response
    err = frame.error
    if err is None:
        return _status.rebuild_error(grpc.StatusCode.INTERNAL, "server sent a request frame")
    return _status.rebuild_error(_status.code_of_number(err.code), err.message, err.error, dict(err.fields))


def _health_name(code: int) -> str:
    return health_pb2.HealthCheckResponse.ServingStatus.Name(code)


class _Client:
    """What both clients hold: the channel (of `_grpc`, grpc or grpc.aio), the bearer
    metadata and one stub per method of the service."""

    _grpc: Any

    def __init__(
        self,
        address: str,
        *,
        credentials: grpc.ChannelCredentials | None = None,
        token: str | None = None,
        max_message_bytes: int = _DEFAULT_MAX_MESSAGE_BYTES,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.address = address
        opts = _options(max_message_bytes, options)
        if credentials is not None:
            self._channel = self._grpc.secure_channel(address, credentials, options=opts)
        else:
            self._channel = self._grpc.insecure_channel(address, options=opts)
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        base = f"/{SERVICE_NAME}/"
        self._infer = self._channel.unary_unary(base + "Infer")
        self._stream = self._channel.stream_stream(base + "InferStream")
        self._plan = self._channel.unary_unary(base + "Plan")
        self._artifacts = self._channel.unary_stream(base + "GetArtifacts")
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.address!r}, token={'set' if self._metadata else 'none'})"


class InferenceClient(_Client):
    """asyncio client. Use `async with InferenceClient(addr) as c:` or call `close()`."""

    _grpc = grpc.aio

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def infer(self, request: InferRequest, *, timeout_s: float | None = None) -> InferResponse:
        """One unary Infer. The gRPC deadline follows `request.deadline_unix_ms` unless `timeout_s` is given.
        Without `infer_counted`'s counts, which cost 150 Python bytecodes a call that only the agent needs."""
        return InferResponse.from_msgpack(await self._call(request.to_msgpack(), request, timeout_s))

    async def infer_counted(self, request: InferRequest, *, timeout_s: float | None = None) -> InferResult:
        """`infer`, with the bytes each way and the round trip of the call."""
        data = request.to_msgpack()
        t0 = time.monotonic()
        raw = await self._call(data, request, timeout_s)
        return InferResult.of(raw, len(data), time.monotonic() - t0)

    async def _call(self, data: bytes, request: InferRequest, timeout_s: float | None) -> bytes:
        try:
            return await self._infer(data, timeout=_grpc_timeout(request, timeout_s), metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error_of_rpc(e) from e

    async def infer_stream(
        self, requests: AsyncIterable[InferRequest] | Iterable[InferRequest], *, timeout_s: float | None = None
    ) -> AsyncIterator[InferResponse | ClusterError]:
        """Sends requests on one InferStream and yields one result per request, in order.

        A failed request yields its error (a ClusterError instance) in its place, so
        the caller can answer it another way; a failed stream raises.
        """

        async def frames() -> AsyncIterator[bytes]:
            seq = 0
            if isinstance(requests, AsyncIterable):
                async for r in requests:
                    yield StreamFrame(seq=seq, request=r).to_msgpack()
                    seq += 1
            else:
                for r in requests:
                    yield StreamFrame(seq=seq, request=r).to_msgpack()
                    seq += 1

        call = self._stream(frames(), timeout=timeout_s, metadata=self._metadata)
        try:
            async for raw in call:
                yield _frame_result(StreamFrame.from_msgpack(raw))
        except grpc.RpcError as e:
            raise _error_of_rpc(e) from e
        finally:
            call.cancel()

    async def plan(self, query: Mapping[str, Any], *, request_id: str | None = None, timeout_s: float = 30.0) -> PlanResponse:
        req = PlanRequest(request_id=request_id or new_request_id(), query=dict(query))
        try:
            raw = await self._plan(req.to_msgpack(), timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error_of_rpc(e) from e
        return PlanResponse.from_msgpack(raw)

    async def get_artifacts(
        self, model: str, version: str, *, device_id: str = "", timeout_s: float | None = 60.0,
        stall_timeout_s: float | None = None, on_chunk: Callable[[ArtifactsChunk], None] | None = None,
    ) -> ArtifactsResponse:
        """The version's files. `timeout_s` bounds the whole download (None: no bound);
        `stall_timeout_s` the wait for each chunk (of up to 1 MiB), so that a large model on a
        slow link downloads for as long as its bytes keep coming, and a dead link is found
        in that time (DeadlineExceeded). `on_chunk` sees each chunk as it arrives."""
        req = ArtifactsRequest(model=model, version=version, device_id=device_id)
        chunks: list[ArtifactsChunk] = []
        call = self._artifacts(req.to_msgpack(), timeout=timeout_s, metadata=self._metadata)
        read = call.read
        try:
            while True:
                try:
                    raw = await (read() if stall_timeout_s is None else asyncio.wait_for(read(), stall_timeout_s))
                except TimeoutError:
                    got = sum(len(c.data) for c in chunks)
                    raise DeadlineExceeded(where=f"while downloading {model}@{version or 'latest'}: no data for "
                                                 f"{stall_timeout_s:g} s after {got} bytes") from None
                if raw is grpc.aio.EOF:
                    break
                chunk = ArtifactsChunk.from_msgpack(raw)
                chunks.append(chunk)
                if on_chunk is not None:
                    on_chunk(chunk)
        except grpc.RpcError as e:
            raise _error_of_rpc(e) from e
        finally:
            call.cancel()
        return ArtifactsResponse.from_chunks(chunks, model=model, version=version)

    async def health(self, service: str = "", *, timeout_s: float = 5.0) -> str:
        """'SERVING', 'NOT_SERVING', ... as grpc.health.v1 reports for `service` ('' = the server)."""
        try:
            resp = await self._health.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise _error_of_rpc(e) from e
        return _health_name(resp.status)


class SyncInferenceClient(_Client):
    """Blocking client with the same methods as InferenceClient."""

    _grpc = grpc

    def __enter__(self) -> SyncInferenceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def infer_raw(self, data: bytes, *, timeout_s: float = 5.0) -> bytes:
        """Sends an already-encoded InferRequest frame (for tests and fuzzing)."""
        try:
            return self._infer(data, timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error_of_rpc(e) from e

    def infer(self, request: InferRequest, *, timeout_s: float | None = None) -> InferResponse:
        raw = self.infer_raw(request.to_msgpack(), timeout_s=_grpc_timeout(request, timeout_s))
        return InferResponse.from_msgpack(raw)

    def infer_counted(self, request: InferRequest, *, timeout_s: float | None = None) -> InferResult:
        data = request.to_msgpack()
        t0 = time.monotonic()
        raw = self.infer_raw(data, timeout_s=_grpc_timeout(request, timeout_s))
        return InferResult.of(raw, len(data), time.monotonic() - t0)

    def infer_stream(
        self, requests: Iterable[InferRequest], *, timeout_s: float | None = None
    ) -> Iterator[InferResponse | ClusterError]:
        frames = (StreamFrame(seq=i, request=r).to_msgpack() for i, r in enumerate(requests))
        call = self._stream(frames, timeout=timeout_s, metadata=self._metadata)
        try:
            for raw in call:
                yield _frame_result(StreamFrame.from_msgpack(raw))
        except grpc.RpcError as e:
            raise _error_of_rpc(e) from e
        finally:
            call.cancel()

    def plan(self, query: Mapping[str, Any], *, request_id: str | None = None, timeout_s: float = 30.0) -> PlanResponse:
        req = PlanRequest(request_id=request_id or new_request_id(), query=dict(query))
        try:
            raw = self._plan(req.to_msgpack(), timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise _error_of_rpc(e) from e
        return PlanResponse.from_msgpack(raw)

    def get_artifacts(self, model: str, version: str, *, device_id: str = "", timeout_s: float = 60.0) -> ArtifactsResponse:
        req = ArtifactsRequest(model=model, version=version, device_id=device_id)
        try:
            chunks = [
                ArtifactsChunk.from_msgpack(raw)
                for raw in self._artifacts(req.to_msgpack(), timeout=timeout_s, metadata=self._metadata)
            ]
        except grpc.RpcError as e:
            raise _error_of_rpc(e) from e
        return ArtifactsResponse.from_chunks(chunks, model=model, version=version)

    def health(self, service: str = "", *, timeout_s: float = 5.0) -> str:
        try:
            resp = self._health.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise _error_of_rpc(e) from e
        return _health_name(resp.status)
