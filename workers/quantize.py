"""One call to quantise a model, with the accuracy it costs.

* :func:`quantize`: post-training static INT8 in QDQ format, with ONNX Runtime's
  ``quantize_static`` calibrated on the data you give (MinMax, Entropy or Percentile).
* :func:`to_fp16`: float16 weights and activations for GPUs, with inputs and outputs
  kept float32 unless asked.

Both run the fp32 and the converted model side by side on the same data and report
top-1 agreement (for classifier-like outputs), max and mean absolute error, and the
size before and after, in a frozen :class:`QuantizeReport`.

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import onnx
import onnx.version_converter
import onnxruntime as ort

from workers._quant_data import CalibrationData, Feeds, FeedReader, to_feeds
from workers.errors import (
    CalibrationDataError,
    QuantizeConfigError,
    QuantizeError,
    QuantizeModelError,
)

__all__ = [
    "AccuracyStats",
    "CalibrationDataError",
    "QuantizeConfigError",
    "QuantizeError",
    "QuantizeModelError",
    "QuantizeReport",
    "QuantizeResult",
    "compute_accuracy",
    "prepare_model",
    "quantize",
    "to_fp16",
]

logger = logging.getLogger(__name__)

Method = Literal["minmax", "entropy", "percentile"]

_METHODS = ("minmax", "entropy", "percentile")
_INT8_TYPES = ("int8", "uint8")
_MIN_QDQ_OPSET = 13  # per-channel QDQ needs the axis attribute of opset 13


@dataclass(frozen=True)
class AccuracyStats:
    """How far the converted model's output is from fp32 on one data set."""

    num_samples: int
    """Samples compared (rows along the batch axis, over all feeds)."""

    output_name: str
    """The output compared."""

    top1_agreement: float | None
    """Fraction of samples whose arg-max class is the same as fp32's; None when the
    output has one value per sample (not classifier-like)."""

    max_abs_error: float
    """Largest |converted - fp32| over all output elements."""

    mean_abs_error: float
    """Mean |converted - fp32| over all output elements."""


@dataclass(frozen=True)
class QuantizeReport:
    """What was done to a model and what it cost. JSON round-trips exactly."""

    kind: Literal["int8_qdq", "fp16"]
    """INT8 static QDQ, or float16."""

    method: str | None
    """Calibration method for INT8 ('minmax', 'entropy', 'percentile'); None for fp16."""

    per_channel: bool
    """Per-output-channel weight scales (INT8 only)."""

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
    """Accuracy against fp32 on the calibration data (INT8), or None."""

    evaluation: AccuracyStats | None
    """Accuracy against fp32 on the held-out eval data, when given."""

    @property
    def size_ratio(self) -> float:
        """Converted size / fp32 size."""
        return self.size_after_bytes / self.size_fp32_bytes

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> QuantizeReport:
        data = json.loads(text)
        for key in ("calibration", "evaluation"):
            if data[key] is not None:
                data[key] = AccuracyStats(**data[key])
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
    per_channel: bool = False,
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
) -> QuantizeResult:
    """Post-training static INT8 quantisation in QDQ format.

    ``calibration_data`` is an iterable of input dicts (one model run each), or an
    array for a single-input model (split into runs of ``calibration_batch_size`` rows,
    or of the model's fixed batch size). ``eval_data`` (same forms) is held-out data
    to report accuracy on. ``activation_type='uint8'`` with ``weight_type='int8'`` is
    ONNX Runtime's advice for x86; set ``reduce_range=True`` on x86 CPUs without VNNI
    if accuracy suffers from saturation. ``percentile`` applies to
    ``method='percentile'``. ``fold_constants`` None folds when needed (see the module
    note). ``output_name`` picks the output compared (default: the first float one).
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
    prepared, folded = _prepare(original, label, fold_constants)
    calib = to_feeds(calibration_data, prepared, calibration_batch_size, label,
                      "calibration_data", equal_runs=method != "minmax")
    evals = (None if eval_data is None
             else to_feeds(eval_data, prepared, calibration_batch_size, label, "eval_data"))
    out_name = _pick_output(prepared, output_name, label)

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
    calib_stats = compute_accuracy(prepared, quantized, calib, out_name, label=label)
    eval_stats = (None if evals is None
                  else compute_accuracy(prepared, quantized, evals, out_name, label=label))
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
) -> QuantizeResult:
    """Converts weights and activations to float16 (for GPUs).

    Uses onnxconverter-common's float16 converter when installed, otherwise the copy
    in ``onnxruntime.transformers.float16``. ``keep_io_types=True`` keeps the inputs
    and outputs float32 (Casts are inserted at the edges), so callers need not change.
    ``op_block_list`` names op types to leave in float32 (the converter's default list
    when None). With ``eval_data`` both models run on ``providers`` and the error is
    reported; ONNX Runtime's CPU provider lacks fp16 kernels for some ops (Conv on
    x86), for which pass a GPU provider or no eval_data.
    """
    try:
        from onnxconverter_common import float16 as _f16
    except ImportError:  # pragma: no cover - depends on the install
        from onnxruntime.transformers import float16 as _f16

    original, label = _load(model)
    prepared, folded = _prepare(original, label, fold_constants)
    evals = (None if eval_data is None
             else to_feeds(eval_data, prepared, eval_batch_size, label, "eval_data"))
    out_name = _pick_output(prepared, output_name, label)
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
        prepared, converted, evals, out_name, label=label, providers=providers))
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
    output_name: str,
    *,
    label: str = "model",
    providers: Sequence[str] = ("CPUExecutionProvider",),
) -> AccuracyStats:
    """Runs both models on ``feeds`` and compares ``output_name`` (see AccuracyStats)."""
    ref = _run_all(reference, feeds, output_name, label, providers)
    new = _run_all(candidate, feeds, output_name, label, providers)
    ref = ref.astype(np.float64).reshape(ref.shape[0], -1)
    new = new.astype(np.float64).reshape(new.shape[0], -1)
    diff = np.abs(new - ref)
    top1 = None
    if ref.shape[1] > 1:
        top1 = float(np.mean(ref.argmax(axis=1) == new.argmax(axis=1)))
    return AccuracyStats(
        num_samples=int(ref.shape[0]),
        output_name=output_name,
        top1_agreement=top1,
        max_abs_error=float(diff.max()) if diff.size else 0.0,
        mean_abs_error=float(diff.mean()) if diff.size else 0.0,
    )


# -- helpers ---------------------------------------------------------------------------


def _load(model: onnx.ModelProto | str | os.PathLike[str]) -> tuple[onnx.ModelProto, str]:
    if isinstance(model, onnx.ModelProto):
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        return copy, model.graph.name or "<ModelProto>"
    if not isinstance(model, (str, os.PathLike)):
        raise QuantizeConfigError(
            f"model is a {type(model).__name__}; pass an onnx.ModelProto or the path of "
            "an .onnx file",
            field_name="model", value=type(model).__name__,
        )
    path = os.fspath(model)
    if not os.path.isfile(path):
        raise QuantizeModelError(
            f"model file {path!r} does not exist; pass the path of an .onnx file",
            stage="load", model=path,
        )
    try:
        loaded = onnx.load_model(path)
    except Exception as e:
        raise QuantizeModelError(
            f"{path!r} is not a readable ONNX model ({type(e).__name__}: {e}); pass an "
            ".onnx file saved by onnx.save_model or an exporter",
            stage="load", model=path, detail=repr(e),
        ) from e
    if not loaded.graph.node:
        raise QuantizeModelError(
            f"{path!r} parsed as an ONNX model with no nodes, so it is not one; pass an "
            ".onnx file saved by onnx.save_model or an exporter",
            stage="load", model=path,
        )
    return loaded, path


def _opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    return 0


def _needs_folding(model: onnx.ModelProto) -> bool:
    """True when some node computes from constants alone (ConstantOfShape weights,
    Constant nodes): the quantiser would not see those tensors as weights."""
    const = {t.name for t in model.graph.initializer}
    for node in model.graph.node:  # nodes are topologically sorted in valid ONNX
        if node.op_type == "Constant":
            return True
        if node.input and all(i in const or not i for i in node.input):
            return True
    return False


def _tidy_inputs(model: onnx.ModelProto) -> None:
    """Drops graph inputs that are initializers or unused (IR 3 listed every weight as
    an input; folding leaves the shape inputs dangling). Both confuse the fp16
    converter and make initializers overridable."""
    used = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
    inits = {t.name for t in model.graph.initializer}
    keep = [i for i in model.graph.input if i.name not in inits and i.name in used]
    if len(keep) != len(model.graph.input):
        del model.graph.input[:]
        model.graph.input.extend(keep)
        # IR 4 is the version from which initializers need not be inputs.
        model.ir_version = max(model.ir_version, 4)
    # ONNX Runtime's optimiser declares every domain it knows; keep the ones used.
    used_domains = {n.domain for n in model.graph.node} | {""}
    keep_opsets = [o for o in model.opset_import if o.domain in used_domains or o.domain == "ai.onnx"]
    if len(keep_opsets) != len(model.opset_import):
        del model.opset_import[:]
        model.opset_import.extend(keep_opsets)


def _prepare(
    model: onnx.ModelProto, label: str, fold_constants: bool | None
) -> tuple[onnx.ModelProto, bool]:
    """Folds constants if needed, tidies inputs and brings the opset to 13 or later
    (see the module note). Returns the fp32 baseline and whether it was folded."""
    fold = _needs_folding(model) if fold_constants is None else fold_constants
    if fold:
        model = _fold_with_ort(model, label)
    _tidy_inputs(model)
    if _opset(model) < _MIN_QDQ_OPSET:
        try:
            model = onnx.version_converter.convert_version(model, _MIN_QDQ_OPSET)
        except Exception as e:
            raise QuantizeModelError(
                f"converting {label} from opset {_opset(model)} to {_MIN_QDQ_OPSET} failed: "
                f"{e}; export the model at opset >= {_MIN_QDQ_OPSET}",
                stage="fold", model=label, detail=repr(e),
            ) from e
    return model, fold


def _fold_with_ort(model: onnx.ModelProto, label: str) -> onnx.ModelProto:
    with tempfile.TemporaryDirectory(prefix="splitinfer-fold-") as tmp:
        out = os.path.join(tmp, "folded.onnx")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.optimized_model_filepath = out
        options.log_severity_level = 3  # the unused-initializer warnings are expected
        try:
            ort.InferenceSession(model.SerializeToString(), options,
                                 providers=["CPUExecutionProvider"])
            folded = onnx.load_model(out)
        except Exception as e:
            raise QuantizeModelError(
                f"constant folding of {label} with ONNX Runtime's basic optimisations failed: "
                f"{e}; check that the model loads in ONNX Runtime, or pass "
                "fold_constants=False if its weights are initializers already",
                stage="fold", model=label, detail=repr(e),
            ) from e
    logger.info("folded constants of %s: %d -> %d nodes, %d initializers", label,
                len(model.graph.node), len(folded.graph.node), len(folded.graph.initializer))
    return folded


def _pick_output(model: onnx.ModelProto, output_name: str | None, label: str) -> str:
    outputs = [o.name for o in model.graph.output]
    if output_name is not None:
        if output_name not in outputs:
            raise QuantizeConfigError(
                f"output_name={output_name!r} is not an output of {label}; its outputs are "
                f"{outputs}",
                field_name="output_name", value=output_name,
            )
        return output_name
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)
    for o in model.graph.output:
        if o.type.tensor_type.elem_type in floats:
            return o.name
    raise QuantizeConfigError(
        f"{label} has no float output to compare (outputs {outputs}); quantisation needs "
        "a float model",
        field_name="output_name", value=None,
    )


def _run_all(
    model: onnx.ModelProto, feeds: Feeds, output_name: str, label: str,
    providers: Sequence[str],
) -> np.ndarray:
    try:
        options = ort.SessionOptions()
        options.log_severity_level = 3
        session = ort.InferenceSession(model.SerializeToString(), options,
                                       providers=list(providers))
        outs = [session.run([output_name], feed)[0] for feed in feeds]
    except Exception as e:
        raise QuantizeModelError(
            f"running {label} on {list(providers)} to measure accuracy failed: {e}; "
            "if a kernel is missing (fp16 on CPU), evaluate on a GPU provider",
            stage="evaluate", model=label, detail=repr(e),
        ) from e
    return np.concatenate(outs, axis=0)
