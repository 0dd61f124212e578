"""`splitinfer gateway`: the cloud gateway process (gRPC on --port, HTTP metrics on --metrics-port).

    splitinfer gateway --port 50051 --metrics-port 9090 --ray-address auto --registry /models \
        [--tokens-file tokens.yaml] [--tls-cert F --tls-key F [--tls-client-ca F]] \
        [--policy-dir /etc/splitinfer/policies [--policy-poll-s 5]] [--pool-start-timeout-s 300]

`--ray-address local-noray` runs the tails in this process (Engines and a batcher, no
Ray). The process serves at once but reports NOT_SERVING (gRPC health, /readyz 503,
whose JSON names each model not ready yet and why) until every version it found has been
tried and at least one serves. A model, version or tail that fails to load is listed
with its cause (/readyz `failed`, a health service per model, GetArtifacts) and counted,
and the others serve (see [Note: failed tails] in cluster/gateway.py). A registry that
is missing, empty or holds nothing in the layout `<name>/<version>/model.onnx` is an
error at start (exit 2; `--allow-empty` lets an empty one start); so is a registry none
of whose models loads. SIGTERM or SIGINT
drains requests for up to 5 s, closes the pools and exits 0, also while loading.
`--policy-dir` is a directory of `<model>.policy.yaml` files (the registry ConfigMap,
mounted) that override `<registry>/<model>/policy.yaml` and are applied live when
they change (see [Note: policy sync] in cluster/gateway.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence

__all__ = ["gateway_main", "check_registry", "make_parser", "LOCAL_NORAY"]

logger = logging.getLogger(__name__)

LOCAL_NORAY = "local-noray"


def make_parser() -> argparse.ArgumentParser:
    from cluster.gateway import DEFAULT_POOL_START_TIMEOUT_S

    p = argparse.ArgumentParser(prog="splitinfer gateway", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 in a pod); default 127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0: any free port)")
    p.add_argument("--metrics-port", type=int, default=9090,
                   help="HTTP port of /metrics, /healthz, /readyz and the OIP REST API under /v2 (-1: off); "
                        "HTTPS with --tls-cert")
    p.add_argument("--registry", required=True,
                   help="model repository: <name>/<version>/model.onnx + model.yaml ('splitinfer registry add' "
                        "writes it)")
    p.add_argument("--allow-empty", action="store_true",
                   help="start on a registry that holds no model yet (it stays NOT_SERVING); without it that is "
                        "an error at start")
    p.add_argument("--ray-address", default=LOCAL_NORAY,
                   help=f"Ray cluster address ('auto', 'local', 'ray://host:10001') or {LOCAL_NORAY!r}")
    p.add_argument("--pool-start-timeout-s", type=float, default=DEFAULT_POOL_START_TIMEOUT_S,
                   help="seconds a tail's Ray workers may take to be placed and load it before its requests get "
                        "UNAVAILABLE with what they asked for (default %(default)g)")
    p.add_argument("--direct-tcp-pickle", action="store_true",
                   help="let the direct channel to Ray workers on other nodes carry pickle frames over TCP "
                        "(errors, objects, strided arrays go by it rather than by a plain Ray call); pickle runs "
                        "whatever it reads, and the channel's token travels in clear with no TLS of its own (Ray's "
                        "does not cover it), so anyone who can reach the cluster network could run code in the "
                        "gateway and workers: only where nobody else reaches the network between nodes, or it is "
                        "encrypted beneath (a WireGuard or IPsec mesh); default off: tensors only")
    p.add_argument("--version-policy", default="latest:1", help="latest[:N], all, or specific:V1,V2")
    p.add_argument("--policy-dir", default=None,
                   help="directory of <model>.policy.yaml (a mounted ConfigMap), polled and applied live")
    p.add_argument("--policy-poll-s", type=float, default=5.0, help="seconds between polls of --policy-dir")
    p.add_argument("--cache-dir", default=None, help="writable directory for segments and ORT artefacts")
    p.add_argument("--tokens-file", default=None, help="YAML 'tokens: [{name, token, models, rate_limit_rps}]'")
    p.add_argument("--rate-limit-rps", type=float, default=None, help="per-device request rate for tokens without one")
    p.add_argument("--max-message-bytes", type=int, default=64 << 20, help="largest gRPC message either way")
    p.add_argument("--tls-cert", default=None,
                   help="PEM server certificate: TLS on the gRPC port, and HTTPS on the --metrics-port")
    p.add_argument("--tls-key", default=None, help="PEM server private key")
    p.add_argument("--tls-client-ca", default=None,
                   help="PEM CA of client certificates (turns on mutual TLS; on the HTTP port /healthz and "
                        "/readyz answer without one, for kubelet's probes)")
    p.add_argument("--provider", default="auto", choices=("auto", "cpu", "cuda", "tensorrt", "torch-cuda"),
                   help="engine provider of the in-process pools: ONNX Runtime's, or torch-cuda (tails converted "
                        "to PyTorch on CUDA; needs splitinfer[gpu])")
    p.add_argument("--log-level", default=os.environ.get("SPLITINFER_LOG_LEVEL", "INFO"))
    p.add_argument("--log-format", default="json", choices=("json", "text"))
    return p


def _check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if (a.tls_cert is None) != (a.tls_key is None):
        p.error("--tls-cert and --tls-key go together; give both or neither")
    if a.tls_client_ca and not a.tls_cert:
        p.error("--tls-client-ca needs --tls-cert and --tls-key: mutual TLS is an extension of TLS")
    if a.policy_dir is not None and not os.path.isdir(a.policy_dir):
        p.error(f"--policy-dir {a.policy_dir!r} is not a directory; mount the registry ConfigMap there, "
                "or leave the flag out")
    if not a.pool_start_timeout_s > 0:
        p.error(f"--pool-start-timeout-s {a.pool_start_timeout_s} must be > 0; leave it out for "
                f"{p.get_default('pool_start_timeout_s'):g} s, time for an autoscaler to add a node")
    if a.direct_tcp_pickle and a.ray_address == LOCAL_NORAY:
        p.error(f"--direct-tcp-pickle concerns the Ray workers' channel; --ray-address {LOCAL_NORAY} runs the "
                "tails in this process: give a Ray address or leave the flag out")
    if not a.policy_poll_s > 0:
        p.error(f"--policy-poll-s {a.policy_poll_s} must be > 0; a few seconds suits a mounted ConfigMap")


def _pool_factory(a: argparse.Namespace):  # noqa: ANN202 - a PoolFactory
    if a.ray_address == LOCAL_NORAY:
        from cluster.gateway import LocalPoolFactory

        return LocalPoolFactory(cache_dir=a.cache_dir, provider=a.provider)
    from cluster.ray_cluster import connect

    connect(a.ray_address)
    return ray_pool_factory(a)


def ray_pool_factory(a: argparse.Namespace):  # noqa: ANN201 - a cluster.ray_cluster.RayPoolFactory
    """The Ray pools the parsed flags `a` ask for (Ray not connected yet)."""
    from cluster.ray_cluster import RayPoolFactory

    return RayPoolFactory(start_timeout_s=a.pool_start_timeout_s, tcp_pickle=a.direct_tcp_pickle)


def check_registry(path: str, *, allow_empty: bool) -> tuple[str | None, tuple[str, ...]]:
    """(the one-line error for a registry the gateway cannot start on, or None; what in it does
    not fit the layout, each as 'path: what is wrong; the fix')."""
    from cluster.registry import LAYOUT, RegistryError, survey

    add = f"splitinfer registry add MODEL {path}"
    try:
        found = survey(path)
    except RegistryError as e:
        return f"--registry {path!r} {e.reason}; expected a directory of {LAYOUT}; create one with: {add}", ()
    if found.models or allow_empty:
        return None, found.problems
    return (f"--registry {path!r} {found.found()}; expected {LAYOUT}; add a model with: {add} "
            "(or start with --allow-empty)"), found.problems


async def _run(a: argparse.Namespace, stop: asyncio.Event | None = None) -> int:
    from cluster.auth import Authorizer, TokenTable, load_http_tls_context, load_server_credentials
    from cluster.gateway import Gateway
    from cluster.metrics import GatewayMetrics, MetricsServer
    from cluster.registry import Registry, VersionPolicy
    from cluster.server import serve

    registry = Registry(a.registry, policy=VersionPolicy.parse(a.version_policy), cache_dir=a.cache_dir,
                        policy_dir=a.policy_dir)
    tokens = TokenTable.from_file(a.tokens_file) if a.tokens_file else None
    creds = load_server_credentials(a.tls_cert, a.tls_key, a.tls_client_ca) if a.tls_cert else None
    # The same files make the HTTP port HTTPS ([Note: HTTPS] in cluster/metrics.py).
    http_tls = load_http_tls_context(a.tls_cert, a.tls_key, a.tls_client_ca) if a.tls_cert else None
    metrics = GatewayMetrics()
    uses_ray = a.ray_address != LOCAL_NORAY
    gateway = Gateway(registry, _pool_factory(a), metrics=metrics, policy_poll_s=a.policy_poll_s,
                      authorizer=Authorizer(tokens, default_rate_limit_rps=a.rate_limit_rps))
    # After connecting to Ray: ray.init installs a SIGTERM handler of its own that kills
    # the process at once; these replace it, so SIGTERM drains and exits 0.
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests), or not POSIX
            pass
    http = server = None
    rc = 0
    try:
        from cluster.oip_grpc import oip_service
        from cluster.oip_rest import OipRest

        oip = OipRest(gateway, loop)  # the Open Inference Protocol's REST routes, under /v2
        http = (MetricsServer(metrics, gateway.readiness, host=a.host, port=a.metrics_port, routes=oip.serve,
                              tls=http_tls) if a.metrics_port >= 0 else None)
        # The OIP gRPC service on the gRPC port, sharing the REST door's models and statistics.
        server = await serve(gateway, host=a.host, port=a.port, credentials=creds, ready=False,
                             max_message_bytes=a.max_message_bytes, services=[oip_service(oip.models)])
        print(f"gateway serving on {server.address}" + (f", metrics on {http.url}" if http else ""), flush=True)
        rc = await _serve(a, gateway, stop)
    finally:
        await _shut_down(gateway, server, http, uses_ray)
    return rc


async def _serve(a: argparse.Namespace, gateway, stop: asyncio.Event) -> int:  # noqa: ANN001 - a cluster Gateway
    """Loads the registry while serving, then waits for `stop`; 2 when no model could be loaded."""
    starting = asyncio.ensure_future(gateway.start(keep_going=True))
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            logger.info("stop requested while loading the registry: %s", gateway.readiness()[1].get("reason"))
            return 0
        starting.result()
        ready, detail = gateway.readiness()
        failed = {k: v for k, v in detail["not_ready"].items() if v.startswith("failed")}
        if ready:
            logger.info("gateway ready: %s", gateway.registry.to_json())
            if failed or detail["failed"]:
                logger.warning("gateway serving without what failed to load: %s (GET /readyz lists them)",
                               "; ".join(f"{k}: {v}" for k, v in detail["failed"].items()))
        elif failed and not detail["versions"]:
            shown = "; ".join(f"{k}: {v}" for k, v in failed.items())
            print(f"splitinfer gateway: error: no model of --registry {a.registry!r} could be loaded: {shown}",
                  file=sys.stderr, flush=True)
            return 2
        else:
            logger.warning("gateway not ready: %s (GET /readyz lists each model and why)", detail["reason"])
        await stopping
        return 0
    finally:
        for task in (starting, stopping):
            task.cancel()
        await asyncio.gather(starting, stopping, return_exceptions=True)


async def _shut_down(gateway, server, http, uses_ray: bool) -> None:  # noqa: ANN001 - the parts _run made
    """Drains and stops every part; each is stopped even when an earlier one fails to."""
    logger.info("gateway stopping: draining requests")
    if server is not None:
        await server.health.set_ready(False)
        await server.stop(grace_s=5.0)
    try:
        await gateway.close()
    finally:
        if http is not None:
            http.stop()
        if uses_ray:
            from cluster.ray_cluster import shutdown

            # Now, while the event loop still runs: Ray's exit hook would otherwise leave
            # its callbacks to a loop already closed.
            shutdown()
    logger.info("gateway stopped")


def gateway_main(argv: Sequence[str]) -> int:
    """Entry point of `splitinfer gateway`; returns the exit code."""
    p = make_parser()
    a = p.parse_args(list(argv))
    _check_args(p, a)
    error, problems = check_registry(a.registry, allow_empty=a.allow_empty)
    if error is not None:
        print(f"splitinfer gateway: error: {error}", file=sys.stderr)
        return 2
    from cluster.metrics import configure_logging

    configure_logging(a.log_level, json_lines=a.log_format == "json")
    for problem in problems:
        logger.warning("not served from %s: %s", a.registry, problem)
    from cluster.server import new_event_loop

    with asyncio.Runner(loop_factory=new_event_loop) as runner:  # uvloop where installed: [Note: event loop]
        return runner.run(_run(a))
