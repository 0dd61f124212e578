"""Proof that engines run their batches at once, for the instance and replica tests."""

from __future__ import annotations

import threading
from collections.abc import Sequence


def meet_at_a_barrier(engines: Sequence) -> list[int]:
    """Makes each engine's ``run_batch`` wait at a barrier of ``len(engines)`` until the
    others have started one too: batches pass only if they run at once, one on each
    engine (one engine's lock would serialise them), and a barrier that times out fails
    them. Returns the list that each run appends its engine's ``id`` to."""
    barrier = threading.Barrier(len(engines), timeout=20)
    used: list[int] = []
    for engine in engines:
        def run_batch(requests, _run=engine.run_batch, _id=id(engine), **kw):
            used.append(_id)
            barrier.wait()
            return _run(requests, **kw)
        engine.run_batch = run_batch
    return used
