"""The graph layer: the immutable graph IR and what reads, edits, loads and checks it.

``graph.py`` holds ``GraphIR``; ``ops.py`` is the one table of what tfmem knows about op types. Nothing here
simulates or measures: ``tfmem.sim`` sits on top. Layer: imports only the base modules ``tfmem.errors`` and
``tfmem.units`` (``tests/test_layers.py``).
"""

from tfmem.ir.graph import GraphIR, OpNode, TensorRef, TensorSpec

__all__ = ["GraphIR", "OpNode", "TensorRef", "TensorSpec"]
