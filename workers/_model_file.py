"""Reading a model an engine is given (a path, bytes or a ModelProto) and the directory
its artefacts go to when its config names none."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading

import onnx
from onnx.external_data_helper import uses_external_data

from workers.errors import EngineLoadError

__all__ = ["default_cache_dir", "read_model"]

_process_cache: str | None = None
_process_cache_lock = threading.Lock()


def default_cache_dir() -> str:
    global _process_cache
    with _process_cache_lock:
        if _process_cache is None:
            _process_cache = tempfile.mkdtemp(prefix="splitinfer-engine-")
            atexit.register(shutil.rmtree, _process_cache, True)
        return _process_cache


def read_model(model) -> tuple[onnx.ModelProto, bytes, str | None, str]:
    """Parse a path, bytes or ModelProto; returns the proto, its identity bytes, base dir, label."""
    if isinstance(model, onnx.ModelProto):
        return model, model.SerializeToString(), None, model.graph.name or "model"
    if isinstance(model, (bytes, bytearray, memoryview)):
        data = bytes(model)
        try:
            return onnx.load_from_string(data), data, None, "model"
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError is not the only failure
            raise EngineLoadError(f"the model bytes do not parse as ONNX: {e}", detail=str(e), stage="parse") from e
    path = os.fspath(model)
    try:
        with open(path, "rb") as f:
            data = f.read()
        proto = onnx.load_from_string(data)
    except OSError as e:
        raise EngineLoadError(f"model file {path} cannot be read: {e}", model=path, detail=str(e), stage="parse") from e
    except Exception as e:  # noqa: BLE001
        raise EngineLoadError(f"model file {path} is not a valid ONNX model: {e}", model=path, detail=str(e), stage="parse") from e
    base = os.path.dirname(os.path.abspath(path))
    # External data changes the model without changing the .onnx bytes: key on it too.
    extra = []
    for t in proto.graph.initializer:
        if uses_external_data(t):
            loc = next(e.value for e in t.external_data if e.key == "location")
            st = os.stat(os.path.join(base, loc))
            extra.append(f"{loc}:{st.st_size}:{st.st_mtime_ns}")
    return proto, data + "|".join(sorted(set(extra))).encode(), base, os.path.basename(path)
