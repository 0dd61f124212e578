"""A FAKE Kubernetes API server for tests: no real Kubernetes runs here.

It speaks just enough of the real REST API for the `splitinfer cluster` operations, on
127.0.0.1, over plain HTTP by default (a real API server speaks only HTTPS; the official
`kubernetes` client takes either) or over HTTPS when given `tls` (the in-cluster test):

    GET   /api/v1/namespaces/{ns}/pods?labelSelector=k=v,...
    GET   /api/v1/nodes
    GET   /api/v1/namespaces/{ns}/configmaps/{name}
    PATCH /api/v1/namespaces/{ns}/configmaps/{name}
    GET   /apis/ray.io/v1/namespaces/{ns}/rayclusters/{name}
    PATCH /apis/ray.io/v1/namespaces/{ns}/rayclusters/{name}

PATCH accepts `application/merge-patch+json` (RFC 7386) and
`application/strategic-merge-patch+json` (applied as a merge patch: the objects used here
have no lists whose strategic merge keys would differ) and refuses strategic merge on
custom resources with 415, as a real server does. A patch whose
`metadata.resourceVersion` differs from the stored one gets 409 Conflict with the real
Status body; every write bumps the resourceVersion.

Tests steer it with `deny` ((verb, resource) pairs answered 403 with the RBAC message
format of a real server) and `concurrent_writes` (path -> how many of the next PATCHes
find the object changed by "another writer" first, which makes their resourceVersion
stale and so gives a genuine 409), and `faults` ((method, path) -> an HTTP status to answer
with instead). `requests` records (method, path, content type, body).
"""

from __future__ import annotations

import copy
import json
import re
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

__all__ = ["FakeKubeApi", "merge_patch", "write_kubeconfig"]

_CORE_NS = re.compile(r"^/api/v1/namespaces/([^/]+)/(pods|configmaps)(?:/([^/]+))?$")
_RAY = re.compile(r"^/apis/ray\.io/v1/namespaces/([^/]+)/rayclusters/([^/]+)$")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def _status(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "details": details or {}, "code": code}


class FakeKubeApi:
    """The fake server and its objects; `url` is where it listens."""

    def __init__(self, service_account: str = "system:serviceaccount:splitinfer:splitinfer",
                 tls: ssl.SSLContext | None = None) -> None:
        self.user = service_account
        self.pods: dict[str, list[dict[str, Any]]] = {}
        self.nodes: list[dict[str, Any]] = []
        self.objects: dict[str, dict[str, Any]] = {}  # request path -> object
        self.deny: set[tuple[str, str]] = set()
        self.concurrent_writes: dict[str, int] = {}
        self.faults: dict[tuple[str, str], int] = {}
        self.requests: list[tuple[str, str, str, Any]] = []
        self.authorizations: list[str] = []
        self._rv = 100
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        if tls is not None:
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        self._scheme = "https" if tls is not None else "http"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        return f"{self._scheme}://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> FakeKubeApi:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # ---- objects

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def add_pod(self, ns: str, name: str, labels: dict[str, str], *, node: str = "node-a",
                phase: str = "Running", ready: bool = True, restarts: int = 0) -> None:
        self.pods.setdefault(ns, []).append({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": labels, "resourceVersion": self._next_rv()},
            "spec": {"nodeName": node, "containers": [{"name": "main", "image": "splitinfer:test"}]},
            "status": {"phase": phase, "containerStatuses": [{
                "name": "main", "image": "splitinfer:test", "imageID": "", "ready": ready,
                "restartCount": restarts}]},
        })

    def add_node(self, name: str, gpus: int = 0) -> None:
        res = {"cpu": "8", "memory": "32Gi"} | ({"nvidia.com/gpu": str(gpus)} if gpus else {})
        self.nodes.append({"apiVersion": "v1", "kind": "Node",
                           "metadata": {"name": name, "resourceVersion": self._next_rv()},
                           "status": {"allocatable": dict(res), "capacity": dict(res)}})

    def add_configmap(self, ns: str, name: str, data: dict[str, str] | None = None) -> str:
        path = f"/api/v1/namespaces/{ns}/configmaps/{name}"
        obj: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap",
                               "metadata": {"name": name, "namespace": ns, "resourceVersion": self._next_rv()}}
        if data is not None:
            obj["data"] = dict(data)
        self.objects[path] = obj
        return path

    def add_raycluster(self, ns: str, name: str, groups: list[dict[str, Any]]) -> str:
        path = f"/apis/ray.io/v1/namespaces/{ns}/rayclusters/{name}"
        self.objects[path] = {"apiVersion": "ray.io/v1", "kind": "RayCluster",
                              "metadata": {"name": name, "namespace": ns, "resourceVersion": self._next_rv()},
                              "spec": {"rayVersion": "2.40.0", "headGroupSpec": {"rayStartParams": {}},
                                       "workerGroupSpecs": groups}}
        return path

    def patches(self, path: str) -> list[tuple[str, Any]]:
        return [(ct, body) for m, p, ct, body in self.requests if m == "PATCH" and p == path]

    # ---- request handling

    def _forbidden(self, verb: str, resource: str, group: str, ns: str, name: str) -> dict[str, Any]:
        obj = f'{resource} "{name}"' if name else resource
        scope = f' in the namespace "{ns}"' if ns else " at the cluster scope"
        return _status(403, "Forbidden",
                       f'{obj} is forbidden: User "{self.user}" cannot {verb} resource "{resource}" '
                       f'in API group "{group}"{scope}', {"name": name, "kind": resource})

    def handle(self, method: str, raw_path: str, content_type: str, body: Any) -> tuple[int, dict[str, Any]]:
        url = urlparse(raw_path)
        path, query = url.path, parse_qs(url.query)
        with self._lock:
            self.requests.append((method, path, content_type, body))
            if m := _CORE_NS.match(path):
                ns, resource, name = m.group(1), m.group(2), m.group(3) or ""
                group = ""
            elif m := _RAY.match(path):
                ns, resource, name, group = m.group(1), "rayclusters", m.group(2), "ray.io"
            elif path == "/api/v1/nodes":
                ns, resource, name, group = "", "nodes", "", ""
            else:
                return 404, _status(404, "NotFound", f"the server could not find the requested resource ({path})")
            if (method, path) in self.faults:
                code = self.faults[(method, path)]
                return code, _status(code, "InternalError", f"injected fault {code} on {method} {path}")
            verb = {"GET": "get" if name else "list", "PATCH": "patch"}.get(method, method.lower())
            if (verb, resource) in self.deny:
                return 403, self._forbidden(verb, resource, group, ns, name)
            if resource == "pods" and verb == "list":
                return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": str(self._rv)},
                             "items": [p for p in self.pods.get(ns, []) if _selected(p, query)]}
            if resource == "nodes" and verb == "list":
                return 200, {"kind": "NodeList", "apiVersion": "v1",
                             "metadata": {"resourceVersion": str(self._rv)}, "items": list(self.nodes)}
            obj = self.objects.get(path)
            if obj is None or verb not in ("get", "patch"):
                kind = "rayclusters.ray.io" if group else resource
                return 404, _status(404, "NotFound", f'{kind} "{name}" not found',
                                    {"name": name, "group": group, "kind": resource})
            if verb == "get":
                return 200, obj
            return self._patch(path, obj, resource, name, group, content_type, body)

    def _patch(self, path: str, obj: dict[str, Any], resource: str, name: str, group: str,
               content_type: str, body: Any) -> tuple[int, dict[str, Any]]:
        ct = content_type.split(";")[0].strip()
        if ct == "application/strategic-merge-patch+json" and group:
            return 415, _status(415, "UnsupportedMediaType",
                                f'the body of the request was in an unknown format - accepted media types '
                                f'include: application/json-patch+json, application/merge-patch+json, '
                                f'application/apply-patch+yaml ({ct})')
        if ct not in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            return 415, _status(415, "UnsupportedMediaType", f"unsupported patch type {ct!r} in this fake")
        if self.concurrent_writes.get(path, 0) > 0:
            self.concurrent_writes[path] -= 1
            obj["metadata"]["resourceVersion"] = self._next_rv()  # "another writer" got there first
        sent_rv = ((body or {}).get("metadata") or {}).get("resourceVersion")
        if sent_rv is not None and sent_rv != obj["metadata"]["resourceVersion"]:
            kind = f"{resource}.{group}" if group else resource
            return 409, _status(409, "Conflict",
                                f'Operation cannot be fulfilled on {kind} "{name}": the object has been '
                                f'modified; please apply your changes to the latest version and try again',
                                {"name": name, "group": group, "kind": resource})
        new = merge_patch(obj, body)
        new["metadata"]["resourceVersion"] = self._next_rv()
        self.objects[path] = new
        return 200, new

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                fake.authorizations.append(self.headers.get("Authorization", ""))
                body = json.loads(raw) if raw else None
                code, out = fake.handle(self.command, self.path, self.headers.get("Content-Type", ""), body)
                data = json.dumps(out).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PATCH = do_POST = do_PUT = do_DELETE = _serve

            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

        return Handler


def _selected(obj: dict[str, Any], query: dict[str, list[str]]) -> bool:
    """Equality label selectors (k=v,k2=v2), the only kind the operations send."""
    labels = obj["metadata"].get("labels") or {}
    for sel in query.get("labelSelector", []):
        for term in filter(None, sel.split(",")):
            k, _, v = term.partition("=")
            if labels.get(k.strip()) != v.strip():
                return False
    return True


def write_kubeconfig(path: str, server_url: str, namespace: str = "splitinfer",
                     context: str = "fake") -> str:
    """A kubeconfig whose context `context` points at the fake server (plain HTTP, a dummy token)."""
    cfg = {
        "apiVersion": "v1", "kind": "Config", "current-context": context,
        "clusters": [{"name": "fake", "cluster": {"server": server_url}}],
        "users": [{"name": "fake", "user": {"token": "fake-token"}}],
        "contexts": [{"name": context, "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}],
    }
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(cfg, fh)  # JSON is YAML, and the client reads kubeconfigs as YAML
    return path
