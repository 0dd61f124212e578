"""The wire protocol between edge agents and the cloud gateway.

Messages (`messages`), tensors as msgpack ext values (`tensors`), boundary
encodings (`encoding`), the errors both ends raise (`errors`), their status table
(`status`) and the client (`client`). It imports nothing else of the project, so
the edge agent and the gateway share it alone (docs/architecture.md). The server
shell is `cluster.server`; docs/protocol.md is the spec.
"""

from cluster.protocol.encoding import CodecStats, decode, encode, measure_codec
from cluster.protocol.messages import (
    PROTOCOL_VERSION,
    SERVICE_NAME,
    SUPPORTED_MAJORS,
    ArtifactsChunk,
    ArtifactsRequest,
    ArtifactsResponse,
    ErrorInfo,
    InferRequest,
    InferResponse,
    PlanRequest,
    PlanResponse,
    StreamFrame,
    Tensor,
)
from cluster.protocol.status import STATUS_OF
from cluster.protocol.tensors import EncodedTensor

__all__ = [
    "PROTOCOL_VERSION",
    "SERVICE_NAME",
    "SUPPORTED_MAJORS",
    "STATUS_OF",
    "ArtifactsChunk",
    "ArtifactsRequest",
    "ArtifactsResponse",
    "CodecStats",
    "EncodedTensor",
    "ErrorInfo",
    "InferRequest",
    "InferResponse",
    "PlanRequest",
    "PlanResponse",
    "StreamFrame",
    "Tensor",
    "decode",
    "encode",
    "measure_codec",
]
