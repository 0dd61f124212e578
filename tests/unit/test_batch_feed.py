"""Batch feeds from sample inputs keep inputs without a batch dim (shape vectors) whole,
so that the batch check, ``profile --batch`` and ``instances --after`` run such models at
their batch."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from partitioner import build_graph, make_cut, split
from workers.coldstart import batch_axes, check_batching, make_batch_feed
from workers.profile import measure
from tests.unit import _shape_models as M


def late_reshape() -> onnx.ModelProto:
    """x[N,12] -> MatMul -> MatMul -> Reshape(to input ``shape``) -> Relu -> ReduceSum: a cut
    after the first MatMul leaves the tail an integer shape input beside a batch input."""
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("MatMul", ["h", "w2"], ["h2"], name="mm2"),
             helper.make_node("Reshape", ["h2", "shape"], ["r"], name="reshape"),
             helper.make_node("Relu", ["r"], ["a"], name="relu"),
             helper.make_node("ReduceSum", ["a", "axes"], ["y"], keepdims=0, name="sum")]
    inits = [M._w("w1", 12, 12), M._w("w2", 12, 12, seed=1), numpy_helper.from_array(np.array([-1], np.int64), "axes")]
    return M._model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 12]),
                            helper.make_tensor_value_info("shape", TensorProto.INT64, ["k"])],
                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits, "late_reshape")


SAMPLES = {"x": np.linspace(-1, 1, 12, dtype=np.float32)[None], "shape": np.array([-1, 3, 4], np.int64)}


def test_a_shape_vector_is_no_batch_of_rows():
    graph = build_graph(late_reshape(), inputs=SAMPLES)
    assert batch_axes("shape", SAMPLES["shape"], graph) == () and batch_axes("x", SAMPLES["x"], graph) == (0,)
    for feed in (make_batch_feed(SAMPLES, 4, np.random.default_rng(0), graph=graph),
                 make_batch_feed(SAMPLES, 4, np.random.default_rng(0), unbatched=("shape",))):
        assert feed["shape"].tolist() == [-1, 3, 4]
        assert feed["x"].shape == (4, 12) and len({row.tobytes() for row in feed["x"]}) == 4
        np.testing.assert_array_equal(feed["x"][0], SAMPLES["x"][0])


def test_a_state_is_batched_along_its_own_batch_axis():
    graph = build_graph(M.recurrent_state())
    samples = {"x": np.ones((1, 4), np.float32), "h": np.arange(8, dtype=np.float32).reshape(2, 1, 4)}
    feed = make_batch_feed(samples, 3, np.random.default_rng(0), graph=graph)
    assert feed["x"].shape == (3, 4) and feed["h"].shape == (2, 3, 4)
    np.testing.assert_array_equal(feed["h"][:, 0], samples["h"][:, 0])
    sess = ort.InferenceSession(M.recurrent_state().SerializeToString(), providers=["CPUExecutionProvider"])
    assert check_batching(sess, 3, samples=samples, graph=graph) == ""


def test_the_batch_check_runs_a_model_whose_integer_input_sets_a_shape():
    sess = ort.InferenceSession(late_reshape().SerializeToString(), providers=["CPUExecutionProvider"])
    assert check_batching(sess, 2, samples=SAMPLES, shape_inputs=("shape",)) == ""
    fixed = dict(SAMPLES, shape=np.array([1, 3, 4], np.int64))  # a batch of 1 written into the model's input
    assert "does not run" in check_batching(sess, 2, samples=fixed, shape_inputs=("shape",))


def test_profile_times_batches_of_a_model_with_a_shape_input():
    model = late_reshape()
    graph = build_graph(model, inputs=SAMPLES)
    got = measure(model, graph, threads=1, runs=2, warmup=1, progress=False, batch_sizes=(1, 4), inputs=SAMPLES)
    assert sorted(got.profile.batch_ms or {}) == [1, 4], got.batch_note


def test_an_engine_with_a_shape_input_reads_rows_from_a_batch_input(tmp_path):
    from workers.engine import Engine, EngineConfig

    model = late_reshape()
    graph = build_graph(model, inputs=SAMPLES)
    _, tail = split(model, make_cut(graph, [0]), graph=graph)
    assert tail.inputs == ("shape", "h")  # the tail's first input holds no rows
    feed = {"h": np.ones((1, 12), np.float32), "shape": SAMPLES["shape"]}
    engine = Engine(tail.model, EngineConfig(log_severity=4, cache_dir=str(tmp_path)), name="tail",
                    sample_inputs=feed)
    assert not engine.batch_safe
    assert [s.name for s in engine.inputs] == ["h", "shape"] and engine.inputs[0].shape == (1, 12)
    assert engine.check(feed) == 1 and engine.run(feed)["y"].shape == (1, 3)


def test_instances_after_a_cut_that_leaves_the_tail_a_shape_input(tmp_path, capsys):
    from splitinfer.instances_cmd import instances_main

    np.savez(tmp_path / "s.npz", **SAMPLES)
    path = M.save(late_reshape(), tmp_path / "late.onnx")
    argv = [path, "--after", "0", "--inputs", str(tmp_path / "s.npz"), "--threads", "2", "--rounds", "1",
            "--seconds", "0.05", "--quiet"]
    assert instances_main(argv) == 0
    assert "late after layer 0 on cpu: 1 row(s) a run" in capsys.readouterr().out


def test_an_engine_never_batches_a_segment_whose_integer_input_sets_a_shape(tmp_path):
    from workers.engine import Engine, EngineConfig

    flat = {"x": SAMPLES["x"], "shape": np.array([-1], np.int64)}
    engine = Engine(late_reshape(), EngineConfig(log_severity=4, cache_dir=str(tmp_path)), name="late",
                    sample_inputs=flat)
    assert not engine.batch_safe and "shape set shapes and hold no rows" in engine.batch_reason
