"""A replica pool's end of one worker's direct channel: the connection (:class:`ChannelClient`)
and its life beside the replica (:class:`DirectLink`)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from typing import Any

import numpy as np

from workers._transport.connection import _Connection
from workers._transport.framing import ChannelClosedError, ChannelRefusedError

__all__ = ["ChannelClient", "DirectLink"]

logger = logging.getLogger(__name__)


class ChannelClient:
    """A pool's end of one worker's channel; use from the event loop that connected it."""

    def __init__(self, path: str, conn: _Connection) -> None:
        self.path = path
        self.loop = asyncio.get_running_loop()
        self._conn = conn
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self.closed = False
        self.late_answers = 0
        """Answers that arrived after their caller stopped waiting (cancelled)."""
        conn.read_frames(self._deliver, self._lost)

    @classmethod
    async def connect(
        cls, address: str | tuple[str, int], token: bytes, *, shared_memory: bool = True, tcp_pickle: bool = False
    ) -> ChannelClient:
        """Connects to a socket path, or a ``(host, port)`` over TCP, and sends the token;
        over a socket path, offers to share arenas unless ``shared_memory`` is False.
        Over TCP, pickle frames go and come only with ``tcp_pickle`` ([Note: no pickle
        over TCP] in workers/_transport/framing.py); a call that needs one raises
        ChannelRefusedError."""
        if isinstance(address, str):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            address = (address[0], int(address[1]))
            sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_STREAM)
        loop = asyncio.get_running_loop()
        conn = None
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
            await loop.sock_sendall(sock, token)
            conn = _Connection(sock, views_until_freed=True, pickle_ok=sock.family == socket.AF_UNIX or tcp_pickle)
            if sock.family == socket.AF_UNIX:
                try:
                    await conn.share_arenas(offer=True, share=shared_memory)
                except ConnectionError as e:
                    raise ChannelClosedError(
                        f"the worker closed the direct channel {address} at its handshake ({e!r}): a wrong "
                        "token, or the worker is going away; the pool sends by plain calls meanwhile",
                        path=address, detail=repr(e)) from e
        except BaseException:
            if conn is not None:
                conn.close()
            sock.close()
            raise
        return cls(address if isinstance(address, str) else f"{address[0]}:{address[1]}", conn)

    @property
    def arena_lent_bytes(self) -> int:
        """Bytes of this end's arena that the worker holds (requests it has not answered)."""
        return self._conn.arena.lent_bytes if self._conn.arena is not None else 0

    def pin_array(self, shape: tuple, dtype: Any) -> np.ndarray | None:
        """An array of ``shape`` and ``dtype`` in this end's arena that the caller keeps
        for its inputs ([Note: inputs kept in the arena] in workers/_transport/arena.py);
        None over TCP, with shared memory off, or when the arena has no room."""
        arena = self._conn.arena
        return None if arena is None or self.closed else arena.pin_array(shape, dtype)

    def unpin(self, region: np.ndarray) -> None:
        """Frees a region that :meth:`pin_array` gave; no request that reads it may be in
        flight."""
        if self._conn.arena is not None:
            self._conn.arena.unpin(region)

    @property
    def arena_fallbacks(self) -> int:
        """Large buffers sent in the frame because the arena was full."""
        return self._conn.arena.fallbacks if self._conn.arena is not None else 0

    def _deliver(self, answer: tuple, held: list[int]) -> None:
        # The connection's on_frame, with no lambda in between.
        request_id, ok, value = answer
        fut = self._pending.pop(request_id, None)
        if fut is None or fut.done():
            self.late_answers += 1
        elif ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def _lost(self, exc: BaseException | None) -> None:
        if self.closed:
            return
        self.closed = True
        self._conn.close()
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if fut.done():
                continue
            if isinstance(exc, ChannelRefusedError):  # the worker refused the connection's frames
                fut.set_exception(ChannelRefusedError(
                    f"the worker refused the direct channel {self.path}: {exc}", detail=repr(exc)))
            else:
                fut.set_exception(ChannelClosedError(
                    f"the direct channel {self.path} closed with the request in flight (the worker died or "
                    "restarted); retry-able: the pool sends it again by a plain call",
                    path=self.path, detail=repr(exc) if exc else None))

    async def call(self, *args: Any) -> Any:
        """The worker's ``handler(*args)``; raises the worker's error, ChannelClosedError
        when the connection is lost meanwhile, or ChannelRefusedError when the request or
        its answer needs pickle over TCP ([Note: no pickle over TCP] in
        workers/_transport/framing.py)."""
        if self.closed:
            raise ChannelClosedError(f"the direct channel {self.path} is closed; reconnect or send by a plain call",
                                     path=self.path)
        request_id = next(self._ids)
        fut = self.loop.create_future()
        self._pending[request_id] = fut
        try:
            try:
                self._conn.send((request_id, args))
            except OSError as e:
                del self._pending[request_id]  # failed below, by the raise, not by _lost
                self._lost(e)
                raise ChannelClosedError(f"sending on the direct channel {self.path} failed ({e!r}); "
                                         "retry-able: the pool sends it again by a plain call",
                                         path=self.path, detail=repr(e)) from e
            return await fut
        finally:
            self._pending.pop(request_id, None)

    def close(self) -> None:
        """Stops reading; callers still waiting get ChannelClosedError."""
        self._lost(None)


class DirectLink:
    """A pool's direct channel to one replica (see [Note: direct channel] in
    workers/_transport/framing.py), connected in the background on first use and again after
    the replica restarts: its Unix socket when the replica is on the caller's node
    (unless ``over_tcp``), its TCP port otherwise."""

    def __init__(self, actor, caller_node_id: str, *, over_tcp: bool, shared_memory: bool,
                 tcp_pickle: bool = False) -> None:
        self._actor = actor
        self._tcp_pickle = tcp_pickle
        self._caller_node_id = caller_node_id
        self._over_tcp = over_tcp
        self._shared_memory = shared_memory
        self._client: ChannelClient | None = None
        self._connecting: asyncio.Task | None = None
        self._failures = 0
        self.not_before_s = 0.0

    def client(self) -> ChannelClient | None:
        """The connected channel on the running loop, or ``None`` (then connects, if due)."""
        loop = asyncio.get_running_loop()
        client = self._client
        if client is not None and not client.closed and client.loop is loop:
            return client
        if client is not None:
            self.close()
        if self._connecting is None and time.monotonic() >= self.not_before_s:
            self._connecting = loop.create_task(self._connect())
        return None

    async def _connect(self) -> None:
        try:
            info = await self._actor.open_channel.remote(self._tcp_pickle)
            local = info["node_id"] == self._caller_node_id and not self._over_tcp
            self._client = await ChannelClient.connect(info["path"] if local else tuple(info["tcp"]), info["token"],
                                                       shared_memory=self._shared_memory, tcp_pickle=self._tcp_pickle)
            self._failures = 0
            logger.info("direct channel to replica pid %s open (%s)", info["pid"], "unix" if local else "tcp")
        except Exception as e:  # noqa: BLE001 - plain calls serve the replica meanwhile
            self._failures += 1
            backoff_s = min(30.0, 0.5 * 2.0 ** self._failures)
            self.not_before_s = time.monotonic() + backoff_s
            logger.warning("direct channel to a replica not opened (%r); plain calls serve it, next try in %.1f s",
                           e, backoff_s)
        finally:
            self._connecting = None

    def lost(self, down_s: float) -> None:
        """The channel broke (the replica died or restarted): reconnect after ``down_s``."""
        self.close()
        self.not_before_s = time.monotonic() + down_s

    def close(self) -> None:
        """Drops the connection (the client closes on its own loop)."""
        client, self._client = self._client, None
        if client is None or client.closed or client.loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if client.loop is running:
            client.close()
        else:
            client.loop.call_soon_threadsafe(client.close)
