"""Calibration and evaluation data for workers.quantize: the accepted forms turned
into checked ONNX Runtime feeds, and the reader that hands them to the calibrators."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

import numpy as np
import onnx

from workers.errors import CalibrationDataError

__all__ = ["CalibrationData", "FeedReader", "Feeds", "real_inputs", "to_feeds"]

logger = logging.getLogger(__name__)

Feeds = list[dict[str, np.ndarray]]
CalibrationData = np.ndarray | Mapping[str, np.ndarray] | Iterable[Mapping[str, np.ndarray]]
"""An array (single-input model), one feed dict, or an iterable of feed dicts."""

_ONNX_TO_NP = {
    onnx.TensorProto.FLOAT: np.float32,
    onnx.TensorProto.FLOAT16: np.float16,
    onnx.TensorProto.DOUBLE: np.float64,
    onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.INT32: np.int32,
    onnx.TensorProto.UINT8: np.uint8,
    onnx.TensorProto.INT8: np.int8,
    onnx.TensorProto.BOOL: np.bool_,
}


class FeedReader:
    """A CalibrationDataReader over a list of feeds (duck-typed: ORT only calls
    get_next, and rewind for multi-pass calibrators)."""

    def __init__(self, feeds: Feeds) -> None:
        self._feeds = feeds
        self._i = 0

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._i >= len(self._feeds):
            return None
        self._i += 1
        return self._feeds[self._i - 1]

    def rewind(self) -> None:
        self._i = 0

    def __len__(self) -> int:
        return len(self._feeds)


def real_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    inits = {t.name for t in model.graph.initializer}
    return [i for i in model.graph.input if i.name not in inits]


def _fixed_batch(value_info: onnx.ValueInfoProto) -> int | None:
    dims = value_info.type.tensor_type.shape.dim
    if dims and dims[0].HasField("dim_value") and dims[0].dim_value > 0:
        return int(dims[0].dim_value)
    return None


def to_feeds(
    data: CalibrationData,
    model: onnx.ModelProto,
    batch_size: int,
    label: str,
    what: str,
    *,
    equal_runs: bool = False,
) -> Feeds:
    """Turns the accepted data forms into a list of checked feeds. ``equal_runs``
    requires every run to have the same shapes (the histogram calibrators)."""
    inputs = real_inputs(model)
    names = [i.name for i in inputs]
    by_name = {i.name: i for i in inputs}
    if isinstance(data, np.ndarray):
        if len(inputs) != 1:
            raise CalibrationDataError(
                f"{what} is one array but {label} has {len(inputs)} inputs {names}; pass an "
                "iterable of dicts mapping each input name to an array",
                num_samples=0, model=label,
            )
        [inp] = inputs
        fixed = _fixed_batch(inp)
        step = fixed or min(batch_size, max(len(data), 1))
        # A fixed batch axis takes exactly that many rows per run, and the histogram
        # calibrators stack runs so they must be equal: there the remainder (fewer
        # rows than one run) is dropped.
        stop = len(data) - len(data) % step if (fixed or equal_runs) else len(data)
        if stop < len(data):
            logger.info("%s: %d rows left out to keep runs of %d rows", what, len(data) - stop, step)
        raw: list[Mapping[str, np.ndarray]] = [
            {inp.name: data[i:i + step]} for i in range(0, stop, step)
        ]
    elif isinstance(data, Mapping):
        raw = [data]
    else:
        try:
            raw = list(data)
        except TypeError as e:
            raise CalibrationDataError(
                f"{what} is a {type(data).__name__}; pass an array (single-input model) or "
                "an iterable of dicts mapping input names to arrays",
                num_samples=0, model=label,
            ) from e
    if not raw:
        raise CalibrationDataError(
            f"{what} is empty; pass at least one sample (a few hundred representative "
            "samples calibrate well)",
            num_samples=0, model=label,
        )
    feeds: Feeds = []
    for k, feed in enumerate(raw):
        if not isinstance(feed, Mapping) or set(feed) != set(names):
            given = sorted(feed) if isinstance(feed, Mapping) else type(feed).__name__
            raise CalibrationDataError(
                f"{what}[{k}] has inputs {given} but {label} takes {sorted(names)}; "
                "pass one dict per run with exactly those names",
                num_samples=len(raw), model=label,
            )
        checked = {}
        for name in names:
            elem = by_name[name].type.tensor_type.elem_type
            dtype = _ONNX_TO_NP.get(elem)
            arr = np.asarray(feed[name])
            if dtype is not None:
                arr = np.ascontiguousarray(arr, dtype=dtype)
            rank = len(by_name[name].type.tensor_type.shape.dim)
            if rank and arr.ndim != rank:
                raise CalibrationDataError(
                    f"{what}[{k}][{name!r}] has shape {arr.shape} but {label} takes rank "
                    f"{rank}; add the batch axis (e.g. x[None]) or reshape",
                    num_samples=len(raw), input_name=name, model=label,
                )
            checked[name] = arr
        feeds.append(checked)
    if equal_runs:
        shapes = {tuple((n, f[n].shape) for n in names) for f in feeds}
        if len(shapes) > 1:
            raise CalibrationDataError(
                f"{what} has runs of different shapes {sorted(shapes)[:3]}...; the entropy and "
                "percentile calibrators stack runs, so give every run the same shape (or use "
                "method='minmax')",
                num_samples=len(feeds), model=label,
            )
    return feeds
