"""Measured profiles: per-layer time of a model on this host, from ONNX Runtime's profiler.

`measure_profile` is the entry point; `measure` also returns how much of the kernel
time could be placed on layers and the segment timings behind the corrections.
The parsing and fitting steps are pure and public for tests and tools.
"""

from workers.profile._calibrate import SegmentTiming, add_random_cuts, calibration_cuts, fit_corrections, spread_cuts
from workers.profile._trace import (
    Attribution,
    KernelEvent,
    ProfilingError,
    RunTrace,
    attribute_runs,
    map_nodes,
    parse_trace,
    resolve_name,
)
from workers.profile.measure import (
    Measurement,
    SegmentJob,
    load_profile,
    measure,
    measure_profile,
    open_session,
    prepare_model,
    segment_jobs,
    time_interleaved,
    time_segments,
)

__all__ = [
    "Attribution", "KernelEvent", "Measurement", "ProfilingError", "RunTrace", "SegmentJob", "SegmentTiming",
    "add_random_cuts", "attribute_runs", "calibration_cuts", "fit_corrections", "load_profile", "map_nodes",
    "measure", "measure_profile", "open_session", "parse_trace", "prepare_model", "resolve_name", "segment_jobs",
    "spread_cuts", "time_interleaved", "time_segments",
]
