"""tfmem: run TensorFlow graphs that do not fit in accelerator memory.

Public surface::

    tfmem.load(graph, feed_shapes)            -> GraphIR with dtype/shape/bytes on every tensor
    tfmem.simulate(graph, fetches, ...)       -> MemoryProfile (peak, live tensors at the peak, timeline)
    tfmem.optimize(graph, fetches, budget=...) -> Optimized(graph, graph_def, config, report)
    tfmem.measure.grappler_peak(...)          -> TensorFlow's own estimate, to cross-check
    tfmem.testbed.Testbed(...)                -> real execution on an emulated, memory-capped accelerator
"""

from __future__ import annotations

from tfmem.errors import (
    BadInputError,
    InfeasibleBudgetError,
    MalformedGraphError,
    PassError,
    ScheduleError,
    TestbedError,
    TfmemError,
    UnknownShapeError,
    UnsupportedOpError,
)
from tfmem.ir import GraphIR, OpNode, TensorRef, TensorSpec
from tfmem.loading import load
from tfmem.memsim import LiveTensor, MemoryProfile, simulate
from tfmem.optimize import Optimized, optimize
from tfmem.units import format_bytes, parse_bytes

__all__ = [
    "BadInputError", "GraphIR", "InfeasibleBudgetError", "LiveTensor", "MalformedGraphError", "MemoryProfile",
    "OpNode", "Optimized", "PassError", "ScheduleError", "TensorRef", "TensorSpec", "TestbedError", "TfmemError",
    "UnknownShapeError", "UnsupportedOpError", "format_bytes", "load", "optimize", "parse_bytes", "simulate",
]
__version__ = "0.1.0"
