"""The edge agent's one root exception and its subclasses.

Every error keeps its facts as keyword-only fields and builds a message that names
the bad value and the fix, so `splitinfer edge run` can print it as one line.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EdgeError", "ConfigError", "ArtifactError", "StartupError", "RequestError", "NotReadyError"]


class EdgeError(Exception):
    """Root of every error the edge agent raises on purpose."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def fields(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "message"}


class ConfigError(EdgeError):
    """edge.yaml holds a key or value the agent cannot use."""

    def __init__(self, *, key: str, reason: str, fix: str, path: str = "") -> None:
        self.key = key
        self.reason = reason
        self.fix = fix
        self.path = path
        where = f"{path}: " if path else ""
        super().__init__(f"{where}config key {key!r} {reason}; {fix}")


class ArtifactError(EdgeError):
    """The model or its artifacts could not be fetched, read or trusted."""

    def __init__(self, *, path: str, reason: str, fix: str) -> None:
        self.path = path
        self.reason = reason
        self.fix = fix
        super().__init__(f"{path}: {reason}; {fix}")


class StartupError(EdgeError):
    """The agent cannot start: no gateway answer and nothing usable in the cache."""

    def __init__(self, *, reason: str, fix: str) -> None:
        self.reason = reason
        self.fix = fix
        super().__init__(f"the edge agent cannot start: {reason}; {fix}")


class RequestError(EdgeError):
    """An app's request is malformed (names, dtypes, shapes, encoding)."""

    def __init__(self, *, reason: str, fix: str) -> None:
        self.reason = reason
        self.fix = fix
        super().__init__(f"bad request: {reason}; {fix}")


class NotReadyError(EdgeError):
    """The agent is starting or shutting down and takes no new requests."""

    def __init__(self, *, state: str) -> None:
        self.state = state
        super().__init__(f"the edge agent is {state} and takes no new requests; retry once /readyz answers 200")
