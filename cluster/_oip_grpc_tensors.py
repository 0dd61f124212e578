"""Tensors of the Open Inference Protocol's gRPC door: `ModelInferRequest` inputs to ndarrays and
ndarrays to `ModelInferResponse` outputs.

Pure converters; no I/O. Every refusal is a `ProtocolError` (INVALID_ARGUMENT) naming the
tensor, the value and the fix. Inputs come either all as `raw_input_contents` (one entry per
input, in the order of `inputs`: flat, row-major, little-endian; read out of the message once
and used in place) or each as the typed `contents` field that its datatype names. Outputs always leave as
`raw_output_contents`: the spec allows either, every OIP client reads both, and raw bytes
skip a per-element conversion on both ends.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cluster._oip_tensors import DATATYPE_OF, DTYPE_OF, WireInput, datatype_of
from cluster.errors import ProtocolError

__all__ = ["CONTENTS_FIELD", "decode_inputs", "encode_outputs", "parameter"]

_WHERE = "OIP gRPC"
_MAX_RANK = 16

#: OIP datatype -> the InferTensorContents field that carries it (FP16 only travels raw).
CONTENTS_FIELD: Mapping[str, str] = {
    "BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents",
}


def _fail(reason: str) -> ProtocolError:
    return ProtocolError(reason=reason, where=_WHERE)


def parameter(params: Any, key: str) -> Any:
    """The value of parameter `key` of a protobuf parameters map (None when absent or unset)."""
    if key not in params:
        return None
    p = params[key]
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def _shape(t: Any) -> tuple[int, ...]:
    shape = tuple(t.shape)
    if len(shape) > _MAX_RANK or not all(0 <= d < 1 << 40 for d in shape):
        raise _fail(f"input {t.name!r} has shape {list(shape)[:20]}; give at most {_MAX_RANK} "
                    "non-negative dimensions")
    return shape


def _dtype(t: Any) -> np.dtype:
    dtype = DTYPE_OF.get(t.datatype)
    if dtype is None:
        raise _fail(f"input {t.name!r} has datatype {t.datatype[:40]!r}; use one of {', '.join(DTYPE_OF)}")
    return dtype


def _from_contents(t: Any, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    datatype = DATATYPE_OF[dtype.name]
    field = CONTENTS_FIELD.get(datatype)
    if field is None:
        raise _fail(f"input {t.name!r} is {datatype}, which travels only as raw_input_contents; send it raw")
    values = getattr(t.contents, field)
    count = math.prod(shape)
    if len(values) != count:
        raise _fail(f"input {t.name!r} has {len(values)} values in contents.{field} but shape {list(shape)} "
                    f"needs {count}")
    if dtype.kind not in "iu":
        return np.asarray(values, dtype=dtype).reshape(shape)
    # The contents field is wider than INT8/INT16/UINT8/UINT16: check the range before narrowing.
    wide = np.asarray(values, dtype=np.int64 if dtype.kind == "i" else np.uint64)
    if wide.size and (wide.min() < np.iinfo(dtype).min or wide.max() > np.iinfo(dtype).max):
        raise _fail(f"input {t.name!r} holds a value outside {datatype}'s range "
                    f"[{np.iinfo(dtype).min}, {np.iinfo(dtype).max}]")
    return wide.astype(dtype, copy=False).reshape(shape)


def decode_inputs(request: Any) -> list[WireInput]:
    """The input tensors of a `ModelInferRequest`."""
    inputs = request.inputs
    if not inputs:
        raise _fail("the request has no inputs; give one InferInputTensor per model input")
    raw = request.raw_input_contents
    if raw and len(raw) != len(inputs):
        raise _fail(f"the request has {len(raw)} raw_input_contents for {len(inputs)} inputs; give one per "
                    "input, in the order of 'inputs'")
    out: list[WireInput] = []
    for i, t in enumerate(inputs):
        shape, dtype = _shape(t), _dtype(t)
        if not raw:
            out.append(WireInput(t.name, _from_contents(t, shape, dtype)))
            continue
        if t.HasField("contents"):
            raise _fail(f"input {t.name!r} has contents and the request has raw_input_contents; use one or "
                        "the other for all inputs")
        want = math.prod(shape) * dtype.itemsize
        data = raw[i]  # each read of a bytes field copies it out of the message (upb): read it once
        if len(data) != want:
            raise _fail(f"input {t.name!r} has {len(data)} raw bytes but shape {list(shape)} of "
                        f"{DATATYPE_OF[dtype.name]} is {want} bytes")
        out.append(WireInput(t.name, np.frombuffer(data, dtype=dtype).reshape(shape)))
    return out


def encode_outputs(response: Any, requested: Sequence[str], outputs: Mapping[str, np.ndarray]) -> None:
    """Fills `response`'s outputs and raw_output_contents: those `requested` in its order (all,
    in the model's order, when it names none)."""
    names = list(requested) or list(outputs)
    unknown = [n for n in names if n not in outputs]
    if unknown:
        raise _fail(f"the request asks for output {unknown[0]!r}; this model's outputs are {sorted(outputs)}")
    for name in names:
        a = np.asarray(outputs[name])
        response.outputs.add(name=name, datatype=datatype_of(a.dtype), shape=a.shape)
        response.raw_output_contents.append(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes())
