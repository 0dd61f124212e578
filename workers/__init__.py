"""Segment engines on ONNX Runtime, profiling, quantisation, batching and Ray actors.

Importing the package is cheap: its modules are imported by name
(`workers.engine`, `workers.actors`, ...). The names below are the ones other
packages share from workers' private modules.
"""

from workers._malloc import freed_memory_kept_by_default, keep_freed_memory

__all__ = ["freed_memory_kept_by_default", "keep_freed_memory"]
