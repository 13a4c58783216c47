"""The checks ``simulate`` runs on its arguments before any work, so that a bad one fails by name.

Each value is checked where it first enters; ``tfmem.optimize`` runs the same checks on the arguments it shares.
"""

from __future__ import annotations

import operator
from typing import SupportsIndex

from tfmem.errors import BadInputError
from tfmem.ir.devices import check_device
from tfmem.ir.execution import fetch_names
from tfmem.ir.shapes import check_feed_shapes
from tfmem.units import parse_bytes

# More inter-op threads than any machine runs; the executor's emulation keeps a queue per thread.
MAX_THREADS = 4096


def checked_arguments(fetches: object, feed_shapes: object, device: object, host: object,
                      device_memory: int | str | None = None, inter_op_threads: object = 1,
                      ) -> tuple[list[str], dict[str, tuple[int, ...]] | None, int | None]:
    """The fetches as names, the feed shapes as ``{"x:0": (d1, ...)}`` (None when there are none) and the device
    memory in bytes; raises ``BadInputError`` naming the first argument that is malformed.

    Examples
    --------
    >>> checked_arguments("y:0", {"x": [2, 3]}, "/CPU:0", None, "4MiB")
    (['y:0'], {'x:0': (2, 3)}, 4194304)
    """
    names = fetch_names(fetches)
    shapes = check_feed_shapes(feed_shapes) or None
    check_device(device, "device")
    check_device(host, "host")
    memory = None if device_memory is None else parse_bytes(device_memory, what="device_memory", minimum=1)
    check_count(inter_op_threads, "inter_op_threads", minimum=1)
    return names, shapes, memory


def check_count(value: object, what: str, minimum: int = 0, maximum: int = MAX_THREADS) -> int:
    """Return ``value`` if it is an int from ``minimum`` to ``maximum`` (not a bool); raise ``BadInputError`` otherwise.

    >>> check_count(-1, "inter_op_threads")
    Traceback (most recent call last):
    ...
    tfmem.errors.BadInputError: inter_op_threads must be an int from 0 to 4096, got -1
    """
    if (isinstance(value, bool) or not isinstance(value, SupportsIndex)
            or not minimum <= operator.index(value) <= maximum):
        raise BadInputError(f"{what} must be an int from {minimum} to {maximum}, got {value!r}")
    return operator.index(value)  # ints and numpy ints
