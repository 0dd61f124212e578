"""gRPC (HTTP/2) through the link emulator: bytes pass unchanged; outages look like outages."""

import asyncio
import time

import grpc
import pytest

from splitinfer.netem import LinkEmulator, LinkSetting, OutageMode

pytestmark = pytest.mark.grpc

LOOPBACK = "127.0.0.1"
METHOD = "/netemtest.Echo/Echo"
# Reconnect quickly after an outage so the test does not wait out gRPC's default backoff.
CHANNEL_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 200),
                   ("grpc.min_reconnect_backoff_ms", 100), ("grpc.max_receive_message_length", 16 << 20)]


async def _echo(request: bytes, context) -> bytes:
    return request


async def _start_echo_server():
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 16 << 20)])
    handler = grpc.method_handlers_generic_handler(
        "netemtest.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(_echo)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port(f"{LOOPBACK}:0")
    await server.start()
    return server, port


def _call(channel):
    return channel.unary_unary(METHOD)


def test_grpc_unary_echo_passes_unchanged_and_pays_the_link():
    payload = bytes(range(256)) * 1000  # 256 kB

    async def scenario():
        server, port = await _start_echo_server()
        setting = LinkSetting.from_mbps(20, 20, 20)
        async with LinkEmulator(upstream=(LOOPBACK, port), setting=setting) as emu:
            async with grpc.aio.insecure_channel(f"{LOOPBACK}:{emu.port}", options=CHANNEL_OPTIONS) as channel:
                echo = _call(channel)
                assert await echo(b"warm-up", timeout=10) == b"warm-up"
                start_s = time.monotonic()
                reply = await echo(payload, timeout=10)
                elapsed_s = time.monotonic() - start_s
            stats = emu.stats()
        await server.stop(None)
        return reply, elapsed_s, stats

    reply, elapsed_s, stats = asyncio.run(scenario())
    assert reply == payload
    # Up and back at 20 Mbit/s plus one RTT. HTTP/2 framing adds a little, and until
    # gRPC's flow-control window has grown each 64 kB window costs a round trip, as it
    # would on a real link; so the upper bound only catches a stall (typical: 1.01-1.05).
    floor_s = 2 * len(payload) * 8 / 20e6 + 0.020
    assert 0.95 < elapsed_s / floor_s < 3.0
    assert stats.bytes_up > len(payload) and stats.bytes_down > len(payload)


def _outage(outage_mode: OutageMode, during_timeout_s: float, *, wait_for_ready: bool):
    """One echo through the link, one during an outage (its error code), one after it comes
    back: (the code during, the answer after, the emulator's stats)."""
    async def scenario():
        server, port = await _start_echo_server()
        async with LinkEmulator(upstream=(LOOPBACK, port), setting=LinkSetting.from_mbps(50, 50, 2),
                                outage_mode=outage_mode) as emu:
            async with grpc.aio.insecure_channel(f"{LOOPBACK}:{emu.port}", options=CHANNEL_OPTIONS) as channel:
                echo = _call(channel)
                assert await echo(b"one", timeout=5) == b"one"
                emu.set(up=False)
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await echo(b"two", timeout=during_timeout_s)
                during = info.value.code()
                emu.set(up=True)
                after = await echo(b"three", timeout=5, wait_for_ready=wait_for_ready)
            stats = emu.stats()
        await server.stop(None)
        return during, after, stats

    return asyncio.run(scenario())


def test_grpc_sees_unavailable_during_a_reset_outage_and_recovers():
    during, after, stats = _outage(OutageMode.RESET, 2, wait_for_ready=True)
    assert during == grpc.StatusCode.UNAVAILABLE
    assert after == b"three"
    assert stats.connections_reset >= 1


def test_grpc_deadline_expires_in_a_blackhole_and_the_channel_recovers():
    during, after, stats = _outage(OutageMode.BLACKHOLE, 0.3, wait_for_ready=False)
    assert during == grpc.StatusCode.DEADLINE_EXCEEDED
    assert after == b"three"
    assert stats.connections_reset == 0 and stats.outages == 1
