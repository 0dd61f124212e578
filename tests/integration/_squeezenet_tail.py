"""Module-scoped fixtures shared by the Ray worker tests: a SqueezeNet tail after layer 28
and a plain single-thread ONNX Runtime session of it as the reference."""

from __future__ import annotations

import onnxruntime as ort
import pytest

import partitioner


@pytest.fixture(scope="module")
def tail():
    model = partitioner.load_zoo("squeezenet", random_weights=True)
    graph = partitioner.build_graph(model)
    _, t = partitioner.split(model, partitioner.prefix_cut(graph, 28), graph=graph)
    return t.model


@pytest.fixture(scope="module")
def reference(tail):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(tail.SerializeToString(), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return lambda inputs: dict(zip(names, sess.run(None, inputs)))
