"""The cloud and the link of `bench.traces`, in a process of their own, as a device meets them:
the gateway (in-process pools) on the registry under ROOT, behind the link emulator replaying a
Mahimahi trace pair, with its HTTP control API on loopback.

    python -m bench._trace_cloud ROOT TRACE.up TRACE.down RTT_MS RATE_SCALE

Prints one JSON line once serving, `{"port": the emulator's port, "control": its control port}`,
with the link fast (`_FAST_MBPS` each way) until a `POST /replay`; stops when stdin closes.
`CloudProcess` starts it and drives it. See [Note: the cloud's process] in bench/traces.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

_FAST_MBPS = 1000.0
"""The link between turns and while the agent installs the model: a turn's leftovers drain fast."""
_NICE = 10
"""How much lower than the agent's this process's CPU priority is; see [Note: the cloud's process]
in bench/traces.py."""


class CloudProcess:
    """The child process of this module, and its link's control API (blocking calls of a few ms,
    made between turns)."""

    def __init__(self, root: str, up: Path, down: Path, rtt_ms: float, rate_scale: float = 1.0) -> None:
        repo = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p))
        self.rtt_ms = rtt_ms
        self._proc = subprocess.Popen([sys.executable, "-m", "bench._trace_cloud", root, str(up), str(down),
                                       str(rtt_ms), str(rate_scale)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=repo, text=True)
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            code = self._proc.wait(30)
            raise RuntimeError(f"the cloud's process exited ({code}) before serving; its log is above")
        ready = json.loads(line)
        self.port, self._control = int(ready["port"]), int(ready["control"])

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self._control}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def replay(self) -> None:
        """The trace from its start."""
        self._call("POST", "/replay", {})

    def fast(self) -> None:
        """The fast link, at the traces' RTT."""
        self._call("POST", "/set", {"up_mbps": _FAST_MBPS, "down_mbps": _FAST_MBPS, "rtt_ms": self.rtt_ms})

    def bytes_up(self) -> int:
        """Bytes the emulated uplink has carried."""
        return int(self._call("GET", "/state")["stats"]["bytes_up"])

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)


async def _serve(root: str, up: str, down: str, rtt_ms: float, rate_scale: float) -> None:
    from cluster.gateway import Gateway, LocalPoolFactory
    from cluster.registry import Registry
    from cluster.server import serve
    from splitinfer.netem import LinkEmulator, LinkSetting, load_mahimahi_trace

    registry = Registry(os.path.join(root, "registry"), cache_dir=os.path.join(root, "gw-cache"))
    gateway = Gateway(registry, LocalPoolFactory(cache_dir=os.path.join(root, "ort")))
    await gateway.start()
    server = await serve(gateway)
    emu = LinkEmulator(upstream=("127.0.0.1", server.port), trace_up=load_mahimahi_trace(up).scaled(rate_scale),
                       trace_down=load_mahimahi_trace(down).scaled(rate_scale), rtt_ms=rtt_ms,
                       control=("127.0.0.1", 0))
    await emu.start()
    emu.set(LinkSetting.from_mbps(_FAST_MBPS, _FAST_MBPS, rtt_ms))
    try:
        print(json.dumps({"port": emu.port, "control": emu.control_port}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
    finally:
        await emu.stop()
        await server.stop(None)
        await gateway.close()


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s cloud %(name)s: %(message)s")
    root, up, down, rtt, rate_scale = argv
    os.nice(_NICE)  # the cloud's work never delays the device's: [Note: the cloud's process]
    asyncio.run(_serve(root, up, down, float(rtt), float(rate_scale)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
