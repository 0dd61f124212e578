"""The checks of a request's inputs (and outputs given to write in place) against an
engine's specs: pure, no ONNX Runtime. :meth:`workers.engine.Engine.check` calls them.

Messages are only formatted on failure, to keep the hot path lean: a passing check is
a few comparisons per input.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from workers._engine_types import TensorSpec
from workers.errors import InputError

__all__ = ["batch_chunks", "check_inputs", "describe", "input_checks_of", "where_prefix"]


def where_prefix(where: str) -> str:
    """``where`` ('request 3') as the start of a message, or nothing."""
    return f"{where}: " if where else ""


def describe(value: np.ndarray) -> str:
    """An array's dtype and shape as messages show them: ``float32[1,3,224,224]``."""
    return f"{value.dtype}[{','.join(map(str, value.shape))}]"


def input_checks_of(specs: Sequence[TensorSpec]) -> tuple[tuple[TensorSpec, np.dtype, set], ...]:
    """The ``input_checks`` of :func:`check_inputs` for an engine's input ``specs``."""
    return tuple((s, np.dtype(s.dtype), set()) for s in specs)


_MAX_PASSED_SHAPES = 64


def check_inputs(inputs: Any, input_names: frozenset[str],
                 input_checks: Sequence[tuple[TensorSpec, np.dtype, set]], *, name: str, max_batch: int,
                 batch_safe: bool, where: str, shape_inputs: frozenset[str] = frozenset()) -> int:
    """Checks names, dtypes and shapes of ``inputs`` for the engine ``name``; returns the
    number of rows (batch) given. Raises :class:`InputError` naming the input, what was
    expected and what came. ``input_checks``: each input's spec, numpy dtype and the
    shapes that passed its checks so far (:func:`input_checks_of`; a shape found there is
    not checked again: a request's shapes are nearly always the last one's, and the
    dims loop is most of a passing check); ``batch_safe``: dim 0 is the batch of every
    input (up to ``max_batch`` rows, the same in all of them); ``shape_inputs``: integer
    inputs that set shapes, whose dim 0 is a shape vector's length, never rows."""
    if type(inputs) is not dict and not isinstance(inputs, Mapping):
        raise InputError(
            f"{where_prefix(where)}inputs of {name} must be a dict of name -> numpy array, got {type(inputs).__name__}",
            model=name,
        )
    if inputs.keys() != input_names:
        expected = sorted(input_names)
        missing = sorted(input_names - set(inputs))
        extra = sorted(map(str, set(inputs) - input_names))
        raise InputError(
            f"{where_prefix(where)}inputs of {name} do not match: missing {missing}, unexpected {extra}; "
            f"pass exactly {expected}",
            model=name,
            expected=", ".join(expected),
            given=", ".join(sorted(map(str, inputs))),
        )
    rows = None
    for spec, dtype, passed in input_checks:
        value = inputs[spec.name]
        if not isinstance(value, np.ndarray):
            want = spec.describe(max_batch if batch_safe else None)
            raise InputError(
                f"{where_prefix(where)}input {spec.name!r} of {name} is a {type(value).__name__}, expected a numpy "
                f"array {want}; convert it with np.asarray(value, dtype=np.{spec.dtype})",
                model=name, input_name=spec.name, expected=want, given=type(value).__name__,
            )
        if value.dtype != dtype:
            want, got = spec.describe(max_batch if batch_safe else None), describe(value)
            raise InputError(
                f"{where_prefix(where)}input {spec.name!r} of {name} has dtype {value.dtype}, expected {want}, "
                f"got {got}; cast it with .astype(np.{spec.dtype})",
                model=name, input_name=spec.name, expected=want, given=got,
            )
        shape = value.shape
        n = shape[0] if shape else 1
        if shape not in passed:
            ok_dims = len(shape) == len(spec.shape)
            for d, g in zip(spec.shape, shape):  # a loop, not all(<generator>): no frame per input
                if d is not None and d != g:
                    ok_dims = False
            ok_batch = (not spec.shape or spec.shape[0] is not None or spec.name in shape_inputs
                        or 1 <= n <= max_batch)
            if not (ok_dims and ok_batch):
                want, got = spec.describe(max_batch if batch_safe else None), describe(value)
                fix = (
                    f"split it into requests of at most {max_batch} rows or add a larger batch bucket"
                    if ok_dims else "reshape it to the expected shape"
                )
                raise InputError(
                    f"{where_prefix(where)}input {spec.name!r} of {name} has shape {got}, expected {want}; {fix}",
                    model=name, input_name=spec.name, expected=want, given=got,
                )
            if len(passed) >= _MAX_PASSED_SHAPES:
                passed.clear()
            passed.add(shape)
        if spec.name in shape_inputs:
            continue
        if rows is None:
            rows = n
        elif n != rows and batch_safe:  # unbatched, each input has its own fixed dim 0
            raise InputError(
                f"{where_prefix(where)}input {spec.name!r} of {name} has {n} rows but the other inputs have "
                f"{rows}; give every input the same batch size",
                model=name, input_name=spec.name, expected=f"{rows} rows", given=f"{n} rows",
            )
    return rows or 1


def batch_chunks(rows: Sequence[int], max_batch: int) -> list[tuple[int, int, int]]:
    """Consecutive requests of ``rows`` rows each grouped into runs of at most ``max_batch``
    rows: ``(start, stop, rows)`` per run, every request in exactly one."""
    chunks = []
    start = 0
    while start < len(rows):
        stop, total = start, 0
        while stop < len(rows) and total + rows[stop] <= max_batch:
            total += rows[stop]
            stop += 1
        if stop == start:  # one request over max_batch runs alone (checks refuse it first)
            stop, total = start + 1, rows[start]
        chunks.append((start, stop, total))
        start = stop
    return chunks
