"""The server's one-timer deadline watchdog (cluster.server._Deadlines), on a bare event loop."""

from __future__ import annotations

import asyncio
import time

from cluster.server import _Deadlines


async def _call(deadlines: _Deadlines, timeout_s: float, work_s: float) -> str:
    task = asyncio.current_task()
    assert task is not None
    entry = deadlines.add(time.monotonic() + timeout_s, task)
    try:
        await asyncio.sleep(work_s)
        return "done"
    except asyncio.CancelledError:
        return "fired" if entry[3] else "cancelled"
    finally:
        deadlines.done(entry)


def test_only_calls_past_their_deadline_are_cancelled_and_the_heap_empties():
    async def main():
        d = _Deadlines()
        # The second call's deadline is earlier than the armed timer's: it must re-arm it.
        out = await asyncio.gather(_call(d, 5.0, 0.01), _call(d, 0.005, 5.0), _call(d, 5.0, 0.02))
        return out, d

    out, d = asyncio.run(main())
    assert out == ["done", "fired", "done"]
    assert d._heap == []


def test_a_cancellation_the_timer_did_not_make_is_not_reported_as_fired():
    async def main():
        d = _Deadlines()
        t = asyncio.ensure_future(_call(d, 5.0, 5.0))
        await asyncio.sleep(0)
        t.cancel()  # as when the client goes away
        return await t, d

    got, d = asyncio.run(main())
    assert got == "cancelled" and d._heap == []


def test_sequential_calls_reuse_one_timer():
    async def main():
        d = _Deadlines()
        timers = set()
        for _ in range(20):
            assert await _call(d, 5.0, 0) == "done"
            timers.add(id(d._timer))
        return d, timers

    d, timers = asyncio.run(main())
    assert len(timers) == 1 and d._heap == []  # later deadlines never re-arm; ended entries leave at once
