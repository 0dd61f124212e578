"""The partitioner's one root exception."""

from __future__ import annotations

__all__ = ["PartitionError"]


class PartitionError(Exception):
    """Anything wrong with a model, a cut or a segment.

    The message says what is wrong, where (file, node, layer or tensor) and how to
    fix it. The keyword-only fields carry the same facts for programs.
    """

    def __init__(
        self,
        message: str,
        *,
        model: str | None = None,
        layer: int | None = None,
        tensor: str | None = None,
        node: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.model = model
        self.layer = layer
        self.tensor = tensor
        self.node = node
