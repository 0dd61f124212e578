"""Profiling a model whose integer input sets shapes: its sample inputs run at their own
batch, never as rows cut to batch 1 beside sizes written for batch 2."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from partitioner import build_graph
from tests.unit._shape_models import reshape_by_input
from workers.profile import measure
from workers.profile._trace import ProfilingError

SAMPLES = {"x": np.linspace(-1, 1, 24, dtype=np.float32).reshape(2, 12), "shape": np.array([2, 6, 2], np.int64)}


def test_profile_times_layers_at_the_samples_own_batch_when_a_shape_input_holds_it():
    model = reshape_by_input(onnx.TensorProto.INT64)
    graph = build_graph(model)
    got = measure(model, graph, threads=1, runs=1, warmup=0, progress=False, inputs=SAMPLES, batch_sizes=(1, 2))
    assert got.profile.batch == 2
    assert set(got.profile.layers) == set(range(len(graph)))
    assert got.profile.batch_ms is None and "batch kept at the sample inputs' 2" in got.batch_note


def test_profile_at_another_batch_than_the_samples_names_the_shape_input_and_the_fix():
    model = reshape_by_input(onnx.TensorProto.INT64)
    with pytest.raises(ProfilingError, match=r"batch 4: its integer input\(s\) shape set shapes.*batch 2"):
        measure(model, build_graph(model), threads=1, runs=1, warmup=0, progress=False, inputs=SAMPLES, batch=4)


def test_a_shape_input_that_leaves_the_batch_to_the_data_is_still_cut_to_batch_1():
    model = reshape_by_input(onnx.TensorProto.INT64)
    samples = {"x": np.ones((3, 12), np.float32), "shape": np.array([-1, 6, 2], np.int64)}
    got = measure(model, build_graph(model), threads=1, runs=1, warmup=0, progress=False, inputs=samples)
    assert got.profile.batch == 1
