"""What the agent plans and encodes with besides the model: the graph sized at model.yaml's
declared inputs, and the image normalisation the accuracy table was measured with.

[Note: agent graph sizes]
A model with symbolic dims besides the batch (an image's H and W, a sequence length) has
boundary tensors of unknown size, and the planner prices an unknown size far above any
real one: planned on such a graph, the agent's frontier holds no cut inside the model
and no codec of the model input. The registry plans on the graph built at model.yaml's
``input_shapes`` and ``sample_inputs`` ([Note: planned at the declared shapes] in
cluster/_registry_sizes.py); GetArtifacts ships model.yaml (and the samples' .npz where
it ships that file), so the agent builds the same graph here and plans with the same
sizes. Heads and tails are still cut from the graph built without them, so they serve
every shape; a cut id names layers by index, so where the two graphs group the nodes
into different layers the agent plans on the unsized graph, as without declared inputs.
"""

from __future__ import annotations

import io
import logging
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np
import yaml

from cluster.protocol.errors import EncodingError
from cluster.protocol.lossy import ImageNorm
from partitioner import LayerGraph, PartitionError, build_graph
from planner import PlannerError
from planner.accuracy import AccuracyTable

__all__ = ["declared_inputs", "image_norm", "planning_graph"]

logger = logging.getLogger(__name__)


def image_norm(files: Mapping[str, bytes]) -> ImageNorm | None:
    """The normalisation of the shipped accuracy.json (`AccuracyTable.image_norm`); None
    without a table, when it fitted each sample's range, or when it is unusable (logged)."""
    text = files.get("accuracy.json")
    if text is None:
        return None
    try:
        d = AccuracyTable.from_json(text.decode("utf-8")).image_norm
        return None if d is None else ImageNorm.from_dict(dict(d))
    except (UnicodeDecodeError, PlannerError, EncodingError, KeyError, TypeError, ValueError) as e:
        logger.warning("the image normalisation of the gateway's accuracy.json is unusable (%s); image codecs fit "
                       "each channel's range", e)
        return None


def _shape(name: str, dims: Any) -> tuple[int, ...]:
    if isinstance(dims, str):
        from partitioner.shapes import parse_input_shape

        return parse_input_shape(dims.rpartition("=")[2])[1]
    if (isinstance(dims, (list, tuple)) and dims
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims)):
        return tuple(dims)
    raise ValueError(f"input_shapes[{name!r}]={dims!r} is not a shape")


def declared_inputs(files: Mapping[str, bytes]) -> tuple[dict[str, tuple[int, ...]], dict[str, np.ndarray] | None]:
    """(input_shapes, sample inputs) of the shipped model.yaml: its ``input_shapes``, and
    the arrays of its ``sample_inputs`` file where the gateway shipped that file (else
    None). Raises ValueError naming what is unusable."""
    text = files.get("model.yaml")
    if text is None:
        return {}, None
    try:
        doc = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"model.yaml is not YAML ({e})") from e
    if not isinstance(doc, Mapping):
        raise ValueError("model.yaml is not a mapping")
    raw = doc.get("input_shapes") or {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"input_shapes={raw!r} is not a mapping of input names to shapes")
    try:
        shapes = {str(k): _shape(str(k), v) for k, v in raw.items()}
    except PartitionError as e:
        raise ValueError(str(e)) from e
    rel = doc.get("sample_inputs")
    data = files.get(rel) if isinstance(rel, str) and rel else None
    if data is None:
        return shapes, None
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            return shapes, {k: np.asarray(z[k]) for k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise ValueError(f"sample_inputs {rel!r} is not an .npz of arrays ({e})") from e


def _same_layers(a: LayerGraph, b: LayerGraph) -> bool:
    def layers(g: LayerGraph) -> list[tuple]:
        return [(x.nodes, x.const_nodes, x.inputs, x.outputs) for x in g.layers]

    return a.inputs == b.inputs and a.outputs == b.outputs and layers(a) == layers(b)


def planning_graph(model_path: str, graph: LayerGraph, files: Mapping[str, bytes]) -> LayerGraph:
    """``graph`` (the splitter's, built from ``model_path`` without declared inputs) built
    again at the shipped model.yaml's inputs, for planning ([Note: agent graph sizes]);
    ``graph`` itself without declared inputs, where they are unusable (logged), or where
    the layers differ (logged)."""
    try:
        shapes, samples = declared_inputs(files)
    except ValueError as e:
        logger.warning("planning without model.yaml's input sizes: %s", e)
        return graph
    if not shapes and samples is None:
        return graph
    try:
        sized = build_graph(model_path, name=graph.model, input_shapes=shapes or None, inputs=samples)
    except PartitionError as e:
        logger.warning("planning without model.yaml's input sizes: the graph does not build at them (%s)", e)
        return graph
    if not _same_layers(graph, sized):
        logger.warning("%s: the layers differ when built at model.yaml's input sizes; planning without them",
                       graph.model)
        return graph
    logger.info("planning %s at model.yaml's input sizes (%s)", graph.model,
                ", ".join(f"{k}={'x'.join(map(str, v))}" for k, v in shapes.items()) or "sample inputs")
    return sized
