"""What a simulation returns: the step's memory profile, with the tensors live at its peak."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from tfmem.ir.graph import OpNode
from tfmem.ir.shapes import dtype_size
from tfmem.sim.schedule import Schedule


@dataclass(frozen=True)
class LiveTensor:
    """A buffer live at the peak, named by the first tensor that owns it."""

    tensor: str
    nbytes: int
    producer: str          # op type of the producing node
    consumers: tuple[str, ...]
    kind: str              # "transient", "persistent", "fed", "fetched", "copy" or "scratch"


@dataclass(frozen=True)
class MemoryProfile:
    """One simulated step: peaks, what is live at the device peak, and the memory timeline.

    ``timeline`` holds ``(time_s, device_bytes, host_bytes, unit)`` after each allocation or free, with times
    from the cost model (``tfmem.sim.costmodel``), so the plot and trace show a plausible pace.
    """

    peak_bytes: int
    peak_unit: str
    peak_time_s: float
    live_at_peak: tuple[LiveTensor, ...]
    persistent_bytes: int
    host_peak_bytes: int
    host_persistent_bytes: int
    timeline: tuple[tuple[float, int, int, str], ...]
    schedule: Schedule
    instrument: str = "simulator"
    notes: tuple[str, ...] = ()
    estimated_step_s: float = 0.0   # cost-model step time with intra-op parallelism (see step_time_estimate)
    allocation_failures: int = 0    # with ``device_memory``: requests no chunk could serve (out of memory)

    @property
    def transient_peak_bytes(self) -> int:
        return self.peak_bytes - self.persistent_bytes


def variable_bytes(node: OpNode) -> int:
    """Bytes of the storage a ``VarHandleOp`` declares (0 when its shape is not fully known)."""
    return declared_variable_bytes(node.attrs)


def declared_variable_bytes(attrs: Mapping[str, attr_value_pb2.AttrValue]) -> int:
    shape = tf.TensorShape(attrs["shape"].shape) if "shape" in attrs else tf.TensorShape(None)
    if not shape.is_fully_defined() or "dtype" not in attrs:
        return 0
    count = 1
    for d in shape.as_list():
        count *= d
    return count * dtype_size(tf.as_dtype(attrs["dtype"].type))
