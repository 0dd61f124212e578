"""Gateway metrics and structured logs (no HTTP here: tests/integration/test_gateway_http.py serves them)."""

from __future__ import annotations

import json
import logging

from cluster.metrics import STAGES, GatewayMetrics, JsonLogFormatter


def test_metric_names_and_labels_match_the_chart():
    m = GatewayMetrics()
    m.observe_request("resnet50", "2", "OK")
    m.observe_request("resnet50", "2", "OK")
    m.observe_request("resnet50", "", "NOT_FOUND")
    for s in STAGES:
        m.observe_stage(s, 0.003)
    m.observe_batch(4)
    m.add_bytes("in", 1000)
    m.add_bytes("out", 40)
    m.inflight.inc()
    assert m.sample("splitinfer_requests_total", {"model": "resnet50", "version": "2", "status": "OK"}) == 2.0
    assert m.sample("splitinfer_requests_total", {"model": "resnet50", "version": "-", "status": "NOT_FOUND"}) == 1.0
    for s in STAGES:
        assert m.sample("splitinfer_stage_latency_seconds_count", {"stage": s}) == 1.0
        assert m.sample("splitinfer_stage_latency_seconds_bucket", {"stage": s, "le": "0.0025"}) == 0.0
        assert m.sample("splitinfer_stage_latency_seconds_bucket", {"stage": s, "le": "0.005"}) == 1.0
    assert m.sample("splitinfer_batch_size_sum") == 4.0
    assert m.sample("splitinfer_bytes_total", {"direction": "in"}) == 1000.0
    assert m.sample("splitinfer_inflight_requests") == 1.0
    text = m.exposition().decode()
    for name in ("splitinfer_requests_total", "splitinfer_stage_latency_seconds_bucket", "splitinfer_batch_size_bucket",
                 "splitinfer_bytes_total", "splitinfer_inflight_requests"):
        assert name in text


def test_each_gateway_has_its_own_registry():
    a, b = GatewayMetrics(), GatewayMetrics()
    a.observe_request("m", "1", "OK")
    assert b.sample("splitinfer_requests_total", {"model": "m", "version": "1", "status": "OK"}) is None
    # Stage series exist from the start, so dashboards see zeros rather than gaps.
    assert b.sample("splitinfer_stage_latency_seconds_count", {"stage": "queue"}) == 0.0


def test_json_log_lines_carry_the_request_id():
    fmt = JsonLogFormatter()
    rec = logging.LogRecord("cluster.gateway", logging.INFO, __file__, 1, "served %s in %d ms", ("r1", 5), None)
    rec.request_id = "r1"
    rec.model = "resnet50"
    line = json.loads(fmt.format(rec))
    assert line["message"] == "served r1 in 5 ms"
    assert line["request_id"] == "r1" and line["model"] == "resnet50" and line["level"] == "INFO"
    plain = json.loads(fmt.format(logging.LogRecord("x", logging.WARNING, __file__, 1, "hi", (), None)))
    assert "request_id" not in plain
