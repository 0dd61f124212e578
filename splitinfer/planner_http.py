"""`splitinfer planner serve`: the what-if service on HTTP/JSON (stdlib only).

An adapter: read the request, call `PlannerService.handle`, write its status and JSON
body. Routing, the OpenAPI document, body validation and error mapping live in
`splitinfer.planner_api`; the work is `planner.whatif`. Profiles PUT to the service are
written to ``--profiles-dir`` (when given) and read back at start.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from planner.errors import ProfileError
from planner.profile import Profile
from planner.whatif import PROFILE_NAME_RE
from splitinfer.planner_api import MAX_BODY_BYTES, PlannerService
from splitinfer.units import arg_type, parse_args

__all__ = ["PlannerHTTPServer", "make_server", "load_profiles_dir", "planner_main"]

logger = logging.getLogger(__name__)


class _Handler(BaseHTTPRequestHandler):
    server: PlannerHTTPServer
    protocol_version = "HTTP/1.1"
    server_version = "splitinfer-planner/1"
    # headers and body go out in two writes; with Nagle on, the second waits for the
    # client's delayed ACK (~40 ms per request on Linux)
    disable_nagle_algorithm = True

    def _serve(self, method: str) -> None:
        length_text = self.headers.get("Content-Length") or "0"
        try:
            length = int(length_text)
        except ValueError:
            length = -1
        if length < 0 or length > MAX_BODY_BYTES:
            status = 400 if length < 0 else 413
            msg = (f"Content-Length {length_text!r} is not a byte count" if length < 0 else
                   f"the request body is {length} bytes; the limit is {MAX_BODY_BYTES}")
            self._reply(status, json.dumps({"error": msg, "field": "(body)"}).encode(), close=True)
            return
        body = self.rfile.read(length) if length else b""
        resp = self.server.service.handle(method, self.path, body)
        self._reply(resp.status, resp.to_json().encode(), headers=resp.headers)

    def _reply(self, status: int, payload: bytes, *, close: bool = False,
               headers: tuple[tuple[str, str], ...] = ()) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        for key, value in headers:
            self.send_header(key, value)
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":  # a HEAD answer has the headers of the body it leaves out
            self.wfile.write(payload)

    def __getattr__(self, name: str) -> Any:
        # http.server answers a method without a do_<METHOD> with an HTML 501; every
        # method goes to the service instead, which answers 405 with an Allow header
        # (or 404 for an unknown path) as JSON.
        if name.startswith("do_"):
            return lambda: self._serve(name[3:])
        raise AttributeError(name)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a bad request line, headers too long) as JSON."""
        text = message or HTTPStatus(code).phrase
        self.log_error("code %d, message %s", code, text)
        self._reply(code, json.dumps({"error": text, "field": "(request)"}).encode(), close=True)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (signature of the base)
        logger.debug("%s " + format, self.address_string(), *args)


class PlannerHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server holding one `PlannerService`."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], service: PlannerService) -> None:
        super().__init__(address, _Handler)
        self.service = service

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def start(self) -> threading.Thread:
        """Serve on a background thread (tests and embedding); `shutdown` stops it."""
        t = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, name="planner-http",
                             daemon=True)
        t.start()
        return t


def load_profiles_dir(path: str) -> dict[str, Profile]:
    """Every ``<name>.json`` profile in ``path`` (created if missing)."""
    os.makedirs(path, exist_ok=True)
    out: dict[str, Profile] = {}
    for entry in sorted(os.listdir(path)):
        name, ext = os.path.splitext(entry)
        if ext != ".json" or not PROFILE_NAME_RE.match(name):
            continue
        with open(os.path.join(path, entry), encoding="utf-8") as f:
            text = f.read()
        try:
            out[name] = Profile.from_json(text)
        except ProfileError as e:
            raise ProfileError(f"{os.path.join(path, entry)}: {e.message}", field=e.field) from e
    return out


def _saver(path: str):  # type: ignore[no-untyped-def]
    def save(name: str, profile: Profile) -> None:
        # the name was checked against PROFILE_NAME_RE, so it is a plain file name
        target = os.path.join(path, f"{name}.json")
        tmp = target + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(profile.to_json(indent=1))
        os.replace(tmp, target)
    return save


def make_server(host: str = "127.0.0.1", port: int = 0, *, registry_dir: str | None = None,
                profiles_dir: str | None = None) -> PlannerHTTPServer:
    """A bound (not yet serving) server; port 0 picks a free port."""
    from splitinfer.plan_cmd import make_service

    profiles = load_profiles_dir(profiles_dir) if profiles_dir else {}
    service = make_service(registry_dir=registry_dir, profiles=profiles,
                           on_profile_saved=_saver(profiles_dir) if profiles_dir else None)
    return PlannerHTTPServer((host, port), service)


def _port(text: str) -> int:
    """A TCP port for --port: 0..65535 (0: any free one)."""
    try:
        port = int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a port; give a number in 0..65535 (0 picks a free one)") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"{port} is not a port; give a number in 0..65535 (0 picks a free one)")
    return port


def planner_main(argv: Sequence[str]) -> int:
    """`splitinfer planner serve --host 127.0.0.1 --port 8080 [--registry DIR] [--profiles-dir DIR]`."""
    ap = argparse.ArgumentParser(prog="splitinfer planner", description="the planner's what-if service")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve the HTTP/JSON API (GET /openapi.json describes it)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=arg_type(_port), default=8080, help="TCP port (default 8080; 0 picks a free one)")
    s.add_argument("--registry", metavar="DIR", help="model registry directory: DIR/<name>/<version>/model.onnx "
                                                     "or DIR/<name>.onnx")
    s.add_argument("--profiles-dir", metavar="DIR", help="where PUT profiles are stored, and read at start")
    args = parse_args(ap, argv)
    try:
        server = make_server(args.host, args.port, registry_dir=args.registry, profiles_dir=args.profiles_dir)
    except OSError as e:
        print(f"splitinfer planner: error: cannot listen on {args.host}:{args.port}: {e.strerror or e}; "
              "give another --port (0 picks a free one) or --host", file=sys.stderr)
        return 2
    host, port = server.server_address[:2]
    print(f"planner serving on http://{host}:{port} (GET /openapi.json for the API)", flush=True)
    logger.info("planner serving on %s:%d, registry %s, profiles %s", host, port, args.registry,
                args.profiles_dir)

    def stop(signum: int, frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
