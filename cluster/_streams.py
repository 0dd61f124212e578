"""A stream's answers: read within a window, answered in order, written by the handler.

Used by the native InferStream (cluster/server.py) and the OIP door's ModelStreamInfer
(cluster/oip_grpc.py).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

__all__ = ["windowed_answers", "write_answer"]


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Marks a finished task's outcome as seen: a stream's leftover tasks end unread on shutdown."""
    if not task.cancelled():
        task.exception()


async def windowed_answers(requests: AsyncIterator[bytes], window: int,
                           answer: Callable[[bytes], Awaitable[bytes]]) -> AsyncIterator[bytes]:
    """`answer(request)` of each message of a stream, in arrival order.

    [Note: stream window] At most `window` messages are read and unanswered at a
    time: the next one is only read when a slot is free, so a fast client is held
    back by HTTP/2 flow control rather than by server memory. Answers leave in
    arrival order even when later ones finish first. Used by InferStream and the
    OIP door's ModelStreamInfer; `answer` should turn its errors into an answer of
    their own, since one that raises ends the stream."""
    pending: collections.deque[asyncio.Task[bytes]] = collections.deque()
    reader: asyncio.Task[bytes] | None = None
    it = requests.__aiter__()
    eof = False
    try:
        while True:
            if reader is None and not eof and len(pending) < window:
                reader = asyncio.ensure_future(it.__anext__())
            waits: set[asyncio.Future[Any]] = set()
            if reader is not None:
                waits.add(reader)
            if pending:
                waits.add(pending[0])
            if not waits:
                return
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if reader is not None and reader in done:
                try:
                    raw = reader.result()
                    pending.append(asyncio.ensure_future(answer(raw)))
                except StopAsyncIteration:
                    eof = True
                reader = None
            while pending and pending[0].done():
                yield pending.popleft().result()
    finally:
        for task in (reader, *pending):
            if task is not None:
                # A reader that ended with StopAsyncIteration as the call was cancelled
                # would otherwise be logged as "Task exception was never retrieved".
                task.add_done_callback(_retrieve)
                task.cancel()


async def write_answer(context: grpc.aio.ServicerContext, answer: bytes) -> None:
    """`context.write(answer)`; a write that fails ends the handler as a cancelled call.

    [Note: failed writes] A call that ends while a write waits on HTTP/2 flow control (a
    client that reads slowly cancels) fails the write in grpc's core before grpc.aio marks
    the call closed, and grpc.aio logs what the handler raises then at ERROR, with a
    traceback. The call has ended and no one is left to answer: as a cancelled call,
    grpc.aio logs it at debug. Handlers write their answers themselves rather than yield
    them to grpc, so that such an end also closes the stream's answers, cancelling the
    requests still in the backend."""
    try:
        await context.write(answer)
    except grpc.aio.InternalError as e:
        raise asyncio.CancelledError("the call ended while an answer was written") from e
