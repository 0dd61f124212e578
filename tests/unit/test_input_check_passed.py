"""workers._input_check.check_inputs: a shape that passed is not checked again, and every
other shape still is."""

import numpy as np
import pytest

from workers._engine_types import TensorSpec
from workers._input_check import _MAX_PASSED_SHAPES, check_inputs, input_checks_of
from workers.errors import InputError


def _check(checks, x: np.ndarray) -> int:
    return check_inputs({"x": x}, frozenset({"x"}), checks, name="s", max_batch=8, batch_safe=True, where="")


def test_a_shape_that_passed_is_remembered_and_others_are_still_refused():
    checks = input_checks_of([TensorSpec("x", "float32", (None, 4))])
    passed = checks[0][2]
    assert _check(checks, np.zeros((3, 4), np.float32)) == 3
    assert passed == {(3, 4)}
    assert _check(checks, np.zeros((3, 4), np.float32)) == 3
    for bad in (np.zeros((3, 5), np.float32), np.zeros((9, 4), np.float32), np.zeros((4,), np.float32)):
        with pytest.raises(InputError, match="has shape"):
            _check(checks, bad)
    with pytest.raises(InputError, match="dtype"):
        _check(checks, np.zeros((3, 4), np.float64))  # the dtype is checked before the shapes that passed
    assert passed == {(3, 4)}


def test_the_shapes_remembered_are_bounded():
    checks = input_checks_of([TensorSpec("x", "float32", (None, None))])
    for i in range(3 * _MAX_PASSED_SHAPES):
        assert _check(checks, np.zeros((1, i + 1), np.float32)) == 1
    assert 0 < len(checks[0][2]) <= _MAX_PASSED_SHAPES
