"""The gRPC server shell of `splitinfer.v1.Inference` with a pluggable backend.

Handlers are adapters: decode the frame, call the typed backend, encode the
answer. Errors become status codes in one place (`abort_with_status`, using the table in
`cluster.protocol.status`); stream frames use the same table for their error
frames. The gateway (routing, registry, auth, metrics) is a `Backend` plus
interceptors; this module knows nothing of Ray.

Deadlines: a request's deadline is the earlier of the gRPC deadline and its
`deadline_unix_ms`. A request already past it is refused before the backend
sees it; otherwise the backend gets it as an absolute `time.monotonic()` value
in `RequestContext.deadline_monotonic_s`, and a backend that overruns it is
cancelled and answered with DEADLINE_EXCEEDED.

A backend may define `observe_refusal(model, status, reason)`: the server calls it for
each Infer request it answers without calling the backend (a malformed frame, a
deadline already passed), so the backend's request counts include them.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cluster._streams import windowed_answers, write_answer
from cluster.errors import DeadlineExceeded, NotSupported, ProtocolError
from cluster.protocol import status as _status
from cluster.protocol.messages import (
    ArtifactsRequest,
    ArtifactsResponse,
    ErrorInfo,
    InferRequest,
    InferResponse,
    PlanRequest,
    SERVICE_NAME,
    PlanResponse,
    StreamFrame,
    encode_response_frame,
)
from workers import keep_freed_memory

__all__ = [
    "SERVICE_NAME",
    "Backend",
    "RequestContext",
    "Health",
    "InferRunner",
    "abort_with_status",
    "windowed_answers",
    "string_metadata",
    "ServiceFactory",
    "RunningServer",
    "ThreadedServer",
    "serve",
    "serve_in_thread",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_STREAM_WINDOW",
    "new_event_loop",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
DEFAULT_STREAM_WINDOW = 8
DEFAULT_CHUNK_BYTES = 1 << 20

InferRunner = Callable[[InferRequest, grpc.aio.ServicerContext, str, float], Awaitable[InferResponse]]
"""`run(request, context, method, received_monotonic_s)`: the native Infer path from a decoded
request to the backend's answer, with its deadline handling (the earlier of the request's and
gRPC's deadline; refused before the backend when already past, cancelled at it otherwise)."""
ServiceFactory = Callable[[InferRunner], grpc.GenericRpcHandler]
"""Builds another gRPC service on the same server (and port, TLS and message limits) over the
native Infer path, e.g. the Open Inference Protocol door (`cluster.oip_grpc.oip_service`)."""


@dataclass(frozen=True)
class RequestContext:
    """What the server knows about a call besides its message."""

    method: str
    """'Infer', 'InferStream', 'Plan' or 'GetArtifacts'."""
    received_monotonic_s: float
    """time.monotonic() when the frame arrived (queue time starts here)."""
    deadline_monotonic_s: float | None
    """Absolute time.monotonic() deadline; None when the call has none (Plan, GetArtifacts)."""
    peer: str = ""
    """The peer address as gRPC reports it."""
    metadata: Mapping[str, str] = field(default_factory=dict, repr=False)
    """Invocation metadata. Holds the bearer token: never log it."""

    @property
    def bearer_token(self) -> str | None:
        """The token of 'authorization: Bearer <token>', or None."""
        auth = self.metadata.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            return auth[7:].strip() or None
        return None

    def remaining_s(self, now_monotonic_s: float | None = None) -> float | None:
        if self.deadline_monotonic_s is None:
            return None
        now = time.monotonic() if now_monotonic_s is None else now_monotonic_s
        return self.deadline_monotonic_s - now


@runtime_checkable
class Backend(Protocol):
    """What the server calls. Raise cluster.errors classes to choose the status code.

    A backend may also define `bind_health(health: Health)` to set readiness, and
    `observe_refusal(model, status, reason)` to count the requests refused before it.
    """

    async def infer(self, request: InferRequest, context: RequestContext) -> InferResponse: ...

    async def plan(self, request: PlanRequest, context: RequestContext) -> PlanResponse: ...

    async def get_artifacts(self, request: ArtifactsRequest, context: RequestContext) -> ArtifactsResponse: ...


class Health:
    """Readiness as the standard grpc.health.v1 service reports it."""

    def __init__(self, servicer: health.aio.HealthServicer) -> None:
        self._servicer = servicer
        self.ready = False
        self.services: dict[str, bool] = {}
        """Per-model service name ('model', 'model@version', 'model@version@cut') -> serving."""

    async def set_ready(self, ready: bool, *, services: Mapping[str, bool] | None = None) -> None:
        """SERVING when ready, NOT_SERVING otherwise, for '' and the inference service.

        ``services``: the state of each model as a service of its own, so a health check of
        'model' or 'model@version' says whether that one serves (a failed one is
        NOT_SERVING while the others serve); a name set before and now absent becomes
        NOT_SERVING."""
        changed = ready != self.ready
        self.ready = ready
        await self._servicer.set("", _health_status(ready))
        await self._servicer.set(SERVICE_NAME, _health_status(ready))
        if services is not None:
            now = {k: bool(v) for k, v in services.items()} | {k: False for k in self.services if k not in services}
            for name, serving in now.items():
                if self.services.get(name) != serving:
                    await self._servicer.set(name, _health_status(serving))
            self.services = now
        if changed or services is None:
            logger.info("health set to %s", "SERVING" if ready else "NOT_SERVING")


def _health_status(serving: bool) -> int:
    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING


async def abort_with_status(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    """The one place where an error becomes a gRPC status."""
    code, message, name, fields = _status.to_status(exc, where=method)
    if code is not grpc.StatusCode.INTERNAL:
        logger.debug("%s answered %s: %s", method, code.name, message)
    await context.abort(code, message, trailing_metadata=_status.trailing_metadata(name, fields))


def _error_info(exc: BaseException, method: str) -> ErrorInfo:
    code, message, name, fields = _status.to_status(exc, where=method)
    return ErrorInfo(code=_status.code_number(code), error=name, message=message, fields=fields)


def string_metadata(pairs: Any) -> dict[str, str]:
    """gRPC metadata pairs as a dict of the text ones (binary `-bin` values left out)."""
    return {key: value for key, value in pairs or () if isinstance(value, str)}


class _CallContext(RequestContext):
    """A RequestContext whose `metadata` dict is built on first read: most backends
    (and every call without auth) never read it, and building it per call shows in
    the 4 KiB round trip. Until then it holds gRPC's metadata pairs, a plain
    tuple: it must not hold gRPC's servicer context, whose call state may only be
    freed while gRPC is still up (a backend may keep a context after the server stopped)."""

    @property  # type: ignore[override]
    def metadata(self) -> Mapping[str, str]:
        d = self.__dict__
        md = d.get("_metadata")
        if md is None:
            md = d["_metadata"] = string_metadata(d.pop("_pairs", ()))
        return md

    @metadata.setter
    def metadata(self, value: Mapping[str, str]) -> None:
        # The frozen dataclass __init__ (dataclasses.replace) sets fields with object.__setattr__.
        self.__dict__["_metadata"] = value


class _Deadlines:
    """Cancels in-flight backend calls at their deadlines with one loop timer.

    [Note: deadline timer] A timer per call (call_later, then cancel) cost more
    than the rest of the server shell in the 4 KiB round trip; here a call costs
    a heap push and, when it ends, a pop. Entries are lists
    [deadline_monotonic_s, seq, task, fired]: `task` is None once the call ended,
    and `fired` is True when this timer cancelled it, so that only that
    cancellation becomes DEADLINE_EXCEEDED (a client that went away stays a
    cancellation). Calls end in about deadline order, so ended entries mostly
    sit at the top of the heap and leave it at once; any others leave when the
    timer passes their deadline. Used on the loop's thread only.
    """

    def __init__(self) -> None:
        self._heap: list[list[Any]] = []
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")

    def add(self, deadline: float, task: asyncio.Task[Any]) -> list[Any]:
        entry = [deadline, next(self._seq), task, False]
        heapq.heappush(self._heap, entry)
        if deadline < self._timer_at:
            self._arm(deadline)
        return entry

    def done(self, entry: list[Any]) -> None:
        entry[2] = None
        heap = self._heap
        while heap and heap[0][2] is None:
            heapq.heappop(heap)

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = at
        self._timer = asyncio.get_running_loop().call_later(max(0.0, at - time.monotonic()), self._fire)

    def _fire(self) -> None:
        self._timer, self._timer_at = None, float("inf")
        heap, now = self._heap, time.monotonic()
        while heap and (heap[0][2] is None or heap[0][0] <= now):
            entry = heapq.heappop(heap)
            task = entry[2]
            if task is not None:
                entry[2], entry[3] = None, True
                task.cancel()
        if heap:
            # The loop's clock may run a little ahead of time.monotonic(): a timer
            # that fired early is simply armed again for what is left.
            self._arm(heap[0][0])


class _Service:
    """The adapters between frames and the backend."""

    def __init__(self, backend: Any, window: int, chunk_bytes: int) -> None:
        self.backend = backend
        self.window = window
        self.chunk_bytes = chunk_bytes
        self.deadlines = _Deadlines()
        self._observe_refusal = getattr(backend, "observe_refusal", None)
        self.calls: set[asyncio.Task[Any]] = set()
        """Tasks running the backend or an InferStream now ([Note: calls outlive stop])."""

    def _refused(self, model: str, exc: BaseException, reason: str) -> None:
        """Tells the backend of a request answered without it (its counts include them)."""
        if self._observe_refusal is None:
            return
        try:
            self._observe_refusal(model, _status.status_of(exc).name, reason)
        except Exception:  # noqa: BLE001 - counting must never change the answer
            logger.exception("backend.observe_refusal failed")

    # -- shared pieces -----------------------------------------------------------------

    def _context(
        self, method: str, context: grpc.aio.ServicerContext, received: float, deadline: float | None
    ) -> RequestContext:
        # Filled directly: the frozen dataclass __init__ costs a setattr per field on
        # every call, and every field is given here.
        ctx = object.__new__(_CallContext)
        ctx.__dict__.update(method=method, received_monotonic_s=received, deadline_monotonic_s=deadline,
                            peer=context.peer() or "", _pairs=context.invocation_metadata())
        return ctx

    async def _run_infer(
        self, req: InferRequest, context: grpc.aio.ServicerContext, method: str, received: float
    ) -> InferResponse:
        # The deadline is the earlier of the request's and gRPC's.
        remaining_s = req.deadline_unix_ms / 1000.0 - time.time()
        grpc_left = context.time_remaining()
        if grpc_left is not None and grpc_left < remaining_s:
            remaining_s = grpc_left
        if remaining_s <= 0:
            err = DeadlineExceeded(where="before the request reached the backend", overdue_ms=-remaining_s * 1e3)
            self._refused(req.model, err, "expired_before_backend")
            raise err
        deadline = time.monotonic() + remaining_s
        ctx = self._context(method, context, received, deadline)
        # [Note: deadline timer] in _Deadlines: the service's one timer cancels this
        # task at the deadline, as asyncio.timeout would, at less cost per call.
        task = asyncio.current_task()
        assert task is not None  # handlers always run in a task
        base = task.cancelling()
        entry = self.deadlines.add(deadline, task)
        self.calls.add(task)
        try:
            resp = await self.backend.infer(req, ctx)
        except asyncio.CancelledError as e:
            if entry[3] and task.uncancel() <= base:
                raise DeadlineExceeded(
                    where="while the backend ran", overdue_ms=(time.monotonic() - deadline) * 1e3
                ) from e
            raise
        finally:
            self.deadlines.done(entry)
            self.calls.discard(task)
        if not isinstance(resp, InferResponse):
            raise TypeError(f"backend.infer returned {type(resp).__name__}, not InferResponse")
        return resp

    # -- methods -----------------------------------------------------------------------

    async def infer(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        received = time.monotonic()
        try:
            t0 = time.perf_counter()
            try:
                req = InferRequest.from_msgpack(raw)
            except Exception as e:  # noqa: BLE001 - counted here, answered by abort_with_status below
                self._refused("", e, "malformed")
                raise
            decode_ms = (time.perf_counter() - t0) * 1e3
            resp = await self._run_infer(req, context, "Infer", received)
            return encode_response_frame(resp, decode_ms)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001 - every error becomes a status in abort_with_status
            await abort_with_status(context, e, "Infer")
            raise AssertionError("context.abort returned") from e

    async def _stream_one(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """Answers one stream frame; never raises, so one bad frame cannot end the stream."""
        received = time.monotonic()
        seq = None
        try:
            t0 = time.perf_counter()
            try:
                frame = StreamFrame.from_msgpack(raw)
                seq = frame.seq
                if frame.request is None:
                    raise ProtocolError(reason="client frames must carry 'request'", where="StreamFrame")
            except Exception as e:  # noqa: BLE001 - counted here, answered as an error frame below
                self._refused("", e, "malformed")
                raise
            decode_ms = (time.perf_counter() - t0) * 1e3
            resp = await self._run_infer(frame.request, context, "InferStream", received)
            return encode_response_frame(resp, decode_ms, seq=seq, stream=True)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - becomes this frame's error frame
            return StreamFrame(seq=seq, error=_error_info(e, "InferStream")).to_msgpack()

    async def infer_stream(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        task = asyncio.current_task()
        assert task is not None  # handlers always run in a task
        self.calls.add(task)
        try:
            async with contextlib.aclosing(windowed_answers(
                    requests, self.window, lambda raw: self._stream_one(raw, context))) as answers:
                async for answer in answers:
                    await write_answer(context, answer)  # [Note: failed writes] in cluster/_streams.py
        except (asyncio.CancelledError, grpc.aio.BaseError):  # grpc's own: the call ended or was aborted
            raise
        except Exception as e:  # noqa: BLE001 - a broken stream still ends with a status
            await abort_with_status(context, e, "InferStream")
        finally:
            self.calls.discard(task)

    async def _call_optional(self, method: str, attr: str, req: Any, context: grpc.aio.ServicerContext,
                             received: float, answer_type: type) -> Any:
        """The backend's optional method `attr` on `req` within the call's gRPC deadline:
        NotSupported where the backend has none, TypeError where it answers other than `answer_type`."""
        fn = getattr(self.backend, attr, None)
        if fn is None:
            raise NotSupported(what=method)
        left = context.time_remaining()
        resp = await fn(req, self._context(method, context, received, None if left is None else received + left))
        if not isinstance(resp, answer_type):
            raise TypeError(f"backend.{attr} returned {type(resp).__name__}, not {answer_type.__name__}")
        return resp

    async def plan(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        received = time.monotonic()
        try:
            req = PlanRequest.from_msgpack(raw)
            resp = await self._call_optional("Plan", "plan", req, context, received, PlanResponse)
            return resp.to_msgpack()
        except asyncio.CancelledError:
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001 - every error becomes a status in abort_with_status
            await abort_with_status(context, e, "Plan")
            raise AssertionError("context.abort returned") from e

    async def get_artifacts(self, raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        received = time.monotonic()
        try:
            req = ArtifactsRequest.from_msgpack(raw)
            resp = await self._call_optional("GetArtifacts", "get_artifacts", req, context, received,
                                             ArtifactsResponse)
            for chunk in resp.to_chunks(self.chunk_bytes):
                yield chunk.to_msgpack()
        except asyncio.CancelledError:
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as e:  # noqa: BLE001 - every error becomes a status in abort_with_status
            await abort_with_status(context, e, "GetArtifacts")

    def generic_handler(self) -> grpc.GenericRpcHandler:
        # Frames stay bytes through gRPC: decoding happens in the handlers, where a
        # bad frame becomes INVALID_ARGUMENT instead of gRPC's own INTERNAL.
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Infer": grpc.unary_unary_rpc_method_handler(self.infer),
                "InferStream": grpc.stream_stream_rpc_method_handler(self.infer_stream),
                "Plan": grpc.unary_unary_rpc_method_handler(self.plan),
                "GetArtifacts": grpc.unary_stream_rpc_method_handler(self.get_artifacts),
            },
        )


@dataclass
class RunningServer:
    """A started server: its address, its health and a way to stop it."""

    server: grpc.aio.Server
    port: int
    host: str
    health: Health
    _health_servicer: health.aio.HealthServicer
    _service: _Service

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def stop(self, grace_s: float | None = 1.0) -> None:
        """Refuses new calls, lets those running finish for `grace_s`, then cancels them.

        [Note: calls outlive stop] grpc.aio's `server.stop(grace)` cancels the calls left at
        the end of the grace in its core and returns; their handlers learn of it later, from
        the loop. A stream whose requests wait in a pool then outlives the server: the gateway
        closes the pool under it (they fail there) and ends the loop, whose cancelling of
        grpc's task for the call, left waiting on the handler, grpc logs with a traceback.
        Cancelled here, handlers end quietly (grpc logs that at debug level) before stop returns."""
        await self._health_servicer.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        left = [task for task in self._service.calls if not task.done()]
        for task in left:
            task.cancel()
        if left:  # a cancelled handler ends within a loop turn or two
            _, pending = await asyncio.wait(left, timeout=1.0)
            logger.info("server stopped: cancelled %d calls still running (%d not ended within 1 s)",
                        len(left), len(pending))

    async def wait(self) -> None:
        await self.server.wait_for_termination()


async def serve(
    backend: Backend,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    stream_window: int = DEFAULT_STREAM_WINDOW,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ready: bool = True,
    services: Sequence[ServiceFactory] = (),
) -> RunningServer:
    """Starts `splitinfer.v1.Inference` and grpc.health.v1 on `host:port` (port 0: the OS picks).

    `stream_window` bounds the unanswered frames per InferStream call;
    `max_message_bytes` bounds each message both ways (larger ones get
    RESOURCE_EXHAUSTED from gRPC). `ready` is the initial health status. Each of `services`
    adds a service beside the native one, served over the same Infer path.
    The process keeps freed buffers instead of returning them to the OS
    (`workers.keep_freed_memory`; SPLITINFER_KEEP_FREED_MEMORY=0 opts out).
    """
    if stream_window < 1:
        raise ValueError(f"stream_window={stream_window} must be >= 1 (frames in flight per stream)")
    keep_freed_memory()  # [Note: fresh pages] (workers/_malloc.py)
    if max_message_bytes < 1024:
        raise ValueError(f"max_message_bytes={max_message_bytes} is too small; use at least 1024")
    for name in ("infer",):
        if not callable(getattr(backend, name, None)):
            raise TypeError(f"backend {type(backend).__name__} has no async {name}(request, context) method")
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Without this a second server on the same port shares it silently.
        ("grpc.so_reuseport", 0),
    ]
    # grpc.aio rather than grpc.server with each call bridged to this loop
    # (run_coroutine_threadsafe): on grpcio 1.85.3, paired in own processes, the bridged
    # Infer took 1.14x / 1.07x / 0.98x this server's time at 4 KiB / 1 MiB / 8 MiB on a
    # 2-core VM and 1.04x / 1.11x / 1.04x on a 16-core host (docs/protocol.md).
    server = grpc.aio.server(interceptors=list(interceptors), options=options)
    service = _Service(backend, stream_window, chunk_bytes)
    server.add_generic_rpc_handlers((service.generic_handler(), *(make(service._run_infer) for make in services)))
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    target = f"{host}:{port}"
    try:
        bound = server.add_secure_port(target, credentials) if credentials else server.add_insecure_port(target)
    except RuntimeError as e:  # grpcio raises this (not OSError) for a taken port
        raise OSError(f"could not bind {target}: {e}; choose a free port or port=0") from e
    if bound == 0:
        raise OSError(f"could not bind {target}; choose a free port or port=0")
    await server.start()
    h = Health(servicer)
    await h.set_ready(ready)
    bind = getattr(backend, "bind_health", None)
    if callable(bind):
        bind(h)
    logger.info("serving %s on %s:%d (tls=%s, window=%d)", SERVICE_NAME, host, bound, credentials is not None, stream_window)
    return RunningServer(server=server, port=bound, host=host, health=h, _health_servicer=servicer,
                         _service=service)


async def _collect() -> None:
    gc.collect()


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The event loop to serve on: uvloop's where it is installed, else asyncio's.

    [Note: event loop] grpc.aio wakes the event loop for every call; on uvloop a
    4 KiB Infer round trip measured about 10% faster than on asyncio's loop, side by
    side (bench/transport.py). uvloop comes with the cloud extra (Ray Serve's uvicorn);
    an edge install without it gets asyncio's loop. SPLITINFER_EVENT_LOOP=asyncio
    forces asyncio's loop (to rule uvloop out when debugging).
    """
    loop = None
    if os.environ.get("SPLITINFER_EVENT_LOOP", "").lower() != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            loop = uvloop.new_event_loop()
    loop = loop or asyncio.new_event_loop()
    loop.set_exception_handler(ignore_poller_race)
    return loop


def ignore_poller_race(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """An event-loop exception handler that drops grpc.aio's harmless poller race.

    [Note: poller race] Where several event loops in one process use grpc.aio (tests,
    benchmarks, a server and a client on different threads), each loop watches the
    same completion-queue wake-up socket; all are woken, one reads the byte, and the
    others' reads fail with BlockingIOError, which grpcio (1.78) lets reach the loop's
    exception handler. Nothing is lost. Everything else goes to the default handler.
    """
    if isinstance(context.get("exception"), BlockingIOError) and "_handle_events" in repr(context.get("handle")):
        return
    loop.default_exception_handler(context)


class ThreadedServer:
    """A server on its own event loop thread, for tests, benchmarks and sync callers."""

    def __init__(self, backend: Backend, **kwargs: Any) -> None:
        self._loop = new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._running: RunningServer | None = None
        self._thread = threading.Thread(target=self._main, args=(backend, kwargs), name="grpc-server", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def _main(self, backend: Backend, kwargs: dict[str, Any]) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._running = self._loop.run_until_complete(serve(backend, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the starting thread
            self._error = e
            self._started.set()
            return
        self._started.set()
        self._loop.run_forever()

    @property
    def address(self) -> str:
        assert self._running is not None
        return self._running.address

    @property
    def port(self) -> int:
        assert self._running is not None
        return self._running.port

    def set_ready(self, ready: bool) -> None:
        assert self._running is not None
        asyncio.run_coroutine_threadsafe(self._running.health.set_ready(ready), self._loop).result()

    def stop(self, grace_s: float | None = 0.5) -> None:
        if self._running is None or not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._running.stop(grace_s), self._loop).result()
        # gRPC call state that reference cycles still hold (errors' tracebacks hold
        # handler frames) is freed here, while this loop runs: freed later by the
        # cyclic GC, after the loop closed, it crashed the process with a segfault
        # (test_grpc_server.py run before test_gateway*.py in one pytest process).
        asyncio.run_coroutine_threadsafe(_collect(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> ThreadedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_in_thread(backend: Backend, **kwargs: Any) -> ThreadedServer:
    """`serve(backend, **kwargs)` on a background thread; stop it with `.stop()` or `with`."""
    return ThreadedServer(backend, **kwargs)
