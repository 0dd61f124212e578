"""The demo's running parts: local Ray, the gateway, the link emulator and the edge agent process.

`Stack.start` brings them up in dependency order on one asyncio loop (Ray's own
processes aside) and `Stack.stop` takes down whatever started, in reverse, however far
start-up got; the demo calls it in a `finally`, so Ctrl-C leaves nothing behind.

    app --HTTP (unix socket)--> edge agent process (emulated device) --gRPC--> 127.0.0.1:netem
        ==emulated link==> 127.0.0.1:gateway --> tails (Ray actors, or in-process with --no-ray)
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from splitinfer.demo.edge import EdgeProcess
from splitinfer.netem import LinkEmulator, LinkSetting, TraceStep

__all__ = ["Stack", "start_ray", "stop_ray"]

logger = logging.getLogger(__name__)

_INSTALL_LINK = LinkSetting(up_bps=1e9, down_bps=1e9, rtt_ms=1.0)


def start_ray(*, quiet: bool = True) -> float:
    """Starts a local Ray on loopback; returns the seconds it took. ``quiet`` keeps Ray's
    workers' log lines off the demo's console (`cluster.ray_cluster.connect`)."""
    # Outside a cluster Ray would advertise the host's routable address; the demo stays
    # on 127.0.0.1. Ray reads this switch when it is imported, so it is set first.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    t0 = time.monotonic()
    from cluster.ray_cluster import connect

    connect("local", num_cpus=max(1, os.cpu_count() or 1), quiet=quiet)
    return time.monotonic() - t0


def stop_ray() -> None:
    from cluster.ray_cluster import shutdown

    shutdown()


class Stack:
    """Gateway, link emulator and edge agent of one demo run."""

    def __init__(self, *, registry_dir: str, work_dir: str, model: str, device_profile_path: str,
                 trace: Sequence[TraceStep], use_ray: bool, remote_timeout_ms: float, slowdown: float) -> None:
        self.registry_dir = registry_dir
        self.work_dir = work_dir
        self.model = model
        self.device_profile_path = device_profile_path
        self.trace = list(trace)
        self.use_ray = use_ray
        self.remote_timeout_ms = remote_timeout_ms
        self.slowdown = slowdown
        self.edge: EdgeProcess | None = None
        self.gateway: Any = None
        self.server: Any = None
        self.emu: LinkEmulator | None = None
        self.timings_s: dict[str, float] = {}

    async def start(self, say: Callable[[str], None] = print) -> None:
        from cluster.gateway import Gateway, LocalPoolFactory
        from cluster.registry import Registry
        from cluster.server import serve

        t0 = time.monotonic()
        gw_cache = os.path.join(self.work_dir, "gateway-cache")
        registry = Registry(self.registry_dir, cache_dir=gw_cache)
        if self.use_ray:
            from cluster.ray_cluster import RayPoolFactory

            pools: Any = RayPoolFactory(provider="cpu")
        else:
            pools = LocalPoolFactory(cache_dir=gw_cache, provider="cpu")
        self.gateway = Gateway(registry, pools)
        await self.gateway.start()
        self.server = await serve(self.gateway, host="127.0.0.1", port=0)
        ready, detail = self.gateway.readiness()
        self.timings_s["gateway"] = time.monotonic() - t0
        say(f"      gateway on {self.server.address} ({'Ray actors' if self.use_ray else 'in-process pool'}; "
            f"{detail['pools']} frontier tails preloaded in {self.timings_s['gateway']:.1f} s, ready={ready})")

        self.emu = LinkEmulator(upstream=("127.0.0.1", self.server.port), trace=self.trace)
        await self.emu.start()
        # The device installs the model (GetArtifacts: ~100 MB for ResNet50) over a fast
        # link, as it would on its home Wi-Fi, so start-up does not take the trace's time;
        # the trace's first step holds from then until the stream starts the replay.
        self.emu.set(_INSTALL_LINK)
        say(f"      link emulator on 127.0.0.1:{self.emu.port} -> gateway (1 Gbit/s while the agent installs "
            f"the model, then {self.trace[0].setting.up_bps / 1e6:.2f} Mbit/s until the stream starts)")

        self.edge = EdgeProcess(work_dir=self.work_dir, gateway=f"127.0.0.1:{self.emu.port}", model=self.model,
                                device_profile_path=self.device_profile_path,
                                remote_timeout_ms=self.remote_timeout_ms, slowdown=self.slowdown)
        self.timings_s["agent"] = await asyncio.to_thread(self.edge.start)
        self.emu.set(self.trace[0].setting)
        st = await self.status()
        pid = self.edge.proc.pid if self.edge.proc else "?"
        warmed = st.get("gateway_warmed") or []
        loaded = f" (the gateway loaded {len(warmed)} cut(s) it had not preloaded: {', '.join(warmed)})"
        loaded = loaded if warmed else ""
        say(f"      edge agent: pid {pid}, API on unix:{self.edge.socket_path}, "
            f"1 ORT thread, its work stretched {self.slowdown:.2f}x; {len(st.get('warm_cuts', []))} warm cuts, ready in "
            f"{self.timings_s['agent']:.1f} s{loaded}")

    async def status(self) -> dict[str, Any]:
        """The agent's GET /v1/status."""
        assert self.edge is not None
        return await asyncio.to_thread(self.edge.status)

    def start_trace(self) -> None:
        assert self.emu is not None
        self.emu.replay(self.trace, loop=False)

    def link_now(self) -> dict[str, Any]:
        assert self.emu is not None
        s = self.emu.setting
        return {"up_bps": s.up_bps, "down_bps": s.down_bps, "rtt_ms": s.rtt_ms, "outage": s.is_outage}

    async def stop(self) -> None:
        """Reverse order; each part is stopped even when an earlier one fails to."""
        steps: list[tuple[str, Callable[[], Any]]] = []
        if self.edge is not None:
            edge = self.edge
            steps.append(("edge agent", lambda: asyncio.to_thread(edge.stop)))
        if self.emu is not None:
            steps.append(("link emulator", self.emu.stop))
        if self.server is not None:
            steps.append(("gRPC server", lambda: self.server.stop(1.0)))
        if self.gateway is not None:
            steps.append(("gateway", self.gateway.close))
        for name, fn in steps:
            try:
                await asyncio.wait_for(fn(), 30.0)
            except BaseException as e:  # noqa: BLE001 - keep stopping the rest, then report
                logger.warning("stopping the %s failed: %s", name, e)
        self.edge = self.emu = self.server = self.gateway = None
