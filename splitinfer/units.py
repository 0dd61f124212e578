"""Parsers and formatters for the rate and duration strings the command line accepts,
and the argparse glue every command uses to read them.

Rates follow `tc`'s bit units (``18.88mbit``, ``500kbit``, ``1gbit``) with SI prefixes
(k = 1000). `tc`'s byte units (``mbps`` = megabytes/s) are rejected on purpose: the
project speaks bits per second everywhere, and accepting ``mbps`` would silently mean 8x
what most readers expect. A negative rate or duration is refused as such.

[Note: values that start with '-']
argparse takes any argument that starts with '-' and is not a negative number for an
option, so ``--uplink -5mbit`` fails with "expected one argument" before the value
reaches a parser that could say what is wrong with it. `parse_args` joins such a value
to its option (``--uplink=-5mbit``) when the option takes one value and the value is
not itself one of the parser's options, so the option's ``type`` sees it and refuses it
by name ("rate '-5mbit' cannot be negative; give e.g. '5mbit'").
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "arg_type", "format_duration_ms", "format_rate_bps", "int_at_least", "join_dash_values", "parse_args",
    "parse_duration_ms", "parse_rate_bps",
]

_NUMBER = r"(?P<sign>[-+]?)(?P<num>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
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
    _refuse_negative("rate", text, match, value)
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
    _refuse_negative("duration", text, match, value)
    return value


def _refuse_negative(kind: str, text: str, match: re.Match[str], value: float) -> None:
    if match.group("sign") == "-" and value != 0:
        plain = text.strip()[1:].lstrip()
        raise ValueError(f"{kind} {text!r} cannot be negative; give e.g. {plain!r}")


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


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type=`` for an integer option of at least ``low``."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"{v} must be >= {low}")
        return v

    return parse


def arg_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` as an argparse ``type=``: its ValueError becomes argparse's usage error,
    which names the option (``argument --uplink: rate '-5mbit' cannot be negative; ...``)."""
    def parse_arg(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e
    parse_arg.__name__ = getattr(parse, "__name__", "value")  # argparse names a failed type by it
    return parse_arg


def _option_kinds(parser: argparse.ArgumentParser) -> tuple[set[str], set[str]]:
    """(every option string of the parser and its subparsers, those that take exactly one value
    wherever they appear)."""
    every: set[str] = set()
    one: dict[str, bool] = {}
    stack = [parser]
    while stack:
        p = stack.pop()
        for action in p._actions:  # argparse keeps no public list of them
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())
            takes_one = action.nargs in (None, 1)  # flags and counters take 0 (nargs=0)
            for opt in action.option_strings:
                every.add(opt)
                one[opt] = one.get(opt, True) and takes_one
    return every, {opt for opt, yes in one.items() if yes}


def _resolve(token: str, options: set[str], abbrev: bool) -> str | None:
    """The option ``token`` names: itself, or the one long option it abbreviates."""
    if token in options:
        return token
    if abbrev and token.startswith("--"):
        hits = [o for o in options if o.startswith(token)]
        if len(hits) == 1:
            return hits[0]
    return None


def join_dash_values(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``argv`` with each value that starts with '-' joined to the option before it;
    see [Note: values that start with '-']."""
    every, one_value = _option_kinds(parser)
    out: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        token = args[i]
        if token == "--":
            out.extend(args[i:])
            break
        nxt = args[i + 1] if i + 1 < len(args) else None
        opt = _resolve(token, every, parser.allow_abbrev) if token.startswith("-") and "=" not in token else None
        if (opt in one_value and nxt is not None and nxt.startswith("-") and nxt not in ("-", "--")
                and _resolve(nxt.split("=", 1)[0], every, parser.allow_abbrev) is None):
            out.append(f"{token}={nxt}" if token.startswith("--") else f"{token}{nxt}")
            i += 2
            continue
        out.append(token)
        i += 1
    return out


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args`` where a value may start with '-' (``--uplink -5mbit``); see
    [Note: values that start with '-']."""
    return parser.parse_args(join_dash_values(parser, sys.argv[1:] if argv is None else argv))
