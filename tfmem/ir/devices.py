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

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from tfmem.errors import BadInputError, first_line

# Where an op with no device runs when nobody says otherwise (Grappler's fusions depend on the device type).
DEFAULT_DEVICE = "/device:CPU:0"
# Job names and device types as TensorFlow's C++ parser (DeviceNameUtils::ParseFullName) accepts them; Python's
# DeviceSpec is laxer ('/job:a b', '/CPU:-1'), and the C++ side fails later, far from the argument.
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_DEVICE_EXAMPLES = "'/GPU:0', '/device:CPU:0' or '/job:worker/replica:0/task:0/device:CPU:0'"


def check_device(value: object, what: str = "device") -> str | None:
    """Return ``value`` if it is None or a device string TensorFlow can parse; raise ``BadInputError`` otherwise.

    Examples
    --------
    >>> check_device("/GPU:0")
    '/GPU:0'
    >>> check_device("@@", "host")
    Traceback (most recent call last):
    ...
    tfmem.errors.BadInputError: host '@@' is not a device string (Unknown attribute '@@' is encountered while parsing the device spec: '@@'.); write e.g. '/GPU:0', '/device:CPU:0' or '/job:worker/replica:0/task:0/device:CPU:0'
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise BadInputError(f"{what} must be a device string such as {_DEVICE_EXAMPLES}, got {value!r} "
                            f"({type(value).__name__})")
    problem = _device_problem(value)
    if problem:
        raise BadInputError(f"{what} {value!r} is not a device string ({problem}); write e.g. {_DEVICE_EXAMPLES}")
    return value


def check_devices(devices: object, device: object = None, host: object = None) -> list[tuple[str, str | None]]:
    """``optimize``'s ``devices=`` as (device, host) pairs in the order given; ``BadInputError`` when it is not a
    non-empty mapping of distinct device strings to host device strings (or None), when a host names one of the
    devices, or when ``device=``/``host=`` is given too.

    Examples
    --------
    >>> check_devices({"/job:worker/task:0": "/job:host/task:0", "/job:worker/task:1": None})
    [('/job:worker/task:0', '/job:host/task:0'), ('/job:worker/task:1', None)]
    >>> check_devices({"/job:worker/task:0": "/job:worker/task:0"})
    Traceback (most recent call last):
    ...
    tfmem.errors.BadInputError: devices: the host of '/job:worker/task:0' is '/job:worker/task:0', which can name a device being planned; swapped tensors must leave the devices: give each device a host on no device's name, e.g. {'/job:worker/task:0/device:GPU:0': '/job:worker/task:0/device:CPU:0'}
    """
    example = "{'/job:worker/task:0/device:GPU:0': '/job:worker/task:0/device:CPU:0'}"
    if device is not None or host is not None:
        raise BadInputError("give devices= (each device mapped to its host) or device=/host= (one device), not "
                            f"both; e.g. devices={example}")
    if not isinstance(devices, Mapping) or not devices:
        raise BadInputError(f"devices must be a non-empty dict of device strings to host device strings (or None), "
                            f"got {devices!r}; e.g. {example}")
    pairs: list[tuple[str, str | None]] = []
    for d, h in devices.items():
        pairs.append((str(check_device(d, "a key of devices")), check_device(h, f"the host of {d!r} in devices")))
    for i, (d, _) in enumerate(pairs):
        for other, _ in pairs[:i]:
            if same_device(d, other):
                raise BadInputError(f"devices: {other!r} and {d!r} can name the same device; give each device once, "
                                    "with its job, task and device, e.g. '/job:worker/task:1/device:GPU:0'")
    for d, h in pairs:
        clash = next((other for other, _ in pairs if h is not None and same_device(h, other)), None)
        if clash is not None:
            raise BadInputError(f"devices: the host of {d!r} is {h!r}, which can name a device being planned; "
                                "swapped tensors must leave the devices: give each device a host on no device's "
                                f"name, e.g. {example}")
    return pairs


@lru_cache(maxsize=1024)
def _device_problem(name: str) -> str:
    """Why TensorFlow would reject the device string ``name`` ("" when it would not)."""
    problem = device_parse_error(name)
    if problem:
        return problem
    spec = tf.DeviceSpec.from_string(name)
    for field, value in (("job", spec.job), ("device type", spec.device_type)):
        if value is not None and value != "*" and not _NAME.match(str(value)):
            return f"{field} {value!r} must be a letter followed by letters, digits or '_'"
    for field, number in (("replica", spec.replica), ("task", spec.task), ("device index", spec.device_index)):
        if number is not None and number != "*" and int(number) < 0:
            return f"{field} must not be negative"
    return ""


@lru_cache(maxsize=4096)
def device_parse_error(name: str) -> str:
    """The first line of the error ``tf.DeviceSpec`` raises for ``name`` ("" when it parses).

    ``GraphIR.from_graph_def`` checks every op's device with it, so that ``same_device`` never fails later.
    """
    try:
        tf.DeviceSpec.from_string(name)
    except Exception as e:  # ValueError, and TypeError for some malformed fields
        return first_line(e)
    return ""


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
