"""The accuracy table: measured on tiny models, cached exactly, stored in the registry, read
by cut and encoding."""

from __future__ import annotations

import json
from dataclasses import replace
import os

import numpy as np
import pytest

from cluster.calibrate import fingerprint, measure_accuracy, select_cuts, split_samples
from cluster.protocol.lossy import ImageNorm
from partitioner import Cut, Splitter
from planner import Encoding, PlannerError
from planner.accuracy import AccuracyEntry, AccuracyTable, encoding_key, parse_encoding_key
from tests.unit._accuracy_models import conv_model, images, mlp_model

NORM = ImageNorm.imagenet()


@pytest.fixture(scope="module")
def conv(tmp_path_factory: pytest.TempPathFactory) -> str:
    return conv_model(str(tmp_path_factory.mktemp("acc") / "conv.onnx"))


@pytest.fixture(scope="module")
def conv_table(conv: str):
    return measure_accuracy(conv, {"x": images()}, norm=NORM, show_progress=False)


def test_every_cut_and_encoding_is_measured_once(conv: str, conv_table) -> None:
    table = conv_table.table
    graph = Splitter(conv).graph
    cuts = select_cuts(graph)
    assert [c.key for c in cuts] == list(table.cut_ids)
    assert Cut(frozenset()).key in table.cut_ids and len(cuts) >= 3
    assert conv_table.measured == len(table.entries) and conv_table.reused == 0
    assert table.num_samples == 4 and table.model == "conv"


def test_fp16_agrees_at_least_as_well_as_int8_and_int8_as_4_bits(conv_table) -> None:
    table = conv_table.table
    for cut in table.cut_ids:
        fp16, int8, bits4 = (table.agreement(cut, k) for k in ("fp16", "int8", "bits@4"))
        assert fp16 is not None and int8 is not None and bits4 is not None
        assert 1.0 >= fp16 >= int8 >= bits4 > 0.5
        e = table.entry(cut, "fp16")
        assert e.worst_output == "y" and e.metric == "rel_l2" and e.num_samples == 4


def test_jpeg_at_quality_10_agrees_less_than_at_95_on_an_image(conv_table) -> None:
    table = conv_table.table
    empty = Cut(frozenset())
    q10, q95 = table.agreement(empty, "jpeg@10"), table.agreement(empty, "jpeg@95")
    assert q10 is not None and q95 is not None and q10 < q95 < 1.0
    assert table.entry(empty, "jpeg@10").wire_bytes < table.entry(empty, "jpeg@95").wire_bytes
    # jpeg sends fewer bytes than int8 of the same input
    assert table.entry(empty, "jpeg@95").wire_bytes < table.entry(empty, "int8").wire_bytes


def test_image_codecs_are_measured_only_where_the_model_input_crosses(conv_table) -> None:
    table = conv_table.table
    for cut in table.cut_ids[1:]:
        assert table.entry(cut, "jpeg@95") is None
        assert table.agreement(cut, "tiled-jpeg@90") is not None  # feature maps [N, 8, H, W]


def test_second_run_on_the_same_inputs_measures_nothing(conv: str, conv_table) -> None:
    again = measure_accuracy(conv, {"x": images()}, norm=NORM, previous=conv_table.table, show_progress=False)
    assert again.measured == 0 and again.reused == len(conv_table.table.entries)
    assert again.table == conv_table.table
    assert conv_table.table.host_model_ms > 0  # the speed the codecs were timed at, kept with them
    untimed = replace(conv_table.table, host_model_ms=None)  # a table stored before it was kept
    timed = measure_accuracy(conv, {"x": images()}, norm=NORM, previous=untimed, show_progress=False)
    assert timed.measured == 0 and timed.table.host_model_ms > 0 and timed.table.entries == untimed.entries


def test_a_new_encoding_is_the_only_thing_measured(conv: str, conv_table) -> None:
    more = measure_accuracy(conv, {"x": images()}, norm=NORM, previous=conv_table.table, show_progress=False,
                            encodings=("fp16", "bits@3"), input_encodings=())
    assert more.measured == len(conv_table.table.cut_ids)  # bits@3 at each cut
    assert more.table.agreement(Cut(frozenset()), "bits@3") is not None
    assert more.table.entry(Cut(frozenset()), "jpeg@95") == conv_table.table.entry(Cut(frozenset()), "jpeg@95")


def test_other_samples_or_another_norm_measure_everything_again(conv: str, conv_table) -> None:
    few = dict(encodings=("fp16",), input_encodings=(), show_progress=False)
    other = measure_accuracy(conv, {"x": images(3)}, norm=NORM, previous=conv_table.table, **few)
    assert other.measured == len(other.table.entries) and other.reused == 0
    assert other.table.fingerprint != conv_table.table.fingerprint
    assert fingerprint(b"m", {"x": images()}, None) != fingerprint(b"m", {"x": images()}, NORM)


def test_a_model_input_that_is_no_image_records_why_jpeg_does_not_apply(tmp_path) -> None:
    path = mlp_model(str(tmp_path / "mlp.onnx"))
    v = np.random.default_rng(0).standard_normal((6, 16)).astype(np.float32)
    r = measure_accuracy(path, {"v": v}, cuts=[Cut(frozenset())], encodings=("fp16", "int8", "tiled-jpeg@90"),
                         input_encodings=("jpeg@90",), show_progress=False)
    empty = Cut(frozenset())
    jpeg = r.table.entry(empty, "jpeg@90")
    assert jpeg.agreement is None and "is not an image" in jpeg.reason
    tiled = r.table.entry(empty, "tiled-jpeg@90")
    assert tiled.agreement is None and "[N, C, H, W]" in tiled.reason
    assert r.table.entry(empty, "fp16").metric == "top1"
    assert r.table.agreement(empty, "fp16") >= r.table.agreement(empty, "int8")


def test_split_samples_gives_one_row_each_and_keeps_unbatched_inputs_whole(tmp_path) -> None:
    import onnx

    model = onnx.load(conv_model(str(tmp_path / "c.onnx")))
    feeds = split_samples(model, {"x": images(3)})
    assert len(feeds) == 3 and feeds[1]["x"].shape == (1, 3, 16, 16)
    assert np.array_equal(feeds[2]["x"][0], images(3)[2])
    state = np.zeros((2, 5), np.float32)  # not one row per sample: every sample gets it whole
    feeds = split_samples(model, {"x": images(3), "h": state})
    assert len(feeds) == 3 and all(f["h"].shape == (2, 5) for f in feeds)


# -- the table as a value ---------------------------------------------------------------


def _table() -> AccuracyTable:
    return AccuracyTable("m", "f" * 32, 4, (
        AccuracyEntry("L", "int8", 0.97, "y", "top1", 4, 1000.0, 0.1),
        AccuracyEntry("L", "int8+pc", 0.99, "y", "top1", 4, 1010.0, 0.1),
        AccuracyEntry("L", "jpeg@90", 0.995, "y", "top1", 4, 300.0, 0.4),
        AccuracyEntry("L0-2", "jpeg@90", None, reason="not an image"),
    ))


def test_agreement_reads_by_cut_and_encoding_and_compression_is_lossless() -> None:
    t = _table()
    assert t.agreement(Cut(frozenset()), Encoding("int8", "zstd")) == 0.97
    assert t.agreement("L", Encoding("int8", "lz4", per_channel=True)) == 0.99
    assert t.agreement("L", "jpeg@90") == 0.995
    assert t.agreement("L0-2", "jpeg@90") is None
    assert t.agreement("L0-2", "fp16") is None
    assert [e.encoding for e in t.best("L", 0.98)] == ["jpeg@90", "int8+pc"]


def test_table_round_trips_through_json_exactly() -> None:
    t = _table()
    assert AccuracyTable.from_json(t.to_json()) == t
    timed = replace(t, host_model_ms=3.5)
    assert AccuracyTable.from_json(timed.to_json()) == timed and json.loads(timed.to_json())["host_model_ms"] == 3.5
    assert json.loads(t.to_json())["schema"] == "splitinfer.accuracy/1"


@pytest.mark.parametrize("key,match", [("int4", "unknown"), ("jpeg@0", r"quality 0, outside 1\.\.100"),
                                       ("jpeg@101", "outside 1..100"), ("bits@9", r"bit depth 9, outside 2\.\.8"),
                                       ("png@90", "unknown")])
def test_bad_encoding_keys_are_clear_errors(key: str, match: str) -> None:
    with pytest.raises(PlannerError, match=match):
        parse_encoding_key(key)


def test_encoding_keys() -> None:
    assert encoding_key(Encoding("fp16", "zstd")) == "fp16"
    assert encoding_key(Encoding("int8", per_channel=True)) == "int8+pc"
    assert parse_encoding_key("tiled-webp@75") == ("tiled-webp", 75)


@pytest.mark.parametrize("bad,match", [
    (lambda: AccuracyTable.from_json("{"), "not JSON"),
    (lambda: AccuracyTable.from_json("[]"), "not a JSON object"),
    (lambda: AccuracyTable.from_json('{"schema": "x/0"}'), "schema is 'x/0'"),
    (lambda: AccuracyEntry("L", "fp16", 1.5), r"agreement .* is 1\.5"),
    (lambda: AccuracyTable("m", "f", 1, (AccuracyEntry("L", "fp16", 1.0),) * 2), "two entries for fp16"),
])
def test_bad_tables_are_clear_errors(bad, match: str) -> None:
    with pytest.raises(PlannerError, match=match):
        bad()


# -- the registry artefact --------------------------------------------------------------


def test_registry_stores_the_table_and_ships_it_to_agents(tmp_path) -> None:
    from cluster.registry import RegistryError, VersionFiles

    vdir = tmp_path / "m" / "1"
    vdir.mkdir(parents=True)
    conv_model(str(vdir / "model.onnx"))
    files = VersionFiles(str(tmp_path), "m", "1")
    assert files.accuracy() is None
    files.write_accuracy(_table())
    assert files.accuracy() == _table()
    assert AccuracyTable.from_json(files.artifact_files()["accuracy.json"].decode()) == _table()
    (vdir / "accuracy.json").write_text("{}")
    with pytest.raises(RegistryError, match="is not an accuracy table.*splitinfer calibrate m@1"):
        files.accuracy()
    files.write_accuracy(_table())
    t = os.path.getmtime(vdir / "accuracy.json")
    os.utime(vdir / "model.onnx", (t + 10, t + 10))
    assert files.accuracy() is None  # older than the model: measured another model


def test_a_slower_sender_pays_for_its_codecs_by_its_models_speed() -> None:
    t = replace(_table(), host_model_ms=4.0)
    slow = t.priced_for(60.0)  # a device that runs the model 15x slower than the host that timed the codecs
    assert slow.entry("L", "jpeg@90").codec_ms == pytest.approx(0.4 * 15)
    assert slow.entry("L", "int8").codec_ms == pytest.approx(0.1 * 15)
    assert slow.entry("L0-2", "jpeg@90") == t.entry("L0-2", "jpeg@90")  # not applicable: nothing to price
    assert [e.agreement for e in slow.entries] == [e.agreement for e in t.entries]
    assert t.priced_for(2.0) is t and _table().priced_for(60.0) == _table()  # a faster sender; an untimed host


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "3", True])
def test_a_bad_host_model_time_is_refused_with_the_fix(bad: object) -> None:
    with pytest.raises(PlannerError, match="host_model_ms .* must be null or a number of ms > 0"):
        replace(_table(), host_model_ms=bad)
