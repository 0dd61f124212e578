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
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np

from edge_agent.errors import RequestError

__all__ = ["JSON", "MSGPACK", "NDJSON", "decode_tensors", "encode_tensors", "loads", "dumps", "DTYPES"]

JSON, MSGPACK, NDJSON = "application/json", "application/msgpack", "application/x-ndjson"
DTYPES = ("float32", "float16", "float64", "int8", "uint8", "int16", "int32", "int64", "bool")
_MAX_ELEMS = 1 << 28


def loads(body: bytes, content_type: str) -> Any:
    try:
        if content_type.startswith(MSGPACK):
            return msgpack.unpackb(body, raw=False)
        return json.loads(body)
    except (ValueError, msgpack.exceptions.ExtraData, msgpack.exceptions.FormatError,
            msgpack.exceptions.StackError) as e:
        kind = "msgpack" if content_type.startswith(MSGPACK) else "JSON"
        raise RequestError(reason=f"the body is not valid {kind} ({e})",
                           fix=f"send {kind}, or set Content-Type to {JSON} or {MSGPACK}") from e


def dumps(obj: Any, content_type: str) -> bytes:
    if content_type.startswith(MSGPACK):
        return msgpack.packb(obj, use_bin_type=True)
    return json.dumps(obj, separators=(",", ":")).encode()


def _tensor(name: str, t: Any, binary: bool) -> np.ndarray:
    if not isinstance(t, Mapping):
        raise RequestError(reason=f"input {name!r} is a {type(t).__name__}",
                           fix='give {"dtype": ..., "shape": [...], "data": ...}')
    dtype = t.get("dtype", "float32")
    if dtype not in DTYPES:
        raise RequestError(reason=f"input {name!r} has dtype {dtype!r}", fix=f"use one of {list(DTYPES)}")
    shape = t.get("shape")
    if "values" in t:
        arr = np.asarray(t["values"], dtype=dtype)
        return arr.reshape(shape) if shape is not None else arr
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise RequestError(reason=f"input {name!r} has shape {shape!r}", fix="give shape as a list of ints >= 0")
    data = t.get("data")
    if binary:
        if not isinstance(data, (bytes, bytearray)):
            raise RequestError(reason=f"input {name!r} has no bin 'data'", fix="put the raw bytes in 'data'")
        raw = bytes(data)
    else:
        if not isinstance(data, str):
            raise RequestError(reason=f"input {name!r} has no base64 'data' string",
                               fix="put base64 of the raw bytes in 'data', or nested lists in 'values'")
        try:
            raw = base64.b64decode(data, validate=True)
        except ValueError as e:
            raise RequestError(reason=f"input {name!r} 'data' is not base64 ({e})", fix="encode it with base64") from e
    n = int(np.prod(shape, dtype=np.int64))
    dt = np.dtype(dtype).newbyteorder("<")
    if n > _MAX_ELEMS or len(raw) != n * dt.itemsize:
        raise RequestError(reason=f"input {name!r} has {len(raw)} bytes but {dtype}{shape} needs {n * dt.itemsize}",
                           fix="send exactly the tensor's bytes in C order, little-endian")
    return np.frombuffer(raw, dtype=dt).astype(dtype, copy=False).reshape(shape)


def decode_tensors(obj: Any, binary: bool) -> tuple[dict[str, np.ndarray], str | None]:
    """(inputs, request id) of a request body."""
    if not isinstance(obj, Mapping) or not isinstance(obj.get("inputs"), Mapping):
        raise RequestError(reason="the body has no 'inputs' map", fix='send {"inputs": {"<name>": {...}}}')
    rid = obj.get("id")
    if rid is not None and not isinstance(rid, str):
        raise RequestError(reason=f"'id' is {rid!r}", fix="give the request id as a string or leave it out")
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
