"""A test backend: `EchoBackend` answers every request with its own tensors.

It is a real backend of the server (not a mock of the gateway): it knows a set
of models, versions and cuts and refuses others with the same errors a real
gateway raises. Tests and the transport benchmark use it to exercise the wire
without any model compute.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from cluster.errors import UnknownCutError, UnknownModelError, UnknownVersionError
from cluster.protocol.messages import (
    ArtifactsRequest,
    ArtifactsResponse,
    InferRequest,
    InferResponse,
    PlanRequest,
    PlanResponse,
)

if TYPE_CHECKING:
    from cluster.server import Health, RequestContext

__all__ = ["EchoBackend", "DEFAULT_CATALOG"]

#: model -> version -> cut ids the echo backend accepts.
DEFAULT_CATALOG: Mapping[str, Mapping[str, tuple[str, ...]]] = {"echo": {"1": ("c0", "c1")}}


class EchoBackend:
    """Returns the request's tensors as outputs; refuses unknown model/version/cut.

    `delay_s(request)` adds an asyncio sleep per request (to test ordering and
    deadlines); `raise_for[model]` is raised for requests to that model (to test
    status mapping). It counts requests in flight and their peak.
    """

    def __init__(
        self,
        catalog: Mapping[str, Mapping[str, tuple[str, ...]]] = DEFAULT_CATALOG,
        *,
        delay_s: Callable[[InferRequest], float] | None = None,
        raise_for: Mapping[str, BaseException] | None = None,
        artifacts: Mapping[str, bytes] | None = None,
    ) -> None:
        self.catalog = catalog
        self.delay_s = delay_s
        self.raise_for = dict(raise_for or {})
        self.artifacts = dict(artifacts or {})
        self.in_flight = 0
        self.peak_in_flight = 0
        self.calls = 0
        self.health: Health | None = None
        self.last_context: RequestContext | None = None

    def bind_health(self, health: Health) -> None:
        self.health = health

    def _check(self, model: str, version: str, cut_id: str | None) -> None:
        if model in self.raise_for:
            raise self.raise_for[model]
        versions = self.catalog.get(model)
        if versions is None:
            raise UnknownModelError(model=model, known=sorted(self.catalog))
        cuts = versions.get(version)
        if cuts is None:
            raise UnknownVersionError(model=model, version=version, known=sorted(versions))
        if cut_id is not None and cut_id not in cuts:
            raise UnknownCutError(model=model, version=version, cut_id=cut_id, known=list(cuts))

    async def infer(self, request: InferRequest, context: RequestContext) -> InferResponse:
        self.calls += 1
        self.last_context = context
        self._check(request.model, request.version, request.cut_id)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        t0 = time.monotonic()
        try:
            if self.delay_s is not None:
                await asyncio.sleep(self.delay_s(request))
        finally:
            self.in_flight -= 1
        return InferResponse(
            request_id=request.request_id,
            outputs=request.tensors,
            timings_ms={"queue": (t0 - context.received_monotonic_s) * 1e3, "compute": (time.monotonic() - t0) * 1e3},
            served_by=f"{request.model}@{request.version}",
        )

    async def plan(self, request: PlanRequest, context: RequestContext) -> PlanResponse:
        self.last_context = context
        model = request.query.get("model")
        if isinstance(model, str):
            if model in self.raise_for or model not in self.catalog:
                self._check(model, "", None)
            version = request.query.get("version")
            if version is not None:
                self._check(model, str(version), None)
        return PlanResponse(request_id=request.request_id, plan={"echo": dict(request.query)})

    async def get_artifacts(self, request: ArtifactsRequest, context: RequestContext) -> ArtifactsResponse:
        self.last_context = context
        self._check(request.model, request.version, None)
        return ArtifactsResponse(model=request.model, version=request.version, files=dict(self.artifacts))
