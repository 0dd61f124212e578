"""A request bound to arrays that stay where they are from run to run, and the pool's
checks of the outputs a caller gives ([Note: bound requests], [Note: outputs written in
place] in workers/_transport/framing.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from workers._pool import RequestTiming
from workers._transport.client import ChannelClient
from workers._transport.framing import WRITTEN, BoundFrame
from workers.errors import InputError

if TYPE_CHECKING:
    from workers.actors import ReplicaPool

__all__ = ["BoundRequest", "check_outputs", "fill_outputs"]


def check_outputs(key: str, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> dict:
    """``outputs`` as a dict, when it is one of writable arrays, none of them an input;
    raises InputError naming the one that is not."""
    if not isinstance(outputs, Mapping):
        raise InputError(f"outputs for {key} must be a dict of output name -> writable numpy array, "
                         f"got {type(outputs).__name__}", model=key)
    for name, a in outputs.items():
        if not isinstance(a, np.ndarray) or not a.flags.writeable:
            what = "a read-only array" if isinstance(a, np.ndarray) else type(a).__name__
            raise InputError(f"outputs[{name!r}] for {key} is {what}; give a writable numpy array "
                             "(pool.shared_array(shape, dtype) for one the worker writes in place)",
                             model=key, input_name=name)
        if any(np.may_share_memory(a, x) for x in (*inputs.values(), *(o for n, o in outputs.items() if n != name))
               if isinstance(x, np.ndarray)):
            raise InputError(f"outputs[{name!r}] for {key} overlaps an input or another output; give each "
                             "output its own array", model=key, input_name=name)
    return dict(outputs)


def fill_outputs(key: str, outputs: dict[str, np.ndarray], got: Any) -> dict[str, np.ndarray]:
    """``outputs`` with the answer ``got`` copied in (nothing to do where the worker
    wrote them: WRITTEN); raises InputError when they do not match."""
    if got is WRITTEN:
        return outputs
    if got.keys() != outputs.keys():
        raise InputError(f"outputs for {key} name {sorted(outputs)}, but the segment's outputs are {sorted(got)}; "
                         "give one array per output", model=key)
    for name, value in got.items():
        out = outputs[name]
        if out.shape != value.shape or out.dtype != value.dtype:
            raise InputError(f"outputs[{name!r}] for {key} is {out.dtype}{list(out.shape)}, but the output is "
                             f"{value.dtype}{list(value.shape)}; give an array of that dtype and shape",
                             model=key, input_name=name, expected=f"{value.dtype}{list(value.shape)}",
                             given=f"{out.dtype}{list(out.shape)}")
        np.copyto(out, value)
    return outputs


class BoundRequest:
    """A request whose inputs and outputs stay where they are from run to run
    (``ReplicaPool.bind``), as ONNX Runtime's IO binding or Triton's registered shared
    memory keep theirs: write ``inputs``, ``await run()``, read ``outputs`` (the same
    arrays every time). Arrays of ``pool.shared_array`` on one replica go as they lie,
    by a frame made once ([Note: bound requests] in workers/_transport/framing.py); otherwise, or
    while that replica is down, a run is an ordinary request (the pool's routing and
    retries) whose answer is copied into ``outputs``. Do not write the inputs or read
    the outputs while a run is in flight; runs of one BoundRequest may not overlap;
    free its arrays (``pool.free_shared_array``) only after its last run.
    """

    def __init__(self, pool: ReplicaPool, key: str, inputs: dict[str, np.ndarray],
                 outputs: dict[str, np.ndarray]) -> None:
        self.key = key
        self.inputs = inputs
        self.outputs = outputs
        self._pool = pool
        self._frame: tuple[ChannelClient, BoundFrame] | None = None
        self._running = False

    def frame_for(self, client: ChannelClient) -> BoundFrame | None:
        """The frame made for ``client``, while nothing of its arena was unpinned since;
        None otherwise (the pool then makes it again after the run)."""
        entry = self._frame
        if entry is None or entry[0] is not client or entry[1][3] != client.unpins:
            return None
        return entry[1]

    def remember(self, client: ChannelClient, frame: BoundFrame | None) -> None:
        if frame is not None:
            self._frame = (client, frame)

    async def run(self, *, deadline_unix_ms: float | None = None, budget_ms: float | None = None,
                  priority: int = 0) -> tuple[dict[str, np.ndarray], RequestTiming | None]:
        """Runs the request; returns ``outputs`` (written) and the worker's timing.
        Raises what :meth:`ReplicaPool.infer` raises."""
        if self._running:
            raise RuntimeError(f"a run of this BoundRequest for {self.key} is in flight: its arrays are in use; "
                               "await it first, or bind another request")
        self._running = True
        try:
            return await self._pool.infer_timed(self.key, self.inputs, deadline_unix_ms=deadline_unix_ms,
                                                budget_ms=budget_ms, priority=priority, outputs=self.outputs,
                                                _bound=self)
        finally:
            self._running = False
