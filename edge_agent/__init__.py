"""The edge agent: the daemon on every device that makes split inference survive real networks.

Modules (import the one you need; `edge_agent.client` stays light for apps):
    config     edge.yaml as a frozen dataclass          monitor   link estimation (pure)
    policy     where the next request runs (pure)       breaker   circuit breaker (pure)
    flow       one request's exactly-one-answer states  runner    the request path
    engines    warm head/tail/full engines, frontier    cache     offline artifact cache
    transport  gRPC to the gateway                      api/wire  the local HTTP API
    daemon     start-up, probe loop, shutdown           client    EdgeClient for local apps
    probing    link checks and probes (runner's mixin)
docs/edge-agent.md is the operator's guide.
"""

__all__ = ["api", "breaker", "cache", "client", "config", "daemon", "engines", "errors", "flow", "monitor",
           "policy", "probing", "runner", "transport", "wire"]
