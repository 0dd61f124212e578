"""Serving any shape: an engine over symbolic non-batch dims, warm-up that never invents
values for integer inputs that set shapes, and a batch check that runs on sample inputs."""

from __future__ import annotations

import logging

import numpy as np
import onnxruntime as ort
import pytest

from tests.serving_models import any_hw_model, mask_model, reshape_by_input_model
from tests.unit._shape_models import recurrent_state
from workers.coldstart import check_batching, make_batch_feed
from workers.engine import Engine, EngineConfig
from workers.errors import EngineLoadError, InputError
from workers.rewrite import shape_feeding_inputs


@pytest.fixture
def config(tmp_path) -> EngineConfig:
    return EngineConfig(cache_dir=str(tmp_path / "ort"), intra_op_threads=1)


def _reference(model, feed):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feed)[0]


def test_an_engine_serves_two_shapes_of_symbolic_h_and_w(config):
    model = any_hw_model()
    engine = Engine(model, config)
    assert engine.any_shape and engine.batch_safe
    assert engine.inputs[0].shape == (None, 4, None, None) and engine.inputs[0].describe() == "float32[N,4,*,*]"
    rng = np.random.default_rng(0)
    for shape in ((1, 4, 5, 7), (2, 4, 3, 3)):
        x = rng.standard_normal(shape).astype(np.float32)
        y = engine.run({"x": x})["y"]
        assert y.shape == shape
        np.testing.assert_allclose(y, _reference(model, {"x": x}), rtol=1e-4, atol=1e-5)


def test_run_batch_stacks_only_requests_of_one_shape(config):
    model = any_hw_model()
    engine = Engine(model, config)
    rng = np.random.default_rng(1)
    small = [rng.standard_normal((1, 4, 3, 3)).astype(np.float32) for _ in range(2)]
    large = rng.standard_normal((1, 4, 6, 2)).astype(np.float32)
    out = engine.run_batch([{"x": small[0]}, {"x": small[1]}, {"x": large}])
    assert [o["y"].shape for o in out] == [(1, 4, 3, 3), (1, 4, 3, 3), (1, 4, 6, 2)]
    for o, x in zip(out, [*small, large]):
        np.testing.assert_allclose(o["y"], _reference(model, {"x": x}), rtol=1e-4, atol=1e-5)
    assert engine.stats().run_count == 2  # the two small ones as one batch, the large one alone


def test_the_fixed_dims_rank_and_dtype_are_still_checked(config):
    engine = Engine(any_hw_model(), config)
    with pytest.raises(InputError, match=r"has shape float32\[1,3,5,5\], expected float32\[N,4,\*,\*\]"):
        engine.run({"x": np.zeros((1, 3, 5, 5), np.float32)})
    with pytest.raises(InputError, match="expected float32"):
        engine.run({"x": np.zeros((1, 4, 5), np.float32)})
    with pytest.raises(InputError, match="has dtype float64"):
        engine.run({"x": np.zeros((1, 4, 5, 5))})
    assert engine.run({"x": np.zeros((1, 4, 2, 2), np.float32)})["y"].shape == (1, 4, 2, 2)


def test_shape_feeding_inputs_finds_integers_that_reach_a_shape_argument():
    assert shape_feeding_inputs(reshape_by_input_model()) == ("shape",)
    assert shape_feeding_inputs(mask_model()) == ()  # the mask only reaches arithmetic
    assert shape_feeding_inputs(any_hw_model()) == ()


def test_warm_up_without_samples_invents_no_value_for_a_shape_input_and_serves(config, caplog):
    with caplog.at_level(logging.INFO, logger="workers.engine"):
        engine = Engine(reshape_by_input_model(), config)
    assert engine.warmed_up.startswith("skipped: its integer inputs shape set shapes")
    assert "warm-up skipped: its integer inputs shape set shapes" in caplog.text
    x = np.arange(6, dtype=np.float32)[None]
    y = engine.run({"x": x, "shape": np.array([3, 2])})["y"]
    np.testing.assert_array_equal(y, x.reshape(3, 2))


def test_warm_up_runs_on_sample_inputs(config):
    samples = {"x": np.ones((1, 6), np.float32), "shape": np.array([2, 3])}
    engine = Engine(reshape_by_input_model(), config, sample_inputs=samples)
    assert engine.warmed_up == "samples"
    assert engine.run({"x": np.ones((1, 6), np.float32), "shape": np.array([6, 1])})["y"].shape == (6, 1)


def test_sample_inputs_that_do_not_fit_fail_the_load_with_the_reason(config):
    with pytest.raises(EngineLoadError, match="sample inputs of .* do not fit it") as e:
        Engine(any_hw_model(), config, sample_inputs={"x": np.ones((1, 3, 4, 4), np.float32)})
    assert e.value.stage == "warmup"


def test_the_batch_check_runs_on_sample_inputs_not_dummy_masks(config):
    model = mask_model()
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    # A 0/1 dummy mask of one column is always 1, where this model divides by zero.
    assert "differs" in check_batching(sess, 2)
    samples = {"x": np.ones((1, 3), np.float32), "mask": np.array([[7]])}
    assert check_batching(sess, 2, samples=samples) == ""
    assert not Engine(model, config).batch_safe
    engine = Engine(model, config, sample_inputs=samples)
    assert engine.batch_safe and engine.warmed_up == "samples"


def test_a_batch_feed_from_one_sample_has_distinct_float_rows_and_real_integers():
    samples = {"x": np.ones((1, 3), np.float32), "mask": np.array([[7]])}
    feed = make_batch_feed(samples, 3, np.random.default_rng(0))
    assert feed["x"].shape == (3, 3) and feed["mask"].tolist() == [[7], [7], [7]]
    np.testing.assert_array_equal(feed["x"][0], samples["x"][0])
    assert len({row.tobytes() for row in feed["x"]}) == 3


def test_without_samples_a_shape_input_makes_batching_unsafe_without_running(config):
    sess = ort.InferenceSession(reshape_by_input_model().SerializeToString(), providers=["CPUExecutionProvider"])
    reason = check_batching(sess, 2, shape_inputs=("shape",))
    assert "integer inputs shape set shapes" in reason and "sample_inputs" in reason


def test_a_state_with_a_fixed_dim_0_does_not_set_the_batch_of_an_engine_unsafe_to_batch(config):
    model = recurrent_state()
    order = sorted(model.graph.input, key=lambda i: i.name != "h")  # h[2,N,4] first: its dim 0 is layers
    del model.graph.input[:]
    model.graph.input.extend(order)
    engine = Engine(model, config)
    assert not engine.batch_safe
    assert engine.buckets == (1,)
    assert {s.name: s.shape for s in engine.inputs}["x"] == (1, 4)
    rng = np.random.default_rng(2)
    feed = {"x": rng.standard_normal((1, 4)).astype(np.float32), "h": rng.standard_normal((2, 1, 4)).astype(np.float32)}
    np.testing.assert_allclose(engine.run(feed)["y"], _reference(model, feed), rtol=1e-5, atol=1e-6)


def test_a_shape_vector_longer_than_the_bucket_is_neither_pinned_nor_cut_to_rows(config):
    from tests.unit._shape_models import reshape_by_input

    model = reshape_by_input()  # shape[k]: a length, not rows
    samples = {"x": np.ones((1, 12), np.float32), "shape": np.array([1, 3, 4], np.int64)}
    engine = Engine(model, config, sample_inputs=samples)
    assert engine.warmed_up == "samples" and engine.max_batch == 1
    feed = {"x": np.linspace(-1, 1, 12, dtype=np.float32)[None], "shape": np.array([1, 2, 2, 3], np.int64)}
    np.testing.assert_allclose(engine.run(feed)["y"], _reference(model, feed), rtol=1e-5, atol=1e-6)


def test_an_engine_unsafe_to_batch_runs_at_the_samples_batch_that_its_shape_input_holds(config):
    from tests.unit._shape_models import reshape_by_input

    model = reshape_by_input()
    samples = {"x": np.linspace(-1, 1, 24, dtype=np.float32).reshape(2, 12), "shape": np.array([2, 6, 2], np.int64)}
    engine = Engine(model, config, sample_inputs=samples)
    assert not engine.batch_safe and engine.buckets == (2,) and engine.warmed_up == "samples"
    np.testing.assert_allclose(engine.run(samples)["y"], _reference(model, samples), rtol=1e-5, atol=1e-6)
