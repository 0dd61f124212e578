"""ONNX model -> layer graph; cuts; segment export and verification; memory plans.

Imports onnx and numpy only (ONNX Runtime is loaded lazily by `verify` and
`run_segments`, the partitioner's checks that segments equal the model, and by shape
inference for what ONNX cannot infer).
"""

from partitioner.build import FUSABLE_OPS, build_graph, load_model
from partitioner.cuts import (
    Cut,
    boundary,
    boundary_bytes,
    candidate_cuts,
    chain_points,
    cloud_outputs,
    device_outputs,
    down_closure,
    is_down_closed,
    make_cut,
    make_tiers,
    prefix_cut,
    random_cut,
    tier_layers,
)
from partitioner.errors import PartitionError
from partitioner.export import Segment, Splitter, make_inputs, run_segments, save_segment, split, split_tiers, verify
from partitioner.graph import BATCH, UNKNOWN_DIM, Layer, LayerGraph, TensorInfo, Total
from partitioner.memplan import MemoryPlan, plan_memory
from partitioner.zoo import ZOO_MODELS, load_zoo, randomize_weights, zoo_path

__all__ = [
    "BATCH", "FUSABLE_OPS", "UNKNOWN_DIM", "ZOO_MODELS",
    "Cut", "Layer", "LayerGraph", "MemoryPlan", "PartitionError", "Segment", "Splitter", "TensorInfo", "Total",
    "boundary", "boundary_bytes", "build_graph", "candidate_cuts", "chain_points",
    "cloud_outputs", "device_outputs", "down_closure", "is_down_closed", "load_model",
    "load_zoo", "make_cut", "make_inputs", "make_tiers", "plan_memory", "prefix_cut",
    "random_cut", "randomize_weights", "run_segments", "save_segment", "split",
    "split_tiers", "tier_layers", "verify", "zoo_path",
]
