"""Cold start: graph rewrites, weight files, artefact keys and cache, transformer fusion."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper
from onnx.external_data_helper import uses_external_data

from tests.unit._engine_models import (
    make_batch_mixing_model,
    make_small_cnn,
    make_transformer_block,
    zoo_model_path,
)
from workers import coldstart
from workers.coldstart import Artefact, check_batching, compute_artefact_key, externalise_weights
from workers.rewrite import (
    BATCH_DIM,
    fuse_transformer,
    looks_like_transformer,
    make_batch_dynamic,
    strip_initializer_inputs,
)
from workers.engine import Engine, EngineConfig
from workers.errors import BatchingUnsafeError, EngineLoadError

KEY_ARGS = dict(provider="cpu", opt_level="all", dynamic_batch=True, batch_check_size=2, transformer_fusion=True)


def _ort_run(model: onnx.ModelProto, feed: dict) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)


def test_strip_initializer_inputs_leaves_only_real_inputs():
    model = make_small_cnn()
    assert len(model.graph.input) > 1
    stripped = strip_initializer_inputs(model)
    assert [i.name for i in stripped.graph.input] == ["x"]
    assert stripped.ir_version >= 4
    assert len(model.graph.input) > 1  # the input model is not modified


def test_make_batch_dynamic_rewrites_inputs_outputs_and_reshape():
    model, rewrites = make_batch_dynamic(strip_initializer_inputs(make_small_cnn()))
    assert rewrites == ("flatten: [1, -1] -> [0, -1]",)
    for vi in list(model.graph.input) + list(model.graph.output):
        assert vi.type.tensor_type.shape.dim[0].dim_param == BATCH_DIM
    shape = next(t for t in model.graph.initializer if t.name == "flat_shape")
    assert numpy_helper.to_array(shape).tolist() == [0, -1]
    x = np.random.default_rng(0).standard_normal((3, 3, 8, 8)).astype(np.float32)
    assert _ort_run(model, {"x": x})[0].shape == (3, 2048)


def test_make_batch_dynamic_keeps_weight_reshapes_and_shared_constants():
    model = strip_initializer_inputs(make_small_cnn())
    g = model.graph
    # A Reshape of a weight (not on the data path) must keep its leading 1.
    g.initializer.append(numpy_helper.from_array(np.array([1, 4, 3, 3, 3], np.int64), "w_shape"))
    g.node.insert(0, helper.make_node("Reshape", ["conv_w", "w_shape"], ["w5"], name="weight_reshape"))
    g.output.append(helper.make_tensor_value_info("w5", onnx.TensorProto.FLOAT, [1, 4, 3, 3, 3]))
    # A shape constant used twice gets a private rewritten copy, added once.
    g.node.append(helper.make_node("Reshape", ["r", "flat_shape"], ["f2"], name="flatten2"))
    g.output.append(helper.make_tensor_value_info("f2", onnx.TensorProto.FLOAT, [1, 256]))
    dyn, rewrites = make_batch_dynamic(model)
    assert len(rewrites) == 2 and all(r.startswith("flatten") for r in rewrites)
    names = [t.name for t in dyn.graph.initializer]
    assert names.count("flat_shape__batch") == 1
    assert numpy_helper.to_array(next(t for t in dyn.graph.initializer if t.name == "w_shape")).tolist()[0] == 1


@pytest.mark.parametrize("shape, fragment", [([3, 16], "fixed dimension 0 of 3"), ([], "scalar")])
def test_make_batch_dynamic_refuses_unbatchable_inputs(shape, fragment):
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, shape)],
    )
    with pytest.raises(BatchingUnsafeError, match=fragment) as info:
        make_batch_dynamic(helper.make_model(graph))
    assert info.value.reason


def test_externalise_folds_generators_into_aligned_weights(tmp_path):
    model = strip_initializer_inputs(make_small_cnn())
    weights = tmp_path / "w.bin"
    out, folded = externalise_weights(model, str(weights))
    assert folded == 1
    assert "ConstantOfShape" not in {n.op_type for n in out.graph.node}
    external = [t for t in out.graph.initializer if uses_external_data(t)]
    assert {t.name for t in external} == {"fc_w", "fc_b"}  # small tensors stay inline
    for t in external:
        offset = int(next(e.value for e in t.external_data if e.key == "offset"))
        assert offset % 64 == 0
    assert "conv_b__SHAPE" not in {t.name for t in out.graph.initializer}
    onnx.save(out, str(tmp_path / "m.onnx"))
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)
    got = ort.InferenceSession(str(tmp_path / "m.onnx")).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, _ort_run(make_small_cnn(), {"x": x})[0], rtol=1e-5, atol=1e-7)


def test_zoo_generators_become_initializers(tmp_path):
    model = strip_initializer_inputs(onnx.load(zoo_model_path("squeezenet")))
    out, folded = externalise_weights(model, str(tmp_path / "w.bin"))
    assert folded == 39
    assert not [n for n in out.graph.node if n.op_type == "ConstantOfShape"]
    assert os.path.getsize(tmp_path / "w.bin") >= 1_200_000 * 4


def test_artefact_key_depends_on_everything_that_changes_the_artefact():
    data = make_small_cnn().SerializeToString()
    base = compute_artefact_key(data, **KEY_ARGS)
    assert compute_artefact_key(data, **KEY_ARGS) == base and len(base) == 32
    variants = [
        dict(KEY_ARGS, provider="cuda"),
        dict(KEY_ARGS, opt_level="basic"),
        dict(KEY_ARGS, dynamic_batch=False),
        dict(KEY_ARGS, batch_check_size=4),
        dict(KEY_ARGS, transformer_fusion=False),
    ]
    keys = {compute_artefact_key(data, **v) for v in variants}
    keys.add(compute_artefact_key(make_small_cnn(seed=1).SerializeToString(), **KEY_ARGS))
    assert base not in keys and len(keys) == len(variants) + 1


def test_second_engine_loads_the_cached_artefact(tmp_path):
    cfg = EngineConfig(cache_dir=str(tmp_path), provider="cpu")
    first = Engine(make_small_cnn(), cfg)
    second = Engine(make_small_cnn(), cfg)
    assert not first.stats().from_cache and first.stats().build_ms > 0
    assert second.stats().from_cache and second.stats().build_ms == 0.0
    assert second.artefact == first.artefact
    assert sorted(os.listdir(first.artefact.directory)) == ["meta.json", "model.onnx", "weights.bin"]
    assert [d for d in os.listdir(tmp_path) if ".build-" in d] == []  # no leftovers
    x = np.zeros((1, 3, 8, 8), np.float32)
    np.testing.assert_array_equal(first.run({"x": x})["y"], second.run({"x": x})["y"])


def test_artefact_json_round_trip(tmp_path):
    art = Engine(make_small_cnn(), EngineConfig(cache_dir=str(tmp_path), provider="cpu")).artefact
    assert Artefact.from_json(art.to_json()) == art
    assert dataclasses.replace(art, fused_ops=(("Attention", 1),)).to_json() != art.to_json()


def test_check_batching_finds_batch_mixing():
    session = ort.InferenceSession(
        make_batch_dynamic(make_batch_mixing_model())[0].SerializeToString(), providers=["CPUExecutionProvider"]
    )
    assert "differs from 3 runs of batch 1" in check_batching(session, 3)
    safe = ort.InferenceSession(
        make_batch_dynamic(strip_initializer_inputs(make_small_cnn()))[0].SerializeToString(),
        providers=["CPUExecutionProvider"],
    )
    assert check_batching(safe, 3) == ""


def test_check_batching_reports_a_batch_that_does_not_run():
    # a Reshape to a hard-coded [2, -1] cannot carry the batch; it is left alone
    model = strip_initializer_inputs(make_small_cnn(reshape_batch=2))
    session = ort.InferenceSession(make_batch_dynamic(model)[0].SerializeToString(), providers=["CPUExecutionProvider"])
    assert check_batching(session, 2).startswith(("a batch of 2 does not run", "output 'y'"))


def test_transformer_fusion_finds_attention_layernorm_and_gelu():
    block = make_transformer_block()
    assert looks_like_transformer(block) and not looks_like_transformer(make_small_cnn())
    fused, stats = fuse_transformer(block)
    ops = {n.op_type for n in fused.graph.node}
    assert stats.get("Attention", 0) == 1 and "Attention" in ops
    assert stats.get("SkipLayerNormalization", 0) + stats.get("LayerNormalization", 0) == 2
    assert stats.get("BiasGelu", 0) + stats.get("Gelu", 0) + stats.get("FastGelu", 0) == 1
    assert not ops & {"Erf", "ReduceMean", "Softmax"}
    rng = np.random.default_rng(0)
    feed = {"x": rng.standard_normal((1, 8, 32)).astype(np.float32), "mask": np.array([[1] * 6 + [0] * 2], np.int64)}
    np.testing.assert_allclose(_ort_run(fused, feed)[0], _ort_run(block, feed)[0], rtol=1e-3, atol=1e-4)


def test_transformer_fusion_degrades_gracefully(monkeypatch):
    import onnxruntime.transformers.optimizer as optimizer

    def broken(*args, **kwargs):
        raise RuntimeError("fuser exploded")

    monkeypatch.setattr(optimizer, "optimize_model", broken)
    block = make_transformer_block()
    out, stats = fuse_transformer(block)
    assert stats == {} and out is block


def test_engine_runs_a_fused_transformer_in_batches(tmp_path):
    block = make_transformer_block()
    eng = Engine(block, EngineConfig(cache_dir=str(tmp_path), provider="cpu"))
    assert dict(eng.artefact.fused_ops).get("Attention") == 1
    assert eng.batch_safe, eng.batch_reason
    rng = np.random.default_rng(2)
    requests = [
        {"x": rng.standard_normal((1, 8, 32)).astype(np.float32), "mask": np.ones((1, 8), np.int64)} for _ in range(3)
    ]
    plain = ort.InferenceSession(block.SerializeToString(), providers=["CPUExecutionProvider"])
    for req, res in zip(requests, eng.run_batch(requests)):
        np.testing.assert_allclose(res["y"], plain.run(None, req)[0], rtol=1e-3, atol=1e-4)


def test_fusion_that_changes_results_is_dropped(tmp_path, monkeypatch):
    block = make_transformer_block()

    def wrong(model, **kwargs):
        bad = onnx.ModelProto()
        bad.CopyFrom(model)
        for n in bad.graph.node:
            if n.op_type == "Identity":
                n.op_type = "Neg"  # a "fusion" that flips the sign of the output
        return bad, {"Attention": 1}

    monkeypatch.setattr(coldstart, "fuse_transformer", wrong)
    eng = Engine(block, EngineConfig(cache_dir=str(tmp_path), provider="cpu"))
    assert eng.artefact.fused_ops == ()


def test_zoo_squeezenet_matches_plain_onnxruntime(tmp_path):
    path = zoo_model_path("squeezenet")
    eng = Engine(path, EngineConfig(cache_dir=str(tmp_path), provider="cpu"))
    assert eng.artefact.folded_constants == 39 and eng.batch_safe
    x = np.random.default_rng(3).standard_normal((1, 3, 224, 224)).astype(np.float32)
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"data_0": x})[0]
    np.testing.assert_allclose(eng.run({"data_0": x})["softmaxout_1"], ref, rtol=1e-4, atol=1e-6)


def test_model_ort_cannot_load_raises_optimise_error(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("NoSuchOp", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])],
    )
    with pytest.raises(EngineLoadError, match="cannot optimise the model") as info:
        Engine(helper.make_model(graph), EngineConfig(cache_dir=str(tmp_path), provider="cpu"))
    assert info.value.stage == "optimise" and info.value.model == "g"


def test_corrupt_cached_artefact_says_to_delete_it(tmp_path):
    cfg = EngineConfig(cache_dir=str(tmp_path), provider="cpu")
    art = Engine(make_small_cnn(seed=3), cfg).artefact
    with open(os.path.join(art.directory, "model.onnx"), "wb") as f:
        f.write(b"garbage")
    with pytest.raises(EngineLoadError, match="delete that directory") as info:
        Engine(make_small_cnn(seed=3), dataclasses.replace(cfg, share_weights=False))
    assert info.value.stage == "session"


def test_truncated_weights_file_says_to_rebuild(tmp_path):
    cfg = EngineConfig(cache_dir=str(tmp_path), provider="cpu")
    art = Engine(make_small_cnn(seed=4), cfg).artefact
    os.truncate(os.path.join(art.directory, "weights.bin"), 1000)
    with pytest.raises(EngineLoadError, match="cannot be mapped") as info:
        Engine(make_small_cnn(seed=4), cfg)
    assert info.value.stage == "session"
