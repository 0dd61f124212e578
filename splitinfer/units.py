"""Parsers and formatters for the rate and duration strings the command line accepts.

Rates follow `tc`'s bit units (``18.88mbit``, ``500kbit``, ``1gbit``) with SI prefixes
(k = 1000). `tc`'s byte units (``mbps`` = megabytes/s) are rejected on purpose: the
project speaks bits per second everywhere, and accepting ``mbps`` would silently mean 8x
what most readers expect.
"""

from __future__ import annotations

import math
import re

__all__ = ["format_duration_ms", "format_rate_bps", "parse_duration_ms", "parse_rate_bps"]

_NUMBER = r"(?P<num>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_RATE_RE = re.compile(_NUMBER + r"\s*(?P<unit>[a-zA-Z/]*)\s*$")
_DURATION_RE = _RATE_RE

_RATE_UNITS_BPS = {
    "": 1.0,
    "bit": 1.0,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "bit/s": 1.0,
    "kbit/s": 1e3,
    "mbit/s": 1e6,
    "gbit/s": 1e9,
    "tbit/s": 1e12,
}
_RATE_FORMS = "'<number><unit>' with unit bit, kbit, mbit, gbit or tbit (e.g. '18.88mbit', '500kbit', '1gbit'); a bare number is bits/s"

_DURATION_UNITS_MS = {"": 1.0, "us": 1e-3, "ms": 1.0, "s": 1e3, "sec": 1e3, "min": 60e3}
_DURATION_FORMS = "'<number><unit>' with unit us, ms, s or min (e.g. '20ms', '1s', '250us'); a bare number is milliseconds"


def parse_rate_bps(text: str) -> float:
    """Parse a rate such as ``'18.88mbit'`` into bits per second.

    Raises ValueError naming the bad string and the accepted forms.
    """
    match = _RATE_RE.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"cannot parse rate {text!r}: use {_RATE_FORMS}")
    unit = match.group("unit").lower()
    if unit not in _RATE_UNITS_BPS:
        hint = ""
        if unit.endswith("bps"):
            hint = f" ('{unit}' is ambiguous between bits and bytes; write '{unit[:-3]}bit' for bits/s)"
        raise ValueError(f"cannot parse rate {text!r}: unknown unit {unit!r}{hint}; use {_RATE_FORMS}")
    value = float(match.group("num")) * _RATE_UNITS_BPS[unit]
    if not math.isfinite(value):
        raise ValueError(f"rate {text!r} is not finite; use {_RATE_FORMS}")
    return value


def parse_duration_ms(text: str) -> float:
    """Parse a duration such as ``'20ms'`` or ``'1s'`` into milliseconds.

    Raises ValueError naming the bad string and the accepted forms.
    """
    match = _DURATION_RE.match(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"cannot parse duration {text!r}: use {_DURATION_FORMS}")
    unit = match.group("unit").lower()
    if unit not in _DURATION_UNITS_MS:
        raise ValueError(f"cannot parse duration {text!r}: unknown unit {unit!r}; use {_DURATION_FORMS}")
    value = float(match.group("num")) * _DURATION_UNITS_MS[unit]
    if not math.isfinite(value):
        raise ValueError(f"duration {text!r} is not finite; use {_DURATION_FORMS}")
    return value


def format_rate_bps(rate_bps: float) -> str:
    """Format bits/s the way `parse_rate_bps` reads it back (``18.88mbit``)."""
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if rate_bps >= scale:
            return f"{rate_bps / scale:.6g}{unit}"
    return f"{rate_bps:.6g}bit"


def format_duration_ms(duration_ms: float) -> str:
    """Format milliseconds the way `parse_duration_ms` reads it back (``20ms``, ``1.5s``)."""
    if duration_ms >= 1e3:
        return f"{duration_ms / 1e3:.6g}s"
    return f"{duration_ms:.6g}ms"
