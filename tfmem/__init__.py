"""tfmem: run TensorFlow graphs that do not fit in accelerator memory.

Public surface::

    tfmem.load(graph, feed_shapes)            -> GraphIR with dtype/shape/bytes on every tensor
    tfmem.simulate(graph, fetches, ...)       -> MemoryProfile (peak, live tensors at the peak, timeline)
    tfmem.optimize(graph, fetches, budget=...) -> Optimized(graph, graph_def, config, report)
    tfmem.unoptimized_profile(graph, fetches) -> MemoryProfile: optimize's "before", what `tfmem analyze` shows
    tfmem.function(step, budget=...)          -> PlannedFunction: a TF2 step planned to fit, on the same variables
    tfmem.on_host(host)                       -> a scope: TF2 variables made in it live in host memory
    tfmem.measure.grappler_peak(...)          -> TensorFlow's own estimate, to cross-check
    tfmem.testbed.Testbed(...)                -> real execution on an emulated, memory-capped accelerator

Names that need TensorFlow are imported on first use (PEP 562), so ``import tfmem`` is cheap and a program
(the CLI) can still set TensorFlow's environment variables after it.
"""

from __future__ import annotations

import importlib
from typing import Any

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
from tfmem.units import format_bytes, parse_bytes

_LAZY = {
    "GraphIR": "tfmem.ir.graph", "OpNode": "tfmem.ir.graph", "TensorRef": "tfmem.ir.graph", "TensorSpec": "tfmem.ir.graph",
    "load": "tfmem.ir.loading",
    "LiveTensor": "tfmem.sim.profile", "MemoryProfile": "tfmem.sim.profile", "simulate": "tfmem.sim.memsim",
    "Optimized": "tfmem.optimizer", "optimize": "tfmem.optimizer", "unoptimized_profile": "tfmem.optimizer",
    "function": "tfmem.planned_function", "PlannedFunction": "tfmem.planned_function",
    "on_host": "tfmem.host_variables",
}

__all__ = [
    "BadInputError", "InfeasibleBudgetError", "MalformedGraphError", "PassError", "ScheduleError", "TestbedError",
    "TfmemError", "UnknownShapeError", "UnsupportedOpError", "format_bytes", "parse_bytes", *_LAZY,
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tfmem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
