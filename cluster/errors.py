"""Errors of the cloud tier: the wire errors, under the name the cloud tier's code uses.

Every error the gateway, the registry and the server raise on purpose reaches a
client as a gRPC status, so each one is a class of `cluster.protocol.errors`,
defined once there with its status in `cluster.protocol.status`. This module
re-exports them so `cluster/` imports its errors from `cluster.errors`.
"""

from __future__ import annotations

from cluster.protocol import errors as _wire
from cluster.protocol.errors import *  # noqa: F403 -- re-exporting the wire errors is this module's purpose

__all__ = list(_wire.__all__)
