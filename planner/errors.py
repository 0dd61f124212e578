"""The planner's one root exception and its subclasses."""

from __future__ import annotations

__all__ = ["PlannerError", "ProfileError", "InfeasibleError"]


class PlannerError(Exception):
    """Anything the planner cannot do with the inputs it was given.

    The message names the bad value and the fix; the keyword-only fields carry the
    same facts for programs.
    """

    def __init__(
        self,
        message: str,
        *,
        model: str | None = None,
        field: str | None = None,
        layer: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.model = model
        self.field = field
        self.layer = layer


class ProfileError(PlannerError):
    """A profile is malformed, or does not cover a layer the plan needs."""

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        device: str | None = None,
        layer: int | None = None,
        model: str | None = None,
    ) -> None:
        super().__init__(message, model=model, field=field, layer=layer)
        self.device = device


class InfeasibleError(PlannerError):
    """No plan meets the constraints.

    ``constraint`` names the constraint ('device_memory', 'latency_slo', 'pinned'),
    ``required`` is the least the constraint would have to allow and ``limit`` what
    it allows, in the constraint's unit (``unit``).
    """

    def __init__(
        self,
        message: str,
        *,
        constraint: str,
        required: float | None = None,
        limit: float | None = None,
        unit: str = "",
        model: str | None = None,
    ) -> None:
        super().__init__(message, model=model, field=constraint)
        self.constraint = constraint
        self.required = required
        self.limit = limit
        self.unit = unit
