"""Parsing of --input-shape and --inputs, shared by every command that reads a model."""

from __future__ import annotations

import numpy as np
import pytest

from partitioner.errors import PartitionError
from partitioner.shapes import load_sample_inputs, parse_input_shape, parse_input_shapes, shapes_of


def test_parse_input_shape_named_and_unnamed():
    assert parse_input_shape("images=1x3x640x640") == ("images", (1, 3, 640, 640))
    assert parse_input_shape("1x16000") == (None, (1, 16000))
    assert parse_input_shape("x:0=2X5") == ("x:0", (2, 5))


@pytest.mark.parametrize("bad", ["images=", "images=1x?x3", "1x-3", "a=1x0", "abc", "1x3x"])
def test_parse_input_shape_refuses_malformed(bad):
    with pytest.raises(PartitionError, match="input shape"):
        parse_input_shape(bad)


def test_parse_input_shapes_unnamed_needs_one_input():
    assert parse_input_shapes(["1x3"], ["x"]) == {"x": (1, 3)}
    with pytest.raises(PartitionError, match="names no input.*2 inputs"):
        parse_input_shapes(["1x3"], ["a", "b"])


def test_parse_input_shapes_unknown_name_and_conflict():
    with pytest.raises(PartitionError, match="'c', which is not a model input"):
        parse_input_shapes(["c=1x3"], ["a", "b"])
    with pytest.raises(PartitionError, match="two shapes"):
        parse_input_shapes(["a=1x3", "a=1x4"], ["a", "b"])


def test_load_sample_inputs_round_trip_and_checks(tmp_path):
    p = tmp_path / "s.npz"
    np.savez(p, a=np.arange(6, dtype=np.int32).reshape(2, 3), b=np.zeros(4, np.float32))
    got = load_sample_inputs(p, ["a", "b"])
    assert got["a"].dtype == np.int32 and got["a"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert shapes_of(got) == {"a": (2, 3), "b": (4,)}
    with pytest.raises(PartitionError, match="missing \\['c'\\]"):
        load_sample_inputs(p, ["a", "b", "c"])
    with pytest.raises(PartitionError, match="does not exist"):
        load_sample_inputs(tmp_path / "none.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(PartitionError, match="not a readable .npz"):
        load_sample_inputs(tmp_path / "junk.npz")
