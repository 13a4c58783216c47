"""Merging of relaxed arrays (Buffers, data-parallel arrays): private copies, additive merges.

Each worker updates its own copy; at a merge every worker's net change since the last merge is added
to the shared array, in worker order, and the copies are refreshed.  The local and the Ray executor both
use ``merge_into`` so their arithmetic, and hence their results, are identical.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def merge_into(shared: np.ndarray, base: np.ndarray, copies: Sequence[np.ndarray]) -> None:
    """``shared += sum(copy - base)`` in worker order; then ``base`` and ``shared`` agree again.

    Examples
    --------
    >>> shared = np.array([10, 10]); base = shared.copy()
    >>> merge_into(shared, base, [np.array([11, 10]), np.array([10, 13])])
    >>> shared.tolist(), base.tolist()
    ([11, 13], [11, 13])
    """
    for c in copies:
        shared += c - base
    base[...] = shared


def sync_every(relaxed: Mapping[str, int]) -> int | None:
    """Steps between merges: the smallest ``max_delay`` (merging early never breaks a bound)."""
    return min(relaxed.values()) if relaxed else None
