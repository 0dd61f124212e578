"""The on-device cache of model artifacts, so the agent starts offline.

    <cache_dir>/models/<model>/<version>/{model.onnx, model.yaml, profiles/, frontier.json,
                                          manifest.json, segments/<cut_id>/{head,tail}.onnx}
    <cache_dir>/models/<model>/current      the version last fetched (offline start of a bare name)
    <cache_dir>/engines/                     ONNX Runtime's pre-optimised artefacts
    <cache_dir>/profiles/<model>@<version>.json   this device's profile

A version directory is written whole to a temporary directory and renamed into place,
so a crash never leaves half a model. manifest.json holds every file's SHA-256;
`load` checks them, and a mismatch is reported as a corrupt cache with the fix.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Mapping

from edge_agent.errors import ArtifactError

__all__ = ["ArtifactCache", "MANIFEST", "CACHE_SCHEMA"]

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
CACHE_SCHEMA = "splitinfer.edge-cache/1"
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def _safe_rel(name: str) -> str:
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") or not _NAME.match(p) for p in parts):
        raise ArtifactError(path=name, reason="is not a safe relative file name",
                            fix="the gateway sent a bad artifact name; check the registry's files")
    return os.path.join(*parts)


class ArtifactCache:
    def __init__(self, root: str) -> None:
        self.root = root

    def version_dir(self, model: str, version: str) -> str:
        return os.path.join(self.root, "models", model, version)

    @property
    def engines_dir(self) -> str:
        return os.path.join(self.root, "engines")

    def profile_path(self, model: str, version: str) -> str:
        return os.path.join(self.root, "profiles", f"{model}@{version}.json")

    def segment_path(self, model: str, version: str, cut_id: str, kind: str) -> str:
        return os.path.join(self.version_dir(model, version), "segments", cut_id, f"{kind}.onnx")

    def current_version(self, model: str) -> str | None:
        """The version last stored for `model`, or None."""
        try:
            with open(os.path.join(self.root, "models", model, "current"), encoding="utf-8") as fh:
                v = fh.read().strip()
        except OSError:
            return None
        return v if _NAME.match(v or "-/") else None

    def store(self, model: str, version: str, files: Mapping[str, bytes]) -> str:
        """Writes a version atomically; returns its directory."""
        if not _NAME.match(model) or not _NAME.match(version):
            raise ArtifactError(path=f"{model}@{version}", reason="is not a valid model@version name",
                                fix="use names of letters, digits, '_', '.' and '-'")
        if "model.onnx" not in files:
            raise ArtifactError(path=f"{model}@{version}", reason="arrived without model.onnx",
                                fix="check that the registry holds <model>/<version>/model.onnx")
        final = self.version_dir(model, version)
        parent = os.path.dirname(final)
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{version}.", dir=parent)
        try:
            manifest = {}
            for name, data in files.items():
                rel = _safe_rel(name)
                path = os.path.join(tmp, rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as fh:
                    fh.write(data)
                manifest[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
            with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as fh:
                json.dump({"schema": CACHE_SCHEMA, "model": model, "version": version, "files": manifest,
                           "stored_unix_s": time.time()}, fh, indent=1, sort_keys=True)
            old = None
            if os.path.exists(final):
                old = final + f".old{os.getpid()}"
                os.replace(final, old)
            os.replace(tmp, final)
            if old:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        cur = os.path.join(parent, "current")
        with open(cur + ".tmp", "w", encoding="utf-8") as fh:
            fh.write(version)
        os.replace(cur + ".tmp", cur)
        logger.info("cached %s@%s (%d files) in %s", model, version, len(files), final)
        return final

    def has(self, model: str, version: str) -> bool:
        """Whether a copy of model@version was stored (it may still fail its checks in `load`)."""
        return os.path.isfile(os.path.join(self.version_dir(model, version), MANIFEST))

    def load(self, model: str, version: str) -> dict[str, bytes]:
        """The cached files of model@version, each checked against the manifest."""
        d = self.version_dir(model, version)
        mpath = os.path.join(d, MANIFEST)
        fix = f"delete {d} and start the agent while the gateway is reachable, so it downloads the model again"
        if not os.path.isfile(mpath):
            raise ArtifactError(path=d, reason="holds no cached copy of this model (no manifest.json)",
                                fix="start the agent once while the gateway is reachable")
        try:
            with open(mpath, encoding="utf-8") as fh:
                manifest = json.load(fh)
            entries = manifest["files"]
            if manifest.get("schema") != CACHE_SCHEMA or not isinstance(entries, dict):
                raise ValueError(f"schema {manifest.get('schema')!r}")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ArtifactError(path=mpath, reason=f"is corrupt ({e})", fix=fix) from e
        out = {}
        for name, meta in entries.items():
            path = os.path.join(d, _safe_rel(name))
            try:
                with open(path, "rb") as fh:
                    data = fh.read()
            except OSError as e:
                raise ArtifactError(path=path, reason=f"is missing from the cache ({e.strerror})", fix=fix) from e
            if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
                raise ArtifactError(path=path, reason="fails its SHA-256 check: the cache is corrupt", fix=fix)
            out[name] = data
        return out
