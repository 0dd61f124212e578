"""Tensors of the Open Inference Protocol's REST door: JSON data and Triton's binary-data extension.

Pure converters between an HTTP body and ndarrays; no I/O. Every refusal is a
`ProtocolError` (INVALID_ARGUMENT, HTTP 400) naming the tensor, the value and the fix.

Binary data (Triton's extension): the body is the JSON object, `Inference-Header-Content-Length`
bytes long, then each binary tensor's raw little-endian bytes in the order its tensor
appears in the JSON, each one `parameters.binary_data_size` bytes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cluster.errors import ProtocolError

__all__ = ["DATATYPE_OF", "DTYPE_OF", "WireInput", "check_inputs", "datatype_of", "decode_body", "encode_outputs"]

_WHERE = "OIP REST"

#: OIP datatype -> numpy dtype (little-endian). BYTES (strings) is not served: no tail takes strings.
DTYPE_OF: Mapping[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "UINT8": np.dtype("<u1"), "UINT16": np.dtype("<u2"), "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"), "INT8": np.dtype("<i1"), "INT16": np.dtype("<i2"), "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"), "FP16": np.dtype("<f2"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
}
#: numpy dtype name -> OIP datatype.
DATATYPE_OF: Mapping[str, str] = {d.name: k for k, d in DTYPE_OF.items()}

_MAX_RANK = 16


def datatype_of(dtype: np.dtype | str) -> str:
    """The OIP datatype of a numpy dtype; ProtocolError for one the protocol has no name for."""
    name = np.dtype(dtype).name
    dt = DATATYPE_OF.get(name)
    if dt is None:
        raise ProtocolError(reason=f"dtype {name} has no Open Inference Protocol datatype", where=_WHERE)
    return dt


@dataclass(frozen=True)
class WireInput:
    """One decoded input tensor."""

    name: str
    array: np.ndarray


def _fail(reason: str) -> ProtocolError:
    return ProtocolError(reason=reason, where=_WHERE)


def _shape(t: Mapping[str, Any], name: str) -> tuple[int, ...]:
    shape = t.get("shape")
    if not isinstance(shape, list) or len(shape) > _MAX_RANK or not all(
            type(d) is int and 0 <= d < 1 << 40 for d in shape):
        raise _fail(f"input {name!r} has shape {str(shape)[:80]}; give a list of at most {_MAX_RANK} "
                    "non-negative integers")
    return tuple(shape)


def _dtype(t: Mapping[str, Any], name: str) -> np.dtype:
    dt = t.get("datatype")
    dtype = DTYPE_OF.get(dt) if isinstance(dt, str) else None
    if dtype is None:
        raise _fail(f"input {name!r} has datatype {str(dt)[:40]!r}; use one of {', '.join(DTYPE_OF)}")
    return dtype


def _flat(data: Any, name: str) -> list[Any]:
    """The JSON data as a flat list: the spec allows a flat or a nested (row-major) array."""
    if not isinstance(data, list):
        raise _fail(f"input {name!r} has data of type {type(data).__name__}; give a JSON array of numbers")
    if not data or not isinstance(data[0], list):
        return data
    out: list[Any] = []
    stack = [iter(data)]
    while stack:
        for x in stack[-1]:
            if isinstance(x, list):
                if len(stack) > _MAX_RANK:
                    raise _fail(f"input {name!r} nests its data deeper than {_MAX_RANK} levels")
                stack.append(iter(x))
                break
            out.append(x)
        else:
            stack.pop()
    return out


def _from_json(data: Any, shape: tuple[int, ...], dtype: np.dtype, name: str) -> np.ndarray:
    flat = _flat(data, name)
    count = math.prod(shape)
    if len(flat) != count:
        raise _fail(f"input {name!r} has {len(flat)} data elements but shape {list(shape)} needs {count}")
    kinds = (bool,) if dtype.kind == "b" else (int,) if dtype.kind in "iu" else (int, float)
    if not all(type(x) in kinds for x in flat):
        bad = next(x for x in flat if type(x) not in kinds)
        raise _fail(f"input {name!r} ({DATATYPE_OF[dtype.name]}) holds {str(bad)[:40]!r}; "
                    f"give {'true/false' if dtype.kind == 'b' else 'numbers'} only")
    try:
        return np.asarray(flat, dtype=dtype).reshape(shape)
    except (OverflowError, ValueError) as e:
        raise _fail(f"input {name!r} has a value out of range for {DATATYPE_OF[dtype.name]}: {e}") from e


def _params(t: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    p = t.get("parameters", {})
    if not isinstance(p, dict):
        raise _fail(f"{where} has parameters of type {type(p).__name__}; give a JSON object")
    return p


def decode_body(body: bytes, header_length: int | None) -> tuple[dict[str, Any], list[WireInput]]:
    """(the request JSON object, its inputs) of an infer request body.

    `header_length` is the Inference-Header-Content-Length header (None: the whole body is JSON).
    """
    if header_length is None:
        header_length = len(body)
    elif not 0 <= header_length <= len(body):
        raise _fail(f"Inference-Header-Content-Length {header_length} is outside the body of {len(body)} bytes")
    try:
        req = json.loads(body[:header_length])
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise _fail(f"the request is not JSON ({str(e)[:120]}); send an inference request object") from None
    if not isinstance(req, dict):
        raise _fail(f"the request is a JSON {type(req).__name__}; send an object with 'inputs'")
    inputs = req.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise _fail("the request has no 'inputs' list; give one entry per input tensor")
    binary = memoryview(body)[header_length:]
    offset = 0
    out: list[WireInput] = []
    for i, t in enumerate(inputs):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise _fail(f"inputs[{i}] is not an object with a string 'name'")
        name = t["name"]
        shape, dtype = _shape(t, name), _dtype(t, name)
        size = _params(t, f"input {name!r}").get("binary_data_size")
        if size is None:
            if "data" not in t:
                raise _fail(f"input {name!r} has neither 'data' nor parameters.binary_data_size")
            out.append(WireInput(name, _from_json(t["data"], shape, dtype, name)))
            continue
        want = math.prod(shape) * dtype.itemsize
        if type(size) is not int or size != want:
            raise _fail(f"input {name!r} has binary_data_size {str(size)[:40]} but shape {list(shape)} of "
                        f"{DATATYPE_OF[dtype.name]} is {want} bytes")
        if offset + size > len(binary):
            raise _fail(f"input {name!r} needs {size} binary bytes at offset {offset} but the body has "
                        f"{len(binary)} after the JSON; check Inference-Header-Content-Length")
        out.append(WireInput(name, np.frombuffer(binary[offset:offset + size], dtype=dtype).reshape(shape)))
        offset += size
    if offset != len(binary):
        raise _fail(f"the body has {len(binary) - offset} bytes after the last binary input; "
                    "check Inference-Header-Content-Length and each binary_data_size")
    return req, out


def _wants_binary(req: Mapping[str, Any]) -> dict[str, bool] | bool:
    """Output name -> binary, for the requested outputs; or, when none are named, the request's default."""
    default = _params(req, "the request").get("binary_data_output", False) is True
    asked = req.get("outputs")
    if asked is None:
        return default
    if not isinstance(asked, list):
        raise _fail(f"'outputs' is a {type(asked).__name__}; give a list of {{'name': ...}} objects")
    out: dict[str, bool] = {}
    for i, o in enumerate(asked):
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            raise _fail(f"outputs[{i}] is not an object with a string 'name'")
        b = _params(o, f"output {o['name']!r}").get("binary_data")
        out[o["name"]] = default if b is None else b is True
    return out


def encode_outputs(req: Mapping[str, Any], outputs: Mapping[str, np.ndarray],
                   head: Mapping[str, Any]) -> tuple[bytes, int | None]:
    """(body, Inference-Header-Content-Length or None) of an infer response.

    `head` holds the response's other fields (model_name, model_version, id). The outputs
    the request names, in its order (all, in the model's order, when it names none), as
    binary data where asked and as flat JSON arrays otherwise.
    """
    wants = _wants_binary(req)
    if isinstance(wants, bool):
        chosen = {k: wants for k in outputs}
    else:
        unknown = [k for k in wants if k not in outputs]
        if unknown:
            raise _fail(f"the request asks for output {unknown[0]!r}; this model's outputs are {sorted(outputs)}")
        chosen = wants
    entries, blobs = [], []
    for name, binary in chosen.items():
        a = np.asarray(outputs[name])
        entry: dict[str, Any] = {"name": name, "datatype": datatype_of(a.dtype), "shape": list(a.shape)}
        if binary:
            raw = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = a.ravel().tolist()
        entries.append(entry)
    text = json.dumps({**head, "outputs": entries}).encode()
    if not blobs:
        return text, None
    return b"".join([text, *blobs]), len(text)


def check_inputs(got: Sequence[WireInput], specs: Sequence[tuple[str, str, tuple[int, ...]]], model: str) -> None:
    """Refuses inputs that do not match the model's: names, datatypes and each fixed dimension
    (-1 in `specs` is free; the first dimension is the batch). `specs`: (name, datatype, shape)."""
    by_name = {s[0]: s for s in specs}
    names = [g.name for g in got]
    if sorted(names) != sorted(by_name) or len(set(names)) != len(names):
        raise _fail(f"{model} takes inputs {sorted(by_name)}, the request gives {names}")
    for g in got:
        _, datatype, shape = by_name[g.name]
        have = datatype_of(g.array.dtype)
        if have != datatype:
            raise _fail(f"input {g.name!r} of {model} is {datatype}, the request gives {have}")
        if len(g.array.shape) != len(shape) or any(w not in (-1, h) for w, h in zip(shape, g.array.shape)):
            raise _fail(f"input {g.name!r} of {model} has shape {list(shape)} (-1: any), "
                        f"the request gives {list(g.array.shape)}")
        if shape and g.array.shape[0] < 1:
            raise _fail(f"input {g.name!r} has a batch of 0; send at least one sample")
