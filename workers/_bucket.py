"""The buffers an engine binds once per batch bucket ([Note: IO binding] in workers/engine.py).

A :class:`Bucket` holds one batch size's input and output arrays and the ``IOBinding``
to them. The engine owns them and serialises every run on them.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np
import onnxruntime as ort

from workers._address import address
from workers._engine_types import TensorSpec

__all__ = ["Bucket", "address_of", "concrete", "pin_batch"]


class Bucket:
    """Pre-allocated, pre-bound buffers for one batch size."""

    __slots__ = ("size", "inputs", "input_values", "outputs", "output_values", "binding", "on_device", "kept")

    def __init__(self, session: ort.InferenceSession, size: int, inputs: Sequence[TensorSpec],
                 outputs: Sequence[TensorSpec], device: str, device_id: int) -> None:
        self.size = size
        self.on_device = device != "cpu"
        self.binding = session.io_binding()
        self.inputs: dict[str, np.ndarray] = {}
        self.input_values: dict[str, ort.OrtValue] = {}
        for spec in inputs:
            shape = concrete(spec.shape, size)
            buf = np.zeros(shape, dtype=spec.dtype)
            if self.on_device:
                value = ort.OrtValue.ortvalue_from_shape_and_type(shape, buf.dtype, device, device_id)
            else:
                value = ort.OrtValue.ortvalue_from_numpy(buf)  # shares buf's memory
            self.binding.bind_ortvalue_input(spec.name, value)
            self.inputs[spec.name] = buf
            self.input_values[spec.name] = value
        self.outputs: dict[str, np.ndarray] = {}
        self.output_values: dict[str, ort.OrtValue] = {}
        for spec in outputs:
            buf = np.zeros(concrete(spec.shape, size), dtype=spec.dtype)
            value = ort.OrtValue.ortvalue_from_numpy(buf)
            self.binding.bind_ortvalue_output(spec.name, value)
            self.outputs[spec.name] = buf
            self.output_values[spec.name] = value
        self.kept: collections.OrderedDict[tuple[int, ...], ort.IOBinding] = collections.OrderedDict()
        """Bindings to memory that requests brought, by its addresses ([Note: bindings kept] in workers/engine.py)."""

    def push_inputs(self) -> None:
        if self.on_device:
            for name, value in self.input_values.items():
                value.update_inplace(self.inputs[name])


def address_of(a: np.ndarray) -> int:
    """Where a C-contiguous array's data lies: for a writable one (requests in the
    channel's arenas are) at a sixth of ``.ctypes.data``'s cost."""
    at = address(a)
    return a.ctypes.data if at < 0 else at


def pin_batch(spec: TensorSpec, batch: int) -> TensorSpec:
    """``spec`` with a symbolic dim 0 fixed at ``batch``; any other spec as it is."""
    if not spec.shape or spec.shape[0] is not None:
        return spec
    return TensorSpec(spec.name, spec.dtype, (batch,) + spec.shape[1:])


def concrete(shape: tuple[int | None, ...], batch: int) -> tuple[int, ...]:
    """``shape`` with its symbolic dims at ``batch`` (only dim 0 is symbolic where buckets are made)."""
    return tuple(batch if d is None else d for d in shape)
