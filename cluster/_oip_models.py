"""What a model is on the Open Inference Protocol doors, and how an OIP request becomes a native one.

One mapping for both doors (cluster.oip_rest and cluster.oip_grpc): `NAME` is the whole model
of registry model NAME, run in the cloud (the empty cut 'L'); `NAME.tail.<cut-id>` is the tail
of a preloaded (frontier) cut of NAME, whose inputs are that cut's boundary tensors. Without a
version the registry routes the request (default version and canary) as it routes a native
request with version ''. Metadata, configuration, readiness, the repository index and the
statistics are built here as plain dicts (the REST door's JSON; the gRPC door fills its
messages from the same dicts), and `OipModels.to_request` makes the `InferRequest` that the
native `Infer` handler would get, so batching, canary routing, auth, deadlines, metrics and
admission are those of `Gateway.infer`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cluster._load_failures import failed_tail
from cluster._oip_tensors import WireInput, check_inputs, datatype_of
from cluster.errors import UnknownCutError, UnknownModelError
from cluster.protocol.messages import InferRequest

__all__ = ["WHOLE_MODEL_CUT", "TAIL_MARK", "DEFAULT_TIMEOUT_S", "EXTENSIONS", "Signature", "OipStats", "OipModels",
           "read_signature", "package_version", "native_priority", "PRIORITY_HINT"]

WHOLE_MODEL_CUT = "L"
"""The empty cut: the device runs nothing and the cloud runs the whole model."""
TAIL_MARK = ".tail."
"""`NAME.tail.<cut-id>` names the tail of a preloaded cut of NAME."""
DEFAULT_TIMEOUT_S = 60.0
"""Deadline of an infer request that gives no `timeout` parameter (and, on gRPC, no deadline)."""
MAX_TIMEOUT_S = 86_400.0
"""The longest deadline a `timeout` parameter sets; a longer one is held to this (a timeout near
int64's range, in microseconds, is past any clock's range: the REST door answered it 500)."""
EXTENSIONS = ("binary_tensor_data", "model_configuration", "statistics")
"""The OIP extensions the doors serve (ServerMetadata / GET /v2)."""


PRIORITY_HINT = "send 0 (the default) or 1-3 (1 the highest), as Triton's priority parameter"


def native_priority(priority: object) -> int | None:
    """The native priority (larger first, 0-3) of Triton's `priority` request parameter, or None
    where it is not one.

    [Note: OIP priority] Triton's priority is 0 for the default level and otherwise 1 for the
    highest, 2 for the next, and so on; the gateway's batcher serves larger priorities first
    and has 3 levels above the default. So Triton's 1, 2 and 3 are the native 3, 2 and 1, and
    0 is 0. A token's `max_priority` caps it as any claim ([Note: priority claims] in
    cluster/auth.py)."""
    if type(priority) is not int or not 0 <= priority <= 3:
        return None
    return 0 if priority == 0 else 4 - priority


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("splitinfer")
    except PackageNotFoundError:
        return "0+unknown"


@dataclass(frozen=True)
class Signature:
    """A tail's inputs and outputs as OIP metadata: (name, datatype, shape with -1 for free dims)."""

    inputs: tuple[tuple[str, str, tuple[int, ...]], ...]
    outputs: tuple[tuple[str, str, tuple[int, ...]], ...]


def read_signature(path: str) -> Signature:
    """The signature of the ONNX model at `path` (its first dimension is the batch: -1)."""
    import onnx
    from onnx.helper import tensor_dtype_to_np_dtype

    graph = onnx.load(path, load_external_data=False).graph
    weights = {t.name for t in graph.initializer}

    def spec(v: Any) -> tuple[str, str, tuple[int, ...]]:
        t = v.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim)
        return v.name, datatype_of(tensor_dtype_to_np_dtype(t.elem_type)), (-1,) + dims[1:] if dims else dims

    return Signature(tuple(spec(v) for v in graph.input if v.name not in weights),
                     tuple(spec(v) for v in graph.output))


def _bump(count_ns: list[int], seconds: float) -> None:
    count_ns[0] += 1
    count_ns[1] += int(seconds * 1e9)


class OipStats:
    """Triton-style statistics of the requests the OIP doors served, per model name and version."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[tuple[str, str], dict[str, Any]] = {}

    def add(self, name: str, version: str, ok: bool, total_s: float, queue_s: float = 0.0,
            compute_s: float = 0.0, batch: int = 0) -> None:
        with self._lock:
            s = self._by_key.setdefault((name, version), {
                "success": [0, 0], "fail": [0, 0], "queue": [0, 0], "compute_infer": [0, 0], "last": 0,
                "inference_count": 0})
            if not ok:
                _bump(s["fail"], total_s)
                return
            _bump(s["success"], total_s)
            _bump(s["queue"], queue_s)
            _bump(s["compute_infer"], compute_s)
            s["inference_count"] += batch
            s["last"] = int(time.time() * 1e3)

    def to_json(self, name: str | None, version: str | None) -> dict[str, Any]:
        with self._lock:
            items = sorted(self._by_key.items())
        zero = {"count": 0, "ns": 0}
        out = []
        for (n, v), s in items:
            if (name is not None and n != name) or (version is not None and v != version):
                continue
            out.append({"name": n, "version": v, "last_inference": s["last"],
                        "inference_count": s["inference_count"], "execution_count": s["success"][0],
                        "inference_stats": {**{k: {"count": s[k][0], "ns": s[k][1]}
                                               for k in ("success", "fail", "queue", "compute_infer")},
                                            "compute_input": zero, "compute_output": zero},
                        "batch_stats": []})
        return {"model_stats": out}


class OipModels:
    """The OIP view of a `cluster.gateway.Gateway`'s registry, shared by both doors.

    `signature` may read an ONNX file (and cut the whole model's tail on first use): call it
    off the event loop; every other method is quick and thread-safe.
    """

    def __init__(self, gateway: Any, *, server_name: str = "splitinfer") -> None:
        self.gateway = gateway
        self.server_metadata = {"name": server_name, "version": package_version(), "extensions": list(EXTENSIONS)}
        self.stats = OipStats()
        self._signatures: dict[tuple[str, str, str], Signature] = {}
        self._lock = threading.Lock()

    @staticmethod
    def split(name: str) -> tuple[str, str]:
        """(registry model, cut id) of a door model name."""
        model, mark, cut_id = name.partition(TAIL_MARK)
        return (model, cut_id) if mark else (name, WHOLE_MODEL_CUT)

    def resolve(self, name: str, version: str, device_id: str = "") -> tuple[Any, str]:
        """(the loaded version, cut id) a door model name and version go to (routed for `device_id`
        when the version is ''); NOT_FOUND errors otherwise."""
        model, cut_id = self.split(name)
        lv = self.gateway.registry.resolve(model, version, device_id)
        tails = [c for c in lv.frontier.cut_ids if c != WHOLE_MODEL_CUT]
        if cut_id != WHOLE_MODEL_CUT and cut_id not in tails:
            if not cut_id:
                raise UnknownModelError(model=name, known=[model] + [f"{model}{TAIL_MARK}{c}" for c in tails])
            raise UnknownCutError(model=model, version=lv.version, cut_id=cut_id,
                                  known=[f"{model}{TAIL_MARK}{c}" for c in tails])
        return lv, cut_id

    def cached_signature(self, lv: Any, cut_id: str) -> Signature | None:
        """The signature when it was read before, without I/O; None otherwise."""
        return self._signatures.get((lv.model, lv.version, cut_id))

    def signature(self, lv: Any, cut_id: str) -> Signature:
        """The tail's signature (blocking on first use: the tail may be cut and read)."""
        key = (lv.model, lv.version, cut_id)
        sig = self._signatures.get(key)
        if sig is None:
            sig = read_signature(lv.files.tail_path(cut_id, lv.frontier.cut_ids))
            with self._lock:
                self._signatures[key] = sig
        return sig

    def check_ready(self, lv: Any, cut_id: str) -> None:
        """Raises FAILED_PRECONDITION with the cause when the tail's pool could not start."""
        why = self.gateway.failed_tails(lv.model, lv.version).get(f"{lv.key}@{cut_id}")
        if why is not None:  # [Note: failed tails] in cluster/gateway.py
            raise failed_tail(f"{lv.key}@{cut_id}", why)

    def metadata(self, name: str, lv: Any, sig: Signature) -> dict[str, Any]:
        """The OIP model metadata of `name` as served by `lv`."""
        tensors = lambda specs: [{"name": n, "datatype": d, "shape": list(s)} for n, d, s in specs]  # noqa: E731
        return {"name": name, "versions": self.gateway.registry.describe()[lv.model]["versions"],
                "platform": "onnxruntime_onnx", "inputs": tensors(sig.inputs), "outputs": tensors(sig.outputs)}

    @staticmethod
    def config(name: str, lv: Any, sig: Signature) -> dict[str, Any]:
        """Triton's model configuration: max_batch_size is the pool's when every input is batched."""
        c = lv.config
        batched = all(s and s[0] == -1 for _, _, s in sig.inputs)

        def dims(specs: Any) -> list[dict[str, Any]]:
            return [{"name": n, "data_type": f"TYPE_{d}", "dims": list(s[1:] if batched else s)} for n, d, s in specs]

        return {"name": name, "platform": "onnxruntime_onnx", "backend": "onnxruntime", "version_policy": {
                    "specific": {"versions": [lv.version]}},
                "max_batch_size": c.max_batch_size if batched else 0, "input": dims(sig.inputs),
                "output": dims(sig.outputs),
                "dynamic_batching": {"max_queue_delay_microseconds": int(c.max_queue_delay_ms * 1e3)},
                "instance_group": [{"count": c.replicas, "kind": "KIND_AUTO"}]}

    def index(self) -> list[dict[str, str]]:
        """Every model the doors serve: each loaded version of NAME and of each of its tails."""
        out = []
        failed = self.gateway.failed_tails()
        for lv in sorted(self.gateway.registry.loaded(), key=lambda v: (v.model, v.version)):
            for cut_id in lv.frontier.cut_ids if WHOLE_MODEL_CUT in lv.frontier.cut_ids else (
                    WHOLE_MODEL_CUT, *lv.frontier.cut_ids):
                name = lv.model if cut_id == WHOLE_MODEL_CUT else f"{lv.model}{TAIL_MARK}{cut_id}"
                why = failed.get(f"{lv.key}@{cut_id}")
                out.append({"name": name, "version": lv.version, "state": "READY"} if why is None else
                           {"name": name, "version": lv.version, "state": "UNAVAILABLE", "reason": why})
        return out

    def to_request(self, name: str, lv: Any, cut_id: str, sig: Signature, inputs: Sequence[WireInput], *,
                   request_id: str, deadline_unix_ms: int, device_id: str = "", priority: int = 0) -> InferRequest:
        """The native request of an OIP infer request whose model resolved to (lv, cut_id);
        INVALID_ARGUMENT when the inputs do not match the tail's signature."""
        check_inputs(inputs, sig.inputs, name)
        return InferRequest(request_id, self.split(name)[0], lv.version, cut_id, deadline_unix_ms,
                            {t.name: t.array for t in inputs}, priority=priority, device_id=device_id)
