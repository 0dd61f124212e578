"""Suite-wide fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _grpc_aio_stays_initialised():
    """Hold one reference on grpc.aio's process-wide state for the whole session.

    grpc.aio shuts its poller thread down when the last aio channel or server is
    destroyed, and joins it from whichever thread drops that reference: inside the
    garbage collector, at an arbitrary point of a later test. That join was seen to hang
    the suite. A long-lived process (the gateway, the agent) holds its channel or server
    for its whole life and never hits this; the suite creates and drops hundreds, so it
    keeps the state alive instead.
    """
    try:
        from grpc._cython import cygrpc
    except ImportError:  # grpc absent: nothing to hold
        yield
        return
    cygrpc.init_grpc_aio()
    yield
