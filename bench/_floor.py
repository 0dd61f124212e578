"""The floor of serving one request from another process: bench/workers.py's c1 limit.

    python -m bench._floor SOCKET MODEL LAYOUT_JSON   (started by FloorServer, not by hand)

[Note: serving floor]
The c1 target is a time added to raw ORT's run. A server in another process cannot
add less than this: the caller copies its input into memory it shares with the
server, wakes the server with one byte over a Unix-domain socket, the server runs the
same artefact in an ORT session whose input and outputs are bound to that shared
memory (no copy on its side), and answers with its run time in eight bytes; the caller
reads the outputs in place. No framing, no pickling, no batcher, no Ray. Two forms:

* ``blocking``: blocking ``recv`` on both ends, the least a process can do to wake up;
* ``asyncio``: an event loop's reader callback on both ends, the way our worker and
  its callers wait (a caller that also serves gRPC cannot block in ``recv``): the
  server's loop is the one our gateway serves on (``cluster.server.new_event_loop``,
  uvloop where installed), as our worker's, a Ray actor's, is uvloop; the caller's is
  whichever runs :meth:`FloorServer.call`.

Its "overhead" (latency minus the server's run) is measured beside ours, in the same
rounds, so the two are comparable on a machine whose speed drifts.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import numpy as np

_RUN = struct.Struct("<d")
_START_TIMEOUT_S = 120.0


class FloorServer:
    """One server process (``mode`` blocking or asyncio) on ``model_path``, fed ``x``.

    ``outputs`` are (name, dtype, shape) of the model's outputs for ``x`` (a raw run
    tells them); the server binds them in the shared memory, where the caller reads them.
    """

    def __init__(self, model_path: str, x_name: str, x: np.ndarray, outputs: list[tuple[str, np.dtype, tuple]],
                 *, mode: str, threads: int, allow_spinning: bool) -> None:
        if mode not in ("blocking", "asyncio"):
            raise ValueError(f"mode={mode!r}: use 'blocking' or 'asyncio'")
        self.mode = mode
        self._x = x
        layout = {"mode": mode, "threads": threads, "spinning": allow_spinning,
                  "input": [x_name, x.dtype.str, list(x.shape), 0], "outputs": []}
        offset = _aligned(x.nbytes)
        for name, dtype, shape in outputs:
            layout["outputs"].append([name, np.dtype(dtype).str, list(shape), offset])
            offset += _aligned(int(np.prod(shape)) * np.dtype(dtype).itemsize)
        self._fd = os.memfd_create("splitinfer-floor")
        os.ftruncate(self._fd, offset)
        self._map = mmap.mmap(self._fd, offset)
        self._in = np.ndarray(x.shape, x.dtype, buffer=self._map)
        self._outs = [np.ndarray(shape, dtype, buffer=self._map, offset=off)
                      for _, dtype, shape, off in layout["outputs"]]
        self._dir = tempfile.mkdtemp(prefix="splitinfer-floor-")
        path = os.path.join(self._dir, "floor.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        listener.settimeout(_START_TIMEOUT_S)
        self._proc = subprocess.Popen([sys.executable, "-m", "bench._floor", path, model_path, json.dumps(layout)],
                                      cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        try:
            self._sock, _ = listener.accept()
        finally:
            listener.close()
        socket.send_fds(self._sock, [b"F"], [self._fd])
        self._sock.settimeout(_START_TIMEOUT_S)
        if self._sock.recv(1) != b"k":
            raise RuntimeError(f"the {mode} floor server did not start; see its error above")
        self._sock.settimeout(None)
        self._reply = bytearray(_RUN.size)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiter: asyncio.Future | None = None

    def call_blocking(self) -> tuple[list[np.ndarray], SimpleNamespace]:
        """One request, waiting in a blocking ``recv``; returns the outputs (in place)
        and the server's run time as ``compute_s``."""
        self._in[...] = self._x
        self._sock.send(b"r")
        view = memoryview(self._reply)
        while view:
            n = self._sock.recv_into(view)
            if not n:
                raise ConnectionResetError("the floor server went away")
            view = view[n:]
        return self._outs, SimpleNamespace(compute_s=_RUN.unpack(self._reply)[0])

    async def call_blocking_async(self) -> tuple[list[np.ndarray], SimpleNamespace]:
        """:meth:`call_blocking` for a closed-loop client of one (it holds the loop)."""
        return self.call_blocking()

    async def call(self) -> tuple[list[np.ndarray], SimpleNamespace]:
        """One request, the caller waiting in the event loop (reader callback)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._sock.setblocking(False)
            self._loop.add_reader(self._sock.fileno(), self._readable)
        self._in[...] = self._x
        self._waiter = self._loop.create_future()
        self._sock.send(b"r")
        return self._outs, SimpleNamespace(compute_s=await self._waiter)

    def _readable(self) -> None:
        try:
            n = self._sock.recv_into(self._reply)
        except (BlockingIOError, InterruptedError):
            return
        if n != _RUN.size:  # eight bytes arrive together on a Unix socket; anything else ends it
            self._waiter.set_exception(ConnectionResetError(f"the floor server sent {n} bytes, not {_RUN.size}"))
            return
        self._waiter.set_result(_RUN.unpack(self._reply)[0])

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        del self._in, self._outs
        self._map.close()
        os.close(self._fd)
        shutil.rmtree(self._dir, ignore_errors=True)


def _aligned(n: int) -> int:
    return (n + 4095) // 4096 * 4096


def _serve(path: str, model_path: str, layout: dict) -> None:
    from bench.workers import _raw_session

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    _, fds, _, _ = socket.recv_fds(sock, 1, 1)
    size = os.fstat(fds[0]).st_size
    shared = mmap.mmap(fds[0], size)
    session = _raw_session(model_path, layout["threads"], allow_spinning=layout["spinning"])
    binding = session.io_binding()
    arrays = []
    for (name, dtype, shape, offset), bind in [(layout["input"], binding.bind_input),
                                               *((o, binding.bind_output) for o in layout["outputs"])]:
        a = np.ndarray(shape, np.dtype(dtype), buffer=shared, offset=offset)
        arrays.append(a)
        bind(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
    for _ in range(3):
        session.run_with_iobinding(binding)
    sock.send(b"k")

    def one() -> None:
        t = time.perf_counter()
        session.run_with_iobinding(binding)
        sock.send(_RUN.pack(time.perf_counter() - t))

    ask = bytearray(1)
    if layout["mode"] == "blocking":
        while sock.recv_into(ask):
            one()
        return
    sock.setblocking(False)
    from cluster.server import new_event_loop

    loop = new_event_loop()
    done = loop.create_future()

    def readable() -> None:
        try:
            n = sock.recv_into(ask)
        except (BlockingIOError, InterruptedError):
            return
        if not n:
            loop.remove_reader(sock.fileno())
            done.set_result(None)
            return
        one()

    loop.add_reader(sock.fileno(), readable)
    loop.run_until_complete(done)


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
