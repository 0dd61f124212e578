"""The limits of a what-if request: one table read by the typed requests (which refuse
a value outside them, whoever builds the request), by the HTTP edge's OpenAPI document
and by its unit-string patterns, so that none of them can disagree.

They are planner limits, not HTTP ones: a Python caller, the gateway's gRPC `Plan` and
the HTTP API all meet the same bounds. Only the strings with a unit ('18.88mbit') are
an edge concept; `splitinfer.planner_api.quantities` builds their patterns from these
numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.types import PRECISIONS, Objective

__all__ = [
    "Limit", "RATE", "DURATION", "POSITIVE_DURATION", "SIZE", "GFLOPS", "POWER", "FIXED_MS", "LOSS",
    "AGREEMENT", "DOWN_RATIO", "MAX_SWEEP_POINTS", "MAX_FIRST_K_LOCAL", "ENCODING_CHOICES", "FRONTIER_OBJECTIVES",
    "ROOFLINE_KEYS",
]


@dataclass(frozen=True)
class Limit:
    """The range of one kind of number in a request."""

    name: str
    """What kind of number: 'rate', 'duration', 'positive_duration', 'size', ..."""
    unit: str
    """Its unit (``bits/s``, ``ms``, ``bytes``, ``GFLOP/s``, ``W``)."""
    lo: float
    """Least value."""
    hi: float
    """Greatest value."""
    lo_open: bool = False
    """``lo`` itself is excluded (a latency SLO of 0 ms means nothing)."""

    def holds(self, x: float) -> bool:
        """Whether ``x`` is a finite number in the range."""
        return (x == x and self.lo <= x <= self.hi and not (self.lo_open and x <= self.lo))

    def words(self) -> str:
        """The range in words, for messages: '>= 1 and <= 1e+15 bits/s'."""
        rel = ">" if self.lo_open else ">="
        return f"{rel} {self.lo:g} and <= {self.hi:g} {self.unit}"


RATE = Limit("rate", "bits/s", 1.0, 1e15)
"""Link rates: 1 bit/s up to 1 Pbit/s."""
DURATION = Limit("duration", "ms", 0.0, 1e9)
"""Round-trip times: 0 up to 1e9 ms (11.6 days)."""
POSITIVE_DURATION = Limit("positive_duration", "ms", 0.0, 1e9, lo_open=True)
"""Latency SLOs: above 0 up to 1e9 ms."""
SIZE = Limit("size", "bytes", 0.0, 2.0 ** 60)
"""Device memory: 0 up to 2**60 bytes."""
GFLOPS = Limit("gflops", "GFLOP/s", 1e-6, 1e9)
"""Roofline device speed. The slowest (1 kFLOP/s) is slower than any real device and a
layer's FLOPs over it stay a finite time for any model (at 5e-324 GFLOP/s a layer
takes inf ms)."""
POWER = Limit("power", "W", 0.0, 1e9)
"""A roofline device's power figures."""
FIXED_MS = Limit("fixed_ms", "ms", 0.0, 1e9)
"""A roofline device's fixed ms per non-empty segment."""
LOSS = Limit("loss", "(fraction)", 0.0, 0.999)
"""Packet loss fraction."""
AGREEMENT = Limit("agreement", "(fraction)", 0.0, 1.0, lo_open=True)
"""An accuracy budget: the least agreement with the fp32 model a plan may have."""
DOWN_RATIO = Limit("down_ratio", "(downlink/uplink)", 1e-6, 1e6)
"""Downlink rate as a multiple of the uplink rate."""
MAX_SWEEP_POINTS = 2000
"""Most points one sweep may ask for (least: 2)."""
MAX_FIRST_K_LOCAL = 1_000_000
"""Largest ``first_k_local``."""
ENCODING_CHOICES = PRECISIONS + ("auto",)
"""What a request's ``encoding`` may be; 'auto' lets the solver pick the precision."""
FRONTIER_OBJECTIVES = (Objective.LATENCY.value, Objective.ENERGY.value)
"""Objectives a frontier covers: those affine in 1/bandwidth."""
ROOFLINE_KEYS = ("gflops", "fixed_ms", "compute_w", "radio_tx_w", "idle_w")
"""Keys of a roofline device spec; ``gflops`` is required."""
