"""`splitinfer registry ...`: write models into the registry layout the gateway serves."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["registry_main"]


def registry_main(argv: Sequence[str]) -> int:
    raise NotImplementedError("splitinfer registry")
