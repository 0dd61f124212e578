"""The strings with a unit that the HTTP API takes for a rate, a duration or a size,
built from the planner's limits (`planner.whatif.limits`): the body reader
(`splitinfer.planner_api.service`) and the OpenAPI document
(`splitinfer.planner_api.openapi`) both read this table, so they cannot disagree.

The numeric limits are the planner's, because every caller meets them (Python, gRPC,
HTTP); the unit strings are this edge's, because only the HTTP API and the command line
take text for a number.

[Note: quantity strings]
A rate, a duration or a size is a JSON number in the base unit (bits/s, ms, bytes),
or a string with a unit ('18.88mbit', '20ms', '64MiB'). A JSON Schema states a
number's range with minimum and maximum, but a string's only with a pattern. So each
pattern here is built to match exactly the strings whose value lies in the range: per
unit, the integer part has at most as many digits as the range allows, and a value
below one unit has at most as many leading zeros after the point as the lower limit
allows. The validator parses a string, then tests it against the same pattern, with
`re.search` as JSON Schema validators do; a string the pattern refuses is refused
whatever the parser made of it ('5Mbit', '1e6bit': give a number for those). The
command line parses its own wider forms and sends numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.whatif import limits

__all__ = ["Quantity", "RATE", "DURATION", "POSITIVE_DURATION", "SIZE", "MIN_GFLOPS", "MAX_GFLOPS", "BY_LIMIT"]

MIN_GFLOPS = limits.GFLOPS.lo
"""Slowest roofline device (see `planner.whatif.limits.GFLOPS`)."""
MAX_GFLOPS = limits.GFLOPS.hi
"""Fastest roofline device."""


@dataclass(frozen=True)
class Quantity:
    """A kind of quantity: the planner's limit on it and the strings that may give it."""

    limit: limits.Limit
    """Unit and range, from `planner.whatif.limits`."""
    pattern: str
    """The strings with a unit whose value lies in the range; see [Note: quantity strings]."""
    example: str
    """A string of this kind, for messages and the document."""
    forms: str
    """The strings in words, for messages."""

    @property
    def unit(self) -> str:
        return self.limit.unit

    @property
    def lo(self) -> float:
        return self.limit.lo

    @property
    def hi(self) -> float:
        return self.limit.hi

    @property
    def lo_open(self) -> bool:
        return self.limit.lo_open


def _decimal(max_int_digits: int, min_exp: int | None) -> str:
    """A non-negative decimal below ``10**max_int_digits``; with ``min_exp``, also at
    least ``10**min_exp`` (so never zero), else zero allowed."""
    if min_exp is None:
        return rf"([0-9]{{1,{max_int_digits}}}(\.[0-9]+)?|\.[0-9]+)"
    alts = []
    if max_int_digits > 0 and min_exp <= 0:
        alts.append(rf"0*[1-9][0-9]{{0,{max_int_digits - 1}}}(\.[0-9]+)?")
    if min_exp < 0:
        alts.append(rf"0*\.0{{0,{-min_exp - 1}}}[1-9][0-9]*")
    return "(" + "|".join(alts) + ")"


def _pattern(units: dict[str, float], lo: float, hi: float, *, nonzero: bool, suffix: str = "",
             bare: bool = False) -> str:
    """Alternatives per unit: a decimal whose value times the unit's scale is in the range."""
    alts = []
    for name, scale in units.items():
        digits = int(math.floor(math.log10(hi / scale) + 1e-9))  # 10**digits * scale <= hi (rounded down)
        if 10 ** digits * scale > hi:
            digits -= 1
        min_exp = None
        if nonzero:
            # the first non-zero digit may come no later than the one worth lo / scale
            min_exp = math.ceil(math.log10(lo / scale) - 1e-9) if lo > 0 else -12
        alts.append(_decimal(digits, min_exp) + r"\s*" + name if name else _decimal(digits, min_exp))
    body = "|".join(f"({a})" for a in alts)
    return f"^({body}){suffix}$" if not bare else f"^({body})$"


_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_DURATION_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "sec": 1e3, "min": 6e4}
_SIZE_UNITS = {"": 1.0, "B": 1.0, "KB": 1e3, "MB": 1e6, "GB": 1e9, "KiB": 2.0 ** 10, "MiB": 2.0 ** 20,
               "GiB": 2.0 ** 30, "TiB": 2.0 ** 40}

RATE = Quantity(
    limits.RATE,
    pattern=_pattern(_RATE_UNITS, limits.RATE.lo, limits.RATE.hi, nonzero=True, suffix="(/s)?"),
    example="18.88mbit",
    forms="a decimal and a unit, bit, kbit, mbit, gbit or tbit (e.g. '18.88mbit', '500kbit'), "
          "at least 1bit and under 1000tbit; or a number in bits/s",
)
DURATION = Quantity(
    limits.DURATION,
    pattern=_pattern(_DURATION_UNITS, limits.DURATION.lo, limits.DURATION.hi, nonzero=False),
    example="20ms",
    forms="a decimal and a unit, us, ms, s, sec or min (e.g. '20ms', '1.5s'), up to 1e9 ms; "
          "or a number in ms",
)
POSITIVE_DURATION = Quantity(
    limits.POSITIVE_DURATION,
    pattern=_pattern(_DURATION_UNITS, limits.POSITIVE_DURATION.lo, limits.POSITIVE_DURATION.hi, nonzero=True),
    example="100ms",
    forms="a non-zero decimal and a unit, us, ms, s, sec or min (e.g. '100ms'), up to 1e9 ms; "
          "or a number in ms",
)
SIZE = Quantity(
    limits.SIZE,
    pattern=_pattern(_SIZE_UNITS, limits.SIZE.lo, limits.SIZE.hi, nonzero=False),
    example="64MiB",
    forms="a decimal and a unit, B, KB, MB, GB, KiB, MiB, GiB or TiB (e.g. '64MiB'), up to 2**60 bytes; "
          "or a number in bytes",
)
BY_LIMIT = {q.limit.name: q for q in (RATE, DURATION, POSITIVE_DURATION, SIZE)}
"""The quantity that gives each limit as text, by `Limit.name`."""
