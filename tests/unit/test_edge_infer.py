"""splitinfer.edge_infer: the inputs it makes or reads, and how it reports an answer."""

from __future__ import annotations

import numpy as np
import pytest

from splitinfer.edge_infer import (
    _InputError,
    describe_placement,
    format_summary,
    make_random_inputs,
    read_inputs,
    summarize_answer,
)

MODEL = {"model": "squeezenet", "version": "1",
         "inputs": [{"name": "data_0", "dtype": "float32", "shape": [1, 3, 8, 8]}],
         "outputs": [{"name": "softmaxout_1", "dtype": "float32", "shape": [1, 10, 1, 1]}]}


@pytest.mark.parametrize("served_by, cut_id, said", [
    ("remote", "L0-2", "split: head on the device (layers 0-2, cut L0-2), tail in the cloud"),
    ("remote", "L0-3_5", "split: head on the device (5 layers, cut L0-3_5), tail in the cloud"),
    ("remote", "Habcdef0123456789", "split: head on the device (cut Habcdef0123456789), tail in the cloud"),
    ("remote", "L", "remote: the whole model in the cloud (cut L)"),
    ("local_tail", "L0-11", "head on the device (layers 0-11, cut L0-11), tail finished on the device"),
    ("local", "", "local: the whole model on the device"),
])
def test_placement_in_words(served_by: str, cut_id: str, said: str) -> None:
    assert describe_placement(served_by, cut_id).startswith(said)


def test_summary_shows_shapes_and_the_top_classes_of_a_class_vector() -> None:
    probs = np.zeros((1, 10, 1, 1), np.float32)
    probs[0, [7, 2, 9], 0, 0] = [0.5, 0.3, 0.1]
    ans = {"id": "r1", "served_by": "remote", "cut_id": "L0-2", "encoding": "fp16", "latency_ms": 39.25,
           "outputs": {"softmaxout_1": probs, "features": np.ones((1, 4, 3), np.float32)}}
    s = summarize_answer(ans, k=3)
    assert s["outputs"][0]["top"] == [(7, 0.5), (2, pytest.approx(0.3)), (9, pytest.approx(0.1))]
    assert "top" not in s["outputs"][1]  # not a class vector: two axes longer than 1
    text = format_summary(s)
    assert text.splitlines()[0] == "served by: split: head on the device (layers 0-2, cut L0-2), tail in the cloud"
    assert "latency: 39.2 ms, boundary fp16" in text
    assert "output softmaxout_1: float32 [1, 10, 1, 1]  top-3: 7 (0.5), 2 (0.3), 9 (0.1)" in text
    assert "output features: float32 [1, 4, 3]" in text


def test_random_inputs_follow_the_model_and_the_seed() -> None:
    model = {"inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 3, -1]},
                        {"name": "ids", "dtype": "int64", "shape": [2]}, {"name": "m", "dtype": "bool", "shape": [1]}]}
    a, b, c = make_random_inputs(model, 0), make_random_inputs(model, 0), make_random_inputs(model, 1)
    assert a["x"].shape == (1, 3, 1) and a["x"].dtype == np.float32
    assert a["ids"].dtype == np.int64 and a["m"].dtype == np.bool_
    assert np.array_equal(a["x"], b["x"]) and not np.array_equal(a["x"], c["x"])


def test_inputs_from_npy_and_npz_are_cast_to_the_models_dtype(tmp_path) -> None:
    x = np.arange(192, dtype=np.float64).reshape(1, 3, 8, 8)
    np.save(tmp_path / "x.npy", x)
    got = read_inputs(str(tmp_path / "x.npy"), MODEL)
    assert got["data_0"].dtype == np.float32 and np.array_equal(got["data_0"], x.astype(np.float32))
    np.savez(tmp_path / "x.npz", data_0=x.astype(np.float32))
    assert read_inputs(str(tmp_path / "x.npz"), MODEL)["data_0"].dtype == np.float32


def test_inputs_that_do_not_fit_are_refused_in_one_line(tmp_path) -> None:
    np.savez(tmp_path / "wrong.npz", image=np.zeros(3, np.float32))
    with pytest.raises(_InputError, match=r"holds \['image'\]; the model's inputs are \['data_0'\]"):
        read_inputs(str(tmp_path / "wrong.npz"), MODEL)
    two = {"inputs": MODEL["inputs"] + [{"name": "mask", "dtype": "bool", "shape": [1]}]}
    np.save(tmp_path / "one.npy", np.zeros(3, np.float32))
    with pytest.raises(_InputError, match="is one array but the model has inputs"):
        read_inputs(str(tmp_path / "one.npy"), two)
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    with pytest.raises(_InputError, match="cannot be read as .npy or .npz"):
        read_inputs(str(tmp_path / "junk.npy"), MODEL)
