"""A rate, duration or size that starts with '-' reaches its parser on every command and
is refused as negative, naming the option; see [Note: values that start with '-'] in
splitinfer/units.py."""

from __future__ import annotations

import argparse

import pytest

from splitinfer.cli import main
from splitinfer.plan_cmd import parse_size_bytes
from splitinfer.units import join_dash_values, parse_duration_ms, parse_rate_bps

_TIERS = ["squeezenet", "--edge", "5gflops", "--cloud", "100gflops"]


def _refused(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "expected one argument" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, line", [
    (["plan", *_TIERS, "--uplink", "-5mbit"],
     "splitinfer plan: error: argument --uplink: rate '-5mbit' cannot be negative; give e.g. '5mbit'"),
    (["plan", *_TIERS, "--uplink", "5mbit", "--downlink", "-1gbit"],
     "splitinfer plan: error: argument --downlink: rate '-1gbit' cannot be negative; give e.g. '1gbit'"),
    (["plan", *_TIERS, "--uplink", "5mbit", "--rtt", "-20ms"],
     "splitinfer plan: error: argument --rtt: duration '-20ms' cannot be negative; give e.g. '20ms'"),
    (["plan", *_TIERS, "--uplink", "5mbit", "--slo", "-0.1s"],
     "splitinfer plan: error: argument --slo: duration '-0.1s' cannot be negative; give e.g. '0.1s'"),
    (["plan", *_TIERS, "--uplink", "5mbit", "--device-memory", "-64MiB"],
     "splitinfer plan: error: argument --device-memory: size '-64MiB' cannot be negative; give e.g. '64MiB'"),
    (["plan", *_TIERS, "--upl", "-5mbit"],  # an abbreviated option, as argparse allows
     "splitinfer plan: error: argument --uplink: rate '-5mbit' cannot be negative; give e.g. '5mbit'"),
    (["sweep", *_TIERS, "--uplink", "-5mbit..1gbit"],
     "splitinfer sweep: error: argument --uplink: rate '-5mbit' cannot be negative; give e.g. '5mbit'"),
    (["sweep", *_TIERS, "--downlink", "-5mbit"],
     "splitinfer sweep: error: argument --downlink: rate '-5mbit' cannot be negative; give e.g. '5mbit'"),
    (["netem", "--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:1", "--up", "-5mbit"],
     "splitinfer netem: error: argument --up: rate '-5mbit' cannot be negative; give e.g. '5mbit'"),
    (["netem", "--listen", "127.0.0.1:0", "--upstream", "127.0.0.1:1", "--up", "5mbit", "--rtt", "-20ms"],
     "splitinfer netem: error: argument --rtt: duration '-20ms' cannot be negative; give e.g. '20ms'"),
    (["planner", "serve", "--port", "-5"],
     "splitinfer planner serve: error: argument --port: -5 is not a port; give a number in 0..65535 "
     "(0 picks a free one)"),
    (["profile", "squeezenet", "-o", "p.json", "--batch", "-1,8"],
     "splitinfer profile: error: argument --batch: --batch '-1,8': batch sizes must be >= 1, e.g. 1,8"),
])
def test_negative_rates_say_negative(capsys, argv: list[str], line: str) -> None:
    assert _refused(capsys, argv) == line


def test_a_forgotten_value_still_says_expected_one_argument(capsys) -> None:
    """A following option is not taken for a value: --uplink --json lacks the rate."""
    with pytest.raises(SystemExit):
        main(["plan", *_TIERS, "--uplink", "--json"])
    assert "argument --uplink: expected one argument" in capsys.readouterr().err


@pytest.mark.parametrize("parse, text, message", [
    (parse_rate_bps, "-5mbit", "rate '-5mbit' cannot be negative; give e.g. '5mbit'"),
    (parse_rate_bps, "-1e3", "rate '-1e3' cannot be negative; give e.g. '1e3'"),
    (parse_duration_ms, " -20 ms", "duration ' -20 ms' cannot be negative; give e.g. '20 ms'"),
    (parse_size_bytes, "-1GiB", "size '-1GiB' cannot be negative; give e.g. '1GiB'"),
])
def test_parsers_refuse_negative_values(parse, text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse(text)
    assert str(info.value) == message


def test_signed_zero_and_plus_are_plain_values() -> None:
    assert parse_rate_bps("-0mbit") == 0.0 and parse_rate_bps("+5mbit") == 5e6
    assert parse_duration_ms("-0") == 0.0


def test_join_dash_values_joins_only_values_of_one_value_options() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rate")
    p.add_argument("-o")
    p.add_argument("--flag", action="store_true")
    p.add_argument("-v", action="count")
    sub = p.add_subparsers(dest="cmd")
    sub.add_parser("serve").add_argument("--port")
    argv = ["--rate", "-5", "-o", "-x", "--flag", "-v", "-n", "serve", "--port", "-1", "--", "--rate", "-1"]
    assert join_dash_values(p, argv) == [
        "--rate=-5", "-o-x", "--flag", "-v", "-n", "serve", "--port=-1", "--", "--rate", "-1"]
    # a value that is itself an option, '-' (stdin) and a joined value stay as given
    assert join_dash_values(p, ["--rate", "--flag", "-o", "-", "--rate=-1"]) == [
        "--rate", "--flag", "-o", "-", "--rate=-1"]


def test_int_at_least_names_the_bound_and_refuses_non_integers() -> None:
    import argparse

    from splitinfer.units import int_at_least

    assert int_at_least(1)("3") == 3 and int_at_least(0)("0") == 0
    with pytest.raises(argparse.ArgumentTypeError, match="0 must be >= 1"):
        int_at_least(1)("0")
    with pytest.raises(argparse.ArgumentTypeError, match="'2.5' is not an integer"):
        int_at_least(0)("2.5")
