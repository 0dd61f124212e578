"""The layer graph a version's frontier is planned on: sizes from model.yaml's inputs.

[Note: planned at the declared shapes]
A model with symbolic dims besides the batch (an image's H and W, a sequence length)
has boundary tensors of unknown size, and the planner prices an unknown size far above
any real one: planned on such a graph, a frontier holds no cut inside the model.
model.yaml's ``input_shapes`` and ``sample_inputs`` give the sizes, so the frontier is
planned on a graph built with them (``partitioner.build_graph(input_shapes=, inputs=)``).
Tails are still cut from the graph built without them (the registry's ``Splitter``):
a graph with fixed sizes types a tail's inputs at those sizes, and the tail would then
refuse every other size, where it now serves each request at its own shape ([Note: any
shape] in workers/engine.py). A cut id names layers by index, so the two graphs must
group the nodes into the same layers; where they do not, the frontier is planned on the
splitter's graph, as without declared inputs, and the difference is logged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["same_layers", "sized_graph"]

logger = logging.getLogger(__name__)


def same_layers(a: Any, b: Any) -> bool:
    """Whether two layer graphs group the same nodes into the same layers, in the same
    order, reading and writing the same tensors: a cut of one is then the same cut of the other."""
    def layers(g: Any) -> list[tuple]:
        return [(x.nodes, x.const_nodes, x.inputs, x.outputs) for x in g.layers]

    return a.inputs == b.inputs and a.outputs == b.outputs and layers(a) == layers(b)


def sized_graph(model: Any, graph: Any, *, input_shapes: Mapping[str, tuple[int, ...]],
                samples: Mapping[str, np.ndarray] | None) -> Any:
    """``graph`` (the splitter's, built from ``model``, a path or a ModelProto, without
    declared inputs) built again with ``input_shapes`` and ``samples``, for planning
    ([Note: planned at the declared shapes]); ``graph`` itself without either, or where
    the layers differ.
    Raises PartitionError where the partitioner refuses the declared inputs."""
    if not input_shapes and samples is None:
        return graph
    from partitioner import build_graph

    sized = build_graph(model, name=graph.model, input_shapes=dict(input_shapes) or None, inputs=samples)
    if not same_layers(graph, sized):
        logger.warning("%s: the layers differ when built at the declared input shapes; the frontier is planned "
                       "without their sizes", graph.model)
        return graph
    return sized
