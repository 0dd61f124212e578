"""The fp32 model that workers.quantize starts from: loaded, constants folded when
needed, inputs tidied, opset raised to 13 (the reasons are workers.quantize's module
note); and the test for a model that is quantised already."""

from __future__ import annotations

import logging
import os
import tempfile
from collections import Counter

import onnx
import onnx.version_converter
import onnxruntime as ort

from partitioner.subgraphs import node_reads, subgraphs
from workers.errors import QuantizeConfigError, QuantizeModelError

__all__ = ["graph_reads", "load", "opset", "prepare", "quantized_ops"]

logger = logging.getLogger(__name__)

_MIN_QDQ_OPSET = 13  # per-channel QDQ needs the axis attribute of opset 13

# Ops that only a quantised model holds. Besides these, every op named QLinear*,
# DynamicQuantize* or QOrdered*, or with "Integer" in its name (ConvInteger,
# MatMulInteger, MatMulIntegerToFloat).
_QUANTIZED_OPS = frozenset({
    "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QGemm", "QAttention",
    "QEmbedLayerNormalization", "MatMulNBits", "MatMulBnb4", "QMoE",
})
_QUANTIZED_PREFIXES = ("QLinear", "DynamicQuantize", "QOrdered")


def _all_nodes(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """Every node of ``graph`` and of its subgraphs, at any depth."""
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        nodes.append(node)
        for sub in subgraphs(node):
            nodes.extend(_all_nodes(sub))
    return nodes


def graph_reads(graph: onnx.GraphProto) -> set[str]:
    """Every value name read by ``graph``'s nodes, including what If/Loop/Scan bodies
    read from the enclosing scopes (partitioner.subgraphs' note on outer-scope reads)."""
    return {name for node in graph.node for name in node_reads(node)}


def quantized_ops(model: onnx.ModelProto) -> Counter[str]:
    """How many nodes of each quantised op type the model holds, subgraphs included;
    empty for a float model."""
    return Counter(
        n.op_type for n in _all_nodes(model.graph)
        if n.op_type in _QUANTIZED_OPS or n.op_type.startswith(_QUANTIZED_PREFIXES)
        or "Integer" in n.op_type
    )


def load(model: onnx.ModelProto | str | os.PathLike[str]) -> tuple[onnx.ModelProto, str]:
    """A copy of the model (it is changed in place later) and a label for messages."""
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


def opset(model: onnx.ModelProto) -> int:
    """The model's ai.onnx opset (0 when it imports none)."""
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
    """Drops graph inputs that are initializers or that nothing reads (IR 3 listed every
    weight as an input; folding leaves the shape inputs dangling). Both confuse the fp16
    converter and make initializers overridable. An input that only an If/Loop/Scan body
    reads is read, and stays."""
    used = graph_reads(model.graph) | {o.name for o in model.graph.output}
    inits = {t.name for t in model.graph.initializer}
    keep = [i for i in model.graph.input if i.name not in inits and i.name in used]
    if len(keep) != len(model.graph.input):
        del model.graph.input[:]
        model.graph.input.extend(keep)
        # IR 4 is the version from which initializers need not be inputs.
        model.ir_version = max(model.ir_version, 4)
    # ONNX Runtime's optimiser declares every domain it knows; keep the ones used.
    used_domains = {n.domain for n in _all_nodes(model.graph)} | {""}
    keep_opsets = [o for o in model.opset_import if o.domain in used_domains or o.domain == "ai.onnx"]
    if len(keep_opsets) != len(model.opset_import):
        del model.opset_import[:]
        model.opset_import.extend(keep_opsets)


def prepare(
    model: onnx.ModelProto, label: str, fold_constants: bool | None
) -> tuple[onnx.ModelProto, bool]:
    """Folds constants if needed, tidies inputs and brings the opset to 13 or later
    (see workers.quantize's module note). Returns the fp32 baseline and whether it was
    folded."""
    fold = _needs_folding(model) if fold_constants is None else fold_constants
    if fold:
        model = _fold_with_ort(model, label)
    _tidy_inputs(model)
    if opset(model) < _MIN_QDQ_OPSET:
        try:
            model = onnx.version_converter.convert_version(model, _MIN_QDQ_OPSET)
        except Exception as e:
            raise QuantizeModelError(
                f"converting {label} from opset {opset(model)} to {_MIN_QDQ_OPSET} failed: "
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
