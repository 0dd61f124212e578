"""A rank only a recorded run knows: the segment takes it, with the batch as a symbol and
every other dim open, so it serves sizes other than the samples'."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from partitioner import PartitionError, Splitter, build_graph
from partitioner.export import with_recorded_ranks
from tests.unit._shape_models import reshape_by_input

SAMPLES = {"x": np.linspace(-1, 1, 12, dtype=np.float32)[None], "shape": np.array([1, 3, 4], np.int64)}


def _run(model, feed):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {k: feed[k] for k in names})))


def test_a_lost_rank_is_taken_from_the_run_with_only_the_batch_named():
    model = reshape_by_input()
    graph = build_graph(model)
    assert graph.tensor["m"].shape is None and graph.tensor["y"].shape is None
    typed = with_recorded_ranks(graph, build_graph(model, inputs=SAMPLES))
    assert typed.tensor["m"].shape == ("N", "?", "?") and typed.tensor["y"].shape == ("N", "?")
    assert typed.tensor["m"].bytes_per_sample is None  # the size stays unknown
    assert typed.tensor["x"] == graph.tensor["x"] and typed.tensor["shape"].shape == ("k",)


def test_without_the_rank_the_cut_is_refused_and_with_it_the_tail_serves_other_sizes():
    model = reshape_by_input()
    graph = build_graph(model)
    with pytest.raises(PartitionError, match="'m' of .* rank is unknown"):
        Splitter(model, graph).split([0])
    splitter = Splitter(model, with_recorded_ranks(graph, build_graph(model, inputs=SAMPLES)))
    head, tail = splitter.split([0])
    feed = {"x": np.arange(24, dtype=np.float32).reshape(2, 12) / 24, "shape": np.array([2, 4, 3], np.int64)}
    whole = _run(model, feed)["y"]
    got = {**feed, **_run(head.model, feed)}
    np.testing.assert_allclose(_run(tail.model, got)["y"], whole, rtol=1e-5, atol=1e-6)
    assert whole.shape == (2, 4)  # neither the samples' batch nor their (3, 4)
