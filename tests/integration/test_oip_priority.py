"""Triton's `priority` request parameter on both OIP doors, from the real tritonclient: 0 is the
default, 1 the highest ([Note: OIP priority] in cluster/_oip_models.py); the gateway's pools
run the request at the native priority (larger first), and a value past its levels is refused
with the fix named."""

from __future__ import annotations

import numpy as np
import pytest

from cluster._oip_models import native_priority
from tests.integration._oip_grpc_support import AUTH as GRPC_AUTH
from tests.integration._oip_grpc_support import import_tritonclient_grpc, oip_grpc_door
from tests.integration._oip_support import AUTH as HTTP_AUTH
from tests.integration._oip_support import oip_door

pytestmark = pytest.mark.grpc

triton_grpc = import_tritonclient_grpc()
triton_http = pytest.importorskip("tritonclient.http", reason="the test extra installs tritonclient[http]")
from tritonclient.utils import InferenceServerException  # noqa: E402 - after the skip

X = np.ones((1, 4, 5, 5), np.float32)


def test_tritons_priority_maps_to_the_native_levels():
    assert [native_priority(p) for p in (0, 1, 2, 3)] == [0, 3, 2, 1]
    assert [native_priority(p) for p in (4, -1, True, 1.0, "1")] == [None] * 5


def _recorded(gateway) -> list[int]:
    """The priority each request is run at by the gateway's (real, in-process) pools."""
    seen: list[int] = []
    for pool in gateway._pools.values():
        run = pool.run

        async def recorded(inputs, *, deadline_s, priority, run=run):
            seen.append(priority)
            return await run(inputs, deadline_s=deadline_s, priority=priority)

        pool.run = recorded
    return seen


@pytest.mark.parametrize("door_kind", ["grpc", "http"])
def test_tritonclient_priority_reaches_the_pool_and_a_bad_one_is_refused(tmp_path, door_kind):
    grpc_door = door_kind == "grpc"
    triton = triton_grpc if grpc_door else triton_http
    with (oip_grpc_door if grpc_door else oip_door)(str(tmp_path)) as door:
        seen = _recorded(door.gateway)
        client = triton.InferenceServerClient(door.host)
        x = triton.InferInput("x", list(X.shape), "FP32")
        x.set_data_from_numpy(X)
        auth = GRPC_AUTH if grpc_door else HTTP_AUTH
        try:
            for p in (0, 1, 3):
                client.infer("m", [x], headers=dict(auth), priority=p)
            with pytest.raises(InferenceServerException, match="parameter priority 4 is not one; send 0"):
                client.infer("m", [x], headers=dict(auth), priority=4)
        finally:
            client.close()
    assert seen == [0, 3, 1]
