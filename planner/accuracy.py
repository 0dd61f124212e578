"""What each encoding of each boundary costs in accuracy: the measured `AccuracyTable`.

An entry says how closely the model's outputs agree with the fp32 whole model's when
the tensors crossing one cut travel in one encoding: the worst output's agreement in
the metric that fits it (``workers.agreement``: top-1, arg-max per position, IoU of
maps, 1 - relative L2). The table is measured by ``splitinfer calibrate`` (see
docs/accuracy.md) and read here without I/O, so the planner, the planner API and the
edge agent share one definition.

[Note: encoding keys]
An entry's encoding is a string:

* the lossless boundary encodings by their precision: ``fp32``, ``fp16``, ``int8``
  (per tensor) and ``int8+pc`` (per channel). Compression (zstd, lz4) is lossless, so
  ``agreement(cut, Encoding("int8", "zstd"))`` reads the ``int8`` entry;
* the lossy codecs as ``CODEC@LEVEL``: ``jpeg@90`` and ``webp@75`` (the model input as an
  image, at that quality), ``tiled-jpeg@90`` and ``tiled-webp@90`` (feature maps tiled
  into one image), ``bits@4`` (per-channel levels of that bit depth, then zstd).

A cut whose device runs every layer sends nothing, so no encoding can lose anything
there; such cuts are not measured, and the planner counts them as agreement 1.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from partitioner.cuts import Cut
from planner.errors import PlannerError
from planner.types import LOSSY_CODECS, Encoding, codec_levels

__all__ = [
    "ACCURACY_SCHEMA",
    "LOSSY_CODECS",
    "AccuracyEntry",
    "AccuracyTable",
    "encoding_key",
    "parse_encoding_key",
]

ACCURACY_SCHEMA = "splitinfer.accuracy/1"
_LOSSLESS = ("fp32", "fp16", "int8", "int8+pc")
_LOSSY_KEY = re.compile(r"^([a-z-]+)@(\d+)$")
_NORM_KEYS = frozenset({"mean", "std", "scale", "layout"})


def encoding_key(encoding: Encoding | str) -> str:
    """The table key of an encoding ([Note: encoding keys]); a string is checked and returned."""
    if isinstance(encoding, Encoding):
        if encoding.lossy_codec:
            return encoding.key
        return encoding.precision + ("+pc" if encoding.per_channel else "")
    parse_encoding_key(encoding)
    return encoding


def parse_encoding_key(key: str) -> tuple[str, int | None]:
    """``'int8+pc'`` -> ``('int8+pc', None)``; ``'jpeg@90'`` -> ``('jpeg', 90)``. PlannerError
    naming the key and the accepted forms otherwise."""
    if key in _LOSSLESS:
        return key, None
    m = _LOSSY_KEY.match(key) if isinstance(key, str) else None
    if m and m.group(1) in LOSSY_CODECS:
        level = int(m.group(2))
        limits = codec_levels(m.group(1))
        if limits[0] <= level <= limits[1]:
            return m.group(1), level
        what = "bit depth" if m.group(1) == "bits" else "quality"
        raise PlannerError(f"encoding {key!r} has {what} {level}, outside {limits[0]}..{limits[1]}; "
                           f"e.g. {m.group(1)}@{limits[1] if m.group(1) != 'bits' else 4}", field="encoding")
    raise PlannerError(
        f"encoding {key!r} is unknown; use one of {', '.join(_LOSSLESS)} or CODEC@LEVEL with CODEC one of "
        f"{', '.join(LOSSY_CODECS)} (jpeg@90, tiled-jpeg@75, bits@4)", field="encoding")


def _cut_id(cut: Cut | str) -> str:
    return cut.key if isinstance(cut, Cut) else str(cut)


@dataclass(frozen=True)
class AccuracyEntry:
    """One encoding of one cut's boundary, measured on the sample inputs."""

    cut_id: str
    """`partitioner.Cut.key` of the cut."""
    encoding: str
    """The encoding's key ([Note: encoding keys])."""
    agreement: float | None
    """Worst output's agreement with the fp32 whole model, in [0, 1]; None when the
    encoding does not apply to this boundary (``reason`` says why)."""
    worst_output: str | None = None
    """The output that agrees least."""
    metric: str | None = None
    """The metric of the worst output (``workers.agreement.Metric``)."""
    num_samples: int = 0
    """Samples compared."""
    wire_bytes: float = 0.0
    """Mean bytes per sample of the encoded boundary (float tensors through the codec,
    others as they are)."""
    codec_ms: float = 0.0
    """Median encode + decode ms per sample on the host that measured."""
    reason: str = ""
    """Why the encoding does not apply (agreement None), else empty."""

    def __post_init__(self) -> None:
        if self.agreement is not None and not (isinstance(self.agreement, (int, float))
                                               and 0.0 <= self.agreement <= 1.0):
            raise PlannerError(f"agreement of {self.encoding} at cut {self.cut_id} is {self.agreement!r}; "
                               "it must be in [0, 1] or None", field="agreement")

    def to_dict(self) -> dict[str, Any]:
        return {"cut_id": self.cut_id, "encoding": self.encoding, "agreement": self.agreement,
                "worst_output": self.worst_output, "metric": self.metric, "num_samples": self.num_samples,
                "wire_bytes": self.wire_bytes, "codec_ms": self.codec_ms, "reason": self.reason}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AccuracyEntry:
        return cls(str(d["cut_id"]), str(d["encoding"]), d.get("agreement"), d.get("worst_output"),
                   d.get("metric"), int(d.get("num_samples", 0)), float(d.get("wire_bytes", 0.0)),
                   float(d.get("codec_ms", 0.0)), str(d.get("reason", "")))


@dataclass(frozen=True)
class AccuracyTable:
    """Every measured (cut, encoding) of one model on one set of sample inputs."""

    model: str
    """The model's name."""
    fingerprint: str
    """Hash of the model file, the sample inputs and the image normalisation: a table
    is reused only for the same three."""
    num_samples: int
    """Samples each entry was measured on."""
    entries: tuple[AccuracyEntry, ...] = ()
    """One per measured (cut, encoding), in measuring order."""
    sample_source: str = "generated"
    """Where the samples came from: 'model.yaml', a file name, or 'generated' (random
    inputs: the agreement of a real model on real inputs may differ)."""
    image_norm: Mapping[str, Any] | None = None
    """The normalisation the image codecs (``jpeg@Q``, ``webp@Q``) turned float inputs
    into pixels with, as ``cluster.protocol.lossy.ImageNorm.to_dict()`` (``mean``, ``std``,
    ``scale``, ``layout``); None: each sample's per-channel range was fitted. A sender
    encodes with the same one, so its bytes and agreement are those measured."""
    host_model_ms: float | None = None
    """The whole model's CPU ms with one thread on the host that timed the codecs (None: not
    timed). A slower sender's codecs take longer by the ratio of its model time to this
    (:meth:`priced_for`, [Note: codec time on the sender])."""

    def __post_init__(self) -> None:
        if self.image_norm is not None:
            if not isinstance(self.image_norm, Mapping) or not set(self.image_norm) <= _NORM_KEYS:
                raise PlannerError(f"the accuracy table of {self.model} has image_norm {self.image_norm!r}; it must "
                                   f"be null or an object of {', '.join(sorted(_NORM_KEYS))}", field="image_norm")
            object.__setattr__(self, "image_norm", dict(self.image_norm))
        h = self.host_model_ms
        if h is not None and not (isinstance(h, (int, float)) and not isinstance(h, bool) and 0 < h < float("inf")):
            raise PlannerError(f"the accuracy table of {self.model} has host_model_ms {h!r}; it must be null or a "
                               "number of ms > 0; measure it again with splitinfer calibrate", field="host_model_ms")
        seen: set[tuple[str, str]] = set()
        for e in self.entries:
            if (e.cut_id, e.encoding) in seen:
                raise PlannerError(f"the accuracy table of {self.model} has two entries for {e.encoding} at cut "
                                   f"{e.cut_id}; keep one", field="entries")
            seen.add((e.cut_id, e.encoding))

    def entry(self, cut: Cut | str, encoding: Encoding | str) -> AccuracyEntry | None:
        """The entry of ``encoding`` at ``cut``, or None when it was not measured."""
        key, cid = encoding_key(encoding), _cut_id(cut)
        for e in self.entries:
            if e.cut_id == cid and e.encoding == key:
                return e
        return None

    def agreement(self, cut: Cut | str, encoding: Encoding | str) -> float | None:
        """The measured agreement, or None when not measured or not applicable."""
        e = self.entry(cut, encoding)
        return None if e is None else e.agreement

    @property
    def cut_ids(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(e.cut_id for e in self.entries))

    @property
    def encodings(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(e.encoding for e in self.entries))

    def with_entries(self, entries: Iterable[AccuracyEntry]) -> AccuracyTable:
        """This table plus ``entries`` (a new entry replaces the old one of its pair)."""
        new = list(entries)
        keys = {(e.cut_id, e.encoding) for e in new}
        kept = [e for e in self.entries if (e.cut_id, e.encoding) not in keys]
        return replace(self, entries=tuple(kept + new))

    def priced_for(self, sender_model_ms: float) -> AccuracyTable:
        """This table with every codec's time at the speed of a sender that runs the whole model
        in `sender_model_ms`; unchanged where the table's host was not timed or is slower.

        [Note: codec time on the sender]
        The cost model counts a lossy codec's measured encode + decode ms on the sender, and
        the table times it on the host that calibrates, often a server many times faster than
        the device. A device's codec is taken to be as many times slower as its model is: a
        tiled JPEG of SqueezeNet's first layer priced at a server's speed looked cheap to a
        device 16x slower, and took 187 ms against the fp16 input's 76 ms."""
        host = self.host_model_ms
        if host is None or host <= 0 or not sender_model_ms > host:
            return self
        k = sender_model_ms / host
        return replace(self, entries=tuple(replace(e, codec_ms=e.codec_ms * k) if e.codec_ms > 0 else e
                                           for e in self.entries))

    def best(self, cut: Cut | str, min_agreement: float) -> tuple[AccuracyEntry, ...]:
        """The entries of ``cut`` at or above ``min_agreement``, fewest wire bytes first."""
        cid = _cut_id(cut)
        ok = [e for e in self.entries if e.cut_id == cid and e.agreement is not None
              and e.agreement >= min_agreement]
        return tuple(sorted(ok, key=lambda e: (e.wire_bytes, -(e.agreement or 0.0))))

    def to_dict(self) -> dict[str, Any]:
        return {"schema": ACCURACY_SCHEMA, "model": self.model, "fingerprint": self.fingerprint,
                "num_samples": self.num_samples, "sample_source": self.sample_source,
                "image_norm": None if self.image_norm is None else dict(self.image_norm),
                "host_model_ms": self.host_model_ms, "entries": [e.to_dict() for e in self.entries]}

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **kw)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AccuracyTable:
        if d.get("schema") != ACCURACY_SCHEMA:
            raise PlannerError(f"accuracy table schema is {d.get('schema')!r}, not {ACCURACY_SCHEMA!r}; measure "
                               "it again with splitinfer calibrate", field="schema")
        return cls(str(d["model"]), str(d["fingerprint"]), int(d["num_samples"]),
                   tuple(AccuracyEntry.from_dict(e) for e in d.get("entries", ())),
                   str(d.get("sample_source", "generated")), d.get("image_norm"),
                   None if d.get("host_model_ms") is None else float(d["host_model_ms"]))

    @classmethod
    def from_json(cls, text: str) -> AccuracyTable:
        try:
            d = json.loads(text)
        except ValueError as e:
            raise PlannerError(f"accuracy table is not JSON ({e}); measure it again with splitinfer calibrate",
                               field="accuracy") from e
        if not isinstance(d, Mapping):
            raise PlannerError("accuracy table is not a JSON object; measure it again with splitinfer calibrate",
                               field="accuracy")
        return cls.from_dict(d)

