"""The codec of the direct channel: arrays pickled lean, and the tensor frames that
carry a pool's requests and a worker's answers without a pickler ([Note: tensor
frames], [Note: answers described in advance]). The frames around them are in
workers/_transport/framing.py.
"""

from __future__ import annotations

import copyreg
import io
import marshal
import operator
import pickle
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from workers._pool import RequestTiming, new_timing
from workers._engine_types import Outputs

_DESCRIBED_HEAD = struct.Struct("<qddq?")
"""A described answer's request id and RequestTiming, before its outputs' description."""
_MAX_KEPT = 256
"""Entries each of this module's caches keeps (descriptions decoded per connection,
:func:`_made_once`); a full cache forgets them all when another comes."""

_DTYPES: dict[str, np.dtype] = {}


def _plain(a: Any) -> bool:
    """A C-contiguous ndarray of a built-in, non-object dtype: sent as buffer, dtype
    string and shape."""
    return type(a) is np.ndarray and a.dtype.isbuiltin == 1 and not a.dtype.hasobject and a.flags.c_contiguous


def _dtype(name: str) -> np.dtype:
    dt = _DTYPES.get(name)
    if dt is None:
        dt = _DTYPES[name] = np.dtype(name)
    return dt


def _rebuild_array(buffer: Any, dtype: str, shape: tuple) -> np.ndarray:
    """Unpickles an array that :func:`_reduce_array` sent."""
    return np.frombuffer(buffer, _dtype(dtype)).reshape(shape)


def _reduce_array(a: np.ndarray) -> tuple:
    """Pickles a C-contiguous array of a plain dtype as its buffer, dtype string and shape.

    [Note: lean array pickling]
    NumPy's own reduction pickles the dtype as an object (a constructor call and a
    ``__setstate__`` on load) and rebuilds the array through a Python function of
    NumPy's; here the dtype is a short string, parsed once per process. Measured in a
    loop (best of 7), a lone request's answer (a 1 MiB array in its outputs dict, and
    its RequestTiming): 16.4 us to pickle and 10.6 us to unpickle with NumPy's
    reduction, 12.9 and 8.0 us this way; the request: 8.0 and 5.9 us against 4.9 and
    3.3 us. That is CPU the caller's event loop spends per request at high
    concurrency. At concurrency 1, right after an engine run, the same steps take ten
    times as long with the caches cold, and there the saving did not show above the
    noise (a traced transformer request, p50 of about 370: the answer's pickling 109
    and 158 us before, 110-142 us after). Other arrays (object, structured or
    byte-swapped dtypes, non-contiguous) take NumPy's reduction.
    """
    if _plain(a):
        return _rebuild_array, (pickle.PickleBuffer(a), a.dtype.str, a.shape)
    return a.__reduce_ex__(5)


class _Dispatch(dict):
    """Our reductions first, then copyreg's as they stand when pickling (errors register
    theirs when a worker starts: workers._worker.register_error_pickling)."""

    def __missing__(self, cls: type) -> Any:
        return copyreg.dispatch_table[cls]


_DISPATCH = _Dispatch({np.ndarray: _reduce_array})


def _dumps(obj: Any, buffer_callback: Callable[[pickle.PickleBuffer], None]) -> bytes:
    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=5, buffer_callback=buffer_callback)
    pickler.dispatch_table = _DISPATCH
    pickler.dump(obj)
    return out.getvalue()


# -- frames of tensors --------------------------------------------------------------
#
# [Note: tensor frames]
# Nearly every frame is a replica pool's request, ``(id, (key, [inputs], [deadline],
# [priority]))``, or a worker's answer, ``(id, True, [(outputs, RequestTiming)])``, with
# dicts of plain arrays. Those go as their arrays' buffers and, as the metadata, a
# marshal of names, dtype strings, shapes and the plain values around them: no pickler,
# no class looked up by name, no reduction called. The head's codec field says which
# (_REQUEST, _ANSWER); any other frame, or one holding anything else (an error, a
# strided array, a numpy scalar), is pickled (_PICKLE). Types are checked exactly,
# since marshal writes any object with a buffer, a numpy scalar say, as bytes. In a
# loop (best of 7) a transformer answer took 8.2 us to pickle and 6.1 us to unpickle
# with [Note: lean array pickling], 3.6 and 3.0 us this way. Traced through Ray at c1
# (p50 of about 370 requests, two runs each, alternating): the answer's encoding
# 102-130 -> 38-70 us, its decoding by the caller 53-62 -> 23-33 us, the request's
# 43-52 -> 32-38 us and 25-30 -> 16-19 us; the c1 serving overhead end to end read
# 0.81-1.11 ms before and 0.93-1.04 ms after (three 3 s rounds of each, twice,
# alternating): no change above this machine's noise.


def _made_once(made: dict[int, tuple[Any, Any]], obj: Any, make: Callable[[Any], Any]) -> Any:
    """``make(obj)``, made once per object: kept in ``made`` by the object's id, the
    object beside it so that the id stays its own while it is there."""
    entry = made.get(id(obj))
    if entry is None or entry[0] is not obj:
        if len(made) >= _MAX_KEPT:
            made.clear()
        entry = made[id(obj)] = (obj, make(obj))
    return entry[1]


_DTYPE_STRS: dict[int, tuple[np.dtype, str]] = {}
"""``dtype.str`` (:func:`_made_once`): it formats the string on every call, 0.4 us in a
loop here and about 30 us right after an engine run."""
_dtype_str = operator.attrgetter("str")


def _describe_arrays(named: Any, arrays: list) -> tuple | None:
    """``named`` (a dict of plain arrays) as (names, dtype strings, shapes), its arrays
    appended to ``arrays``; None when it is anything else."""
    if type(named) is not dict and type(named) is not Outputs:
        return None
    for name, a in named.items():
        if type(name) is not str or not _plain(a):
            return None
    arrays.extend(named.values())
    return (tuple(named), tuple(_made_once(_DTYPE_STRS, a.dtype, _dtype_str) for a in named.values()),
            tuple(a.shape for a in named.values()))


def _encode_request(obj: Any) -> tuple[bytes, list] | None:
    """A replica pool's request, ``(id, (key, [inputs], [deadline], [priority]))``."""
    if type(obj) is not tuple or len(obj) != 2 or type(obj[1]) is not tuple or len(obj[1]) != 4:
        return None
    request_id, (key, requests, deadlines, priorities) = obj
    if (type(key) is not str or type(request_id) is not int or type(requests) is not list
            or type(deadlines) is not list or type(priorities) is not list
            or not all(d is None or type(d) is float for d in deadlines)
            or not all(type(p) is int for p in priorities)):
        # marshal writes any object with a buffer (a numpy scalar, say) as bytes: only
        # exact types go this way; the rest is pickled.
        return None
    arrays: list = []
    specs = []
    for inputs in requests:
        spec = _describe_arrays(inputs, arrays)
        if spec is None:
            return None
        specs.append(spec)
    return marshal.dumps((request_id, key, specs, deadlines, priorities)), arrays


def _encode_answer(obj: Any) -> tuple[bytes, list] | None:
    """A worker's answer, ``(id, True, [(outputs, RequestTiming | None)])``."""
    if (type(obj) is not tuple or len(obj) != 3 or type(obj[0]) is not int or obj[1] is not True
            or type(obj[2]) is not list):
        return None
    arrays: list = []
    items = []
    for result in obj[2]:
        if type(result) is not tuple or len(result) != 2:
            return None
        spec = _describe_arrays(result[0], arrays)
        timing = result[1]
        if spec is None or not (timing is None or type(timing) is RequestTiming):
            return None
        items.append((*spec, None if timing is None else (float(timing.queue_s), float(timing.compute_s),
                                                          int(timing.batch_size), bool(timing.first_in_batch))))
    return marshal.dumps((obj[0], items)), arrays


# [Note: answers described in advance]
# A lone request's answer is nearly always the same outputs of the same engine bucket
# at the same batch size. The engine describes them once per bucket (Outputs.described
# in workers/engine.py); its marshal is made once per description, and a
# described answer's metadata is the request id and timing in a fixed struct followed
# by those bytes (_made_once). The receiver decodes each distinct description once per connection
# and then only checks that the bytes match. Right after an engine run every step costs
# about ten times its warm time, and this takes the per-array checks, the dtype strings,
# the marshal of the whole answer and its decoding off both ends. The transformer tail's
# c1 serving overhead through Ray (input kept in shared memory; the median of four 3 s
# rounds per process, old and new code in alternate processes, 13 pairs; scripts not
# committed): 0.73-0.94 ms, median 0.83, before; 0.66-0.83 ms, median 0.75, after;
# lower in 10 of the 13 pairs.

_DESCRIPTIONS: dict[int, tuple[tuple, bytes]] = {}
"""Outputs.described's marshal (:func:`_made_once`)."""


def _encode_described_answer(obj: Any) -> tuple[bytes, list] | None:
    """A worker's answer to one request, ``(id, True, [(Outputs, RequestTiming)])``."""
    if (type(obj) is not tuple or len(obj) != 3 or type(obj[0]) is not int or obj[1] is not True
            or type(obj[2]) is not list or len(obj[2]) != 1):
        return None
    result = obj[2][0]
    if type(result) is not tuple or len(result) != 2:
        return None
    outputs, timing = result
    if type(outputs) is not Outputs or type(timing) is not RequestTiming:
        return None
    head = _DESCRIBED_HEAD.pack(obj[0], timing.queue_s, timing.compute_s, timing.batch_size, timing.first_in_batch)
    return head + _made_once(_DESCRIPTIONS, outputs.described, marshal.dumps), list(outputs.values())


def _decode_described_answer(meta: memoryview, buffers: list, known: dict[bytes, list]) -> tuple:
    request_id, queue_s, compute_s, batch_size, first = _DESCRIBED_HEAD.unpack_from(meta)
    description = bytes(meta[_DESCRIBED_HEAD.size:])
    arrays = known.get(description)
    if arrays is None:
        names, dtypes, shapes = marshal.loads(description)
        arrays = [(str(name), _dtype(dtype), tuple(shape)) for name, dtype, shape in zip(names, dtypes, shapes)]
        if not len(arrays) == len(names) == len(dtypes) == len(shapes):
            raise ValueError("a described answer's names, dtypes and shapes differ in number; not a channel frame")
        if len(known) >= _MAX_KEPT:
            known.clear()
        known[description] = arrays
    if len(arrays) != len(buffers):
        raise ValueError(f"a described answer has {len(buffers)} buffers for {len(arrays)} arrays; "
                         "not a channel frame")
    outputs = {name: np.frombuffer(b, dtype).reshape(shape) for (name, dtype, shape), b in zip(arrays, buffers)}
    return request_id, True, [(outputs, new_timing((queue_s, compute_s, batch_size, first)))]


def _arrays(specs: Any, buffers: Any) -> dict[str, np.ndarray]:
    names, dtypes, shapes = specs
    return {name: _rebuild_array(next(buffers), dtype, shape) for name, dtype, shape in zip(names, dtypes, shapes)}


def _decode_request(meta: memoryview, buffers: list) -> tuple:
    request_id, key, specs, deadlines, priorities = marshal.loads(meta)
    it = iter(buffers)
    return request_id, (key, [_arrays(s, it) for s in specs], deadlines, priorities)


def _decode_answer(meta: memoryview, buffers: list) -> tuple:
    request_id, items = marshal.loads(meta)
    it = iter(buffers)
    return request_id, True, [(_arrays(item[:3], it), None if item[3] is None else RequestTiming(*item[3]))
                              for item in items]
