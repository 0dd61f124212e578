"""Observability of the gateway: Prometheus metrics, /healthz and /readyz, request-id logs.

Metric names (the Helm chart's dashboard and ServiceMonitor read them):

    splitinfer_requests_total{model,version,status}   counter; status is the gRPC code name
    splitinfer_stage_latency_seconds{stage}            histogram; decode, queue, compute, encode
    splitinfer_batch_size                              histogram of batches the workers ran
    splitinfer_bytes_total{direction}                  counter; 'in' (boundary) and 'out' (outputs)
    splitinfer_inflight_requests                       gauge
    splitinfer_refusals_total{model,reason}            counter; requests refused or expired, by reason
                                                       (REFUSAL_REASONS), before the handler included
    splitinfer_queue_depth{model,version,cut}          gauge; requests waiting for a batch, per pool
    splitinfer_predicted_wait_seconds{model,version,cut}  gauge; predicted wait of a request arriving now
    splitinfer_capacity_requests_per_second{model,version,cut}  gauge; full batches on every instance
    splitinfer_arrival_requests_per_second{model,version,cut}   gauge; arrivals, admitted or not
    splitinfer_discarded_results_total{model,version,cut}  counter; results computed after their deadline
    splitinfer_model_load_failures_total{model,version,reason}  counter; versions and tails that failed to
                                                       load, by LOAD_FAILURE_REASONS (the cause: /readyz)

The per-pool series are read from the pools when scraped (`set_load_source`), so they
cost the request path nothing. Each refusal reason is also logged, at most once per
`REFUSAL_LOG_INTERVAL_S` with its count, so an overload shows in the log without a
line per request.

Each `GatewayMetrics` has its own CollectorRegistry, so two gateways in one process
(tests) do not share counters. The HTTP server is a small threaded http.server: it
serves /metrics, /healthz (the process answers) and /readyz (200 only when the
readiness callable is true: the frontier tails are loaded). `/readyz?load=1` adds the
load per pool and answers 503 while the gateway is overloaded (it refused a request for
load within the last few seconds); plain /readyz and /healthz do not look at load, so an
overload never fails liveness or readiness. Given an SSL context (the gateway's --tls-cert
and --tls-key, `cluster.auth.load_http_tls_context`) it serves HTTPS on the same port; see
[Note: HTTPS] for client certificates.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["GatewayMetrics", "MetricsServer", "JsonLogFormatter", "LOAD_FAILURE_REASONS", "PoolLoadSample",
           "PROBE_PATHS", "REFUSAL_REASONS", "REFUSAL_LOG_INTERVAL_S", "STAGES", "TLS_HANDSHAKE_TIMEOUT_S",
           "configure_logging"]

logger = logging.getLogger(__name__)

STAGES = ("decode", "queue", "compute", "encode")
# From 50 us to ~100 s: a decode on loopback up to a queue behind a cold GPU.
_LATENCY_BUCKETS_S = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                      2.5, 5.0, 10.0, 30.0, 100.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
_MAX_CACHED_SERIES = 1024

REFUSAL_REASONS = (
    "queue_full",  # the pool's queue is at max_queue_size
    "predicted_wait",  # refused on arrival: the queue ahead ends after the deadline
    "deadline_unreachable",  # refused when its batch formed: the batch ends after the deadline
    "request_too_large",  # the boundary tensors exceed max_request_bytes
    "expired_before_backend",  # the deadline had passed when the request reached the server
    "expired_in_queue",  # the deadline passed while it waited for a batch
    "expired_in_pool",  # the deadline passed inside the pool: queued longer than predicted, or running
    "malformed",  # the frame did not decode (counted by the server, before the gateway)
)
REFUSAL_LOG_INTERVAL_S = 10.0

LOAD_FAILURE_REASONS = (
    "registry",  # the version's files: model.yaml, sample inputs, a model the partitioner cannot read
    "cut",  # the tail of a cut could not be cut from the model
    "session",  # ONNX Runtime refused the tail (or its pre-optimised artefact)
    "optimise",  # ONNX Runtime could not optimise the tail
    "warmup",  # the tail loaded but its warm-up run failed
    "other",  # anything else (the log has the details)
)
"""The `reason` label of splitinfer_model_load_failures_total: a small fixed set, so that
the series stay few; the full cause is on /readyz and in the log."""

PoolLoadSample = tuple[tuple[str, str, str], int, "float | None", "float | None", int, "float | None"]
"""((model, version, cut), queue depth, predicted wait s, capacity req/s, discarded results,
arrivals req/s)."""


class _LoadCollector:
    """The per-pool series, read from the gateway's load source at scrape time."""

    def __init__(self, source: Callable[[], Iterable[PoolLoadSample]]) -> None:
        self._source = source

    def describe(self) -> list[Any]:
        return []  # unchecked: the series depend on the pools loaded at scrape time

    def collect(self) -> Iterable[Any]:
        labels = ("model", "version", "cut")
        depth = GaugeMetricFamily("splitinfer_queue_depth", "Requests waiting for a batch, per pool.", labels=labels)
        wait = GaugeMetricFamily("splitinfer_predicted_wait_seconds",
                                 "Predicted wait for a batch of a request arriving now, per pool.", labels=labels)
        cap = GaugeMetricFamily("splitinfer_capacity_requests_per_second",
                                "Requests per second the pool answers at full batches on every instance.",
                                labels=labels)
        arrivals = GaugeMetricFamily("splitinfer_arrival_requests_per_second",
                                     "Requests that reached the pool per second, admitted or not.", labels=labels)
        discarded = CounterMetricFamily("splitinfer_discarded_results",
                                        "Results computed after their deadline and thrown away, per pool.",
                                        labels=labels)
        for key, n, wait_s, capacity, thrown, arrival_rps in self._source():
            depth.add_metric(key, n)
            if wait_s is not None:
                wait.add_metric(key, wait_s)
            if capacity is not None:
                cap.add_metric(key, capacity)
            if arrival_rps is not None:
                arrivals.add_metric(key, arrival_rps)
            discarded.add_metric(key, thrown)
        return [depth, wait, cap, arrivals, discarded]


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
        self.refusals = Counter("splitinfer_refusals_total",
                                "Requests refused or expired, by model and reason (see REFUSAL_REASONS).",
                                ("model", "reason"), registry=self.registry)
        self._refusals: dict[tuple[str, str], Any] = {}
        self.load_failures = Counter("splitinfer_model_load_failures_total",
                                     "Model versions and tails that failed to load, by model, version and reason "
                                     "(see LOAD_FAILURE_REASONS).", ("model", "version", "reason"),
                                     registry=self.registry)
        self._refusal_log: dict[str, tuple[float, int]] = {}
        """reason -> (when it was last logged, count since then)."""
        self._refusal_lock = threading.Lock()
        self._load_source: Callable[[], Iterable[PoolLoadSample]] | None = None
        self.load_view: Callable[[], dict[str, Any]] | None = None
        """What `/readyz?load=1` shows: {'overloaded': bool, 'pools': {...}} (the gateway sets it)."""

    def set_load_source(self, source: Callable[[], Iterable[PoolLoadSample]]) -> None:
        """Where the per-pool gauges come from (the gateway's pools); read on each scrape."""
        if self._load_source is None:
            self.registry.register(_LoadCollector(lambda: self._load_source() if self._load_source else ()))
        self._load_source = source

    def observe_refusal(self, model: str, reason: str, *, now_s: float | None = None) -> None:
        """Counts one refusal or expiry and logs its reason at most once per REFUSAL_LOG_INTERVAL_S."""
        key = (model or "-", reason)
        child = self._refusals.get(key)
        if child is None:
            child = self.refusals.labels(*key)
            if len(self._refusals) < _MAX_CACHED_SERIES:
                self._refusals[key] = child
        child.inc()
        now_s = time.monotonic() if now_s is None else now_s
        with self._refusal_lock:
            last_s, n = self._refusal_log.get(reason, (float("-inf"), 0))
            n += 1
            if now_s - last_s < REFUSAL_LOG_INTERVAL_S:
                self._refusal_log[reason] = (last_s, n)
                return
            self._refusal_log[reason] = (now_s, 0)
        logger.warning("%d requests refused (%s) since this reason was last logged; the last for model %s",
                       n, reason, model or "-", extra={"model": model, "status": reason})

    def observe_load_failure(self, model: str, version: str, reason: str) -> None:
        """Counts one version or tail that failed to load; ``reason`` is one of LOAD_FAILURE_REASONS."""
        self.load_failures.labels(model or "-", version or "-",
                                  reason if reason in LOAD_FAILURE_REASONS else "other").inc()

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


TLS_HANDSHAKE_TIMEOUT_S = 10.0
"""A client that has not finished its TLS handshake by then is dropped, freeing its thread."""
PROBE_PATHS = ("/healthz", "/readyz")
"""Paths that answer without a client certificate under mutual TLS: kubelet's probes send none."""

# [Note: HTTPS] With --tls-client-ca the gRPC port refuses a client without a certificate
# signed by that CA in the handshake. The HTTP port cannot: kubelet's HTTPS probes send no
# certificate. So its handshake asks for one (CERT_OPTIONAL: one that is sent must verify)
# and the handler refuses, with 403, a request that came without one to any path but
# PROBE_PATHS, which show readiness and nothing of a model's inputs or outputs.


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def _refused_without_client_cert(self) -> bool:
        """True (and answered 403) when mutual TLS is on and this connection sent no certificate."""
        tls = self.server.tls
        if tls is None or tls.verify_mode is ssl.CERT_NONE:
            return False
        path = self.path.split("?", 1)[0]
        if path in PROBE_PATHS or self.connection.getpeercert():
            return False
        self.close_connection = True  # a POST's body is left unread
        why = ("a client certificate signed by the gateway's --tls-client-ca is required on this port "
               f"(all but {', '.join(PROBE_PATHS)})")
        if path == "/v2" or path.startswith("/v2/"):
            self._send(403, json.dumps({"error": why}).encode(), "application/json")
        else:
            self._send(403, why.encode() + b"\n", "text/plain")
        return True

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self._refused_without_client_cert():
            return
        if self.server.routes is not None and self.server.routes(self):  # e.g. OIP REST (cluster.oip_rest)
            return
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, self.server.metrics.exposition(), CONTENT_TYPE_LATEST)
        elif path == "/healthz":
            self._send(200, b"ok\n", "text/plain")
        elif path == "/readyz":
            ready, detail = self.server.ready()
            code = 200 if ready else 503
            load = self.server.metrics.load_view
            if load is not None and "load=1" in self.path.partition("?")[2].split("&"):
                view = load()
                detail = {**detail, "load": view}
                if view.get("overloaded"):
                    code = 503
            body = json.dumps({"ready": ready, **detail}, sort_keys=True).encode() + b"\n"
            self._send(code, body, "application/json")
        else:
            self._send(404, b"not found: try /metrics, /healthz or /readyz\n", "text/plain")

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        if self._refused_without_client_cert():
            return
        if self.server.routes is None or not self.server.routes(self):
            self.close_connection = True  # the body is left unread
            self._send(404, b"not found: POST serves only the routes given to MetricsServer\n", "text/plain")

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
    routes: Callable[[BaseHTTPRequestHandler], bool] | None
    tls: ssl.SSLContext | None = None

    def finish_request(self, request: Any, client_address: Any) -> None:
        """Handles one connection on its own thread; the TLS handshake happens here rather than
        in accept(), where a client that never finished its handshake would stall every other."""
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        request.settimeout(TLS_HANDSHAKE_TIMEOUT_S)
        try:
            conn = self.tls.wrap_socket(request, server_side=True)  # takes over the socket
        except (ssl.SSLError, OSError) as e:
            logger.debug("metrics https: TLS handshake with %s failed: %s", client_address[0], e)
            return
        try:
            conn.settimeout(None)
            super().finish_request(conn, client_address)
        finally:
            try:
                conn.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            conn.close()


class MetricsServer:
    """/metrics, /healthz and /readyz over HTTP on its own thread.

    `ready()` returns (ready, detail); detail is shown as JSON on /readyz. `routes(handler)`,
    when given, sees each GET and POST first and returns True when it answered (the OIP
    REST door, `cluster.oip_rest.OipRest.serve`). With `tls` the port serves HTTPS only
    (`cluster.auth.load_http_tls_context`; [Note: HTTPS]).
    """

    def __init__(self, metrics: GatewayMetrics, ready: Callable[[], tuple[bool, dict[str, Any]]],
                 *, host: str = "127.0.0.1", port: int = 0,
                 routes: Callable[[BaseHTTPRequestHandler], bool] | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        try:
            self._httpd = _Server((host, port), _Handler)
        except OSError as e:
            raise OSError(f"could not bind the metrics port {host}:{port} ({e.strerror}); "
                          "choose a free --metrics-port or 0") from e
        self._httpd.metrics = metrics
        self._httpd.ready = ready
        self._httpd.routes = routes
        self._httpd.tls = tls
        self.scheme = "https" if tls is not None else "http"
        self.host = host
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()
        logger.info("metrics on %s://%s:%d/metrics", self.scheme, host, self.port)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

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
