"""FLOPs of the ops real models use: exact numbers per op, as [Note: FLOPs of real models'
ops] in partitioner/flops.py defines them."""

from __future__ import annotations

import pytest
from onnx import helper

from partitioner.flops import node_flops


def _flops(op: str, inputs: dict, out, domain: str = "", **attrs) -> int | None:
    """FLOPs of one ``op`` node whose inputs have the given shapes (None: absent) and whose
    first output has shape ``out``; the batch is the symbol N."""
    names = [name if shape is not None or name == "" else "" for name, shape in inputs.items()]
    shapes = {name: tuple(shape) for name, shape in inputs.items() if shape is not None}
    shapes["y"] = None if out is None else tuple(out)
    node = helper.make_node(op, names, ["y"], domain=domain, **attrs)
    return node_flops(node, lambda t: shapes.get(t), "N")


X = ["N", 4, 8, 8]


@pytest.mark.parametrize("mode,out,expect", [
    ("nearest", ["N", 4, 16, 16], 0),
    ("linear", ["N", 4, 16, 16], 4 * 16 * 16 * 9),     # bilinear: 3 lerps of 3 ops
    ("linear", ["N", 4, 8, 16], 4 * 8 * 16 * 3),       # one axis resized: 1 lerp
    ("cubic", ["N", 4, 16, 16], 4 * 16 * 16 * 35),     # bicubic: 5 four-tap sums of 7 ops
])
def test_resize_counts_per_output_element_by_mode(mode, out, expect):
    assert _flops("Resize", {"x": X, "roi": None, "scales": [4]}, out, mode=mode) == expect


def test_upsample_counts_as_resize_and_unknown_sizes_stay_unknown():
    assert _flops("Upsample", {"x": X, "scales": [4]}, ["N", 4, 16, 16], mode="linear") == 4 * 16 * 16 * 9
    assert _flops("Resize", {"x": X, "roi": None, "scales": [4]}, ["N", 4, "?", "?"], mode="linear") is None
    assert _flops("Resize", {"x": X, "roi": None, "scales": [4]}, ["N", 4, 16, 16], mode="area") is None


CONV = 2 * (4 * 6 * 6) * 3 * 9  # out [4,6,6], 3 input channels, 3x3 kernel


def test_int8_convolutions_count_as_conv():
    qlinear = {"x": ["N", 3, 8, 8], "xs": [], "xz": [], "w": [4, 3, 3, 3], "ws": [], "wz": [], "ys": [], "yz": [],
               "b": [4]}
    assert _flops("QLinearConv", qlinear, ["N", 4, 6, 6]) == CONV + 4 * 6 * 6
    assert _flops("Conv", {"x": ["N", 3, 8, 8], "w": [4, 3, 3, 3], "b": [4]}, ["N", 4, 6, 6]) == CONV + 4 * 6 * 6
    # ConvInteger's third input is a zero point, not a bias
    assert _flops("ConvInteger", {"x": ["N", 3, 8, 8], "w": [4, 3, 3, 3], "xz": []}, ["N", 4, 6, 6]) == CONV


def test_int8_matrix_products_count_as_theirs():
    mm = 2 * (5 * 6) * 8
    assert _flops("MatMul", {"a": ["N", 5, 8], "b": [8, 6]}, ["N", 5, 6]) == mm
    assert _flops("MatMulInteger", {"a": ["N", 5, 8], "b": [8, 6], "az": []}, ["N", 5, 6]) == mm
    assert _flops("QLinearMatMul", {"a": ["N", 5, 8], "as": [], "az": [], "b": [8, 6], "bs": [], "bz": [],
                                    "ys": [], "yz": []}, ["N", 5, 6]) == mm
    assert _flops("MatMulIntegerToFloat", {"a": ["N", 5, 8], "b": [8, 6], "as": [], "bs": []}, ["N", 5, 6],
                  domain="com.microsoft") == mm
    qgemm = {"a": ["N", 8], "as": [], "az": [], "b": [6, 8], "bs": [], "bz": [], "c": [6]}
    assert _flops("QGemm", qgemm, ["N", 6], domain="com.microsoft", transB=1) == 2 * 6 * 8 + 6


def test_quantisation_and_qlinear_elementwise_ops():
    assert _flops("QuantizeLinear", {"x": ["N", 32], "s": [], "z": []}, ["N", 32]) == 64
    assert _flops("DequantizeLinear", {"x": ["N", 32], "s": [], "z": []}, ["N", 32]) == 64
    assert _flops("DynamicQuantizeLinear", {"x": ["N", 32]}, []) == 128  # per input element, not the scalar out
    assert _flops("QLinearAdd", {"a": ["N", 32], "as": [], "az": [], "b": ["N", 32], "bs": [], "bz": [],
                                 "cs": [], "cz": []}, ["N", 32], domain="com.microsoft") == 32
    assert _flops("QLinearGlobalAveragePool", {"x": X, "xs": [], "xz": [], "ys": [], "yz": []}, ["N", 4, 1, 1],
                  domain="com.microsoft") == 4 * 8 * 8
    assert _flops("Floor", {"x": ["N", 32]}, ["N", 32]) == 32


def _rnn(op, x, **attrs):
    return _flops(op, {"x": x, "w": [1, 16, 3], "r": [1, 16, 4], "b": attrs.pop("b", None)}, None,
                  hidden_size=4, **attrs)


def test_recurrent_layers_count_per_step_times_the_static_length():
    # LSTM, hidden 4, input 3, 5 steps: 2*4*4*(3+4) + 4*4 + bias 2*4*4 + cell 24*4 per step
    assert _rnn("LSTM", [5, "N", 3], b=[1, 32]) == 5 * (224 + 16 + 32 + 96)
    assert _rnn("LSTM", [5, "N", 3]) == 5 * (224 + 16 + 96)
    assert _rnn("LSTM", [5, "N", 3], b=[1, 32], direction="bidirectional") == 2 * 5 * (224 + 16 + 32 + 96)
    assert _rnn("GRU", [5, "N", 3]) == 5 * (2 * 3 * 4 * 7 + 12 + 17 * 4)
    assert _rnn("RNN", [5, "N", 3]) == 5 * (2 * 4 * 7 + 4 + 16)
    assert _rnn("RNN", ["N", 5, 3], layout=1) == 5 * (2 * 4 * 7 + 4 + 16)
    assert _rnn("LSTM", ["T", "N", 3]) is None  # a dynamic sequence length


def test_dynamic_quantize_lstm_counts_as_lstm():
    ins = {"x": [5, "N", 3], "w": [1, 3, 16], "r": [1, 4, 16], "b": [1, 32]}
    assert _flops("DynamicQuantizeLSTM", ins, None, domain="com.microsoft", hidden_size=4) == 5 * (224 + 16 + 32 + 96)


def test_attention_ops_of_com_microsoft():
    # input [4 positions, 8], QKV weights [8, 24] with bias, 2 heads: projection, scores, scale and
    # softmax (4 per score per head), weighted sum
    att = _flops("Attention", {"x": ["N", 4, 8], "w": [8, 24], "b": [24]}, ["N", 4, 8], domain="com.microsoft",
                 num_heads=2)
    assert att == (2 * 4 * 8 * 24 + 4 * 24) + 2 * 4 * 4 * 8 + 4 * 2 * 4 * 4 + 2 * 4 * 4 * 8
    mha = _flops("MultiHeadAttention", {"q": ["N", 4, 8], "k": ["N", 6, 8], "v": ["N", 6, 8]}, ["N", 4, 8],
                 domain="com.microsoft", num_heads=2)
    assert mha == 2 * 4 * 6 * 8 + 4 * 2 * 4 * 6 + 2 * 4 * 6 * 8
    assert _flops("MultiHeadAttention", {"q": ["N", "S", 8], "k": ["N", 6, 8], "v": ["N", 6, 8]}, None,
                  domain="com.microsoft", num_heads=2) is None


def test_einsum_counts_as_the_matrix_product_it_is():
    mm = 2 * 4 * 8 * 6
    assert _flops("Einsum", {"a": ["N", 4, 8], "b": ["N", 8, 6]}, ["N", 4, 6], equation="bij,bjk->bik") == mm
    assert _flops("Einsum", {"a": ["N", 4, 8], "b": [8, 6]}, ["N", 4, 6], equation="...ij,jk->...ik") == mm
    assert _flops("Einsum", {"a": [4, 8]}, [4], equation="ij->i") == 32
    assert _flops("Einsum", {"a": [4, 8]}, [8, 4], equation="ij->ji") == 0


def test_normalisation_softmax_and_reductions():
    assert _flops("LayerNormalization", {"x": ["N", 4, 8], "s": [8], "b": [8]}, ["N", 4, 8]) == 32 * 5
    assert _flops("Softmax", {"x": ["N", 4, 8]}, ["N", 4, 8]) == 32 * 3
    assert _flops("ReduceMean", {"x": ["N", 4, 8]}, ["N", 4, 1]) == 32
    assert _flops("ReduceL2", {"x": ["N", 4, 8]}, ["N", 4, 1]) == 64
    # a reduction's work is per input element: a known output never stands in for it
    assert _flops("GlobalAveragePool", {"x": ["N", 6, "H", "W"]}, ["N", 6, 1, 1]) is None
