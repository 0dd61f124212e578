"""ONNX Runtime plumbing shared by the engine and the cold-start optimiser.

Private: execution provider choice, session options, dtype names, host facts that key
cached artefacts, and resident-memory readings.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform

import numpy as np
import onnxruntime as ort
from onnx import helper

from workers.errors import EngineLoadError

__all__ = [
    "OPT_LEVELS",
    "PROVIDER_NAMES",
    "host_fingerprint",
    "make_session_options",
    "np_dtype_of_ort",
    "resident_bytes",
    "select_providers",
    "tensor_np_dtype",
    "wants_torch",
]

logger = logging.getLogger(__name__)

PROVIDER_NAMES = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}
"""Engine provider preference -> ONNX Runtime execution provider name."""

OPT_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}

_AUTO_ORDER = ("tensorrt", "cuda", "cpu")

_ORT_TYPE_TO_NP = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(int16)": np.int16,
    "tensor(uint16)": np.uint16,
    "tensor(int32)": np.int32,
    "tensor(uint32)": np.uint32,
    "tensor(int64)": np.int64,
    "tensor(uint64)": np.uint64,
    "tensor(bool)": np.bool_,
}


def np_dtype_of_ort(type_str: str) -> np.dtype:
    """numpy dtype of an ORT type string such as ``tensor(float)``."""
    try:
        return np.dtype(_ORT_TYPE_TO_NP[type_str])
    except KeyError:
        raise EngineLoadError(
            f"tensor type {type_str} is not supported by the engine; "
            f"supported: {', '.join(sorted(_ORT_TYPE_TO_NP))}",
            stage="session",
        ) from None


def tensor_np_dtype(elem_type: int) -> np.dtype:
    """numpy dtype of an ONNX TensorProto element type."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))


def select_providers(preference: str, *, device_id: int = 0, trt_cache_dir: str | None = None) -> tuple[str, list]:
    """Pick the execution provider for a preference: ``auto``, ``cpu``, ``cuda`` or ``tensorrt``.

    Returns the chosen short name and the provider list for ``InferenceSession``. The
    CPU provider always comes last so that nodes a GPU provider lacks still run.
    """
    available = set(ort.get_available_providers())
    if preference == "auto":
        chosen = next(p for p in _AUTO_ORDER if PROVIDER_NAMES[p] in available)
    elif preference in PROVIDER_NAMES:
        if PROVIDER_NAMES[preference] not in available:
            raise EngineLoadError(
                f"execution provider {preference!r} ({PROVIDER_NAMES[preference]}) is not in this "
                f"onnxruntime build (available: {', '.join(sorted(available))}); install "
                "onnxruntime-gpu for cuda/tensorrt, or set provider='auto' or 'cpu'",
                stage="config",
            )
        chosen = preference
    else:
        raise EngineLoadError(
            f"provider {preference!r} is unknown; use one of auto, cpu, cuda, tensorrt",
            stage="config",
        )
    providers: list = []
    if chosen == "tensorrt":
        trt_opts = {"device_id": device_id}
        if trt_cache_dir is not None:
            # TensorRT builds its engines at session creation; caching them is its
            # cold-start optimisation, the counterpart of the saved ORT graph.
            trt_opts.update(
                {"trt_engine_cache_enable": True, "trt_engine_cache_path": trt_cache_dir, "trt_timing_cache_enable": True}
            )
        providers.append((PROVIDER_NAMES["tensorrt"], trt_opts))
    if chosen in ("tensorrt", "cuda"):
        providers.append((PROVIDER_NAMES["cuda"], {"device_id": device_id}))
    providers.append(PROVIDER_NAMES["cpu"])
    return chosen, providers


@functools.lru_cache(maxsize=1)
def _torch_cuda_usable() -> bool:
    """True where torch and onnx2torch import and torch sees a CUDA device (checked once)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("onnx2torch") is None:
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken torch install is no GPU
        logger.debug("torch does not import; auto stays on onnxruntime", exc_info=True)
        return False


def wants_torch(preference: str) -> bool:
    """True where a segment runs on the PyTorch backend (workers/_torch_engine.py):
    ``torch-cuda`` and ``torch-cpu`` always; ``auto`` where onnxruntime has no CUDA or
    TensorRT provider but torch sees a GPU."""
    if preference in ("torch-cuda", "torch-cpu"):
        return True
    if preference != "auto":
        return False
    available = set(ort.get_available_providers())
    if PROVIDER_NAMES["cuda"] in available or PROVIDER_NAMES["tensorrt"] in available:
        return False
    return _torch_cuda_usable()


def make_session_options(
    *,
    intra_op_threads: int,
    inter_op_threads: int,
    opt_level: str,
    log_severity: int,
    disable_prepacking: bool = False,
    allow_spinning: bool = True,
) -> ort.SessionOptions:
    """Session options with every setting that affects speed pinned explicitly."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = intra_op_threads
    so.inter_op_num_threads = inter_op_threads
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL if inter_op_threads <= 1 else ort.ExecutionMode.ORT_PARALLEL
    so.graph_optimization_level = OPT_LEVELS[opt_level]
    so.log_severity_level = log_severity
    if not allow_spinning:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if disable_prepacking:
        # Pre-packing copies Gemm/MatMul weights into a private per-session layout,
        # which would defeat weight sharing; see [Note: weight sharing] in workers/engine.py.
        so.add_session_config_entry("session.disable_prepacking", "1")
    return so


@functools.lru_cache(maxsize=1)
def host_fingerprint() -> str:
    """Short hash of the facts that make a fully optimised graph host specific.

    Level ``all`` lays weights out for this CPU's vector width (NCHWc blocks), so an
    artefact built on one CPU family must not be reused on another.
    """
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = line.split(":", 1)[1].strip()
                    break
    except OSError:
        flags = platform.processor()
    text = "|".join((platform.machine(), platform.system(), flags))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def resident_bytes() -> int:
    """Resident set size of this process in bytes (0 where it cannot be read)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        logger.debug("resident memory cannot be read on this platform")
        return 0
