"""Observability of the gateway: Prometheus metrics, /healthz and /readyz, request-id logs.

Metric names (the Helm chart's dashboard and ServiceMonitor read them):

    splitinfer_requests_total{model,version,status}   counter; status is the gRPC code name
    splitinfer_stage_latency_seconds{stage}            histogram; decode, queue, compute, encode
    splitinfer_batch_size                              histogram of batches the workers ran
    splitinfer_bytes_total{direction}                  counter; 'in' (boundary) and 'out' (outputs)
    splitinfer_inflight_requests                       gauge

Each `GatewayMetrics` has its own CollectorRegistry, so two gateways in one process
(tests) do not share counters. The HTTP server is a small threaded http.server: it
serves /metrics, /healthz (the process answers) and /readyz (200 only when the
readiness callable is true: the frontier tails are loaded).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["GatewayMetrics", "MetricsServer", "JsonLogFormatter", "STAGES", "configure_logging"]

logger = logging.getLogger(__name__)

STAGES = ("decode", "queue", "compute", "encode")
# From 50 us to ~100 s: a decode on loopback up to a queue behind a cold GPU.
_LATENCY_BUCKETS_S = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                      2.5, 5.0, 10.0, 30.0, 100.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
_MAX_CACHED_SERIES = 1024


class GatewayMetrics:
    """The gateway's metrics, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("splitinfer_requests_total", "Requests answered, by model, version and gRPC status.",
                                ("model", "version", "status"), registry=self.registry)
        self.stage_latency = Histogram("splitinfer_stage_latency_seconds", "Time per request in each gateway stage.",
                                       ("stage",), buckets=_LATENCY_BUCKETS_S, registry=self.registry)
        self.batch_size = Histogram("splitinfer_batch_size", "Requests per batch run by the workers.",
                                    buckets=_BATCH_BUCKETS, registry=self.registry)
        self.bytes = Counter("splitinfer_bytes_total", "Tensor bytes received ('in') and sent ('out').",
                             ("direction",), registry=self.registry)
        self.inflight = Gauge("splitinfer_inflight_requests", "Requests being served now.", registry=self.registry)
        # Children made up front, so a dashboard sees zeros rather than no series, and
        # kept: labels() takes a lock and builds a key on every call of the hot path.
        self._stages = {s: self.stage_latency.labels(s) for s in STAGES}
        self._bytes = {d: self.bytes.labels(d) for d in ("in", "out")}
        self._requests: dict[tuple[str, str, str], Any] = {}

    def observe_request(self, model: str, version: str, status: str) -> None:
        key = (model, version or "-", status)
        child = self._requests.get(key)
        if child is None:
            child = self.requests.labels(*key)
            if len(self._requests) < _MAX_CACHED_SERIES:  # names come from clients: bound the cache
                self._requests[key] = child
        child.inc()

    def observe_stage(self, stage: str, seconds: float) -> None:
        child = self._stages.get(stage) or self.stage_latency.labels(stage)
        child.observe(seconds if seconds > 0.0 else 0.0)

    def observe_batch(self, size: int) -> None:
        self.batch_size.observe(size)

    def add_bytes(self, direction: str, n: int) -> None:
        (self._bytes.get(direction) or self.bytes.labels(direction)).inc(n)

    def exposition(self) -> bytes:
        """The text format Prometheus scrapes."""
        return generate_latest(self.registry)

    def sample(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """One sample's value (tests and status pages)."""
        return self.registry.get_sample_value(name, labels or {})


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, self.server.metrics.exposition(), CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            self._send(200, b"ok\n", "text/plain")
        elif path == "/readyz":
            ready, detail = self.server.ready()
            body = json.dumps({"ready": ready, **detail}, sort_keys=True).encode() + b"\n"
            self._send(200 if ready else 503, body, "application/json")
        else:
            self._send(404, b"not found: try /metrics, /healthz or /readyz\n", "text/plain")

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        logger.debug("metrics http: " + format, *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    metrics: GatewayMetrics
    ready: Callable[[], tuple[bool, dict[str, Any]]]


class MetricsServer:
    """/metrics, /healthz and /readyz over HTTP on its own thread.

    `ready()` returns (ready, detail); detail is shown as JSON on /readyz.
    """

    def __init__(self, metrics: GatewayMetrics, ready: Callable[[], tuple[bool, dict[str, Any]]],
                 *, host: str = "127.0.0.1", port: int = 0) -> None:
        try:
            self._httpd = _Server((host, port), _Handler)
        except OSError as e:
            raise OSError(f"could not bind the metrics port {host}:{port} ({e.strerror}); "
                          "choose a free --metrics-port or 0") from e
        self._httpd.metrics = metrics
        self._httpd.ready = ready
        self.host = host
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()
        logger.info("metrics on http://%s:%d/metrics", host, self.port)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and request_id when the record has one."""

    _EXTRA = ("request_id", "model", "version", "cut_id", "device_id", "principal", "status")

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for k in self._EXTRA:
            v = getattr(record, k, None)
            if v is not None:
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, sort_keys=False)


def configure_logging(level: str = "INFO", *, json_lines: bool = True) -> None:
    """Root logging for the gateway process: JSON lines (for log shippers) or plain text."""
    import time as _time

    handler = logging.StreamHandler()
    if json_lines:
        fmt = JsonLogFormatter()
        fmt.converter = _time.gmtime
        handler.setFormatter(fmt)
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
