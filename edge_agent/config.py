"""edge.yaml: the agent's configuration, a frozen dataclass loaded from YAML.

Keys are snake_case; the camelCase spelling of every key is accepted too, because the
Helm chart's DaemonSet ConfigMap writes `gateway`, `model`, `objective`, `apiHost`
and `apiPort`. Every error names the key and the fix. docs/edge-agent.md is the
reference.

The policy's and the link monitor's knobs are their own frozen configs,
`edge_agent.policy.PolicyConfig` and `edge_agent.monitor.MonitorConfig`, set from the
`policy:` and `monitor:` sections; their defaults and limits live there only.
`objective`, `slo_ms`, `hysteresis` and `dwell_s` may also stand at the top level
(the Helm chart writes `objective` there): they set the same policy knobs.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from edge_agent.errors import ConfigError
from edge_agent.monitor import MonitorConfig
from edge_agent.policy import OBJECTIVES, PolicyConfig

__all__ = ["EdgeConfig", "load_config", "config_from_dict", "default_cache_dir", "OBJECTIVES", "FALLBACKS"]

FALLBACKS = ("local", "none")
_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


def default_cache_dir() -> str:
    """$XDG_CACHE_HOME/splitinfer/edge, else ~/.cache/splitinfer/edge."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "splitinfer", "edge")


@dataclass(frozen=True)
class EdgeConfig:
    """Everything `splitinfer edge run` needs. Only `gateway` and `model` are required."""

    gateway: str
    """Gateway address host:port (gRPC)."""
    model: str
    """name@version in the registry; a bare name takes the version the gateway routes this device to."""
    token: str | None = None
    """Bearer token sent to the gateway. Prefer `token_file`."""
    token_file: str | None = None
    """File whose first line is the bearer token (a mounted Secret)."""
    tls_ca: str | None = None
    """PEM of the CA that signed the gateway's certificate; set it to use TLS."""
    tls_cert: str | None = None
    """PEM client certificate for mutual TLS (with `tls_key`)."""
    tls_key: str | None = None
    """PEM client key for mutual TLS (with `tls_cert`)."""
    device_id: str = ""
    """This device's id for the gateway's quotas and canary routing; empty: $NODE_NAME or the host name."""
    device_profile: str | None = None
    """Device Profile JSON; absent: estimated on first start and cached under `cache_dir`."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """Where each request runs: objective, SLO, hysteresis, dwell, back-off and trials (`policy:`)."""
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    """How the link is estimated: smoothing, step detection, RTT window, stall bounds (`monitor:`)."""
    fallback: str = "local"
    """'local': finish on the device when the cloud fails or is late; 'none': return the error."""
    cache_dir: str = ""
    """Where the model, artifacts, segments and profile are cached; empty: default_cache_dir()."""
    api_host: str = "127.0.0.1"
    """Host the local API binds to."""
    api_port: int = 8500
    """Port of the local API (0: the OS picks)."""
    api_socket: str | None = None
    """Unix socket path for the local API instead of host:port."""
    api_idle_timeout_s: float = 60.0
    """A local API connection on which no request begins for this long is closed."""
    api_read_timeout_s: float = 30.0
    """A local API request's head, and then its body, must arrive within this long; else 408."""
    remote_timeout_ms: float = 2000.0
    """Longest a request waits for the cloud when no `slo_ms` is set."""
    startup_timeout_s: float = 10.0
    """How long start-up waits for the gateway's first answer before it uses the cache."""
    download_stall_s: float = 60.0
    """Longest wait for each further piece (up to 1 MiB) of the model's download; the download
    itself takes as long as its pieces keep coming (60 s: a 1 MiB piece at 140 kbit/s)."""
    probe_interval_s: float = 2.0
    """Idle time after which the agent probes the link (health RTT and a resent boundary)."""
    recovery_probe_s: float = 0.5
    """While requests run locally, a health check this often on the idle link shows when an outage ends."""
    breaker_failures: int = 3
    """Consecutive remote failures that open the circuit breaker."""
    breaker_open_s: float = 2.0
    """Time the breaker stays open before it lets one probe through (half-open)."""
    intra_op_threads: int = 0
    """ONNX Runtime threads per operator on the device; 0 lets ORT choose."""
    encodings: tuple[str, ...] = ("fp32", "fp16")
    """Boundary encodings the planner may choose ('fp32', 'fp16', 'int8'; int8 trades accuracy for bytes)."""
    min_agreement: float | None = None
    """Accuracy budget in (0, 1]: plans keep to it on the gateway's accuracy.json, which may then place
    int8 and the lossy codecs it measured (the stricter of this and model.yaml's); None: model.yaml's."""
    max_inflight: int = 64
    """Requests the local API runs at once; more wait."""
    emulate_device: str | None = None
    """Reference device (planner.devices: rpi4, rpi5, ...) this host plays: the agent plans with its
    roofline profile of the model, and its work is stretched in time to match (edge-agent.md)."""
    emulate_slowdown: float | None = None
    """Emulation: every engine run and encode on the device takes this many times its CPU time here
    (>= 1; [Note: time-scaled device] in edge_agent.device); None: this host's speed, or emulate_device's."""
    emulate_uplink: str | None = None
    """Uplink of a link emulated between the agent and the gateway by `splitinfer edge run`, e.g. '10mbit'."""
    emulate_downlink: str | None = None
    """Downlink of that link, e.g. '40mbit'; absent: 4x the uplink."""
    emulate_rtt: str | None = None
    """Round-trip time that link adds, e.g. '5ms'; absent: none."""

    def __post_init__(self) -> None:
        _check(self)

    @property
    def model_name(self) -> str:
        return self.model.split("@", 1)[0]

    @property
    def model_version(self) -> str:
        return self.model.split("@", 1)[1] if "@" in self.model else ""

    @property
    def resolved_cache_dir(self) -> str:
        return os.path.abspath(os.path.expanduser(self.cache_dir or default_cache_dir()))

    @property
    def resolved_device_id(self) -> str:
        return self.device_id or os.environ.get("NODE_NAME") or socket.gethostname()

    def read_token(self) -> str | None:
        """The bearer token, from `token` or the first line of `token_file`."""
        if self.token is not None:
            return self.token
        if self.token_file is None:
            return None
        try:
            with open(self.token_file, encoding="utf-8") as fh:
                tok = fh.readline().strip()
        except OSError as e:
            raise ConfigError(key="token_file", reason=f"({self.token_file!r}) cannot be read: {e.strerror}",
                              fix="point it at a readable file holding the token") from e
        if not tok:
            raise ConfigError(key="token_file", reason=f"({self.token_file!r}) is empty",
                              fix="write the token on its first line")
        return tok

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def redacted(self) -> EdgeConfig:
        """A copy safe to print: the token replaced by '<set>'."""
        return self if self.token is None else dataclasses.replace(self, token="<set>")

    @classmethod
    def from_json(cls, text: str) -> EdgeConfig:
        d = json.loads(text)
        d["encodings"] = tuple(d["encodings"])
        d["policy"] = PolicyConfig(**d["policy"])
        d["monitor"] = MonitorConfig(**d["monitor"])
        return cls(**d)

    def __repr__(self) -> str:  # never show the token
        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "token"}
        shown["token"] = "set" if self.token else None
        return "EdgeConfig(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"


_FIELDS = {f.name: f for f in dataclasses.fields(EdgeConfig)}
_REQUIRED = ("gateway", "model")
_SECTIONS: dict[str, type[PolicyConfig] | type[MonitorConfig]] = {"policy": PolicyConfig, "monitor": MonitorConfig}
#: Top-level keys that set a knob of a section.
_ALIASES = {"objective": "policy.objective", "slo_ms": "policy.slo_ms", "hysteresis": "policy.hysteresis",
            "dwell_s": "policy.dwell_s"}
#: Every knob edge.yaml can set, as 'name' or 'section.name'.
_KNOBS = ([n for n in _FIELDS if n not in _SECTIONS]
          + [f"{sec}.{f.name}" for sec, cls in _SECTIONS.items() for f in dataclasses.fields(cls)])


_POSITIVE_TIMES = ("remote_timeout_ms", "startup_timeout_s", "download_stall_s", "probe_interval_s",
                   "recovery_probe_s", "breaker_open_s", "api_idle_timeout_s", "api_read_timeout_s")
"""Durations that must be > 0; an integer in edge.yaml becomes a float."""


def _bad(key: str, value: Any, want: str, fix: str) -> ConfigError:
    return ConfigError(key=key, reason=f"is {value!r}; it must be {want}", fix=fix)


def _check(c: EdgeConfig) -> None:
    if not isinstance(c.gateway, str) or not _ADDRESS.match(c.gateway):
        raise _bad("gateway", c.gateway, "host:port", "e.g. gateway: splitinfer-gateway.default.svc:50051")
    if not isinstance(c.model, str) or not re.match(r"^[A-Za-z0-9_.-]+(@[A-Za-z0-9_.-]*)?$", c.model):
        raise _bad("model", c.model, "name@version (or a bare name)", "e.g. model: resnet50@1")
    if c.fallback not in FALLBACKS:
        raise _bad("fallback", c.fallback, f"one of {list(FALLBACKS)}", "use 'local' to finish on the device")
    for key in _POSITIVE_TIMES:
        v = getattr(c, key)
        if not (_num(v) and v > 0):
            raise _bad(key, v, "a number > 0", f"remove it to use the default ({_FIELDS[key].default})")
    for key, lo in (("breaker_failures", 1), ("intra_op_threads", 0), ("max_inflight", 1), ("api_port", 0)):
        v = getattr(c, key)
        if not isinstance(v, int) or isinstance(v, bool) or v < lo or (key == "api_port" and v > 65535):
            raise _bad(key, v, f"an integer >= {lo}" + (" and <= 65535" if key == "api_port" else ""),
                       f"remove it to use the default ({_FIELDS[key].default})")
    if (not isinstance(c.encodings, tuple) or not c.encodings
            or any(e not in ("fp32", "fp16", "int8") for e in c.encodings)):
        raise _bad("encodings", c.encodings, "a non-empty list of 'fp32', 'fp16', 'int8'",
                   "e.g. encodings: [fp32, fp16]")
    if c.min_agreement is not None and not (_num(c.min_agreement) and 0 < c.min_agreement <= 1):
        raise _bad("min_agreement", c.min_agreement, "a fraction in (0, 1]", "e.g. min_agreement: 0.99, or remove it")
    if (c.tls_cert is None) != (c.tls_key is None):
        raise ConfigError(key="tls_cert" if c.tls_key else "tls_key", reason="is set without its pair",
                          fix="set both tls_cert and tls_key for mutual TLS, or neither")
    if c.tls_cert is not None and c.tls_ca is None:
        raise ConfigError(key="tls_ca", reason="is missing while a client certificate is set",
                          fix="set tls_ca to the CA that signed the gateway's certificate")
    if c.token is not None and c.token_file is not None:
        raise ConfigError(key="token", reason="is set together with token_file", fix="keep one of them")
    for key in ("tls_ca", "tls_cert", "tls_key", "device_profile", "api_socket", "token_file", "token",
                "emulate_device", "emulate_uplink", "emulate_downlink", "emulate_rtt"):
        v = getattr(c, key)
        if v is not None and (not isinstance(v, str) or not v):
            raise _bad(key, v, "a non-empty string", "remove the key or give a value")
    _check_emulated_device(c)


def _check_emulated_device(c: EdgeConfig) -> None:
    """The device must be a reference device; its rates and durations are parsed by `splitinfer edge`."""
    if c.emulate_slowdown is not None:
        if not (_num(c.emulate_slowdown) and c.emulate_slowdown >= 1):
            raise _bad("emulate.slowdown", c.emulate_slowdown, "a number >= 1 (1: this host's speed)",
                       "e.g. emulate: {slowdown: 12}, or remove it")
        if c.emulate_device is not None:
            raise ConfigError(key="emulate.slowdown", reason="is set together with emulate.device",
                              fix="keep one: the emulated device's slowdown follows from its profile")
    if c.emulate_device is None:
        return
    from planner.devices import DEVICES  # here: planner loads onnx, which only this check needs


    if c.emulate_device not in DEVICES:
        close = difflib.get_close_matches(c.emulate_device, list(DEVICES), n=1)
        raise ConfigError(key="emulate.device", reason=f"is {c.emulate_device!r}, not a reference device",
                          fix=(f"did you mean {close[0]!r}? " if close else "") + f"known devices: {', '.join(DEVICES)}")
    if c.device_profile is not None:
        raise ConfigError(key="emulate.device", reason="is set together with device_profile",
                          fix="keep one: the emulated device plans with its own profile")


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _snake(key: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", key).lower().replace("-", "_")


def config_from_dict(raw: Any, *, path: str = "") -> EdgeConfig:
    """An EdgeConfig from a parsed YAML mapping (camelCase keys accepted)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(key="<top level>", reason=f"is a {type(raw).__name__}, not a mapping",
                          fix="write key: value lines, e.g. 'gateway: host:50051'", path=path)
    d: dict[str, Any] = {}
    spelled: dict[str, str] = {}  # knob -> the key that set it, to refuse a knob given twice
    for key, value in raw.items():
        name = _snake(str(key))
        if name in ("tls", "emulate") and isinstance(value, Mapping):  # nested: tls: {ca:, ...}, emulate: {device:, ...}
            pairs = [(f"{name}_{_snake(str(sub))}", f"{key}.{sub}", v) for sub, v in value.items()]
        elif name in _SECTIONS and (value is None or isinstance(value, Mapping)):  # policy: {slo_ms:, ...}
            pairs = [(f"{name}.{_snake(str(sub))}", f"{key}.{sub}", v) for sub, v in (value or {}).items()]
        elif name in ("emulate", *_SECTIONS):
            example = {"emulate": "emulate: {device: rpi4, uplink: 10mbit, rtt: 5ms}",
                       "policy": "policy: {slo_ms: 200, dwell_s: 2}", "monitor": "monitor: {rtt_window: 8}"}[name]
            raise ConfigError(key=str(key), reason=f"is {value!r}, not a mapping", path=path, fix=f"e.g. {example}")
        else:
            pairs = [(_ALIASES.get(name, name), str(key), value)]
        for knob, shown, v in pairs:
            if knob in spelled:
                raise ConfigError(key=shown, reason=f"repeats {spelled[knob]!r} (both set {knob!r})",
                                  fix="keep one of the two keys", path=path)
            spelled[knob] = shown
            d[knob] = v
    unknown = sorted(set(d) - set(_KNOBS))
    if unknown:
        known = [*_KNOBS, *_ALIASES]
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
        raise ConfigError(key=unknown[0], reason="is not a known key", fix=hint, path=path)
    for section, cls in _SECTIONS.items():
        values = {k.split(".", 1)[1]: d.pop(k) for k in list(d) if k.startswith(section + ".")}
        d[section] = _make_section(cls, section, values, spelled, path)
    for key in _REQUIRED:
        if d.get(key) in (None, ""):
            raise ConfigError(key=key, reason="is missing", path=path,
                              fix="e.g. gateway: host:50051" if key == "gateway" else "e.g. model: resnet50@1")
    for key in _POSITIVE_TIMES:
        if isinstance(d.get(key), int) and not isinstance(d.get(key), bool):
            d[key] = float(d[key])
    if isinstance(d.get("encodings"), list):
        d["encodings"] = tuple(d["encodings"])
    elif isinstance(d.get("encodings"), str):
        d["encodings"] = (d["encodings"],)
    if isinstance(d.get("api_port"), str) and d["api_port"].isdigit():
        d["api_port"] = int(d["api_port"])
    for key in ("model", "device_id"):
        if key in d and not isinstance(d[key], str) and d[key] is not None:
            d[key] = str(d[key])
    for key in ("emulate_uplink", "emulate_downlink", "emulate_rtt"):
        if isinstance(d.get(key), (int, float)) and not isinstance(d.get(key), bool):
            d[key] = str(d[key])  # a bare number: bits/s for rates, ms for the rtt (splitinfer.units)
    try:
        return EdgeConfig(**d)
    except ConfigError as e:
        if path and not e.path:
            raise ConfigError(key=e.key, reason=e.reason, fix=e.fix, path=path) from None
        raise


def _make_section(cls: type[PolicyConfig] | type[MonitorConfig], section: str, values: Mapping[str, Any],
                  spelled: Mapping[str, str], path: str) -> PolicyConfig | MonitorConfig:
    """`cls(**values)`: a whole number where a float belongs becomes one; a value of the wrong
    type, or one the config's own limits refuse, is a ConfigError naming the key as written."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        v, key, kind = values[f.name], spelled[f"{section}.{f.name}"], str(f.type)
        fix = f"remove it to use the default ({f.default!r})"
        if v is None and kind.endswith("| None"):
            pass
        elif kind.startswith("float"):
            if not _num(v):
                raise ConfigError(key=key, reason=f"is {v!r}; it must be a number", fix=fix, path=path)
            v = float(v)
        elif kind == "int" and (not isinstance(v, int) or isinstance(v, bool)):
            raise ConfigError(key=key, reason=f"is {v!r}; it must be an integer", fix=fix, path=path)
        elif kind == "str" and not isinstance(v, str):
            raise ConfigError(key=key, reason=f"is {v!r}; it must be a string", fix=fix, path=path)
        kwargs[f.name] = v
    try:
        return cls(**kwargs)
    except ValueError as e:  # "name=value must be ...", from the config's own limits
        name, _, rest = str(e).partition("=")
        key = spelled.get(f"{section}.{name}", section)
        want = rest.partition(" must be ")[2] or str(e)
        default = getattr(cls, name, None)
        raise ConfigError(key=key, reason=f"is {values.get(name)!r}; it must be {want}", path=path,
                          fix=f"remove it to use the default ({default!r})") from None


def load_config(path: str) -> EdgeConfig:
    """Reads and checks edge.yaml."""
    try:
        with open(path, encoding="utf-8") as fh:
            raw = yaml.load(fh, Loader=_UniqueKeyLoader)  # noqa: S506 -- a SafeLoader subclass
    except FileNotFoundError as e:
        raise ConfigError(key="--config", reason=f"names {path!r}, which does not exist",
                          fix="pass the path of edge.yaml") from e
    except OSError as e:
        raise ConfigError(key="--config", reason=f"({path!r}) cannot be read: {e.strerror}",
                          fix="check the file's permissions") from e
    except _DuplicateKey as e:
        raise ConfigError(key=e.key, reason=f"appears twice (lines {e.first_line} and {e.line})",
                          fix="keep one of the two keys", path=path) from e
    except yaml.YAMLError as e:
        raise ConfigError(key="<yaml>", reason=f"is not valid YAML ({e})", fix="fix the syntax", path=path) from e
    return config_from_dict(raw if raw is not None else {}, path=path)


class _DuplicateKey(Exception):
    def __init__(self, key: str, first_line: int, line: int) -> None:
        super().__init__(f"{key!r} appears twice")
        self.key, self.first_line, self.line = key, first_line, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping with the same key twice (plain YAML keeps the last one silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[str, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key, line = str(self.construct_object(key_node)), key_node.start_mark.line + 1
            if key in first_line:
                raise _DuplicateKey(key, first_line[key], line)
            first_line[key] = line
        return super().construct_mapping(node, deep=deep)
