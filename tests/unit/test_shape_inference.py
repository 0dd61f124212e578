"""Shape inference that does not give up, fixed input shapes and sample inputs, on tiny
models made with onnx.helper (tests/unit/_shape_models.py)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from partitioner import PartitionError, build_graph, make_cut, split, verify
from partitioner._infer import _onnx_types
from partitioner.export import make_inputs
from splitinfer.partition_cmd import inspect_main, split_main
from tests.unit import _shape_models as M


def _verify_every_chain_cut(model, graph, feed):
    for last in range(len(graph) - 1):
        head, tail = split(model, make_cut(graph, list(range(last + 1))), graph=graph)
        diffs = verify(model, [head, tail], feed, graph=graph)
        assert max(diffs.values()) <= 1e-5


def test_symbolic_h_w_stay_symbols_and_their_sizes_unknown():
    g = build_graph(M.conv_resize())
    assert g.tensor["x"].shape == ("N", 3, "H", "W")
    assert g.tensor["c1"].shape == ("N", 4, "?", "?") and g.tensor["c1"].bytes_per_sample is None
    assert g.tensor["f"].bytes_per_sample == 6 * 4  # after the pool the size is known again
    total = g.flops_total()
    # conv1, resize, conv2 and the pool over the unknown H x W: only the Gemm is known
    assert total.unknown == 4 and total.exact is None and g.total_flops == total.known == 60
    assert g.output_bytes(["c1", "f"]) is None and g.bytes_total(["c1", "f"]).known == 24


def test_fixed_h_w_keep_the_symbolic_batch_through_resize():
    m = M.conv_resize()
    # ONNX inference alone loses the batch at the Resize once H and W are fixed
    fixed = onnx.ModelProto()
    fixed.CopyFrom(m)
    for d, v in zip(fixed.graph.input[0].type.tensor_type.shape.dim[2:], (32, 32)):
        d.dim_value = v
    assert _onnx_types(fixed, "m")["r"][1][0] is None
    g = build_graph(m, input_shapes={"x": (1, 3, 32, 32)})
    assert g.batch == "N"
    assert g.tensor["a"].shape == ("N", 4, 64, 64)
    assert g.tensor["a"].bytes_per_sample == 4 * 64 * 64 * 4
    conv2 = next(layer for layer in g.layers if layer.name == "conv2")
    assert conv2.flops == 2 * 6 * 64 * 64 * 4 * 9
    _verify_every_chain_cut(m, g, make_inputs(m, g))


def test_sequence_length_symbolic_then_fixed():
    m = M.sequence()
    g = build_graph(m)
    assert g.tensor["e"].shape == ("N", "seq", 8) and g.tensor["e"].bytes_per_sample is None
    g = build_graph(m, input_shapes={"ids": (1, 7)})
    assert g.tensor["e"].shape == ("N", 7, 8) and g.tensor["e"].bytes_per_sample == 7 * 8 * 4
    assert g.flops_total().unknown == 0
    _verify_every_chain_cut(m, g, make_inputs(m, g))


def test_rank_lost_by_onnx_inference_is_recorded_from_a_run_on_sample_inputs():
    m = M.reshape_by_input()
    assert _onnx_types(m, "m")["r"][1] is None  # ONNX inference really loses the rank
    g = build_graph(m)
    assert g.tensor["m"].shape is None and g.tensor["m"].bytes_per_sample is None
    with pytest.raises(PartitionError, match=r"rank is unknown.*--inputs FILE.npz"):
        split(m, make_cut(g, [0, 1]), graph=g)
    feed = {"x": np.random.default_rng(0).standard_normal((1, 12)).astype(np.float32),
            "shape": np.array([-1, 3, 4], np.int64)}
    g = build_graph(m, inputs=feed)
    assert g.tensor["m"].shape == ("N", 3, 4) and g.tensor["m"].bytes_per_sample == 48
    assert g.tensor["y"].shape == ("N", 3)
    _verify_every_chain_cut(m, g, feed)


def test_op_of_another_domain_is_typed_by_ort_symbolic_inference_and_segments_pass_the_checker():
    m = M.ms_gelu()
    assert "g" not in _onnx_types(m, "m")  # ONNX does not know com.microsoft Gelu
    g = build_graph(m, input_shapes={"x": (1, 8)})
    assert g.tensor["g"].shape == ("N", 16) and g.tensor["g"].bytes_per_sample == 64
    _verify_every_chain_cut(m, g, make_inputs(m, g))  # split() runs the checker on each segment


@pytest.mark.parametrize("dtype", [onnx.TensorProto.INT32, onnx.TensorProto.INT64])
def test_integer_input_that_feeds_reshape_needs_sample_inputs(dtype):
    m = M.reshape_by_input(dtype)
    g = build_graph(m, input_shapes={"x": (2, 12), "shape": (3,)})
    with pytest.raises(PartitionError, match=r"input 'shape' .* shapes or sizes .*--inputs FILE.npz"):
        make_inputs(m, g)
    np_type = onnx.helper.tensor_dtype_to_np_dtype(dtype)
    feed = {"x": np.ones((2, 12), np.float32), "shape": np.array([2, 3, 4], np_type)}
    g = build_graph(m, inputs=feed)
    assert g.tensor["m"].shape == ("N", 3, 4)
    _verify_every_chain_cut(m, g, feed)


def test_given_shapes_that_contradict_the_model_are_refused():
    m = M.conv_resize()
    with pytest.raises(PartitionError, match="rank 4 .* give 4 dims"):
        build_graph(m, input_shapes={"x": (1, 3, 32)})
    with pytest.raises(PartitionError, match="dim 1 fixed at 3 .* give 3 there"):
        build_graph(m, input_shapes={"x": (1, 4, 32, 32)})
    with pytest.raises(PartitionError, match="sample input is 1x3x8x8"):
        build_graph(m, input_shapes={"x": (1, 3, 32, 32)}, inputs={"x": np.zeros((1, 3, 8, 8), np.float32)})


def test_inspect_prints_question_marks_and_lower_bounds(tmp_path, capsys):
    path = M.save(M.conv_resize(), tmp_path / "cr.onnx")
    assert inspect_main([path]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.split()[:1] == ["0"])
    assert row.split()[-3:] == ["Nx4x?x?", "?", "?"]
    assert "≥ 0.1 KFLOPs (4 unknown)" in out and "--input-shape" in out
    assert inspect_main([path, "--input-shape", "1x3x32x32", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    a = next(t for t in got["tensors"] if t["name"] == "a")
    assert a["shape"] == ["N", 4, 64, 64] and a["bytes_per_sample"] == 65536
    # a nearest Resize picks input elements: 0 FLOPs, so every layer is known
    assert got["totals"]["flops_unknown_layers"] == 0 and got["totals"]["flops"] == got["totals"]["flops_known"] > 0


def test_split_cli_with_input_shape_and_with_inputs(tmp_path, capsys):
    path = M.save(M.conv_resize(), tmp_path / "cr.onnx")
    assert split_main([path, "--after", "1", "-o", str(tmp_path / "a"), "--verify", "--input-shape", "x=1x3x16x16"]) == 0
    info = json.loads((tmp_path / "a" / "split.json").read_text())
    assert info["boundary"] == ["a"] and info["boundary_bytes_per_sample"] == 4 * 32 * 32 * 4
    npz = tmp_path / "s.npz"
    np.savez(npz, x=np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32))
    assert split_main([path, "--after", "2", "-o", str(tmp_path / "b"), "--verify", "--inputs", str(npz)]) == 0
    assert "verified" in capsys.readouterr().out


def test_split_that_fails_leaves_no_files(tmp_path):
    path = M.save(M.conv_resize(), tmp_path / "cr.onnx")
    out = tmp_path / "o"
    with pytest.raises(PartitionError, match=r"symbolic dims .*--input-shape x=1x3xHxW .*--inputs FILE.npz"):
        split_main([path, "--after", "1", "-o", str(out), "--verify"])
    assert not out.exists() or not any(out.iterdir())


def test_batch_folded_into_rows_is_k_times_n_and_segments_serve_any_batch():
    m = M.folded_batch()
    g = build_graph(m)
    assert g.tensor["r"].shape == ("4*N", 8) and g.tensor["r"].bytes_per_sample == 4 * 8 * 4
    head, tail = split(m, make_cut(g, [0]), graph=g)
    dims = tail.model.graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in dims] == ["4*N", 8]
    feed = make_inputs(m, g, batch=3)
    assert tail.inputs == ("r",) and verify(m, [head, tail], feed, graph=g)["r"] == 0.0
    _verify_every_chain_cut(m, g, feed)


def test_input_dims_without_a_name_are_each_their_own_symbol():
    m = M.conv_resize()
    dims = m.graph.input[0].type.tensor_type.shape.dim
    dims[0].dim_value = -1  # "any", as some exporters write it
    dims[2].dim_param = dims[3].dim_param = "?"  # PaddlePaddle's name for every open dim
    g = build_graph(m)
    assert g.batch == "x:0" and g.tensor["x"].shape == ("N", 3, "x:2", "x:3")
    g = build_graph(m, input_shapes={"x": (1, 3, 8, 12)})
    assert g.tensor["x"].shape == ("N", 3, 8, 12) and g.tensor["a"].shape == ("N", 4, 16, 24)
    _verify_every_chain_cut(m, g, make_inputs(m, g))


def test_random_inputs_take_the_batch_the_shape_gives():
    m = M.sequence()
    g = build_graph(m, input_shapes={"ids": (3, 5)})
    assert g.tensor["ids"].shape == ("N", 5)
    assert make_inputs(m, g)["ids"].shape == (1, 5)
    assert make_inputs(m, g, input_shapes={"ids": (3, 5)})["ids"].shape == (3, 5)


def test_recurrent_state_keeps_its_batch_on_axis_1():
    m = M.recurrent_state()
    rng = np.random.default_rng(2)
    feed = {"x": rng.standard_normal((2, 4)).astype(np.float32), "h": rng.standard_normal((2, 2, 4)).astype(np.float32)}
    g = build_graph(m, inputs=feed)
    assert g.tensor["h"].shape == (2, "N", 4) and g.tensor["h_out"].shape == (2, "N", 4)
    assert g.tensor["h_out"].bytes_per_sample == 2 * 4 * 4 and g.tensor["y"].shape == ("N", 3)
    _verify_every_chain_cut(m, g, feed)


def test_sample_inputs_are_repeated_along_every_batch_axis():
    from partitioner._infer import _tile

    got = _tile({"x": np.zeros((1, 4)), "h": np.zeros((2, 1, 4)), "sr": np.array(16000)},
                {"x": [0], "h": [1], "sr": []})
    assert got["x"].shape == (2, 4) and got["h"].shape == (2, 2, 4) and got["sr"].shape == ()


def test_sample_rows_follow_the_batch_on_every_axis():
    from partitioner.shapes import sample_rows

    m = M.recurrent_state()
    feed = {"x": np.arange(8, dtype=np.float32).reshape(2, 4), "h": np.zeros((2, 2, 4), np.float32)}
    g = build_graph(m, inputs=feed)
    got = sample_rows(feed, g, 3)
    assert got["x"].shape == (3, 4) and got["h"].shape == (2, 3, 4)
    assert got["x"][2].tolist() == feed["x"][0].tolist()  # its own rows first, then repeats


def test_sample_inputs_of_another_dtype_are_refused():
    m = M.reshape_by_input()
    feed = {"x": np.zeros((1, 12), np.float64), "shape": np.array([-1, 3, 4], np.int64)}
    with pytest.raises(PartitionError, match=r"sample input 'x' .* float64, but the model takes float32"):
        build_graph(m, inputs=feed)
