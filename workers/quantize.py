"""One call to quantise a model, with the accuracy it costs.

* :func:`quantize`: post-training static INT8 in QDQ format, with ONNX Runtime's
  ``quantize_static`` calibrated on the data you give (MinMax, Entropy or Percentile).
* :func:`to_fp16`: float16 weights and activations for GPUs, with inputs and outputs
  kept float32 unless asked.

Both run the fp32 and the converted model side by side on the same data and report,
for every output, its agreement with fp32 in the metric that fits it (top-1 for class
vectors, arg-max per position for sequences, IoU for dense maps, relative L2 otherwise:
:mod:`workers.agreement`), the output that agrees least, max and mean absolute error,
and the size before and after, in a frozen :class:`QuantizeReport`.

Weights get one scale per output channel by default (``per_channel=True``): one scale
for a whole Conv/MatMul/Gemm weight lets its largest channel set the step of all the
others. On the PP-OCRv4 recogniser, 0.90 of the CTC positions agree with fp32 per-channel
against 0.44 per-tensor (``bench/quantize.py``, docs/quantization.md). A model
that holds quantised ops already (QDQ pairs, QLinearConv, MatMulInteger, ...) is
returned unchanged with a note: quantising it again would quantise its dequantised
weights a second time.

[Note: constant folding before quantisation]
The quantiser only sees weights stored as initializers. Models whose weights are
computed at load (the zoo models shipped in the ``onnx`` package build every weight
with ConstantOfShape; exporters leave Constant nodes) would be quantised as if they had
no weights at all. So, when any node computes from constants alone, the model is first
passed through ONNX Runtime's *basic* graph optimisations, saved with
``SessionOptions.optimized_model_filepath``: constant folding turns those sub-graphs
into initializers, and the other basic rewrites (BatchNormalization folded into Conv,
redundant node removal) keep the model in standard ONNX ops, valid on any provider.
The same step is what ``onnxruntime.quantization.quant_pre_process`` recommends.
Opsets below 13 are then converted with ``onnx.version_converter``: the quantiser would
otherwise only relabel the opset, which silently changes Softmax's axis semantics.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import onnx
import onnxruntime as ort

from workers._quant_data import CalibrationData, Feeds, FeedReader, to_feeds
from workers._quant_model import load as _load
from workers._quant_model import opset as _opset
from workers._quant_model import prepare as _prepare
from workers._quant_model import quantized_ops
from workers.agreement import METRICS, AccuracyStats, OutputAgreement, compare_runs
from workers.errors import (
    CalibrationDataError,
    QuantizeConfigError,
    QuantizeError,
    QuantizeModelError,
)

__all__ = [
    "AccuracyStats",
    "CalibrationDataError",
    "OutputAgreement",
    "QuantizeConfigError",
    "QuantizeError",
    "QuantizeModelError",
    "QuantizeReport",
    "QuantizeResult",
    "compute_accuracy",
    "prepare_model",
    "quantize",
    "quantized_ops",
    "to_fp16",
]

logger = logging.getLogger(__name__)

Method = Literal["minmax", "entropy", "percentile"]

_METHODS = ("minmax", "entropy", "percentile")
_INT8_TYPES = ("int8", "uint8")


@dataclass(frozen=True)
class QuantizeReport:
    """What was done to a model and what it cost. JSON round-trips exactly."""

    kind: Literal["int8_qdq", "fp16", "already_quantized"]
    """INT8 static QDQ, float16, or a model quantised already and returned unchanged."""

    method: str | None
    """Calibration method for INT8 ('minmax', 'entropy', 'percentile'); None otherwise."""

    per_channel: bool
    """Per-output-channel weight scales (INT8 only; False when nothing was done)."""

    folded_constants: bool
    """Whether constant sub-graphs were folded into initializers first (see the
    module's note)."""

    opset_before: int
    """The model's ai.onnx opset as given."""

    opset_after: int
    """The converted model's ai.onnx opset."""

    size_original_bytes: int
    """Serialized size of the model as given (tiny for ConstantOfShape models)."""

    size_fp32_bytes: int
    """Serialized size of the fp32 model after folding: the baseline to compare."""

    size_after_bytes: int
    """Serialized size of the converted model."""

    calibration: AccuracyStats | None
    """Agreement with fp32 on the calibration data (INT8), or None."""

    evaluation: AccuracyStats | None
    """Agreement with fp32 on the held-out eval data, when given."""

    note: str | None = None
    """Why the model was left as it was: quantised already (``already_quantized``), or
    nothing the quantiser could reach (all compute inside If/Loop/Scan bodies); None
    otherwise."""

    @property
    def size_ratio(self) -> float:
        """Converted size / fp32 size."""
        return self.size_after_bytes / self.size_fp32_bytes

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> QuantizeReport:
        """Reads :meth:`to_json`'s output, and reports stored before the per-output
        agreement (see :meth:`AccuracyStats.from_dict`)."""
        data = json.loads(text)
        for key in ("calibration", "evaluation"):
            if data[key] is not None:
                data[key] = AccuracyStats.from_dict(data[key])
        return cls(**data)


@dataclass(frozen=True)
class QuantizeResult:
    """The converted model and its report."""

    model: onnx.ModelProto
    """The converted model (QDQ INT8 or float16)."""

    report: QuantizeReport
    """What was done and what it cost."""

    def to_json(self) -> str:
        """The report as JSON; save the model itself with :meth:`save`."""
        return self.report.to_json()

    def save(self, path: str | os.PathLike[str]) -> None:
        onnx.save_model(self.model, os.fspath(path))


def quantize(
    model: onnx.ModelProto | str | os.PathLike[str],
    calibration_data: CalibrationData,
    *,
    method: Method = "minmax",
    per_channel: bool = True,
    eval_data: CalibrationData | None = None,
    activation_type: Literal["uint8", "int8"] = "uint8",
    weight_type: Literal["int8", "uint8"] = "int8",
    reduce_range: bool = False,
    percentile: float = 99.999,
    calibration_batch_size: int = 32,
    op_types_to_quantize: Sequence[str] | None = None,
    nodes_to_exclude: Sequence[str] = (),
    fold_constants: bool | None = None,
    output_name: str | None = None,
    metrics: Mapping[str, str] | None = None,
) -> QuantizeResult:
    """Post-training static INT8 quantisation in QDQ format.

    ``calibration_data`` is an iterable of input dicts (one model run each), or an
    array for a single-input model (split into runs of ``calibration_batch_size`` rows,
    or of the model's fixed batch size). ``eval_data`` (same forms) is held-out data
    to report accuracy on. ``activation_type='uint8'`` with ``weight_type='int8'`` is
    ONNX Runtime's advice for x86; set ``reduce_range=True`` on x86 CPUs without VNNI
    if accuracy suffers from saturation. ``percentile`` applies to
    ``method='percentile'``. ``per_channel=False`` gives each weight one scale (see
    the module's docstring for why that is not the default). ``fold_constants`` None
    folds when needed (see the module note). Every tensor output is compared with fp32,
    or only ``output_name``; ``metrics`` maps output names to a metric of
    :data:`workers.agreement.METRICS` where the picked one does not fit. A model that is
    quantised already comes back unchanged, its report's ``note`` saying why.
    """
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    if method not in _METHODS:
        raise QuantizeConfigError(
            f"method={method!r} is not one of {_METHODS}; pick one (minmax is fastest, "
            "entropy and percentile clip outliers)",
            field_name="method", value=method,
        )
    for name, value in (("activation_type", activation_type), ("weight_type", weight_type)):
        if value not in _INT8_TYPES:
            raise QuantizeConfigError(
                f"{name}={value!r} is not one of {_INT8_TYPES}",
                field_name=name, value=value,
            )
    if not 0.0 < percentile <= 100.0:
        raise QuantizeConfigError(
            f"percentile={percentile} must lie in (0, 100]; 99.999 is the usual choice",
            field_name="percentile", value=percentile,
        )
    if calibration_batch_size < 1:
        raise QuantizeConfigError(
            f"calibration_batch_size={calibration_batch_size} must be >= 1",
            field_name="calibration_batch_size", value=calibration_batch_size,
        )
    original, label = _load(model)
    present = quantized_ops(original)
    if present:
        return _unchanged(original, label, present, "quantising it again would quantise its "
                          "dequantised weights a second time")
    prepared, folded = _prepare(original, label, fold_constants)
    out_names = _compared_outputs(prepared, output_name, metrics, label)
    calib = to_feeds(calibration_data, prepared, calibration_batch_size, label,
                      "calibration_data", equal_runs=method != "minmax")
    evals = (None if eval_data is None
             else to_feeds(eval_data, prepared, calibration_batch_size, label, "eval_data"))

    calibrate_method = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }[method]
    qtype = {"int8": QuantType.QInt8, "uint8": QuantType.QUInt8}
    # The calibrators' tunables live in extra_options; only the ones exposed above
    # are set, the rest keep ONNX Runtime's defaults.
    extra_options: dict[str, Any] = {}
    if method == "percentile":
        extra_options["CalibPercentile"] = percentile
    with tempfile.TemporaryDirectory(prefix="splitinfer-quant-") as tmp:
        src = os.path.join(tmp, "fp32.onnx")
        dst = os.path.join(tmp, "int8.onnx")
        onnx.save_model(prepared, src)
        try:
            quantize_static(
                src,
                dst,
                FeedReader(calib),
                quant_format=QuantFormat.QDQ,
                op_types_to_quantize=list(op_types_to_quantize) if op_types_to_quantize else None,
                per_channel=per_channel,
                reduce_range=reduce_range,
                activation_type=qtype[activation_type],
                weight_type=qtype[weight_type],
                nodes_to_exclude=list(nodes_to_exclude),
                calibrate_method=calibrate_method,
                extra_options=extra_options,
            )
            quantized = onnx.load_model(dst)
        except QuantizeError:
            raise
        except Exception as e:
            raise QuantizeModelError(
                f"onnxruntime.quantization.quantize_static failed on {label} "
                f"(method={method}, per_channel={per_channel}): {e}; check that the model runs "
                "in ONNX Runtime with the calibration data, or exclude the failing nodes "
                "with nodes_to_exclude",
                stage="quantize", model=label, detail=repr(e),
            ) from e
    calib_stats = compute_accuracy(prepared, quantized, calib, out_names, metrics=metrics,
                                   label=label)
    eval_stats = (None if evals is None else compute_accuracy(
        prepared, quantized, evals, out_names, metrics=metrics, label=label))
    report = QuantizeReport(
        kind="int8_qdq",
        method=method,
        per_channel=per_channel,
        folded_constants=folded,
        opset_before=_opset(original),
        opset_after=_opset(quantized),
        size_original_bytes=original.ByteSize(),
        size_fp32_bytes=prepared.ByteSize(),
        size_after_bytes=quantized.ByteSize(),
        calibration=calib_stats,
        evaluation=eval_stats,
        note=_nothing_quantized_note(prepared, quantized, label),
    )
    logger.info("quantized %s: %s", label, report.to_json())
    return QuantizeResult(model=quantized, report=report)


def to_fp16(
    model: onnx.ModelProto | str | os.PathLike[str],
    eval_data: CalibrationData | None = None,
    *,
    keep_io_types: bool = True,
    op_block_list: Sequence[str] | None = None,
    fold_constants: bool | None = None,
    eval_batch_size: int = 32,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    output_name: str | None = None,
    metrics: Mapping[str, str] | None = None,
) -> QuantizeResult:
    """Converts weights and activations to float16 (for GPUs).

    Uses onnxconverter-common's float16 converter when installed, otherwise the copy
    in ``onnxruntime.transformers.float16``. ``keep_io_types=True`` keeps the inputs
    and outputs float32 (Casts are inserted at the edges), so callers need not change.
    ``op_block_list`` names op types to leave in float32 (the converter's default list
    when None). With ``eval_data`` both models run on ``providers`` and the error is
    reported; ONNX Runtime's CPU provider lacks fp16 kernels for some ops (Conv on
    x86), for which pass a GPU provider or no eval_data. ``output_name`` and ``metrics``
    are as for :func:`quantize`; a model quantised already comes back unchanged, as
    from :func:`quantize`.
    """
    try:
        from onnxconverter_common import float16 as _f16
    except ImportError:  # pragma: no cover - depends on the install
        from onnxruntime.transformers import float16 as _f16

    original, label = _load(model)
    present = quantized_ops(original)
    if present:
        return _unchanged(original, label, present, "float16 scales would change its "
                          "quantisation, and its integer ops would stay as they are")
    prepared, folded = _prepare(original, label, fold_constants)
    out_names = _compared_outputs(prepared, output_name, metrics, label)
    evals = (None if eval_data is None
             else to_feeds(eval_data, prepared, eval_batch_size, label, "eval_data"))
    try:
        kwargs: dict[str, Any] = {"keep_io_types": keep_io_types}
        if op_block_list is not None:
            kwargs["op_block_list"] = list(op_block_list)
        with warnings.catch_warnings():
            # It warns for every weight below fp16's range that it rounds; the report's
            # error numbers are what matters.
            warnings.simplefilter("ignore", UserWarning)
            converted = _f16.convert_float_to_float16(prepared, **kwargs)
    except Exception as e:
        raise QuantizeModelError(
            f"float16 conversion failed on {label}: {e}; put the failing op types in "
            "op_block_list to keep them float32",
            stage="fp16", model=label, detail=repr(e),
        ) from e
    eval_stats = (None if evals is None else compute_accuracy(
        prepared, converted, evals, out_names, metrics=metrics, label=label,
        providers=providers))
    report = QuantizeReport(
        kind="fp16",
        method=None,
        per_channel=False,
        folded_constants=folded,
        opset_before=_opset(original),
        opset_after=_opset(converted),
        size_original_bytes=original.ByteSize(),
        size_fp32_bytes=prepared.ByteSize(),
        size_after_bytes=converted.ByteSize(),
        calibration=None,
        evaluation=eval_stats,
    )
    logger.info("converted %s to fp16: %s", label, report.to_json())
    return QuantizeResult(model=converted, report=report)


def prepare_model(
    model: onnx.ModelProto | str | os.PathLike[str], *, fold_constants: bool | None = None
) -> onnx.ModelProto:
    """The fp32 model that quantize() and to_fp16() start from: constants folded when
    needed, weight inputs tidied, opset >= 13 (see the module note). Use it as the
    baseline when timing the converted model."""
    loaded, label = _load(model)
    return _prepare(loaded, label, fold_constants)[0]


def compute_accuracy(
    reference: onnx.ModelProto,
    candidate: onnx.ModelProto,
    feeds: Feeds,
    output_names: str | Sequence[str] | None = None,
    *,
    metrics: Mapping[str, str] | None = None,
    label: str = "model",
    providers: Sequence[str] = ("CPUExecutionProvider",),
) -> AccuracyStats:
    """Runs both models on ``feeds`` and compares each of ``output_names`` (every
    tensor output when None) in the metric that fits it, or the one ``metrics`` names
    (see :mod:`workers.agreement`)."""
    if isinstance(output_names, str):
        output_names = [output_names]
    names = list(output_names) if output_names is not None else _compared_outputs(
        reference, None, metrics, label)
    ref = _run_all(reference, feeds, names, label, providers)
    new = _run_all(candidate, feeds, names, label, providers)
    return compare_runs(ref, new, metrics=metrics, num_samples=_num_samples(feeds))


# -- helpers ---------------------------------------------------------------------------


def _unchanged(model: onnx.ModelProto, label: str, present: Mapping[str, int],
               why: str) -> QuantizeResult:
    """The result for a model that holds quantised ops already: the model as given."""
    ops = ", ".join(f"{op} x{k}" for op, k in sorted(present.items()))
    note = (f"{label} is quantised already ({ops}); returned unchanged, because {why}. "
            "Convert the float model instead to choose the settings")
    size = model.ByteSize()
    report = QuantizeReport(
        kind="already_quantized", method=None, per_channel=False, folded_constants=False,
        opset_before=_opset(model), opset_after=_opset(model), size_original_bytes=size,
        size_fp32_bytes=size, size_after_bytes=size, calibration=None, evaluation=None,
        note=note,
    )
    logger.warning("%s", note)
    return QuantizeResult(model=model, report=report)


def _nothing_quantized_note(fp32: onnx.ModelProto, int8: onnx.ModelProto, label: str) -> str | None:
    """A note when ONNX Runtime's quantiser changed nothing, so that an agreement of 1.0
    is not read as INT8 costing nothing; None when it quantised something."""
    if quantized_ops(int8):
        return None
    bodies = sorted({n.op_type for n in fp32.graph.node
                     if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                            for a in n.attribute)})
    where = (f"; its compute is inside {'/'.join(bodies)} bodies, which static quantisation "
             "does not enter" if bodies else "")
    note = (f"no op of {label} was quantised: the model returned computes in fp32, so its "
            f"agreement says nothing about INT8{where}")
    logger.warning("%s", note)
    return note


_NUMPY_ELEM_TYPES = frozenset({
    onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
    onnx.TensorProto.BFLOAT16, onnx.TensorProto.INT8, onnx.TensorProto.UINT8,
    onnx.TensorProto.INT16, onnx.TensorProto.UINT16, onnx.TensorProto.INT32,
    onnx.TensorProto.UINT32, onnx.TensorProto.INT64, onnx.TensorProto.UINT64,
    onnx.TensorProto.BOOL,
})


def _compared_outputs(model: onnx.ModelProto, output_name: str | None,
                      metrics: Mapping[str, str] | None, label: str) -> list[str]:
    """The outputs to compare: ``output_name``, or every numeric tensor output (a
    sequence or map output, as scikit-learn's ZipMap gives, is left out)."""
    outputs = [o.name for o in model.graph.output]
    for name, metric in (metrics or {}).items():
        if name not in outputs:
            raise QuantizeConfigError(
                f"metrics names output {name!r}, which {label} does not have; its outputs "
                f"are {outputs}",
                field_name="metrics", value=name,
            )
        if metric not in METRICS:
            raise QuantizeConfigError(
                f"metrics[{name!r}]={metric!r} is not one of {METRICS}",
                field_name="metrics", value=metric,
            )
    if output_name is not None:
        if output_name not in outputs:
            raise QuantizeConfigError(
                f"output_name={output_name!r} is not an output of {label}; its outputs are "
                f"{outputs}",
                field_name="output_name", value=output_name,
            )
        return [output_name]
    tensors = [o.name for o in model.graph.output
               if o.type.HasField("tensor_type")
               and o.type.tensor_type.elem_type in _NUMPY_ELEM_TYPES]
    if not tensors:
        raise QuantizeConfigError(
            f"{label} has no tensor output to compare (outputs {outputs}); give "
            "output_name, or convert a model whose outputs are tensors",
            field_name="output_name", value=None,
        )
    return tensors


def _num_samples(feeds: Feeds) -> int:
    """Rows along the batch axis over all runs: the first axis of each run's first
    input of rank 1 or more (a run of scalars is one sample)."""
    total = 0
    for feed in feeds:
        ranked = [a for a in feed.values() if np.ndim(a) >= 1]
        total += len(ranked[0]) if ranked else 1
    return total


def _run_all(
    model: onnx.ModelProto, feeds: Feeds, output_names: Sequence[str], label: str,
    providers: Sequence[str],
) -> list[dict[str, np.ndarray]]:
    """The outputs of each run, by name."""
    try:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        session = ort.InferenceSession(model.SerializeToString(), options,
                                       providers=list(providers))
        runs = [session.run(list(output_names), feed) for feed in feeds]
    except Exception as e:
        raise QuantizeModelError(
            f"running {label} on {list(providers)} to measure accuracy failed: {e}; "
            "if a kernel is missing (fp16 on CPU), evaluate on a GPU provider",
            stage="evaluate", model=label, detail=repr(e),
        ) from e
    return [{name: np.asarray(a) for name, a in zip(output_names, run)} for run in runs]
