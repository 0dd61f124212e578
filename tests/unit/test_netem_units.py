"""Rate and duration strings (splitinfer.units)."""

import pytest

from splitinfer.units import format_duration_ms, format_rate_bps, parse_duration_ms, parse_rate_bps


@pytest.mark.parametrize(
    ("text", "expected_bps"),
    [
        ("18.88mbit", 18.88e6),
        ("500kbit", 500e3),
        ("1gbit", 1e9),
        ("75Mbit", 75e6),
        ("100bit", 100.0),
        ("2500", 2500.0),
        (" 1.5 mbit ", 1.5e6),
        ("10mbit/s", 10e6),
        ("0mbit", 0.0),
        (".5kbit", 500.0),
    ],
)
def test_parse_rate_bps_accepts_tc_bit_units(text, expected_bps):
    assert parse_rate_bps(text) == pytest.approx(expected_bps)


@pytest.mark.parametrize("text", ["", "fast", "5 furlongs", "mbit", "1e999mbit", "1.2.3mbit"])
def test_parse_rate_bps_rejects_bad_strings_naming_them_and_the_forms(text):
    with pytest.raises(ValueError) as info:
        parse_rate_bps(text)
    message = str(info.value)
    assert repr(text) in message
    assert "kbit" in message and "mbit" in message


def test_parse_rate_bps_explains_byte_units_are_ambiguous():
    with pytest.raises(ValueError, match="'mbit' for bits/s"):
        parse_rate_bps("10mbps")


@pytest.mark.parametrize(
    ("text", "expected_ms"),
    [("20ms", 20.0), ("1s", 1000.0), ("250us", 0.25), ("1.5s", 1500.0), ("2min", 120000.0), ("40", 40.0)],
)
def test_parse_duration_ms(text, expected_ms):
    assert parse_duration_ms(text) == pytest.approx(expected_ms)


@pytest.mark.parametrize("text", ["", "soon", "20 parsecs", "ms"])
def test_parse_duration_ms_rejects_bad_strings_naming_them_and_the_forms(text):
    with pytest.raises(ValueError) as info:
        parse_duration_ms(text)
    assert repr(text) in str(info.value)
    assert "ms" in str(info.value) and "'1s'" in str(info.value)


@pytest.mark.parametrize("rate_bps", [130e3, 1.1e6, 18.88e6, 75.52e6, 2e9, 512.0])
def test_format_rate_round_trips(rate_bps):
    assert parse_rate_bps(format_rate_bps(rate_bps)) == pytest.approx(rate_bps)


@pytest.mark.parametrize("duration_ms", [0.5, 20.0, 999.0, 1500.0])
def test_format_duration_round_trips(duration_ms):
    assert parse_duration_ms(format_duration_ms(duration_ms)) == pytest.approx(duration_ms)
