"""Weights of an optimised artefact, mapped once per process and shared by sessions.

[Note: weight sharing]
An artefact keeps its large initializers in one file (``weights.bin``) with 64-byte
aligned offsets. :func:`acquire_weights` maps that file read-only with ``np.memmap``
and wraps each tensor in an ``OrtValue`` that points into the mapping. Sessions get
them through ``SessionOptions.add_initializer``, which makes ONNX Runtime use the
caller's buffer as is instead of reading and copying the tensor. So:

* N engines of one artefact in a process share one set of weight pages: the registry
  below hands every engine the same ``SharedWeights`` while any engine holds it;
* engines in different processes share them too, through the page cache;
* loading reads nothing up front: pages fault in on the first run.

Pre-packing (ORT's private copy of Gemm/MatMul weights in a kernel-friendly layout)
would give every session its own copy again, so the engine turns it off when sharing.
The Python API has no ``PrepackedWeightsContainer`` that would share packed copies.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort
from onnx.external_data_helper import uses_external_data

from workers._ort import tensor_np_dtype
from workers.errors import EngineLoadError

__all__ = ["SharedWeights", "acquire_weights", "live_weight_sets"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_registry: "weakref.WeakValueDictionary[tuple, SharedWeights]" = weakref.WeakValueDictionary()


@dataclass(eq=False)
class SharedWeights:
    """The OrtValues of one artefact's external initializers, in host memory."""

    key: tuple
    values: dict[str, ort.OrtValue]
    nbytes: int
    _arrays: list = field(default_factory=list, repr=False)

    def apply(self, so: ort.SessionOptions) -> None:
        """Hand every shared tensor to a session about to be created."""
        for name, value in self.values.items():
            so.add_initializer(name, value)


def _read_external(model_path: str) -> SharedWeights:
    base = os.path.dirname(model_path)
    model = onnx.load(model_path, load_external_data=False)
    files: dict[str, np.memmap] = {}  # one mapping per weights file, sliced per tensor
    values: dict[str, ort.OrtValue] = {}
    nbytes = 0
    for init in model.graph.initializer:
        if not uses_external_data(init):
            continue
        info = {e.key: e.value for e in init.external_data}
        dtype = tensor_np_dtype(init.data_type)
        shape = tuple(int(d) for d in init.dims)
        path = os.path.join(base, info["location"])
        offset = int(info.get("offset", 0))
        length = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        try:
            if path not in files:
                files[path] = np.memmap(path, dtype=np.uint8, mode="r")
            raw = files[path][offset : offset + length]
            if raw.nbytes != length or offset % dtype.itemsize:
                raise ValueError(f"{length} bytes at offset {offset} do not fit the file as {dtype}[{shape}]")
            arr = raw.view(dtype).reshape(shape)
        except (OSError, ValueError) as e:
            raise EngineLoadError(
                f"weights of {init.name!r} cannot be mapped from {path} at offset {offset}: {e}; "
                "delete the artefact directory so that it is rebuilt",
                model=model_path,
                detail=str(e),
                stage="session",
            ) from e
        # Host memory even for GPU providers: ORT copies initializers to the device
        # per session, so GPU sessions share the host copy only. The OrtValue borrows
        # the mapping, which the SharedWeights keeps alive.
        values[init.name] = ort.OrtValue.ortvalue_from_numpy(arr)
        nbytes += length
    return SharedWeights(key=(), values=values, nbytes=nbytes, _arrays=list(files.values()))


def acquire_weights(model_path: str) -> SharedWeights:
    """The process-wide shared weights of an artefact's model file.

    Engines keep the returned object for as long as their session lives; when the last
    one drops it the mapping is released.
    """
    st = os.stat(model_path)
    key = (os.path.realpath(model_path), st.st_mtime_ns)
    with _lock:
        found = _registry.get(key)
        if found is not None:
            return found
        weights = _read_external(model_path)
        weights.key = key
        _registry[key] = weights
        logger.debug("mapped %d shared weight tensors (%d bytes) from %s", len(weights.values), weights.nbytes, model_path)
        return weights


def live_weight_sets() -> int:
    """How many distinct weight sets are mapped in this process now."""
    with _lock:
        return len(_registry)
