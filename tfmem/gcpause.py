"""Run large graph rewrites without Python's cyclic garbage collector pausing them.

``optimize`` builds hundreds of thousands of small immutable objects (nodes, tensor refs, schedules) in a
process that already holds TensorFlow's millions. Each automatic collection walks the whole heap, about a
third of ``optimize``'s time on the 20,000-op graph of ``python -m experiments.optimize_speed``.
What tfmem builds is freed by reference counting (it makes no cycles worth collecting), so collection is
switched off for the duration and restored afterwards, whatever its state was.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def without_gc_pauses(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorate ``fn`` so the cyclic collector is off while it runs (re-enabled after, if it was on).

    Examples
    --------
    >>> @without_gc_pauses
    ... def collector_on() -> bool:
    ...     return gc.isenabled()
    >>> collector_on(), gc.isenabled()
    (False, True)
    """

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()

    return wrapper
