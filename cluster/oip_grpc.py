"""The Open Inference Protocol (KServe v2) gRPC door of the gateway, with Triton's additions.

`inference.GRPCInferenceService` on the gateway's gRPC port, beside `splitinfer.v1.Inference`
(same server: same TLS, message limits and event loop), so tritonclient.grpc and any client
generated from the OIP .proto work unchanged. Spec: the OIP gRPC API, protocol version 2
(kserve/open-inference-protocol, open_inference_grpc.proto), plus the Triton methods that
tritonclient and its tools call (grpc_service.proto): ModelConfig, ModelStatistics,
ModelStreamInfer and RepositoryIndex. The messages are cluster/_oip_pb/oip.proto's.

    ServerLive, ServerReady            live: always; ready: the gateway's readiness (/readyz)
    ModelReady                         false for a tail that failed to load ([Note: failed tails])
    ServerMetadata, ModelMetadata      as GET /v2 and GET /v2/models/{m}[/versions/{v}]
    ModelConfig                        Triton's configuration with max_batch_size
    ModelStatistics                    Triton's statistics of both OIP doors' requests
    RepositoryIndex                    every model and tail, per version
    ModelInfer                         raw_input_contents or typed contents in; raw_output_contents out
    ModelStreamInfer                   ModelInfer per message; an error is that message's error_message

What a model is here is what it is on the REST door (cluster._oip_models, one mapping):
`NAME` runs the whole model, `NAME.tail.<cut-id>` a preloaded tail. Each handler is an adapter:
parse the message (a malformed one is INVALID_ARGUMENT, never a crash), the typed call, then
the answer. Inference goes through the native Infer path (`cluster.server.InferRunner`:
deadlines, then `Gateway.infer` with auth by `authorization: Bearer` metadata, canary routing,
batching, metrics and admission). The deadline is the earlier of the gRPC deadline and the
`timeout` parameter (microseconds, as tritonclient sends it); a request with neither gets
`DEFAULT_TIMEOUT_S`. Errors map to status codes through cluster.protocol.status, the native
door's table: NOT_FOUND for an unknown model or version, INVALID_ARGUMENT for a wrong
datatype, shape or byte length, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED (with retry_after_ms in
the trailers) on overload, UNAUTHENTICATED without a valid token.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc

from cluster._oip_grpc_tensors import decode_inputs, encode_outputs, parameter
from cluster._oip_models import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S, PRIORITY_HINT, OipModels, Signature, native_priority
from cluster._oip_pb import oip_pb2 as pb
from cluster.errors import ProtocolError
from cluster.protocol import status as _status
from cluster._streams import windowed_answers, write_answer
from cluster.server import InferRunner, ServiceFactory, abort_with_status, string_metadata

__all__ = ["SERVICE_NAME", "STREAM_WINDOW", "OipGrpc", "oip_service"]

SERVICE_NAME = "inference.GRPCInferenceService"
STREAM_WINDOW = 8
"""Requests of one ModelStreamInfer call read and unanswered at a time (as the native InferStream)."""
_WHERE = "OIP gRPC"


def _metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    return string_metadata(context.invocation_metadata())


def _parse(cls: Any, raw: bytes) -> Any:
    try:
        return cls.FromString(raw)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and the C parser's errors
        raise ProtocolError(reason=f"the message is not a valid {cls.DESCRIPTOR.name} ({str(e)[:80]}); "
                                   "send the protobuf message of the OIP spec", where=_WHERE) from None


class OipGrpc:
    """The handlers of `inference.GRPCInferenceService` over a gateway; `run` is the native Infer path."""

    def __init__(self, models: OipModels, run: InferRunner, *, stream_window: int = STREAM_WINDOW) -> None:
        if stream_window < 1:
            raise ValueError(f"stream_window={stream_window} must be >= 1 (requests in flight per stream)")
        self.models = models
        self.gateway = models.gateway
        self.run = run
        self.stream_window = stream_window

    # -- shared pieces -----------------------------------------------------------------

    async def _signature(self, lv: Any, cut_id: str) -> Signature:
        sig = self.models.cached_signature(lv, cut_id)
        if sig is None:  # reading (and maybe cutting) the tail blocks: off the loop
            sig = await asyncio.get_running_loop().run_in_executor(None, self.models.signature, lv, cut_id)
        return sig

    def _unary(self, method: str, request_cls: Any, fn: Callable[[Any, grpc.aio.ServicerContext], Any]) -> Any:
        """A unary handler: parse, `await fn(request, context)` for the answer message, serialize."""

        async def handler(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
            try:
                return (await fn(_parse(request_cls, raw), context)).SerializeToString()
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as e:  # noqa: BLE001 - every error becomes a status in abort_with_status
                await abort_with_status(context, e, method)
                raise AssertionError("context.abort returned") from e

        return grpc.unary_unary_rpc_method_handler(handler)

    def _read(self, context: grpc.aio.ServicerContext, name: str) -> None:
        self.gateway.auth.authorize(_metadata(context), model=self.models.split(name)[0] if name else None,
                                    action="read metadata of" if name else "read statistics")

    # -- health and metadata -------------------------------------------------------------

    async def server_live(self, _: Any, __: grpc.aio.ServicerContext) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, _: Any, __: grpc.aio.ServicerContext) -> Any:
        return pb.ServerReadyResponse(ready=self.gateway.readiness()[0])

    async def server_metadata(self, _: Any, __: grpc.aio.ServicerContext) -> Any:
        return pb.ServerMetadataResponse(**self.models.server_metadata)

    async def model_ready(self, req: Any, context: grpc.aio.ServicerContext) -> Any:
        self._read(context, req.name)
        lv, cut_id = self.models.resolve(req.name, req.version)
        failed = f"{lv.key}@{cut_id}" in self.gateway.failed_tails(lv.model, lv.version)
        return pb.ModelReadyResponse(ready=not failed)

    async def model_metadata(self, req: Any, context: grpc.aio.ServicerContext) -> Any:
        self._read(context, req.name)
        lv, cut_id = self.models.resolve(req.name, req.version)
        return pb.ModelMetadataResponse(**self.models.metadata(req.name, lv, await self._signature(lv, cut_id)))

    async def model_config(self, req: Any, context: grpc.aio.ServicerContext) -> Any:
        self._read(context, req.name)
        lv, cut_id = self.models.resolve(req.name, req.version)
        c = self.models.config(req.name, lv, await self._signature(lv, cut_id))
        versions = [int(v) for v in c["version_policy"]["specific"]["versions"] if v.isdigit()]
        config = pb.ModelConfig(
            name=c["name"], platform=c["platform"], backend=c["backend"], max_batch_size=c["max_batch_size"],
            version_policy=pb.ModelVersionPolicy(specific=pb.ModelVersionPolicy.Specific(versions=versions)),
            input=[pb.ModelInput(name=t["name"], data_type=t["data_type"], dims=t["dims"]) for t in c["input"]],
            output=[pb.ModelOutput(name=t["name"], data_type=t["data_type"], dims=t["dims"]) for t in c["output"]],
            dynamic_batching=pb.ModelDynamicBatching(**c["dynamic_batching"]),
            instance_group=[pb.ModelInstanceGroup(**g) for g in c["instance_group"]])
        return pb.ModelConfigResponse(config=config)

    async def model_statistics(self, req: Any, context: grpc.aio.ServicerContext) -> Any:
        self._read(context, req.name)
        stats = self.models.stats.to_json(req.name or None, req.version or None)["model_stats"]
        return pb.ModelStatisticsResponse(model_stats=stats)

    async def repository_index(self, _: Any, context: grpc.aio.ServicerContext) -> Any:
        self.gateway.auth.authorize(_metadata(context), model=None, action="list models")
        return pb.RepositoryIndexResponse(models=self.models.index())

    # -- inference -----------------------------------------------------------------------

    async def _infer(self, req: Any, context: grpc.aio.ServicerContext, method: str, received: float) -> Any:
        """The ModelInferResponse of one ModelInferRequest; cluster errors otherwise."""
        # Who asks is checked before what is asked for, as on the REST door; Gateway.infer
        # then authorises (model, rate) as on the native door.
        self.gateway.auth.authenticate(_metadata(context))
        name, ok, result, samples, served = req.model_name, False, None, 0, ""
        try:
            inputs = decode_inputs(req)
            samples = inputs[0].array.shape[0] if inputs[0].array.ndim else 1
            device_id = parameter(req.parameters, "device_id") or ""
            timeout = parameter(req.parameters, "timeout")
            claimed = parameter(req.parameters, "priority")
            priority = native_priority(0 if claimed is None else claimed)  # [Note: OIP priority] in cluster/_oip_models.py
            if priority is None:
                raise ProtocolError(reason=f"parameter priority {str(claimed)[:40]} is not one; {PRIORITY_HINT}",
                                    where=_WHERE)
            if not isinstance(device_id, str):
                raise ProtocolError(reason=f"parameter device_id {str(device_id)[:40]} is not a string_param",
                                    where=_WHERE)
            if timeout is not None and (type(timeout) is not int or timeout < 0):
                raise ProtocolError(reason=f"parameter timeout {str(timeout)[:40]} is not an int64_param of "
                                           "microseconds >= 0", where=_WHERE)
            lv, cut_id = self.models.resolve(name, req.model_version, device_id)
            served = lv.version  # counted from here on: names that resolve are few, client-sent ones are not
            sig = await self._signature(lv, cut_id)
            timeout_s = DEFAULT_TIMEOUT_S if timeout is None else min(timeout / 1e6, MAX_TIMEOUT_S)
            request_id = req.id or uuid.uuid4().hex
            native = self.models.to_request(name, lv, cut_id, sig, inputs, request_id=request_id,
                                            deadline_unix_ms=int((time.time() + timeout_s) * 1e3),
                                            device_id=device_id, priority=priority)
            result = await self.run(native, context, method, received)
            resp = pb.ModelInferResponse(model_name=name, model_version=lv.version, id=req.id)
            encode_outputs(resp, [o.name for o in req.outputs], result.outputs)
            ok = True
            return resp
        finally:
            if served:
                t = result.timings_ms if result is not None else {}
                self.models.stats.add(name, served, ok, time.monotonic() - received, t.get("queue", 0.0) / 1e3,
                                      t.get("compute", 0.0) / 1e3, samples)

    async def model_infer(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        received = time.monotonic()
        try:
            return (await self._infer(self._parse_infer(raw), context, "ModelInfer", received)).SerializeToString()
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:  # noqa: BLE001 - every error becomes a status in abort_with_status
            await abort_with_status(context, e, "ModelInfer")
            raise AssertionError("context.abort returned") from e

    def _parse_infer(self, raw: bytes) -> Any:
        """The ModelInferRequest in `raw`; a malformed one is counted as the native door
        counts it (Gateway.observe_refusal) and raises ProtocolError."""
        try:
            return _parse(pb.ModelInferRequest, raw)
        except ProtocolError as e:
            observe = getattr(self.gateway, "observe_refusal", None)
            if observe is not None:
                observe("", _status.status_of(e).name, "malformed")
            raise

    async def _stream_one(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """One ModelStreamInferResponse; never raises, so one bad request cannot end the stream."""
        received = time.monotonic()
        try:
            req = self._parse_infer(raw)
            resp = pb.ModelStreamInferResponse(infer_response=await self._infer(req, context, "ModelStreamInfer",
                                                                                received))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - becomes this request's error_message
            code, message, _, _ = _status.to_status(e, where="ModelStreamInfer")
            resp = pb.ModelStreamInferResponse(error_message=f"{code.name}: {message}")
        return resp.SerializeToString()

    async def model_stream_infer(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        # As the native InferStream ([Note: stream window] in cluster/_streams.py).
        try:
            async with contextlib.aclosing(windowed_answers(
                    requests, self.stream_window, lambda raw: self._stream_one(raw, context))) as answers:
                async for answer in answers:
                    await write_answer(context, answer)  # [Note: failed writes] in cluster/_streams.py
        except (asyncio.CancelledError, grpc.aio.BaseError):  # grpc's own: the call ended or was aborted
            raise
        except Exception as e:  # noqa: BLE001 - a broken stream still ends with a status
            await abort_with_status(context, e, "ModelStreamInfer")

    # -- registration --------------------------------------------------------------------

    def generic_handler(self) -> grpc.GenericRpcHandler:
        # Messages stay bytes through gRPC: parsing happens in the handlers, where a
        # malformed one becomes INVALID_ARGUMENT instead of gRPC's own INTERNAL.
        unary: Mapping[str, tuple[Any, Any]] = {
            "ServerLive": (pb.ServerLiveRequest, self.server_live),
            "ServerReady": (pb.ServerReadyRequest, self.server_ready),
            "ServerMetadata": (pb.ServerMetadataRequest, self.server_metadata),
            "ModelReady": (pb.ModelReadyRequest, self.model_ready),
            "ModelMetadata": (pb.ModelMetadataRequest, self.model_metadata),
            "ModelConfig": (pb.ModelConfigRequest, self.model_config),
            "ModelStatistics": (pb.ModelStatisticsRequest, self.model_statistics),
            "RepositoryIndex": (pb.RepositoryIndexRequest, self.repository_index),
        }
        handlers = {name: self._unary(name, cls, fn) for name, (cls, fn) in unary.items()}
        handlers["ModelInfer"] = grpc.unary_unary_rpc_method_handler(self.model_infer)
        handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(self.model_stream_infer)
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


def oip_service(models: OipModels | Any, *, stream_window: int = STREAM_WINDOW) -> ServiceFactory:
    """The factory that `cluster.server.serve(services=[...])` takes: the OIP door over `models`
    (an `OipModels`, shared with the REST door so both count the same statistics, or a gateway)."""
    shared = models if isinstance(models, OipModels) else OipModels(models)

    def make(run: InferRunner) -> grpc.GenericRpcHandler:
        return OipGrpc(shared, run, stream_window=stream_window).generic_handler()

    return make
