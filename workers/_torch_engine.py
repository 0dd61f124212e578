"""The ``torch-cuda`` engine backend: a segment converted to PyTorch and run on CUDA.

Many GPU hosts have PyTorch built for their CUDA but no onnxruntime-gpu that matches it.
:class:`TorchEngine` serves a segment there: the ONNX graph is converted to a
``torch.nn.Module`` by onnx2torch, moved to the device and run under ``inference_mode``.
It has the :class:`workers.engine.Engine` interface that the batcher and the replica
pools call (``check``, ``run``, ``run_batch``, ``stats``, ``close``, the specs and
``max_batch``), so ``Engine(model, EngineConfig(provider="torch-cuda"))`` returns one
and nothing above it changes.

Why onnx2torch: an 81 kB pure-Python wheel that converts ONNX node by node into plain
torch modules (no tracing, no export toolchain), so it travels to a bare GPU host beside
the project tree. PyTorch's own ONNX support only exports; it has no ONNX import.

[Note: verified before serving]
Conversion is trusted only after a check: the converted module and the ONNX model on
ONNX Runtime's CPU provider run the same random (or sample) inputs, ``batch_check_size``
rows, and every output must agree within the precision's tolerance, measured as the
largest absolute error over the largest magnitude of the reference output:
:data:`TOLERANCE` (fp32 1e-3; fp16 2e-2, FP16's 11-bit mantissa over a deep tail). A
segment that fails is refused at load with the error found, never served. On CUDA,
``fp32`` is IEEE fp32: the engine turns off TF32 (cuDNN's convolutions use it by
default), process-wide, since TF32's 10-bit mantissa errs about as FP16 does; ``fp16``
is the fast precision, under its own tolerance.

[Note: IO on the device]
``run``/``run_batch`` take and give numpy arrays (the interface of the pools).
``run_tensors`` takes and gives torch tensors that stay on the device, so a pipeline of
stages on one GPU hands tensors on without a host copy. With ``cuda_graphs=True`` each
bucket's run is captured once as a CUDA graph over static input and output tensors; a
request is copied into the bucket's inputs, the graph replayed and the outputs read, as
the ORT engine's IO binding does ([Note: IO binding] in workers/engine.py).

[Note: weights shared on the device]
With ``EngineConfig.share_weights`` (the default) engines of one model, device and
precision in a process share one converted module, so a second replica costs its
activations only. Its forward keeps no state, so two engines may run it at once.

Ops that onnx2torch lacks are an :class:`EngineLoadError` naming the op and the
fallback: onnxruntime, on ``provider='cpu'`` (or ``cuda``/``tensorrt`` where
onnxruntime-gpu loads).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx.external_data_helper import load_external_data_for_model, uses_external_data

from workers._engine_types import EngineConfig, EngineStats, Place, TensorSpec
from workers._input_check import batch_chunks, check_inputs, input_checks_of
from workers._model_file import read_model
from workers._ort import tensor_np_dtype
from workers.errors import BatchingUnsafeError, EngineLoadError, EngineRunError

__all__ = ["TOLERANCE", "TorchEngine", "convert_model", "forget_shared_modules", "relative_error", "shape_constants",
           "shapes_on_host", "torch_available"]

logger = logging.getLogger(__name__)

TOLERANCE = {"fp32": 1e-3, "fp16": 2e-2}
"""Largest error over the reference's largest magnitude accepted at load ([Note: verified before serving])."""

_LATENCY_WINDOW = 4096
_SHARED: dict[tuple, Any] = {}
_SHARED_LOCK = threading.Lock()


_TORCHVISION_OPS = frozenset({"NonMaxSuppression", "RoiAlign"})
"""The ops whose onnx2torch converters call torchvision."""


def _import_onnx2torch():
    """onnx2torch, also where torchvision is absent (a bare GPU host has torch alone).

    onnx2torch imports torchvision at import time for two converters only
    (:data:`_TORCHVISION_OPS`); without it, an empty stand-in module lets the rest load, and
    a segment with those ops is refused at conversion, naming them.
    """
    import importlib.util
    import sys
    import types

    if "torchvision" not in sys.modules and importlib.util.find_spec("torchvision") is None:
        stub = types.ModuleType("torchvision")
        stub.ops = types.ModuleType("torchvision.ops")  # type: ignore[attr-defined]
        stub.ops.roi_align = None  # type: ignore[attr-defined]
        stub.__splitinfer_stub__ = True  # type: ignore[attr-defined]
        sys.modules["torchvision"], sys.modules["torchvision.ops"] = stub, stub.ops  # type: ignore[attr-defined]
        logger.info("torchvision is not installed: onnx2torch loads without it; %s are refused",
                    ", ".join(sorted(_TORCHVISION_OPS)))
    import onnx2torch

    return onnx2torch


def torch_available() -> str | None:
    """None where torch and onnx2torch import, else why not (for skips and errors)."""
    try:
        import torch  # noqa: F401

        _import_onnx2torch()
    except ImportError as e:
        return f"{e.name or e} is not installed; pip install 'splitinfer[gpu]' (torch and onnx2torch)"
    return None


def forget_shared_modules() -> None:
    """Drop this process's shared modules ([Note: weights shared on the device]); engines
    holding one keep it, later engines convert afresh."""
    with _SHARED_LOCK:
        _SHARED.clear()


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """Largest absolute error over the largest magnitude of ``want`` (0 for two empty arrays)."""
    want64 = np.asarray(want, dtype=np.float64)
    if want64.size == 0:
        return 0.0
    scale = max(float(np.max(np.abs(want64))), 1e-6)
    return float(np.max(np.abs(np.asarray(got, dtype=np.float64) - want64))) / scale


def fold_constants(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose nodes computed from initializers alone (``Constant``, a weight made by
    ``ConstantOfShape``) are initializers: onnx2torch reads a Conv's or Gemm's weights only
    from initializers. Evaluated once with onnx's reference evaluator."""
    from onnx import numpy_helper
    from onnx.reference import ReferenceEvaluator

    out = onnx.ModelProto()
    out.CopyFrom(proto)
    graph = out.graph
    known = {t.name: t for t in graph.initializer}
    graph_inputs = {v.name for v in graph.input} - set(known)
    kept = []
    for node in graph.node:
        foldable = (not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)
                    and all(i == "" or (i in known and i not in graph_inputs) for i in node.input)
                    and node.domain in ("", "ai.onnx"))
        if not foldable:
            kept.append(node)
            continue
        feeds = {i: numpy_helper.to_array(known[i]) for i in node.input if i}
        one = onnx.helper.make_model(
            onnx.helper.make_graph([node], "fold", [], [onnx.helper.make_tensor_value_info(o, 0, None)
                                                        for o in node.output]),
            opset_imports=list(out.opset_import))
        values = ReferenceEvaluator(one).run(None, feeds)
        for o, v in zip(node.output, values):
            known[o] = t = numpy_helper.from_array(np.asarray(v), o)
            graph.initializer.append(t)
    del graph.node[:]
    graph.node.extend(kept)
    used = {i for n in graph.node for i in n.input} | {v.name for v in graph.output}
    keep_init = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep_init)
    names = {t.name for t in keep_init}
    inputs = [v for v in graph.input if v.name in graph_inputs or v.name in names]
    del graph.input[:]
    graph.input.extend(inputs)
    return out


_MIN_OPSET = 13
"""Graphs of older opsets are upgraded to this one before conversion: onnx2torch has no
converters for some old versions (Dropout-7 in the zoo's opset-9 models)."""


def _dropout_as_identity(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Dropout is the identity at inference: each whose mask nobody reads becomes an
    Identity (onnx2torch's Dropout returns its mask too, and lacks Dropout-7)."""
    used = {i for n in proto.graph.node for i in n.input} | {v.name for v in proto.graph.output}
    for node in proto.graph.node:
        if node.op_type == "Dropout" and node.domain in ("", "ai.onnx") and not (
                len(node.output) > 1 and node.output[1] in used):
            data, result = node.input[0], node.output[0]
            node.Clear()
            node.CopyFrom(onnx.helper.make_node("Identity", [data], [result]))
    return proto


def prepare_graph(proto: onnx.ModelProto, *, dynamic_batch: bool) -> tuple[onnx.ModelProto, str]:
    """The graph onnx2torch converts: initializers off the inputs, constants folded, the
    batch dim made symbolic (as the ORT engine does: workers/rewrite.py) and the opset
    raised to :data:`_MIN_OPSET`. Returns it and why batching was left off ('' if not)."""
    from onnx import version_converter

    from workers.errors import BatchingUnsafeError
    from workers.rewrite import make_batch_dynamic, strip_initializer_inputs

    out = _dropout_as_identity(fold_constants(strip_initializer_inputs(proto)))
    why = "" if dynamic_batch else "dynamic_batch is off"
    if dynamic_batch:
        try:
            out, _ = make_batch_dynamic(out)
        except BatchingUnsafeError as e:
            why = str(e)
    opset = next((o.version for o in out.opset_import if o.domain in ("", "ai.onnx")), _MIN_OPSET)
    if opset < _MIN_OPSET:
        try:
            out = version_converter.convert_version(out, _MIN_OPSET)
        except Exception as e:  # noqa: BLE001 - the converter's failures have no common type
            logger.info("opset %d -> %d upgrade failed (%s); converting the graph as given", opset, _MIN_OPSET, e)
    return out, why


def convert_model(proto: onnx.ModelProto, name: str):
    """onnx2torch's module for ``proto``; a missing converter is one clear EngineLoadError."""
    import sys

    onnx2torch = _import_onnx2torch()
    if getattr(sys.modules.get("torchvision"), "__splitinfer_stub__", False):
        needs = sorted({n.op_type for n in proto.graph.node} & _TORCHVISION_OPS)
        if needs:
            raise EngineLoadError(
                f"{name}: op {needs[0]} needs torchvision, which is not installed; install torchvision for this "
                "torch, or serve the segment on onnxruntime: provider='cpu'", model=name, stage="convert")
    try:
        return onnx2torch.convert(proto)
    except NotImplementedError as e:
        op = re.search(r"operation_type='([^']+)'", str(e))
        version = re.search(r"version=(\d+)", str(e))
        what = (f"has no converter for op {op.group(1)}" + (f" (opset {version.group(1)})" if version else "")
                if op else f"cannot convert it: {str(e).strip().rstrip('.')}")
        raise EngineLoadError(
            f"{name}: onnx2torch {what}; serve this segment on onnxruntime "
            "instead: provider='cpu' (or 'cuda'/'tensorrt' where onnxruntime-gpu loads)",
            model=name, detail=str(e), stage="convert") from e
    except Exception as e:  # noqa: BLE001 - a converter's own failure, whatever its type
        raise EngineLoadError(
            f"{name}: onnx2torch could not convert the segment: {str(e).splitlines()[0][:300]}; serve it on "
            "onnxruntime instead: provider='cpu' (or 'cuda'/'tensorrt' where onnxruntime-gpu loads)",
            model=name, detail=str(e), stage="convert") from e


_SHAPE_ARGS = {"OnnxReshape": (1,), "OnnxExpand": (1,), "OnnxTile": (1,)}
"""onnx2torch modules that turn an argument into a ``torch.Size``, by argument position."""


def shape_constants(module) -> list[str]:
    """The integer constants of a converted module that only Reshape, Expand and Tile read,
    as shapes (:data:`_SHAPE_ARGS`), by attribute path."""
    graph = getattr(module, "graph", None)
    found = []
    for node in graph.nodes if graph is not None else ():
        if node.op != "get_attr":
            continue
        uses = [(u, i) for u in node.users for i, a in enumerate(u.args) if a is node]
        if uses and all(u.op == "call_module" and i in _SHAPE_ARGS.get(type(module.get_submodule(u.target)).__name__, ())
                        for u, i in uses):
            t = module.get_parameter(node.target) if node.target in dict(module.named_parameters()) else \
                module.get_buffer(node.target)
            if not t.is_floating_point():
                found.append(node.target)
    return found


def shapes_on_host(module) -> list[str]:
    """Moves :func:`shape_constants` back to the CPU; returns the ones moved.

    onnx2torch's modules read them into a ``torch.Size``; a vector on the GPU makes each run
    wait for a device-to-host copy, which also makes the segment impossible to capture as a
    CUDA graph.
    """
    moved = []
    for target in shape_constants(module):
        owner_path, _, attr = target.rpartition(".")
        owner = module.get_submodule(owner_path) if owner_path else module
        t = getattr(owner, attr)
        if t.device.type != "cpu" and attr in owner._buffers:
            owner._buffers[attr] = t.cpu()
            moved.append(target)
    return moved


def _specs(proto: onnx.ModelProto) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    init = {t.name for t in proto.graph.initializer}

    def spec(v) -> TensorSpec:
        t = v.type.tensor_type
        shape = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None for d in t.shape.dim)
        return TensorSpec(v.name, tensor_np_dtype(t.elem_type).name, shape)

    return (tuple(spec(v) for v in proto.graph.input if v.name not in init),
            tuple(spec(v) for v in proto.graph.output))


def _random_feed(inputs: Sequence[TensorSpec], rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feed = {}
    for s in inputs:
        if any(d is None for d in s.shape[1:]):
            raise EngineLoadError(f"input {s.name} has symbolic dims besides the batch ({s.describe()}); give "
                                  "sample_inputs so the segment can be verified", stage="verify")
        shape = (rows, *s.shape[1:]) if s.shape else ()
        dt = np.dtype(s.dtype)
        if dt.kind == "f":
            feed[s.name] = rng.standard_normal(shape).astype(dt)
        elif dt.kind == "b":
            feed[s.name] = np.ones(shape, dt)
        else:
            feed[s.name] = np.ones(shape, dt)
    return feed


class TorchEngine:
    """One segment converted to PyTorch, on ``cuda`` (provider ``torch-cuda``) or ``cpu``
    (``torch-cpu``, for tests). ``precision``: ``fp32`` or ``fp16`` (weights and float
    inputs in half, outputs given back in their declared dtype). ``cuda_graphs``: capture
    each bucket's run as a CUDA graph ([Note: IO on the device]); CUDA only. None takes
    ``config.cuda_graphs`` (which the pools set from model.yaml's ``cuda_graphs``), and
    where that is None too, captures on CUDA where the sizes besides the batch are fixed."""

    def __init__(self, model, config: EngineConfig | None = None, *, name: str | None = None,
                 sample_inputs: Mapping[str, np.ndarray] | None = None, precision: str = "fp32",
                 cuda_graphs: bool | None = None) -> None:
        t0 = time.perf_counter()
        why = torch_available()
        if why:
            raise EngineLoadError(f"provider torch-cuda needs PyTorch: {why}; or use provider='cpu'", stage="config")
        import torch

        self._torch = torch
        self.config = cfg = config or EngineConfig(provider="torch-cuda")
        if precision not in TOLERANCE:
            raise EngineLoadError(f"precision={precision!r} is invalid; use fp32 or fp16", stage="config")
        if cuda_graphs is None:
            cuda_graphs = cfg.cuda_graphs
        proto, identity, base_dir, label = read_model(model)
        self.name = name or label
        if base_dir and any(uses_external_data(t) for t in proto.graph.initializer):
            load_external_data_for_model(proto, base_dir)
        device = "cpu" if cfg.provider == "torch-cpu" else f"cuda:{cfg.device_id}"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise EngineLoadError(f"{self.name}: provider torch-cuda needs a CUDA device and torch sees none "
                                  f"(torch {torch.__version__}); use provider='cpu'", model=self.name, stage="config")
        if precision == "fp16" and device == "cpu":
            logger.info("engine %s: fp16 on the CPU runs torch's half kernels (slow); for tests only", self.name)
        if cuda_graphs and device == "cpu":
            raise EngineLoadError("cuda_graphs=True needs provider torch-cuda", stage="config")
        self.provider = "torch-cuda" if device.startswith("cuda") else "torch-cpu"
        self.device = torch.device(device)
        self.precision = precision
        self._fixed_inputs, _ = _specs(proto)
        prepared, self._no_batch_reason = prepare_graph(proto, dynamic_batch=cfg.dynamic_batch)
        self.inputs, self.outputs = _specs(prepared)
        self.any_shape = any(d is None for s in self.inputs + self.outputs for d in s.shape[1:])
        if cuda_graphs is None:  # where it applies ([Note: IO on the device])
            cuda_graphs = device.startswith("cuda") and not self.any_shape
        self.cuda_graphs = cuda_graphs
        if self.any_shape and cuda_graphs:
            raise EngineLoadError(f"{self.name}: cuda_graphs=True needs fixed sizes besides the batch", stage="config")
        tc = time.perf_counter()
        self.module, self.shared = self._module(prepared, identity)
        self.convert_ms = (time.perf_counter() - tc) * 1e3
        self._half = torch.float16 if precision == "fp16" else None
        if device.startswith("cuda"):  # fp32 means fp32 ([Note: verified before serving])
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False
        self._input_names = frozenset(s.name for s in self.inputs)
        self._input_checks = input_checks_of(self.inputs)
        self._output_names = [s.name for s in self.outputs]
        self._lock = threading.Lock()
        self._latency_ms = np.zeros(_LATENCY_WINDOW, dtype=np.float64)
        self._run_count = 0
        self._graphs: dict[int, tuple[Any, dict, list]] = {}
        self.graphs_refused = ""
        """Why ``cuda_graphs`` was turned off at capture (an op that waits on the device), or empty."""
        samples = None if sample_inputs is None else {k: np.asarray(v) for k, v in sample_inputs.items()}
        tv = time.perf_counter()
        self.batch_safe, self.batch_reason, self.verify_error = self._verify(proto, samples)
        self.verify_ms = (time.perf_counter() - tv) * 1e3
        self.buckets = tuple(cfg.batch_buckets) if self.batch_safe else (1,)
        tw = time.perf_counter()
        self._warm_up(samples)
        self._warmup_ms = (time.perf_counter() - tw) * 1e3
        self._load_ms = (time.perf_counter() - t0) * 1e3
        logger.info("engine %s: %s %s, converted in %.0f ms, verified (error %.2e) in %.0f ms, loaded in %.0f ms",
                    self.name, self.provider, precision, self.convert_ms, self.verify_error, self.verify_ms,
                    self._load_ms)

    # -- loading ------------------------------------------------------------------------

    def _module(self, proto: onnx.ModelProto, identity: bytes):
        import hashlib

        key = (hashlib.sha256(identity).hexdigest(), str(self.device), self.precision)
        if self.config.share_weights:
            with _SHARED_LOCK:
                hit = _SHARED.get(key)
                if hit is not None:
                    return hit, True
        module = convert_model(proto, self.name).eval().to(self.device)
        if self.precision == "fp16":
            module = module.half()
        shapes_on_host(module)
        if self.config.share_weights:
            with _SHARED_LOCK:
                module = _SHARED.setdefault(key, module)
        return module, self.config.share_weights

    def _verify(self, proto: onnx.ModelProto, samples) -> tuple[bool, str, float]:
        """[Note: verified before serving]; returns (batch_safe, why not, error)."""
        tol = TOLERANCE[self.precision]
        fixed = any(not s.shape or s.shape[0] is not None for s in self._fixed_inputs)
        feed = samples if samples is not None else _random_feed(
            self._fixed_inputs, 1 if fixed else self.config.batch_check_size, seed=0)
        so = ort.SessionOptions()
        so.log_severity_level = 3
        try:
            ref_sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
            ref = ref_sess.run(self._output_names, feed)
        except Exception as e:  # noqa: BLE001
            raise EngineLoadError(f"{self.name}: onnxruntime cannot run the reference for the check: "
                                  f"{str(e).splitlines()[0][:300]}", model=self.name, detail=str(e),
                                  stage="verify") from e
        got = self._checked_forward(feed)
        worst = 0.0
        for name, g, r in zip(self._output_names, got, ref):
            if g.shape != r.shape:
                raise EngineLoadError(f"{self.name}: output {name} has shape {g.shape} in torch but {r.shape} in "
                                      "onnxruntime; serve it on onnxruntime (provider='cpu')", stage="verify")
            err = relative_error(g, r)
            worst = max(worst, err)
            if not err <= tol:
                raise EngineLoadError(
                    f"{self.name}: output {name} of the converted module differs from onnxruntime by {err:.2e} "
                    f"of its magnitude (tolerance {tol:.0e} for {self.precision}); use precision='fp32' or "
                    "serve it on onnxruntime (provider='cpu')", model=self.name, stage="verify")
        if self._no_batch_reason:
            return False, self._no_batch_reason, worst
        # a batch must equal its rows run one by one (a reshape with a hard-coded batch would not)
        rows = self.config.batch_check_size
        try:
            batch = _random_feed(self.inputs, rows, seed=2) if samples is None else {
                k: np.concatenate([v] * rows) for k, v in samples.items()}
            joined = self._forward_np(batch)
        except Exception as e:  # noqa: BLE001
            return False, f"a batch of {rows} fails: {str(e).splitlines()[0][:200]}", worst
        n = next(iter(batch.values())).shape[0]
        singles = [self._forward_np({k: v[i:i + 1] for k, v in batch.items()}) for i in range(n)]
        for j, name in enumerate(self._output_names):
            one_by_one = np.concatenate([s[j] for s in singles])
            if one_by_one.shape != joined[j].shape or relative_error(joined[j], one_by_one) > tol:
                return False, f"output {name} of a batch of {n} differs from its rows run one by one", worst
        return True, "", worst

    def _checked_forward(self, feed) -> list[np.ndarray]:
        try:
            return self._forward_np(feed)
        except Exception as e:  # noqa: BLE001
            raise EngineLoadError(f"{self.name}: the converted module fails on the check inputs: "
                                  f"{str(e).splitlines()[0][:300]}; serve it on onnxruntime (provider='cpu')",
                                  model=self.name, detail=str(e), stage="verify") from e

    def _warm_up(self, samples) -> None:
        if not self.config.warmup_runs:
            return
        feed = samples if samples is not None else _random_feed(self.inputs, 1, seed=1) if not self.any_shape else None
        if feed is None:
            return
        for _ in range(self.config.warmup_runs):
            self.run(feed)
        for b in self.buckets:
            if self._graph_for(b) is None:
                break

    # -- running ------------------------------------------------------------------------

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def check(self, inputs: Any, where: str = "") -> int:
        """Checks names, dtypes and shapes as :meth:`workers.engine.Engine.check` does; returns the rows."""
        return check_inputs(inputs, self._input_names, self._input_checks, name=self.name, max_batch=self.max_batch,
                            batch_safe=self.batch_safe, where=where, shape_inputs=frozenset())

    def _to_device(self, a: np.ndarray):
        t = self._torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=True)
        return t.to(self._half) if self._half is not None and t.is_floating_point() else t

    def _forward(self, tensors: Sequence[Any]) -> list:
        with self._torch.inference_mode():
            out = self.module(*tensors)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    def _forward_np(self, feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        outs = self._forward([self._to_device(feed[s.name]) for s in self.inputs])
        return [self._to_host(o, s) for o, s in zip(outs, self.outputs)]

    def _to_host(self, t, spec: TensorSpec) -> np.ndarray:
        return t.detach().to("cpu").numpy().astype(spec.dtype, copy=False)

    def _graph_for(self, rows: int):
        """The bucket's CUDA graph, captured on first use ([Note: IO on the device]); None,
        and eager runs from then on, where the module cannot be captured."""
        g = self._graphs.get(rows)
        if g is not None or not self.cuda_graphs:
            return g
        torch = self._torch
        static = {s.name: self._to_device(np.zeros((rows, *s.shape[1:]), s.dtype)) for s in self.inputs}
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(3):
                self._forward([static[s.name] for s in self.inputs])
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                outs = self._forward([static[s.name] for s in self.inputs])
        except Exception as e:  # noqa: BLE001 - an op that waits on the device cannot be captured
            self.cuda_graphs = False
            self.graphs_refused = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            logger.warning("engine %s: CUDA graph capture failed (%s); it runs eagerly", self.name,
                           self.graphs_refused)
            torch.cuda.synchronize(self.device)
            return None
        self._graphs[rows] = g = (graph, static, outs)
        return g

    def run_tensors(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """One run on tensors already on the device; the outputs stay there ([Note: IO on the device])."""
        if self.module is None:
            raise EngineRunError(f"engine {self.name} is closed; create a new Engine", model=self.name)
        with self._lock:
            t = time.perf_counter()
            outs = self._forward([tensors[s.name] for s in self.inputs])
            self._record(t)
        return dict(zip(self._output_names, outs))

    def _record(self, t: float) -> None:
        self._latency_ms[self._run_count % _LATENCY_WINDOW] = (time.perf_counter() - t) * 1e3
        self._run_count += 1

    def run(self, inputs: Mapping[str, np.ndarray], *, copy: bool = False, place: Place | None = None,
            rows: int | None = None, where: str = "") -> dict[str, np.ndarray]:
        """One run; returns fresh host arrays by output name (so ``copy`` changes nothing).
        ``place`` and ``rows`` as for :meth:`workers.engine.Engine.run`: each output is
        copied where ``place`` puts it, and ``rows`` is the count an earlier check gave."""
        if self.module is None:
            raise EngineRunError(f"engine {self.name} is closed; create a new Engine", model=self.name)
        if rows is None:
            rows = self.check(inputs, where)
        with self._lock:
            t = time.perf_counter()
            try:
                captured = self._graph_for(next(b for b in self.buckets if b >= rows)) if self.cuda_graphs else None
                if captured is not None:
                    graph, static, outs = captured
                    with self._torch.inference_mode():
                        for s in self.inputs:
                            static[s.name][:rows].copy_(self._to_device(inputs[s.name]))
                    graph.replay()
                    result = {s.name: self._to_host(o[:rows], s) for o, s in zip(outs, self.outputs)}
                else:
                    result = dict(zip(self._output_names, self._forward_np(inputs)))
            except Exception as e:  # noqa: BLE001
                raise EngineRunError(f"{self.name}: torch run failed: {str(e).splitlines()[0][:300]}",
                                     model=self.name, detail=str(e)) from e
            self._record(t)
        if place is not None:
            for k, v in result.items():
                spot = place(v)
                if spot is not None:
                    np.copyto(spot[0], v)
                    result[k] = spot[0]
        return result

    def run_batch(self, requests: Sequence[Mapping[str, np.ndarray]], *,
                  loop_fallback: bool | None = None) -> list[dict[str, np.ndarray]]:
        """Runs requests as one batch (or one by one where batching is unsafe and allowed)."""
        if not requests:
            return []
        if not self.batch_safe and len(requests) > 1:
            allowed = self.config.loop_fallback if loop_fallback is None else loop_fallback
            if not allowed:
                raise BatchingUnsafeError(f"{self.name} cannot batch: {self.batch_reason}", model=self.name)
            return [self.run(r) for r in requests]
        rows = [self.check(r, f"request {i}: ") for i, r in enumerate(requests)]
        out: list[dict[str, np.ndarray]] = []
        for start, end, total in batch_chunks(rows, self.max_batch):
            chunk = requests[start:end]
            joined = {s.name: np.concatenate([np.asarray(r[s.name]) for r in chunk]) for s in self.inputs}
            res = self.run(joined, rows=total)
            offset = 0
            for r in rows[start:end]:
                out.append({k: v[offset:offset + r] for k, v in res.items()})
                offset += r
        return out

    def random_inputs(self, rows: int, seed: int = 0) -> dict[str, np.ndarray]:
        return _random_feed(self.inputs, rows, seed)

    def weight_bytes(self) -> int:
        """Bytes of the module's parameters and buffers on the device."""
        mod = self.module
        if mod is None:
            return 0
        return sum(p.numel() * p.element_size() for p in list(mod.parameters()) + list(mod.buffers()))

    def shared_weight_bytes(self) -> int:
        return self.weight_bytes() if self.shared else 0

    def stats(self) -> EngineStats:
        n = min(self._run_count, _LATENCY_WINDOW)
        lat = self._latency_ms[:n]
        return EngineStats(
            provider=self.provider, load_ms=self._load_ms, build_ms=self.convert_ms, warmup_ms=self._warmup_ms,
            from_cache=self.shared, batch_safe=self.batch_safe, run_count=self._run_count,
            median_ms=float(np.median(lat)) if n else 0.0, p90_ms=float(np.percentile(lat, 90)) if n else 0.0)

    def close(self) -> None:
        self.module = None
        self._graphs.clear()

    def __repr__(self) -> str:
        return f"TorchEngine({self.name!r}, {self.provider}, {self.precision}, batch_safe={self.batch_safe})"
