"""The image normalisation of an accuracy table: calibrate records the one it measured the
image codecs with, and the agent encodes the frame with it, so the agent sends the bytes
and gets the agreement the table measured."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from cluster.calibrate import measure_accuracy
from cluster.protocol.encoding import decode
from cluster.protocol.lossy import ImageNorm, decode_lossy, encode_lossy
from edge_agent.engines import CutEngines
from edge_agent.model_inputs import image_norm
from edge_agent.policy import Action
from edge_agent.runner import Runner
from partitioner import Cut
from planner import Encoding, PlannerError
from planner.accuracy import AccuracyTable
from tests.onnx_models import image_classifier

L = Cut(frozenset()).key


def image_model():
    """x [1, 3, 32, 32] -> Conv -> Relu -> GlobalAveragePool -> Flatten -> Gemm -> y [1, 5]."""
    return image_classifier(32, 32)


def frame() -> np.ndarray:
    """A smooth camera-like frame, ImageNet-normalised."""
    yy, xx = np.mgrid[0:32, 0:32] / 32
    pixels = np.stack([0.5 + 0.4 * np.sin(4 * xx + k) * np.cos(3 * yy - k) for k in range(3)])[None]
    mean, std = np.array((0.485, 0.456, 0.406)), np.array((0.229, 0.224, 0.225))
    return ((pixels - mean[None, :, None, None]) / std[None, :, None, None]).astype(np.float32)


def _calibrate(norm: ImageNorm | None, previous: AccuracyTable | None = None):
    return measure_accuracy(image_model(), {"x": frame()}, cuts=[Cut(frozenset())], encodings=(),
                            input_encodings=("jpeg@90",), norm=norm, previous=previous, show_progress=False)


def _agent_record(norm: ImageNorm | None):
    agent = SimpleNamespace(models=SimpleNamespace(model="img", version="1"), _device_id="d", image_norm=norm)
    ce = CutEngines(L, None, None, ("x",), ())  # type: ignore[arg-type]
    enc = Encoding(codec="jpeg", level=90, ratio=0.05, codec_ms_per_mb=1.0)
    action = Action("offload", L, enc)
    req = Runner._make_request(agent, action, ce, {"x": frame()}, "r1", 5.0)  # type: ignore[arg-type]
    return req.tensors["x"]


def test_the_agent_sends_the_jpeg_calibrate_measured_with_the_declared_norm() -> None:
    declared = ImageNorm.imagenet()
    table = _calibrate(declared).table
    assert table.image_norm == declared.to_dict()
    entry = table.entry(L, "jpeg@90")
    assert entry is not None and entry.agreement is not None
    norm = image_norm({"accuracy.json": table.to_json().encode()})
    assert norm == declared
    sent = _agent_record(norm)
    assert abs(sent.wire_bytes - entry.wire_bytes) <= 0.03 * entry.wire_bytes
    measured = decode_lossy(encode_lossy(frame(), "jpeg", 90, norm=declared))  # what calibrate fed the tail
    np.testing.assert_array_equal(decode(sent), measured)
    # Fitting each channel's range instead (the agent without the table's norm) sends other values.
    assert not np.array_equal(decode(_agent_record(None)), measured)


def test_a_fitted_table_records_no_norm_and_the_agent_fits_too() -> None:
    table = _calibrate(None).table
    assert table.image_norm is None and image_norm({"accuracy.json": table.to_json().encode()}) is None
    sent = _agent_record(None)
    np.testing.assert_array_equal(decode(sent), decode_lossy(encode_lossy(frame(), "jpeg", 90)))


def test_a_reused_table_states_its_norm() -> None:
    declared = ImageNorm((0.5,), (0.25,), 255.0)
    first = _calibrate(declared).table
    older = AccuracyTable.from_dict({k: v for k, v in first.to_dict().items() if k != "image_norm"})
    assert older.image_norm is None  # a table written before the field existed
    again = _calibrate(declared, previous=older)
    assert again.measured == 0 and again.table.image_norm == declared.to_dict()


def test_image_norm_round_trips_and_a_bad_one_is_a_clear_error(caplog) -> None:
    t = AccuracyTable("m", "f", 1, (), "generated", ImageNorm.imagenet("NHWC").to_dict())
    assert AccuracyTable.from_json(t.to_json()) == t
    assert ImageNorm.from_dict(dict(AccuracyTable.from_json(t.to_json()).image_norm)) == ImageNorm.imagenet("NHWC")
    with pytest.raises(PlannerError, match=r"image_norm .*'gamma'.*must be null or an object of layout, mean"):
        AccuracyTable("m", "f", 1, (), "generated", {"gamma": 2.0})
    bad = AccuracyTable("m", "f", 1, (), "generated", {"std": [0.0]}).to_json().encode()
    assert image_norm({"accuracy.json": bad}) is None
    assert "image codecs fit each channel's range" in caplog.text
    assert image_norm({}) is None
