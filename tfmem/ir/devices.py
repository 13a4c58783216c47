"""Device strings: which memory (device, host, or neither) an op's device string puts it in.

Examples
--------
>>> p = Placement("/job:worker/replica:0/task:0/device:CPU:0", "/job:host/replica:0/task:0/device:CPU:0")
>>> p.domain("/job:host/replica:0/task:0/device:CPU:0"), p.domain(""), p.domain("/job:other/device:CPU:0")
('host', 'device', 'other')
>>> Placement("/GPU:0", "/CPU:0").domain("/device:GPU:0")
'device'
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import tensorflow as tf
from tensorflow.core.framework import graph_pb2

# Where an op with no device runs when nobody says otherwise (Grappler's fusions depend on the device type).
DEFAULT_DEVICE = "/device:CPU:0"


def same_device(a: str, b: str) -> bool:
    """True when ``a`` and ``b`` name the same device, fields absent in either being wildcards."""
    sa, sb = tf.DeviceSpec.from_string(a), tf.DeviceSpec.from_string(b)
    for field in ("job", "replica", "task", "device_type", "device_index"):
        va, vb = getattr(sa, field), getattr(sb, field)
        if va is not None and vb is not None and str(va).upper() != str(vb).upper():
            return False
    return True


@dataclass(frozen=True)
class Placement:
    """Classifies device strings as the simulated ``device``, the ``host``, or ``other``.

    An op with no device runs on the default device, which is the simulated device. With ``device=None``
    every op not on ``host`` counts as the device.
    """

    device: str | None = None
    host: str | None = None

    def domain(self, op_device: str) -> str:
        return _domain(op_device, self.device, self.host)


@lru_cache(maxsize=65536)
def _domain(op_device: str, device: str | None, host: str | None) -> str:
    if not op_device:
        return "device"
    if host and same_device(op_device, host):
        return "host"
    if device is None or same_device(op_device, device):
        return "device"
    return "other"


def with_default_device(graph_def: graph_pb2.GraphDef, device: str) -> graph_pb2.GraphDef:
    """A copy of ``graph_def`` in which every op without a device is placed on ``device``."""
    out = graph_pb2.GraphDef()
    out.CopyFrom(graph_def)
    for node in out.node:
        if not node.device:
            node.device = device
    return out
