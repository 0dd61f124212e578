"""The gateway's load and refusal metrics: counting by reason, one log line per reason and
interval, per-pool series read at scrape time (/readyz?load=1: tests/integration/test_gateway_overload.py)."""

from __future__ import annotations

import logging

from cluster.metrics import REFUSAL_LOG_INTERVAL_S, GatewayMetrics


def test_refusals_are_counted_by_reason_and_logged_once_per_interval(caplog):
    m = GatewayMetrics()
    with caplog.at_level(logging.WARNING, logger="cluster.metrics"):
        for i in range(5):
            m.observe_refusal("net", "predicted_wait", now_s=100.0 + i)
        m.observe_refusal("net", "queue_full", now_s=101.0)
        m.observe_refusal("net", "predicted_wait", now_s=100.0 + REFUSAL_LOG_INTERVAL_S)
    assert m.sample("splitinfer_refusals_total", {"model": "net", "reason": "predicted_wait"}) == 6
    assert m.sample("splitinfer_refusals_total", {"model": "net", "reason": "queue_full"}) == 1
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "1 requests refused (predicted_wait) since this reason was last logged; the last for model net",
        "1 requests refused (queue_full) since this reason was last logged; the last for model net",
        "5 requests refused (predicted_wait) since this reason was last logged; the last for model net",
    ]


def test_pool_load_is_read_when_scraped():
    m = GatewayMetrics()
    pools = [(("net", "1", "L"), 3, 0.25, 40.0, 2, 55.0)]
    m.set_load_source(lambda: pools)
    labels = {"model": "net", "version": "1", "cut": "L"}
    assert m.sample("splitinfer_queue_depth", labels) == 3
    assert m.sample("splitinfer_predicted_wait_seconds", labels) == 0.25
    assert m.sample("splitinfer_capacity_requests_per_second", labels) == 40.0
    assert m.sample("splitinfer_discarded_results_total", labels) == 2
    assert m.sample("splitinfer_arrival_requests_per_second", labels) == 55.0
    pools[0] = (("net", "1", "L"), 0, None, None, 2, None)  # no batch timed yet: no wait, no capacity
    assert m.sample("splitinfer_queue_depth", labels) == 0
    assert m.sample("splitinfer_predicted_wait_seconds", labels) is None
    assert b"splitinfer_queue_depth{" in m.exposition()
