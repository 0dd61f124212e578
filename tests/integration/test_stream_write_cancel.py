"""A native InferStream call that a client cancels while the server writes it an answer takes its
requests waiting in a pool with it, quietly.

The client reads nothing and its receive window is HTTP/2's 64 KiB, so the write of a 1 MiB answer
waits on flow control when the cancellation comes ([Note: failed writes] in cluster/_streams.py).
The gateway, its pool and the rounds are those of the OIP door's test of the same case."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from cluster.protocol.client import make_request
from cluster.protocol.messages import StreamFrame
from cluster.server import SERVICE_NAME
from tests.integration.test_oip_grpc_stream_cancel import SHAPE, check_cancel_during_write, stream_call

pytestmark = pytest.mark.grpc

_STREAM = f"/{SERVICE_NAME}/InferStream"


def _frame(seq: int, sign: float) -> bytes:
    request = make_request("m", "1", "L", {"x": np.full(SHAPE, sign, np.float32)}, timeout_s=60)
    return StreamFrame(seq=seq, request=request).to_msgpack()


def _cancelled_stream(address: str, signs: list[float], cancel: threading.Event) -> grpc.StatusCode:
    """An InferStream call of one frame per sign that reads no answer and is cancelled at `cancel`:
    the status the call ended with."""
    return stream_call(address, _STREAM, [_frame(seq, sign) for seq, sign in enumerate(signs)], cancel, read=False)


def test_a_client_that_cancels_during_a_write_cancels_the_requests_in_the_pool(tmp_path, capfd, caplog):
    check_cancel_during_write(tmp_path, capfd, caplog, lambda gateway: (), _cancelled_stream)
