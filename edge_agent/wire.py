"""Tensors in the local API's bodies: JSON with base64, or msgpack with raw bytes.

A tensor is `{"dtype": "float32", "shape": [1, 3, 224, 224], "data": <bytes>}`: in JSON,
`data` is base64 of the C-order little-endian bytes (or `values`, nested lists, for
hand-written requests); in msgpack, `data` is a bin value. A request is
`{"inputs": {name: tensor}, "id": optional str}`; an answer is `{"id", "outputs",
"served_by", "cut_id", "latency_ms"}`. docs/edge-agent.md has examples.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from edge_agent.errors import RequestError

__all__ = ["JSON", "MSGPACK", "NDJSON", "decode_tensors", "encode_tensors", "loads", "dumps", "DTYPES"]

JSON, MSGPACK, NDJSON = "application/json", "application/msgpack", "application/x-ndjson"
DTYPES = ("float32", "float16", "float64", "int8", "uint8", "int16", "int32", "int64", "bool")
_MAX_ELEMS = 1 << 28
_MAX_DIMS = 32


def loads(body: bytes, content_type: str) -> Any:
    """The parsed body; RequestError for anything that is not valid JSON (or msgpack)."""
    kind = "msgpack" if content_type.startswith(MSGPACK) else "JSON"
    try:
        if content_type.startswith(MSGPACK):
            return msgpack.unpackb(body, raw=False)
        return json.loads(body)
    except RecursionError as e:
        raise RequestError(reason=f"the {kind} body is nested too deeply", fix="send a flat request body") from e
    except (ValueError, TypeError, msgpack.exceptions.UnpackException) as e:  # ValueError covers bad UTF-8
        raise RequestError(reason=f"the body is not valid {kind} ({_short(str(e) or type(e).__name__)})",
                           fix=f"send {kind}, or set Content-Type to {JSON} or {MSGPACK}") from e


def dumps(obj: Any, content_type: str) -> bytes:
    if content_type.startswith(MSGPACK):
        return msgpack.packb(obj, use_bin_type=True)
    return json.dumps(obj, separators=(",", ":")).encode()


def _short(text: str, limit: int = 80) -> str:
    """`text` cut to `limit` characters, so an error never echoes a whole body back."""
    return text if len(text) <= limit else text[:limit] + "..."


def _tensor(name: str, t: Any, binary: bool) -> np.ndarray:
    shown = _short(repr(name))
    if not isinstance(t, Mapping):
        raise RequestError(reason=f"input {shown} is a {type(t).__name__}",
                           fix='give {"dtype": ..., "shape": [...], "data": ...}')
    dtype = t.get("dtype", "float32")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise RequestError(reason=f"input {shown} has dtype {_short(repr(dtype))}", fix=f"use one of {list(DTYPES)}")
    shape = t.get("shape")
    if ("values" not in t or shape is not None) and not (
            isinstance(shape, list) and len(shape) <= _MAX_DIMS
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise RequestError(reason=f"input {shown} has shape {_short(repr(shape))}",
                           fix=f"give shape as a list of at most {_MAX_DIMS} ints >= 0")
    n = math.prod(shape) if shape is not None else 0
    if n > _MAX_ELEMS:
        raise RequestError(reason=f"input {shown} has shape {_short(repr(shape))}: {n} elements, over {_MAX_ELEMS}",
                           fix="send a smaller tensor")
    if "values" in t:
        try:
            arr = np.asarray(t["values"], dtype=dtype)
            return arr.reshape(shape) if shape is not None else arr
        except (ValueError, TypeError, OverflowError) as e:
            raise RequestError(reason=f"input {shown} 'values' are not a {dtype} array of shape {shape} "
                               f"({_short(str(e))})",
                               fix="give 'values' as nested lists of numbers matching 'shape'") from e
    data = t.get("data")
    if binary:
        if not isinstance(data, (bytes, bytearray)):
            raise RequestError(reason=f"input {shown} has no bin 'data'", fix="put the raw bytes in 'data'")
        raw = bytes(data)
    else:
        if not isinstance(data, str):
            raise RequestError(reason=f"input {shown} has no base64 'data' string",
                               fix="put base64 of the raw bytes in 'data', or nested lists in 'values'")
        try:
            raw = base64.b64decode(data, validate=True)
        except ValueError as e:  # binascii.Error, and non-ASCII characters
            raise RequestError(reason=f"input {shown} 'data' is not base64 ({_short(str(e))})",
                               fix="encode it with base64") from e
    dt = np.dtype(dtype).newbyteorder("<")
    if len(raw) != n * dt.itemsize:
        raise RequestError(reason=f"input {shown} has {len(raw)} bytes but {dtype}{shape} needs {n * dt.itemsize}",
                           fix="send exactly the tensor's bytes in C order, little-endian")
    return np.frombuffer(raw, dtype=dt).astype(dtype, copy=False).reshape(shape)


def decode_tensors(obj: Any, binary: bool) -> tuple[dict[str, np.ndarray], str | None]:
    """(inputs, request id) of a request body."""
    if not isinstance(obj, Mapping) or not isinstance(obj.get("inputs"), Mapping):
        raise RequestError(reason="the body has no 'inputs' map", fix='send {"inputs": {"<name>": {...}}}')
    rid = obj.get("id")
    if rid is not None and not isinstance(rid, str):
        raise RequestError(reason=f"'id' is {_short(repr(rid))}", fix="give the request id as a string or leave it out")
    return {str(k): _tensor(str(k), v, binary) for k, v in obj["inputs"].items()}, rid


def encode_tensors(tensors: Mapping[str, np.ndarray], binary: bool) -> dict[str, Any]:
    out = {}
    for k, v in tensors.items():
        a = np.ascontiguousarray(v)
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        raw = a.tobytes()
        out[k] = {"dtype": str(a.dtype), "shape": list(a.shape), "data": raw if binary else base64.b64encode(raw).decode()}
    return out
