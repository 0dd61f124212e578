"""Artefacts of models that real weights exposed: weights inside If branches, and a
model whose fixed batch of 1 cannot be made symbolic."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import uses_external_data

from tests.control_flow_models import if_model
from workers import coldstart
from workers.engine import Engine, EngineConfig


def _subgraph_initializers(model: onnx.ModelProto):
    for node in model.graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from a.g.initializer


def test_if_branch_weights_survive_the_artefact_round_trip(tmp_path, monkeypatch):
    # if_model's weights are small: a low threshold makes ORT save every one of them
    # (outer and inside both branches) to its external file, as it does for real sizes.
    monkeypatch.setattr(coldstart, "_EXTERNAL_MIN_BYTES", 16)
    model = if_model()
    cfg = EngineConfig(cache_dir=str(tmp_path), provider="cpu")
    eng = Engine(model, cfg)
    art_dir = eng.artefact.directory
    saved = onnx.load(os.path.join(art_dir, "model.onnx"), load_external_data=False)
    branch_inits = list(_subgraph_initializers(saved))
    assert branch_inits and not any(uses_external_data(t) for t in branch_inits)
    assert any(uses_external_data(t) for t in saved.graph.initializer)
    assert sorted(os.listdir(art_dir)) == ["meta.json", "model.onnx", "weights.bin"]

    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((1, 8)).astype(np.float32)
    for sr in (16000, 8000):  # both branches
        feed = {"x": x, "sr": np.array(sr, np.int64)}
        np.testing.assert_allclose(eng.run(feed)["prob"], ref.run(["prob"], feed)[0], rtol=1e-5, atol=1e-6)
    # a second engine reloads the cached artefact
    again = Engine(model, cfg)
    assert again.artefact.directory == art_dir
    feed = {"x": x, "sr": np.array(8000, np.int64)}
    np.testing.assert_allclose(again.run(feed)["prob"], ref.run(["prob"], feed)[0], rtol=1e-5, atol=1e-6)
