"""A worker's end of its direct channels: the listeners, the token check, and each
request answered at once or by the handler ([Note: answered at once]).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import pickle
import secrets
import shutil
import socket
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

from workers._transport.connection import _Connection
from workers._transport.framing import _TOKEN_BYTES, _TOKEN_WAIT_S, ChannelRefusedError
from workers.batcher import NOT_NOW
from workers.errors import WorkerError

__all__ = ["ChannelServer", "open_channel_server"]

logger = logging.getLogger(__name__)

Handler = Callable[..., Awaitable[Any]]
"""Called with a request's arguments; its result or error goes back to the caller."""
NowHandler = Callable[..., Any]
"""Called first, synchronously, for a request with nothing behind it in the socket: its
result goes back at once, or it returns ``NOT_NOW`` (workers.batcher) for ``Handler``.
Called with the request's arguments and ``place``: None, or ``Arena.place`` of the
connection's arena, where the handler may write the answer's large arrays so that they
go back without a copy ([Note: outputs placed] in workers/engine.py)."""

class ChannelServer:
    """A worker's end: answers each request on its connections with ``handler``."""

    def __init__(self, handler: Handler, directory: str, now: NowHandler | None = None, *,
                 tcp_pickle: bool = False) -> None:
        self._handler = handler
        self.tcp_pickle = tcp_pickle
        """Whether TCP connections accepted from now on carry pickle frames ([Note: no
        pickle over TCP] in workers/_transport/framing.py); Unix-domain ones always do."""
        self._now = now
        self._directory = directory
        self.path = os.path.join(directory, "channel.sock")
        self.tcp_address: tuple[str, int] | None = None
        """Where the TCP listener is, when one was asked for."""
        self.token = secrets.token_bytes(_TOKEN_BYTES)
        """What every connection must send first; hand it out only over an authenticated path."""
        self._listeners: list[socket.socket] = []
        self._tasks: set[asyncio.Task] = set()
        self._connections: set[_Connection] = set()

    @property
    def arena_lent_bytes(self) -> int:
        """Bytes of this worker's arenas that callers have not handed back yet."""
        return sum(c.arena.lent_bytes for c in self._connections if c.arena is not None)

    def _spawn(self, coro: Awaitable) -> None:
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start(self, tcp_host: str | None) -> None:
        listeners = [(socket.AF_UNIX, self.path)]
        if tcp_host is not None:
            listeners.append((socket.AF_INET6 if ":" in tcp_host else socket.AF_INET, (tcp_host, 0)))
        for family, address in listeners:
            listener = socket.socket(family, socket.SOCK_STREAM)
            self._listeners.append(listener)
            listener.bind(address)
            listener.listen(64)
            listener.setblocking(False)
            if family != socket.AF_UNIX:
                self.tcp_address = listener.getsockname()[:2]
            self._spawn(self._accept(listener))

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(listener)
            pickle_ok = sock.family == socket.AF_UNIX or self.tcp_pickle
            self._spawn(self._serve(_Connection(sock, views_until_freed=False, pickle_ok=pickle_ok)))

    async def _serve(self, conn: _Connection) -> None:
        self._connections.add(conn)
        try:
            token = bytearray(_TOKEN_BYTES)
            await asyncio.wait_for(conn._recv_into(memoryview(token)), _TOKEN_WAIT_S)
            if not hmac.compare_digest(bytes(token), self.token):
                logger.warning("direct channel %s: a connection sent a wrong token; closed", self.path)
                return
            if conn.sock.family == socket.AF_UNIX:
                await asyncio.wait_for(conn.share_arenas(offer=False), _TOKEN_WAIT_S)
            lost: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()
            conn.read_frames(lambda request, held: self._handle(conn, request, held),
                             lambda e: lost.done() or lost.set_result(e))
            why = await lost
            if isinstance(why, ChannelRefusedError):
                logger.warning("direct channel %s: %s; closing that connection", self.path, why)
                conn.send_refusal(-1, str(why))
            elif not isinstance(why, ConnectionError):
                logger.error("direct channel %s: a frame did not decode (%r); closing that connection", self.path, why)
        except (ConnectionError, TimeoutError):
            pass  # the pool closed it, or died, or never sent its token
        except Exception as e:  # noqa: BLE001 - a garbled handshake ends its connection, never the worker
            logger.error("direct channel %s: a connection's handshake failed (%r); closing it", self.path, e)
        finally:
            self._connections.discard(conn)
            conn.close()

    def _handle(self, conn: _Connection, request: Any, held: list[int]) -> None:
        """One request, in the connection's reader ([Note: frames in the reader])."""
        request_id, args = request
        if self._now is not None and not conn.more_waiting:
            # [Note: answered at once]
            # A request with nothing behind it may be answered right here, with no task
            # and no event-loop iteration (its batcher runs it inline anyway: [Note: run
            # now] in workers/batcher.py). With more frames waiting it goes the usual
            # way, so that they can batch with it.
            arena = conn.arena
            try:
                ok, value = True, self._now(*args, place=arena.place if arena is not None else None)
            except Exception as e:  # noqa: BLE001 - as in _answer
                ok, value = False, e
            if value is not NOT_NOW:  # NOT_NOW: nothing ran, nothing was reserved
                self._reply(conn, request_id, args, ok, value, held)
                if arena is not None:
                    arena.unreserve()  # what the answer did not carry (an error, say)
                return
        self._spawn(self._answer(conn, request_id, args, held))

    async def _answer(self, conn: _Connection, request_id: Any, args: tuple, held: list[int]) -> None:
        try:
            ok, value = True, await self._handler(*args)
        except Exception as e:  # noqa: BLE001 - every error goes back to its caller as a value
            ok, value = False, e
        self._reply(conn, request_id, args, ok, value, held)

    @staticmethod
    def _reply(conn: _Connection, request_id: Any, args: tuple, ok: bool, value: Any, held: list[int]) -> None:
        """Sends the handler's result (``ok``) or error to the caller of ``request_id``."""
        if not ok:
            value.__traceback__ = value.__context__ = value.__cause__ = None
        # The request's arrays are done with once it is answered (see [Note: channel arena]).
        conn.hand_back(held)
        try:
            try:
                conn.send((request_id, ok, value))
            except ChannelRefusedError as e:  # the pool sends it again by a plain call
                conn.send_refusal(request_id, str(e))
            except (pickle.PicklingError, TypeError, AttributeError) as e:
                key = str(args[0]) if args else None
                conn.send((request_id, False, WorkerError(
                    f"the answer to request {request_id} for {key} could not be sent ({e!r}); "
                    "report this: worker results must be picklable", model=key, detail=repr(e))))
        except OSError:
            pass  # the pool went away; it has counted this request already

    def close(self) -> None:
        for listener in self._listeners:
            listener.close()
        for task in self._tasks:
            task.cancel()
        shutil.rmtree(self._directory, ignore_errors=True)


async def open_channel_server(
    handler: Handler, *, now: NowHandler | None = None, tcp_host: str | None = None, tcp_pickle: bool = False,
) -> ChannelServer:
    """Listens on a new socket in a private directory (``server.path``) and, given
    ``tcp_host``, on a TCP port of that address too (``server.tcp_address``). ``now``, if
    given, is tried first for requests with nothing behind them (see [Note: answered at once]).
    TCP connections carry pickle frames only with ``tcp_pickle`` ([Note: no pickle over TCP])."""
    directory = tempfile.mkdtemp(prefix="splitinfer-ch-")  # mode 0700: see [Note: direct channel]
    server = ChannelServer(handler, directory, now, tcp_pickle=tcp_pickle)
    try:
        await server._start(tcp_host)
    except BaseException:
        server.close()
        raise
    return server
