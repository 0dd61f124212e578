"""The segment engine: pinned sessions, IO binding, validation, batching, stats."""

from __future__ import annotations

import tracemalloc

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tests.unit._engine_models import CNN_CLASSES, make_batch_mixing_model, make_small_cnn
from workers._ort import select_providers
from workers.engine import Engine, EngineConfig, EngineStats, TensorSpec
from workers.errors import BatchingUnsafeError, EngineLoadError, EngineRunError, InputError, WorkerError

HAS_GPU = "CUDAExecutionProvider" in ort.get_available_providers()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("engine-cache"))


@pytest.fixture(scope="module")
def cnn_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("models") / "cnn.onnx"
    onnx.save(make_small_cnn(), str(path))
    return str(path)


@pytest.fixture(scope="module")
def engine(cnn_path, cache_dir) -> Engine:
    return Engine(cnn_path, EngineConfig(cache_dir=cache_dir, provider="cpu", intra_op_threads=1))


@pytest.fixture(scope="module")
def reference(cnn_path):
    session = ort.InferenceSession(cnn_path, providers=["CPUExecutionProvider"])
    return lambda x: session.run(None, {"x": x})[0]


def _x(rows: int = 1, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 3, 8, 8)).astype(np.float32)


def test_run_matches_plain_onnxruntime(engine, reference):
    x = _x()
    np.testing.assert_allclose(engine.run({"x": x})["y"], reference(x), rtol=1e-4, atol=1e-6)


def test_engine_reports_provider_and_specs(engine):
    assert engine.provider == "cpu"
    assert engine.inputs == (TensorSpec("x", "float32", (None, 3, 8, 8)),)
    assert engine.outputs == (TensorSpec("y", "float32", (None, CNN_CLASSES)),)
    assert engine.buckets == (1, 2, 4, 8)


def test_run_writes_into_the_same_preallocated_buffer(engine):
    first = engine.run({"x": _x(seed=1)})["y"]
    pointer = first.__array_interface__["data"][0]
    second = engine.run({"x": _x(seed=2)})["y"]
    assert second.__array_interface__["data"][0] == pointer
    assert np.shares_memory(second, engine.output_buffer("y", 1))
    # the view tracks the buffer: the first result now shows the second run's values
    np.testing.assert_array_equal(first, second)


def test_hot_path_allocates_no_tensor_buffers(engine):
    x = {"x": _x()}
    out_bytes = engine.output_buffer("y").nbytes
    tracemalloc.start()
    try:
        # Fill CPython's free lists first: their blocks count as traced until reused.
        for _ in range(200):
            engine.run(x)
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        for _ in range(200):
            engine.run(x)
        current, peak = tracemalloc.get_traced_memory()
        # The copying path must show up in the same measurement, or it proves nothing.
        tracemalloc.reset_peak()
        kept = [engine.run(x, copy=True) for _ in range(3)]
        _, peak_copy = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - base < out_bytes / 4
    assert current - base < out_bytes / 4
    assert peak_copy - base >= 3 * out_bytes
    assert len(kept) == 3


def test_a_whole_bucket_input_is_read_in_place_and_the_bucket_buffer_bound_again(engine, reference):
    # [Note: inputs in place]
    staging = engine._bucket_for(1).inputs["x"]
    staging[...] = 0.0
    x1, x2 = _x(seed=11), _x(seed=12)
    np.testing.assert_allclose(engine.run({"x": x1})["y"], reference(x1), rtol=1e-4, atol=1e-6)
    assert not staging.any()  # read where it lay: never copied into the bucket
    # run_batch packs into the bucket's buffer: it must be the one bound again.
    [out] = engine.run_batch([{"x": x2}])
    np.testing.assert_allclose(out["y"], reference(x2), rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(staging, x2)
    # Not C-contiguous (or not the input's dtype): copied into the bucket as before.
    strided = np.ascontiguousarray(np.concatenate([x1, x1], axis=3))[:, :, :, ::2]
    assert not strided.flags.c_contiguous
    np.testing.assert_allclose(engine.run({"x": strided})["y"], reference(np.ascontiguousarray(strided)),
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(staging, strided)


def _placed(region: np.ndarray, like: np.ndarray) -> tuple[np.ndarray, int]:
    """An engine's ``place``: ``like``'s array over ``region``, and its address."""
    array = region.view(like.dtype).reshape(like.shape)
    return array, array.ctypes.data


def test_outputs_placed_are_written_there_and_the_bucket_buffer_bound_again(engine, reference):
    # [Note: outputs placed]
    own = engine.output_buffer("y", 1)
    own[...] = 0.0
    regions: list[np.ndarray] = []

    def place(like: np.ndarray) -> tuple[np.ndarray, int]:
        regions.append(np.zeros(like.nbytes + 64, np.uint8)[64:])  # writable, not the engine's
        array = regions[-1].view(like.dtype).reshape(like.shape)
        return array, array.ctypes.data

    x1, x2 = _x(seed=21), _x(seed=22)
    out = engine.run({"x": x1}, place=place)["y"]
    np.testing.assert_allclose(out, reference(x1), rtol=1e-4, atol=1e-6)
    assert len(regions) == 1 and np.shares_memory(out, regions[0])
    assert not own.any()  # ORT wrote where it was placed, not into the bucket
    # The next run without place writes into the bucket's buffer again; the placed
    # answer keeps its values.
    again = engine.run({"x": x2})["y"]
    assert np.shares_memory(again, own)
    np.testing.assert_allclose(again, reference(x2), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(out, reference(x1), rtol=1e-4, atol=1e-6)
    # Nowhere to place it (place gives None), or a part of a bucket: the bucket's buffers.
    assert np.shares_memory(engine.run({"x": x1}, place=lambda n: None)["y"], own)
    x3 = _x(rows=3, seed=23)
    three = engine.run({"x": x3}, place=place)["y"]
    assert len(regions) == 1 and np.shares_memory(three, engine.output_buffer("y", 4))


def test_bindings_to_request_memory_are_kept_by_address_and_reused_only_there(engine, reference, monkeypatch):
    # [Note: bindings kept]
    from workers.engine import _KEPT_BINDINGS

    made: list[int] = []
    real = engine._session.io_binding
    monkeypatch.setattr(engine._session, "io_binding", lambda: made.append(1) or real())
    nbytes = engine.output_buffer("y", 1).nbytes
    slots = [_x(seed=30), _x(seed=31)]  # two places where requests arrive
    regions = [np.zeros(nbytes + 64, np.uint8)[64:] for _ in range(2)]  # two places for answers
    engine._bucket_for(1).kept.clear()
    for i in range(6):  # alternating places, fresh values each time
        slot, region = slots[i % 2], regions[i % 2]
        slot[...] = _x(seed=40 + i)
        out = engine.run({"x": slot}, place=lambda like, r=region: _placed(r, like))["y"]
        assert np.shares_memory(out, region)
        np.testing.assert_allclose(out, reference(slot), rtol=1e-4, atol=1e-6)
    assert len(made) == 2  # one binding per pair of places, then reused
    # The same input place with the answer in the bucket's own buffer is another binding.
    out = engine.run({"x": slots[0]})["y"]
    assert np.shares_memory(out, engine.output_buffer("y", 1)) and len(made) == 3
    np.testing.assert_allclose(out, reference(slots[0]), rtol=1e-4, atol=1e-6)
    # Many places: the bucket keeps the latest few, and every answer is still right.
    many = [_x(seed=50 + i) for i in range(_KEPT_BINDINGS + 3)]
    for x in many:
        np.testing.assert_allclose(engine.run({"x": x})["y"], reference(x), rtol=1e-4, atol=1e-6)
    assert len(engine._bucket_for(1).kept) == _KEPT_BINDINGS
    # The bucket's own binding was never changed: a copied input and a part of a bucket
    # still run on the bucket's buffers.
    strided = np.ascontiguousarray(np.concatenate([many[0], many[0]], axis=3))[:, :, :, ::2]
    np.testing.assert_allclose(engine.run({"x": strided})["y"], reference(np.ascontiguousarray(strided)),
                               rtol=1e-4, atol=1e-6)
    [a, b] = engine.run_batch([{"x": many[1]}, {"x": many[2]}])
    np.testing.assert_allclose(a["y"], reference(many[1]), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(b["y"], reference(many[2]), rtol=1e-4, atol=1e-6)


def test_copy_returns_private_arrays(engine):
    a = engine.run({"x": _x(seed=3)}, copy=True)["y"]
    b = engine.run({"x": _x(seed=4)}, copy=True)["y"]
    assert not np.shares_memory(a, b)
    assert not np.allclose(a, b)


def test_partial_batch_uses_the_next_bucket(engine, reference):
    x = _x(rows=3, seed=5)
    out = engine.run({"x": x})["y"]
    assert out.shape == (3, CNN_CLASSES)
    assert np.shares_memory(out, engine.output_buffer("y", 4))
    expected = np.concatenate([reference(x[i : i + 1]) for i in range(3)])
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-6)


def test_run_batch_equals_single_runs_and_chunks_over_buckets(engine, reference):
    requests = [{"x": _x(seed=10 + i)} for i in range(11)]  # 8 + 3: two batches
    before = engine.stats().run_count
    results = engine.run_batch(requests)
    assert engine.stats().run_count - before == 2
    assert len(results) == 11
    for req, res in zip(requests, results):
        np.testing.assert_allclose(res["y"], reference(req["x"]), rtol=1e-4, atol=1e-6)
        assert not np.shares_memory(res["y"], engine.output_buffer("y", 8))
    assert engine.run_batch([]) == []


def test_run_batch_accepts_multi_row_requests(engine, reference):
    requests = [{"x": _x(rows=2, seed=20)}, {"x": _x(rows=3, seed=21)}]
    results = engine.run_batch(requests)
    assert [r["y"].shape[0] for r in results] == [2, 3]
    np.testing.assert_allclose(results[1]["y"][2:], reference(requests[1]["x"][2:]), rtol=1e-4, atol=1e-6)


def test_rewrites_the_hard_coded_reshape(engine):
    assert engine.batch_safe
    assert engine.artefact.batch_rewrites == ("flatten: [1, -1] -> [0, -1]",)
    assert engine.artefact.folded_constants == 1


@pytest.mark.parametrize(
    "inputs, fragments",
    [
        ({"image": _x()}, ["missing ['x']", "unexpected ['image']", "pass exactly ['x']"]),
        ({"x": _x(), "extra": _x()}, ["unexpected ['extra']"]),
        ({"x": _x().astype(np.float64)}, ["'x'", "dtype float64", "float32[N,3,8,8]", ".astype(np.float32)"]),
        ({"x": np.zeros((1, 3, 8, 9), np.float32)}, ["'x'", "float32[1,3,8,9]", "expected float32[N,3,8,8]"]),
        ({"x": np.zeros((3, 8, 8), np.float32)}, ["float32[3,8,8]", "reshape it"]),
        ({"x": np.zeros((9, 3, 8, 8), np.float32)}, ["N in 1..8", "at most 8 rows"]),
        ({"x": _x().tolist()}, ["is a list", "np.asarray"]),
    ],
)
def test_bad_requests_raise_input_error_and_the_engine_keeps_serving(engine, reference, inputs, fragments):
    with pytest.raises(InputError) as info:
        engine.run(inputs)
    for fragment in fragments:
        assert fragment in str(info.value)
    assert isinstance(info.value, WorkerError)
    x = _x(seed=6)
    np.testing.assert_allclose(engine.run({"x": x})["y"], reference(x), rtol=1e-4, atol=1e-6)


def test_input_error_carries_fields(engine):
    with pytest.raises(InputError) as info:
        engine.run({"x": np.zeros((1, 3, 8, 8), np.int32)})
    err = info.value
    assert (err.input_name, err.expected, err.given) == ("x", "float32[N,3,8,8] with N in 1..8", "int32[1,3,8,8]")
    assert err.model == "cnn.onnx"


def test_inputs_must_be_a_mapping(engine):
    with pytest.raises(InputError, match="must be a dict"):
        engine.run([_x()])


def test_run_batch_names_the_bad_request(engine):
    with pytest.raises(InputError, match="request 1: input 'x'"):
        engine.run_batch([{"x": _x()}, {"x": _x().astype(np.float16)}])


def test_stats_count_runs_and_report_percentiles(cnn_path, cache_dir):
    eng = Engine(cnn_path, EngineConfig(cache_dir=cache_dir, provider="cpu", intra_op_threads=1))
    assert eng.stats().run_count == 0 and eng.stats().median_ms == 0.0
    for i in range(5):
        eng.run({"x": _x(seed=i)})
    stats = eng.stats()
    assert stats.run_count == 5
    assert 0 < stats.median_ms <= stats.p90_ms
    assert stats.from_cache and stats.build_ms == 0.0
    assert stats.load_ms >= stats.warmup_ms > 0
    assert EngineStats.from_json(stats.to_json()) == stats


def test_stats_do_not_wait_for_a_run_in_progress(cnn_path, cache_dir):
    # A Ray worker answers its stats call on its event loop: waiting for a running batch there
    # would hold every other call of the worker for the rest of the batch.
    import threading

    eng = Engine(cnn_path, EngineConfig(cache_dir=cache_dir, provider="cpu", intra_op_threads=1))
    eng.run({"x": _x(seed=0)})
    got: list[EngineStats] = []
    with eng._lock:  # as a run holds it
        reader = threading.Thread(target=lambda: got.append(eng.stats()))
        reader.start()
        reader.join(timeout=10.0)
        assert not reader.is_alive(), "stats() waited for the run's lock"
    assert got[0].run_count == 1 and got[0].median_ms > 0


def test_batch_mixing_model_is_refused(tmp_path):
    eng = Engine(make_batch_mixing_model(), EngineConfig(cache_dir=str(tmp_path), provider="cpu"))
    assert not eng.batch_safe
    assert "differs from 2 runs of batch 1" in eng.batch_reason
    assert eng.buckets == (1,)
    requests = [{"x": np.random.default_rng(i).standard_normal((1, 16)).astype(np.float32)} for i in range(3)]
    with pytest.raises(BatchingUnsafeError) as info:
        eng.run_batch(requests)
    assert info.value.reason == eng.batch_reason
    assert "loop_fallback=True" in str(info.value)
    looped = eng.run_batch(requests, loop_fallback=True)
    assert all(np.allclose(r["y"], 0.0) for r in looped)  # x - mean(x) over a batch of one
    with pytest.raises(InputError, match=r"float32\[2,16\], expected float32\[1,16\]"):
        eng.run({"x": np.zeros((2, 16), np.float32)})


def test_loop_fallback_from_config(tmp_path):
    eng = Engine(make_batch_mixing_model(), EngineConfig(cache_dir=str(tmp_path), provider="cpu", loop_fallback=True))
    assert len(eng.run_batch([{"x": np.ones((1, 16), np.float32)}] * 2)) == 2


def test_dynamic_batch_off_keeps_batch_one(tmp_path):
    eng = Engine(make_small_cnn(), EngineConfig(cache_dir=str(tmp_path), provider="cpu", dynamic_batch=False))
    assert not eng.batch_safe and "off" in eng.batch_reason
    assert eng.buckets == (1,) and eng.inputs[0].shape == (1, 3, 8, 8)
    assert eng.artefact.batch_rewrites == ()


def test_engines_of_one_model_share_one_weight_set(cnn_path, cache_dir, engine):
    others = [Engine(cnn_path, EngineConfig(cache_dir=cache_dir, provider="cpu")) for _ in range(3)]
    assert all(o._weights is engine._weights for o in others)
    assert engine.shared_weight_bytes >= 4 * 8 * 8 * CNN_CLASSES * 4
    unshared = Engine(cnn_path, EngineConfig(cache_dir=cache_dir, provider="cpu", share_weights=False))
    assert unshared.shared_weight_bytes == 0
    x = _x(seed=8)
    # pre-packed and plain Gemm kernels round differently in the last bits
    np.testing.assert_allclose(unshared.run({"x": x})["y"], others[0].run({"x": x})["y"], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"batch_buckets": (4, 1)}, "increasing order: (1, 4)"),
        ({"batch_buckets": ()}, "positive integers"),
        ({"batch_buckets": (0, 2)}, "positive integers"),
        ({"intra_op_threads": -1}, "intra_op_threads=-1"),
        ({"inter_op_threads": 0}, "inter_op_threads=0"),
        ({"provider": "tpu"}, "auto, cpu, cuda or tensorrt"),
        ({"graph_optimization_level": "max"}, "disable, basic, extended, all"),
        ({"warmup_runs": -1}, "warmup_runs"),
        ({"batch_check_size": 1}, "a batch of 1 proves nothing"),
        ({"log_severity": 7}, "log_severity"),
    ],
)
def test_config_rejects_bad_values(kwargs, fragment):
    with pytest.raises(EngineLoadError) as info:
        EngineConfig(**kwargs)
    assert fragment in str(info.value)
    assert info.value.stage == "config"


def test_config_json_round_trip():
    cfg = EngineConfig(batch_buckets=(1, 3), cache_dir="/cache", provider="cpu", share_weights=False)
    assert EngineConfig.from_json(cfg.to_json()) == cfg
    spec = TensorSpec("x", "float32", (None, 3))
    assert TensorSpec.from_json(spec.to_json()) == spec


@pytest.mark.skipif(HAS_GPU, reason="this onnxruntime has CUDA")
def test_asking_for_cuda_without_it_says_how_to_fix():
    with pytest.raises(EngineLoadError, match="install onnxruntime-gpu") as info:
        select_providers("cuda")
    assert info.value.stage == "config"


def test_auto_picks_cpu_last():
    chosen, providers = select_providers("auto")
    assert providers[-1] == "CPUExecutionProvider"
    assert chosen == ("tensorrt" if "TensorrtExecutionProvider" in ort.get_available_providers() else
                      "cuda" if HAS_GPU else "cpu")


def test_unreadable_model_raises_load_error(tmp_path):
    with pytest.raises(EngineLoadError, match="cannot be read") as info:
        Engine(tmp_path / "missing.onnx", EngineConfig(cache_dir=str(tmp_path)))
    assert info.value.stage == "parse"
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(EngineLoadError, match="not a valid ONNX model"):
        Engine(bad, EngineConfig(cache_dir=str(tmp_path)))
    with pytest.raises(EngineLoadError, match="do not parse as ONNX"):
        Engine(b"\xff\xff", EngineConfig(cache_dir=str(tmp_path)))


def test_closed_engine_refuses_to_run(cnn_path, cache_dir):
    eng = Engine(cnn_path, EngineConfig(cache_dir=cache_dir, provider="cpu"))
    eng.close()
    with pytest.raises(EngineRunError, match="is closed") as info:
        eng.run({"x": _x()})
    assert info.value.model == "cnn.onnx" and isinstance(info.value, WorkerError)
    with pytest.raises(EngineRunError, match="is closed"):
        eng.run_batch([{"x": _x()}])


def test_shared_weights_are_released_with_the_last_engine(tmp_path):
    import gc

    from workers._ort import resident_bytes
    from workers._weights import live_weight_sets

    assert resident_bytes() > 0
    gc.collect()  # engines of earlier tests that are garbage already must not go during this one
    before = live_weight_sets()
    a = Engine(make_small_cnn(seed=5), EngineConfig(cache_dir=str(tmp_path), provider="cpu"))
    b = Engine(make_small_cnn(seed=5), EngineConfig(cache_dir=str(tmp_path), provider="cpu"))
    assert live_weight_sets() == before + 1
    a.close()
    gc.collect()
    assert live_weight_sets() == before + 1  # b still holds it
    b.close()
    del a, b
    gc.collect()
    assert live_weight_sets() == before


# -- cancelled runs ([Note: cancelled runs]) ----------------------------------------------


def _slow_matmul_model(path: str, *, rows: int = 512, width: int = 1024, depth: int = 12) -> None:
    """A chain of `depth` [rows, width] x [width, width] products: seconds of one thread's work."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.full((width, width), 1.0 / width, np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x" if i == 0 else f"h{i}", "w"], [f"h{i + 1}" if i < depth - 1 else "y"])
             for i in range(depth)]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, width])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)


def test_a_cancelled_run_stops_in_progress_and_the_engine_serves_on(tmp_path, cache_dir) -> None:
    import threading

    from workers.engine import RunCancel
    from workers.errors import RunCancelledError

    path = str(tmp_path / "chain.onnx")
    _slow_matmul_model(path)
    eng = Engine(path, EngineConfig(intra_op_threads=1, batch_buckets=(1,), dynamic_batch=False, warmup_runs=0,
                                    cache_dir=cache_dir))
    try:
        x = {"x": np.ones((512, 1024), np.float32)}
        cancel = RunCancel()
        timer = threading.Timer(0.03, cancel.cancel)  # well inside a run of 6 GMAC on one thread
        timer.start()
        with pytest.raises(RunCancelledError, match="cancelled"):
            eng.run(x, cancel=cancel)
        timer.join()
        with pytest.raises(RunCancelledError):  # a run whose cancel is set never starts
            eng.run(x, cancel=cancel)
        out = eng.run({"x": np.ones((512, 1024), np.float32)}, cancel=RunCancel())  # and the engine runs on
        np.testing.assert_allclose(out["y"], 1.0, rtol=1e-4)
    finally:
        eng.close()
