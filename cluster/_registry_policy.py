"""A model's version policy, default and canary: parsing and the pure routing rules.

`cluster.registry` re-exports every public name here; see [Note: leases and rollback]
and [Note: live policy] there for how the registry applies them.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from cluster._registry_disk import NAME_PATTERN, RegistryError, version_sort_key

__all__ = ["POLICY_FILE_SUFFIX", "ROUTED_VERSIONS", "Canary", "VersionPolicy", "canary_fraction", "parse_policy",
           "read_policy_dir", "route"]

#: Version strings in a request that mean "whatever this device is routed to".
ROUTED_VERSIONS = ("", "latest")

#: File name suffix of a model's policy in a policy directory: `<model>.policy.yaml`.
POLICY_FILE_SUFFIX = ".policy.yaml"
_POLICY_FIELDS = frozenset({"version_policy", "default_version", "canary"})


@dataclass(frozen=True)
class VersionPolicy:
    """Which versions on disk get loaded (Triton's version_policy)."""

    kind: str = "latest"
    """'latest' (the `n` highest), 'all', or 'specific' (`versions`)."""
    n: int = 1
    """How many of the highest versions 'latest' loads."""
    versions: tuple[str, ...] = ()
    """The versions 'specific' loads."""

    def __post_init__(self) -> None:
        if self.kind not in ("latest", "all", "specific"):
            raise ValueError(f"version policy kind {self.kind!r} must be 'latest', 'all' or 'specific'")
        if self.kind == "latest" and self.n < 1:
            raise ValueError(f"latest:{self.n} must load at least one version; use latest:1 or more")
        if self.kind == "specific" and not self.versions:
            raise ValueError("a 'specific' version policy needs at least one version")

    def select(self, available: Sequence[str]) -> tuple[str, ...]:
        """The versions to load among `available`, highest first. Pure."""
        ordered = sorted(available, key=version_sort_key, reverse=True)
        if self.kind == "all":
            return tuple(ordered)
        if self.kind == "latest":
            return tuple(ordered[: self.n])
        return tuple(v for v in ordered if v in self.versions)

    @classmethod
    def parse(cls, spec: str | Mapping[str, Any]) -> VersionPolicy:
        """'latest', 'latest:2', 'all', 'specific:1,3', or the YAML mapping {latest: 2} / {all: true} /
        {specific: [1, 3]}."""
        try:
            if isinstance(spec, Mapping):
                if len(spec) != 1:
                    raise ValueError(f"expected one key, got {sorted(spec)}")
                (k, v), = spec.items()
                if k == "latest":
                    return cls("latest", int(v or 1))
                if k == "all":
                    return cls("all")
                if k == "specific":
                    vs = v if isinstance(v, (list, tuple)) else [v]
                    return cls("specific", versions=tuple(str(x) for x in vs))
                raise ValueError(f"unknown kind {k!r}")
            kind, _, arg = str(spec).partition(":")
            if kind == "latest":
                return cls("latest", int(arg or 1))
            if kind == "all" and not arg:
                return cls("all")
            if kind == "specific":
                return cls("specific", versions=tuple(x.strip() for x in arg.split(",") if x.strip()))
            raise ValueError(f"unknown kind {kind!r}")
        except (ValueError, TypeError) as e:
            raise RegistryError(path="version_policy", reason=f"{spec!r} is not a version policy ({e})",
                                fix="use latest, latest:N, all or specific:V1,V2") from e


@dataclass(frozen=True)
class Canary:
    """`percent` of devices (by a stable hash of their id) get `version` instead of the default."""

    version: str
    percent: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.percent <= 100.0:
            raise ValueError(f"canary percent {self.percent} must be in [0, 100]")


def canary_fraction(model: str, device_id: str) -> float:
    """A device's stable position in [0, 1) for `model`: sha256 of 'model/device_id'.

    Salting with the model keeps one unlucky group of devices from being every
    model's canary. The same id always lands at the same place, across processes.
    """
    digest = hashlib.sha256(f"{model}/{device_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def route(model: str, default_version: str, canary: Canary | None, device_id: str) -> str:
    """The version a device's routed request goes to. Devices without an id never get the canary."""
    if canary is not None and device_id and canary_fraction(model, device_id) < canary.percent / 100.0:
        return canary.version
    return default_version


def parse_policy(data: bytes | str, *, path: str, fallback: VersionPolicy) -> tuple[VersionPolicy, str | None,
                                                                                   Canary | None]:
    """A policy file's text -> (version policy, default version, canary). Pure.

    `fallback` is the version policy of a file that names none. Raises RegistryError
    naming `path` and the bad field.
    """
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        d = yaml.safe_load(text) or {}
        if not isinstance(d, dict):
            raise ValueError("expected a mapping")
        unknown = sorted(set(d) - _POLICY_FIELDS)
        if unknown:
            raise ValueError(f"unknown field(s) {unknown}; use version_policy, default_version, canary")
        policy = VersionPolicy.parse(d["version_policy"]) if "version_policy" in d else fallback
        default = str(d["default_version"]) if d.get("default_version") is not None else None
        c = d.get("canary")
        canary = Canary(str(c["version"]), float(c["percent"])) if c else None
    except RegistryError as e:
        raise RegistryError(path=path, reason=e.reason, fix=e.fix) from e
    except (yaml.YAMLError, UnicodeDecodeError, ValueError, TypeError, KeyError) as e:
        raise RegistryError(path=path, reason=f"is not a valid policy file ({e})",
                            fix="see docs/registry.md for version_policy, default_version and canary") from e
    return policy, default, canary


def read_policy_dir(path: str) -> dict[str, bytes]:
    """The `<model>.policy.yaml` files of a directory -> {model: content}.

    A mounted ConfigMap holds one link per key into a `..data` link that the kubelet
    swaps to a new timestamped directory on each update, so names starting with '.'
    are skipped and the key links are followed. A file gone between listing and
    reading was swapped away: the next poll sees the new set.
    """
    out = {}
    for name in sorted(os.listdir(path)):
        model = name[: -len(POLICY_FILE_SUFFIX)]
        if name.startswith(".") or not name.endswith(POLICY_FILE_SUFFIX) or not NAME_PATTERN.match(model):
            continue
        try:
            with open(os.path.join(path, name), "rb") as fh:
                out[model] = fh.read()
        except (FileNotFoundError, IsADirectoryError):
            continue
    return out
