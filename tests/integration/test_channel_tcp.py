"""The direct channel's TCP form (workers/_transport/), both ends in this process over
127.0.0.1: the unit tests' cases, across the loopback network."""

from __future__ import annotations

from tests.unit.test_channel import refuses_a_wrong_token, round_trip_arrays


def test_arrays_round_trip_over_tcp():
    round_trip_arrays("tcp")


def test_a_tcp_connection_with_a_wrong_token_reaches_nothing():
    refuses_a_wrong_token("tcp")
