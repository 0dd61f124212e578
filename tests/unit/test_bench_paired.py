"""bench.paired reads the metrics a change must not regress from the committed results."""

from __future__ import annotations

import json
from pathlib import Path

from bench.paired import METRICS

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def test_the_workers_metrics_are_the_c32_ratios_and_the_c1_added_latency_per_model():
    name, extract, lower_better = METRICS["workers"]
    got = extract(json.loads((RESULTS / name).read_text()))
    models = {k.split(".")[0] for k in got}
    assert models == {"densenet121", "resnet50", "transformer"}
    assert {k.split(".")[1] for k in got} == {"c32_over_raw_batched", "c32_over_serve", "c1_added_p50_ms"}
    assert [k for k in got if lower_better(k)] == [k for k in got if k.endswith("c1_added_p50_ms")]
    assert all(v > 0 for v in got.values())


def test_the_transport_metrics_are_the_round_trip_per_size():
    name, extract, lower_better = METRICS["transport"]
    got = extract(json.loads((RESULTS / name).read_text()))
    assert {k.split(".")[0] for k in got} == {"round_trip_4KiB", "round_trip_1024KiB", "round_trip_8192KiB"}
    assert all(lower_better(k) for k in got) and all(v > 0 for v in got.values())
