"""The metadata of a tensor frame: a replica pool's request or a worker's answer of
plain arrays, as a marshal of what surrounds the arrays and the arrays' buffers
([Note: tensor frames]). The frame around it is in workers/_transport/framing.py.

[Note: tensor frames]
Nearly every frame is a replica pool's request, ``(id, (key, [inputs], [deadline],
[priority]))``, or a worker's answer, ``(id, True, [(outputs, RequestTiming)])``, with
dicts of plain arrays (C-contiguous, of a built-in dtype). Those go as their arrays'
buffers and, as the metadata, a marshal (version 2: no table of shared references,
which version 3 builds on every call) of names, dtype strings, shapes and the plain
values around them. Marshal runs no code when it reads, so this is what a TCP
connection may carry without pickle ([Note: no pickle over TCP] in
workers/_transport/framing.py); it also takes no pickler, no class looked up by name and
no reduction (a transformer answer in a loop: 8.2 / 6.1 us to pickle / unpickle, 3.6 /
3.0 us this way). Types are checked exactly, since marshal writes any object with a
buffer, a numpy scalar say, as bytes; anything else (an error, a strided array, a numpy
scalar) is no tensor frame and is pickled where pickle may go. The receiver reads the
metadata before the buffers (:func:`request_layout`, :func:`answer_layout`), so that
each array is made where its bytes land, and checks a layout (no object dtypes, no
negative dimensions, sizes that match the buffers) once per distinct set of names,
dtypes and shapes.

[Note: tensor frames' cost]
At concurrency 1 each frame is encoded and read right after an engine run, where every
Python step costs about ten times its warm time, so the path takes few steps: no helper
call per array, the layout found with each request's names by one dict lookup, arrays
made without a generator. Counted by callgrind (a lone request of 1 MiB in and out
through the channel, both ends in one process, the interpreter's instructions per
request): 314k as they are; 337k with version 3's marshal, a helper call per array, a
frame's head and metadata sent as two parts, and the engine's input check looping by
a generator (workers/_input_check.py).
"""

from __future__ import annotations

import marshal
import math
from typing import Any

import numpy as np

from workers._pool import RequestTiming, new_timing

__all__ = ["answer_layout", "encode_answer", "encode_request", "make_answer", "make_request", "request_layout"]

_DTYPES: dict[str, np.dtype] = {}


def _dtype(name: str) -> np.dtype:
    dt = _DTYPES.get(name)
    if dt is None:
        dt = _DTYPES[name] = np.dtype(name)
    return dt


_DTYPE_STRS: dict[int, tuple[np.dtype, str]] = {}
"""``dtype.str`` of the built-in, non-object dtypes met so far, by the dtype's id (the
dtype kept beside it): the attribute formats the string on every call."""


def _describe_arrays(named: Any, arrays: list) -> tuple | None:
    """``named`` (a dict of plain arrays: C-contiguous, of a built-in, non-object dtype)
    as (names, dtype strings, shapes), its arrays appended to ``arrays``; None when it is
    anything else.

    Loops and no helper calls: right after an engine run each Python frame costs about
    ten times its warm time."""
    if not isinstance(named, dict):
        return None
    names, dtypes, shapes = [], [], []
    for name, a in named.items():
        if type(name) is not str or type(a) is not np.ndarray:
            return None
        dt = a.dtype
        entry = _DTYPE_STRS.get(id(dt))
        if entry is None or entry[0] is not dt:
            if dt.isbuiltin != 1 or dt.hasobject:
                return None
            entry = _DTYPE_STRS[id(dt)] = (dt, dt.str)
        if not a.flags.c_contiguous:
            return None
        names.append(name)
        dtypes.append(entry[1])
        shapes.append(a.shape)
    arrays.extend(named.values())
    return tuple(names), tuple(dtypes), tuple(shapes)


def encode_request(obj: Any) -> tuple[bytes, list] | None:
    """A replica pool's request, ``(id, (key, [inputs], [deadline], [priority]))``, as
    metadata and arrays; None when ``obj`` is anything else."""
    if type(obj) is not tuple or len(obj) != 2 or type(obj[1]) is not tuple or len(obj[1]) != 4:
        return None
    request_id, (key, requests, deadlines, priorities) = obj
    if (type(key) is not str or type(request_id) is not int or type(requests) is not list
            or type(deadlines) is not list or type(priorities) is not list):
        return None
    for d in deadlines:
        if d is not None and type(d) is not float:
            return None
    for p in priorities:
        if type(p) is not int:
            return None
    arrays: list = []
    specs = []
    for inputs in requests:
        spec = _describe_arrays(inputs, arrays)
        if spec is None:
            return None
        specs.append(spec)
    return marshal.dumps((request_id, key, tuple(specs), deadlines, priorities), 2), arrays


def encode_answer(obj: Any) -> tuple[bytes, list] | None:
    """A worker's answer, ``(id, True, [(outputs, RequestTiming | None)])``, as metadata
    and arrays; None when ``obj`` is anything else."""
    if (type(obj) is not tuple or len(obj) != 3 or type(obj[0]) is not int or obj[1] is not True
            or type(obj[2]) is not list):
        return None
    arrays: list = []
    specs = []
    timings = []
    for result in obj[2]:
        if type(result) is not tuple or len(result) != 2:
            return None
        spec = _describe_arrays(result[0], arrays)
        timing = result[1]
        if spec is None or not (timing is None or type(timing) is RequestTiming):
            return None
        specs.append(spec)
        timings.append(None if timing is None else (float(timing.queue_s), float(timing.compute_s),
                                                    int(timing.batch_size), bool(timing.first_in_batch)))
    return marshal.dumps((obj[0], tuple(specs), timings), 2), arrays


_LAYOUTS: dict[tuple, tuple[list, list]] = {}
""":func:`_layout`'s answer by the specs it was given (a frame's are the same from one
request to the next); a full cache forgets them all."""
_MAX_LAYOUTS = 256


def _layout(specs: Any) -> tuple[list, list]:
    """Per array of ``specs`` (per request or result: names, dtype strings, shapes),
    ``(name, dtype, shape, bytes)``, and per request or result its names; raises
    ValueError for what no plain arrays can be. Checked once per distinct ``specs``."""
    known = _LAYOUTS.get(specs) if type(specs) is tuple else None
    if known is not None:
        return known
    if type(specs) is not tuple:
        raise ValueError(f"a tensor frame's arrays are declared as {type(specs).__name__}; not a channel frame")
    layout: list = []
    for spec in specs:
        _check_layout(spec, layout)
    known = layout, [spec[0] for spec in specs]
    if len(_LAYOUTS) >= _MAX_LAYOUTS:
        _LAYOUTS.clear()
    _LAYOUTS[specs] = known
    return known


def _check_layout(spec: Any, into: list) -> None:
    if type(spec) is not tuple or len(spec) != 3:
        raise ValueError(f"a tensor frame declares arrays as {spec!r}; not a channel frame")
    names, dtypes, shapes = spec
    if not (type(names) is tuple and len(names) == len(dtypes) == len(shapes)):
        raise ValueError("a tensor frame's names, dtypes and shapes differ in number; not a channel frame")
    for name, dtype, shape in zip(names, dtypes, shapes):
        dt = _dtype(dtype) if type(dtype) is str else None
        ok = type(name) is str and dt is not None and not dt.hasobject and type(shape) is tuple
        if ok:
            for d in shape:
                ok = ok and type(d) is int and d >= 0
        if not ok:
            raise ValueError(f"a tensor frame declares {name!r} as {dtype!r} {shape!r}; not a channel frame")
        into.append((name, dt, shape, math.prod(shape) * dt.itemsize))


def request_layout(meta: memoryview) -> tuple[tuple, list]:
    """A request frame's metadata: its ``(id, key, names per request, deadlines,
    priorities)`` and, per array in order, ``(name, dtype, shape, bytes)``, so that the
    reader can make each array where its bytes land ([Note: arrays made once] in
    workers/_transport/arena.py). Raises ValueError (or what marshal raises) for
    metadata that is no request's."""
    request_id, key, specs, deadlines, priorities = marshal.loads(meta)
    layout, names = _layout(specs)
    return (request_id, key, names, deadlines, priorities), layout


def answer_layout(meta: memoryview) -> tuple[tuple, list]:
    """An answer frame's metadata: its ``(id, names per result, timings)`` and its
    arrays' layout, as :func:`request_layout` gives a request's."""
    request_id, specs, timings = marshal.loads(meta)
    layout, names = _layout(specs)
    if type(timings) is not list or len(timings) != len(names):
        raise ValueError(f"an answer declares {len(names)} results and {timings!r} as their timings; "
                         "not a channel frame")
    for timing in timings:
        if timing is not None and (type(timing) is not tuple or len(timing) != 4):
            raise ValueError(f"an answer's timing {timing!r} is no RequestTiming; not a channel frame")
    return (request_id, names, timings), layout


def make_request(head: tuple, arrays: list) -> tuple:
    """The request of :func:`request_layout`'s ``head`` with its ``arrays``."""
    request_id, key, names, deadlines, priorities = head
    if len(names) == 1:  # a lone request: no slices
        return request_id, (key, [dict(zip(names[0], arrays))], deadlines, priorities)
    requests, at = [], 0
    for named in names:
        requests.append(dict(zip(named, arrays[at:at + len(named)])))
        at += len(named)
    return request_id, (key, requests, deadlines, priorities)


def make_answer(head: tuple, arrays: list) -> tuple:
    """The answer of :func:`answer_layout`'s ``head`` with its ``arrays``."""
    request_id, names, timings = head
    if len(names) == 1:  # a lone result: no slices
        timing = timings[0]
        return request_id, True, [(dict(zip(names[0], arrays)), None if timing is None else new_timing(timing))]
    results, at = [], 0
    for named, timing in zip(names, timings):
        results.append((dict(zip(named, arrays[at:at + len(named)])), None if timing is None else new_timing(timing)))
        at += len(named)
    return request_id, True, results
