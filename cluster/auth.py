"""Security of the gateway: TLS credentials, bearer tokens, model allow-lists, rate limits.

TLS and mutual TLS come from PEM files (a Kubernetes TLS Secret mounts as such files).
Devices authenticate with a bearer token from a YAML file (a mounted Secret is the
same file)::

    tokens:
      - name: camera-17            # principal shown in logs and errors (never the token)
        token: "<random string>"
        models: [resnet50]         # optional allow-list; absent means every model
        rate_limit_rps: 20         # optional; requests per second per device
        burst: 40                  # optional; bucket size (default: max(1, rate))
        max_priority: 0            # optional; 0-3, the highest priority its requests get

[Note: one place for auth] The gateway calls `Authorizer.authorize` first thing in
each method, before routing: the model a request names is only known once its frame
is decoded, and a per-model allow-list needs it. So a rejected call never reaches a
worker pool. Tokens are compared in constant time (by their SHA-256 digests) and are
never logged or put in an error: principals are logged by name.

[Note: priority claims] A request's priority is the client's claim: the edge agent
claims 1 for a request that no local run can answer in time ([Note: priority under
overload] in edge_agent/hedge.py), and the batcher serves it first and refuses the others
first. A token's `max_priority` caps what its requests get: a higher claim is served at
the cap, not refused (the request is still valid; only its place in the queue is the
operator's to give). Without it a token's claims stand, as they do with auth off.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import ssl
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import yaml

from cluster.errors import ClusterError, PermissionDenied, ResourceExhausted, Unauthenticated

__all__ = [
    "AuthConfigError",
    "TokenEntry",
    "TokenTable",
    "TokenBucket",
    "Principal",
    "Authorizer",
    "ANONYMOUS",
    "load_server_credentials",
    "load_http_tls_context",
    "load_channel_credentials",
]

logger = logging.getLogger(__name__)


class AuthConfigError(ClusterError):
    """A tokens file or TLS file that cannot be used."""

    def __init__(self, *, path: str, reason: str, fix: str) -> None:
        self.path = path
        self.reason = reason
        self.fix = fix
        super().__init__(f"{path}: {reason}; {fix}")


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise AuthConfigError(path=path, reason=f"cannot read the {what} ({e.strerror})",
                              fix=f"mount the {what} there or fix the path") from e
    if not data.strip():
        raise AuthConfigError(path=path, reason=f"the {what} is empty", fix=f"write the PEM {what} into it")
    if what != "tokens file" and b"-----BEGIN" not in data:
        raise AuthConfigError(path=path, reason=f"the {what} is not PEM", fix="give a PEM file ('-----BEGIN ...')")
    return data


def load_server_credentials(cert_file: str, key_file: str, client_ca_file: str | None = None) -> grpc.ServerCredentials:
    """TLS for the server; with `client_ca_file`, mutual TLS: clients must present a cert it signed."""
    cert = _read(cert_file, "certificate")
    key = _read(key_file, "private key")
    ca = _read(client_ca_file, "client CA") if client_ca_file else None
    logger.info("TLS on (%s); client certificates %s", cert_file, "required" if ca else "not asked")
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def load_http_tls_context(cert_file: str, key_file: str, client_ca_file: str | None = None) -> ssl.SSLContext:
    """TLS for the HTTP port (/metrics, /healthz, /readyz, /v2), from the gRPC port's PEM files.

    With `client_ca_file` a client certificate is asked for and, when sent, must be signed by that
    CA (CERT_OPTIONAL): kubelet's probes send none, so the HTTP server itself refuses a request
    without one on every path but /healthz and /readyz (cluster.metrics.MetricsServer).
    """
    for path, what in ((cert_file, "certificate"), (key_file, "private key")) + (
            ((client_ca_file, "client CA"),) if client_ca_file else ()):
        _read(path, what)  # the same errors as the gRPC port's, naming the file
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert_file, key_file)
        if client_ca_file:
            ctx.load_verify_locations(cafile=client_ca_file)
            ctx.verify_mode = ssl.CERT_OPTIONAL
    except ssl.SSLError as e:
        raise AuthConfigError(path=cert_file, reason=f"the certificate, its key or the client CA do not load ({e})",
                              fix="give the PEM certificate and the private key that belongs to it") from e
    return ctx


def load_channel_credentials(ca_file: str | None = None, cert_file: str | None = None,
                             key_file: str | None = None) -> grpc.ChannelCredentials:
    """TLS for a client: trust `ca_file` (system roots when None); present a cert for mutual TLS."""
    if (cert_file is None) != (key_file is None):
        raise AuthConfigError(path=cert_file or key_file or "", reason="a client certificate needs its key and vice versa",
                              fix="give both cert_file and key_file, or neither")
    ca = _read(ca_file, "CA certificate") if ca_file else None
    cert = _read(cert_file, "certificate") if cert_file else None
    key = _read(key_file, "private key") if key_file else None
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


@dataclass(frozen=True)
class TokenEntry:
    """One device credential. `token` never appears in repr, logs or errors."""

    name: str
    """Principal name: what logs, metrics and errors show."""
    token: str = field(repr=False)
    """The secret."""
    models: tuple[str, ...] | None = None
    """Models this token may use; None: all."""
    rate_limit_rps: float | None = None
    """Requests per second per device; None: unlimited."""
    burst: float | None = None
    """Bucket size; None: max(1, rate_limit_rps)."""
    max_priority: int | None = None
    """The highest priority its requests are served at ([Note: priority claims]); None: as claimed."""

    def allows(self, model: str) -> bool:
        return self.models is None or model in self.models


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


class TokenTable:
    """Tokens by digest. Built from a dict list or a YAML file; lookups take constant time per entry."""

    def __init__(self, entries: Sequence[TokenEntry]) -> None:
        names = [e.name for e in entries]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise AuthConfigError(path="tokens", reason=f"names {dup} appear more than once",
                                  fix="give every token its own name")
        self._entries = [(_digest(e.token), e) for e in entries]
        if len({d for d, _ in self._entries}) != len(self._entries):
            raise AuthConfigError(path="tokens", reason="two entries share one token",
                                  fix="give every device its own token")

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"TokenTable({len(self)} tokens: {', '.join(e.name for _, e in self._entries)})"

    def lookup(self, token: str) -> TokenEntry | None:
        d = _digest(token)
        found = None
        for digest, entry in self._entries:  # no early exit: time does not depend on the match
            if hmac.compare_digest(digest, d):
                found = entry
        return found

    @classmethod
    def from_dicts(cls, items: Any, path: str = "tokens") -> TokenTable:
        if not isinstance(items, list):
            raise AuthConfigError(path=path, reason="'tokens' must be a list of {name, token} entries",
                                  fix="write 'tokens:' followed by '- name: ...' items")
        entries = []
        for i, d in enumerate(items):
            where = f"tokens[{i}]"
            if not isinstance(d, dict):
                raise AuthConfigError(path=path, reason=f"{where} is not a mapping", fix="give name and token")
            unknown = sorted(set(d) - {"name", "token", "models", "rate_limit_rps", "burst", "max_priority"})
            if unknown:
                raise AuthConfigError(path=path, reason=f"{where} has unknown field(s) {unknown}",
                                      fix="use name, token, models, rate_limit_rps, burst, max_priority")
            name, token = d.get("name"), d.get("token")
            if not isinstance(name, str) or not name:
                raise AuthConfigError(path=path, reason=f"{where}.name is missing or not a string",
                                      fix="name every token")
            if not isinstance(token, str) or len(token) < 16:
                # The value is not echoed: it is a secret even when it is a bad one.
                raise AuthConfigError(path=path, reason=f"{where} ({name}) token is missing or shorter than 16 characters",
                                      fix="generate one with 'python -c \"import secrets; print(secrets.token_urlsafe(32))\"'")
            models = d.get("models")
            if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) for m in models)):
                raise AuthConfigError(path=path, reason=f"{where} ({name}) models must be a list of model names",
                                      fix="write models: [name1, name2] or leave it out for all models")
            rate, burst = d.get("rate_limit_rps"), d.get("burst")
            for fname, val in (("rate_limit_rps", rate), ("burst", burst)):
                if val is not None and (isinstance(val, bool) or not isinstance(val, (int, float))
                                        or not math.isfinite(val) or val <= 0):
                    raise AuthConfigError(path=path, reason=f"{where} ({name}) {fname}={val!r} must be a positive number",
                                          fix=f"set {fname} > 0 or leave it out")
            top = d.get("max_priority")
            if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 3):
                raise AuthConfigError(path=path, reason=f"{where} ({name}) max_priority={top!r} must be an integer 0-3",
                                      fix="set max_priority: 0 to serve its requests in arrival order, or leave it out")
            entries.append(TokenEntry(name, token, tuple(models) if models is not None else None,
                                      float(rate) if rate is not None else None,
                                      float(burst) if burst is not None else None, top))
        return cls(entries)

    @classmethod
    def from_file(cls, path: str) -> TokenTable:
        data = _read(path, "tokens file")
        try:
            doc = yaml.safe_load(data)
        except yaml.YAMLError as e:
            # yaml's message quotes the offending line, which may hold a token: keep only its position.
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}" if mark is not None else ""
            raise AuthConfigError(path=path, reason=f"is not valid YAML{at}", fix="fix the syntax") from None
        if not isinstance(doc, dict) or "tokens" not in doc:
            raise AuthConfigError(path=path, reason="has no top-level 'tokens' list",
                                  fix="write 'tokens: [{name: ..., token: ...}]'")
        table = cls.from_dicts(doc["tokens"], path)
        logger.info("loaded %d tokens from %s", len(table), os.path.basename(path))
        return table


class TokenBucket:
    """`rate` tokens per second up to `burst`; pure arithmetic with time passed in."""

    def __init__(self, rate: float, burst: float, now_s: float) -> None:
        self.rate = rate
        self.burst = burst
        self.level = burst
        self.stamp_s = now_s

    def take(self, now_s: float, n: float = 1.0) -> float:
        """0.0 when `n` tokens were taken, else the seconds until they would be there."""
        self.level = min(self.burst, self.level + max(0.0, now_s - self.stamp_s) * self.rate)
        self.stamp_s = max(self.stamp_s, now_s)
        if self.level >= n:
            self.level -= n
            return 0.0
        return (n - self.level) / self.rate


@dataclass(frozen=True)
class Principal:
    """Who made a call: a token's name, or 'anonymous' when auth is off."""

    name: str
    models: tuple[str, ...] | None = None
    max_priority: int | None = None
    """The highest priority its requests are served at ([Note: priority claims]); None: as claimed."""

    def priority(self, claimed: int) -> int:
        """The priority a request of this principal claiming `claimed` is served at."""
        return claimed if self.max_priority is None else min(claimed, self.max_priority)


ANONYMOUS = Principal("anonymous")


class Authorizer:
    """Checks a call's bearer token, the model it names and its device's request rate.

    With `tokens=None` authentication is off (every call is ANONYMOUS); rate limits
    then apply only through `default_rate_limit_rps`.
    """

    _MAX_BUCKETS = 100_000

    def __init__(self, tokens: TokenTable | None, *, default_rate_limit_rps: float | None = None,
                 clock: Any = time.monotonic) -> None:
        self.tokens = tokens
        self.default_rate_limit_rps = default_rate_limit_rps
        self._clock = clock
        self._buckets: dict[tuple[str, str], TokenBucket] = {}
        self._lock = threading.Lock()
        self.rejected: dict[str, int] = {"unauthenticated": 0, "permission_denied": 0, "rate_limited": 0}

    @property
    def enabled(self) -> bool:
        return self.tokens is not None

    def authenticate(self, metadata: Mapping[str, str]) -> tuple[Principal, TokenEntry | None]:
        if self.tokens is None:
            return ANONYMOUS, None
        auth = metadata.get("authorization", "")
        if not auth:
            self.rejected["unauthenticated"] += 1
            raise Unauthenticated(reason="no authorization metadata")
        if auth[:7].lower() != "bearer ":
            self.rejected["unauthenticated"] += 1
            raise Unauthenticated(reason="authorization metadata is not a Bearer token")
        entry = self.tokens.lookup(auth[7:].strip())
        if entry is None:
            self.rejected["unauthenticated"] += 1
            raise Unauthenticated(reason="the token is not known")
        return Principal(entry.name, entry.models, entry.max_priority), entry

    def authorize(self, metadata: Mapping[str, str], *, model: str | None, device_id: str = "",
                  action: str = "infer") -> Principal:
        """The caller's principal; raises Unauthenticated, PermissionDenied or ResourceExhausted."""
        principal, entry = self.authenticate(metadata)
        if model is not None and entry is not None and not entry.allows(model):
            self.rejected["permission_denied"] += 1
            logger.info("denied %s on model %r to %s", action, model, principal.name)
            raise PermissionDenied(principal=principal.name, action=f"{action} model {model!r}")
        rate = entry.rate_limit_rps if entry is not None and entry.rate_limit_rps else self.default_rate_limit_rps
        if rate:
            burst = entry.burst if entry is not None and entry.burst else max(1.0, rate)
            wait_s = self._take((principal.name, device_id), rate, burst)
            if wait_s > 0:
                self.rejected["rate_limited"] += 1
                raise ResourceExhausted(resource=f"request rate of {principal.name}/{device_id or '-'}",
                                        limit=rate, retry_after_ms=wait_s * 1e3)
        return principal

    def _take(self, key: tuple[str, str], rate: float, burst: float) -> float:
        now = self._clock()
        with self._lock:
            b = self._buckets.get(key)
            if b is None:
                if len(self._buckets) >= self._MAX_BUCKETS:
                    # Device ids come from clients: bound the table rather than grow forever.
                    self._buckets.clear()
                b = self._buckets[key] = TokenBucket(rate, burst, now)
            return b.take(now)
