"""Suite-wide fixtures."""

from __future__ import annotations

import logging

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


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """Put the root logger's handlers and level back after each test.

    A command's `main` run in-process sets up logging (`logging.basicConfig`, or the
    gateway's `configure_logging`, which replaces the root's handlers), with a handler that
    writes to the sys.stderr of that moment: pytest's capture of that test, closed when it
    ends. Left on the root logger, it turns every later record into a 'Logging error'
    traceback on stderr, and a later test that checks stderr for tracebacks fails on it.
    pytest's own capture handlers come and go with each phase and are left to it.
    """
    def foreign(h: logging.Handler) -> bool:
        return not type(h).__module__.startswith("_pytest")

    root = logging.getLogger()
    handlers, level = [h for h in root.handlers if foreign(h)], root.level
    yield
    for h in root.handlers[:]:
        if foreign(h) and h not in handlers:
            root.removeHandler(h)
    for h in handlers:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(level)
