"""A model of TensorFlow's BFC ("best-fit with coalescing") allocator, for byte-exact peak accounting.

Peaks that TensorFlow reports are sums of *chunk* sizes, not of tensor sizes: a request is rounded up to
256 bytes, served by the smallest free chunk that fits, and that chunk is split only when it is at least
twice the request (or more than 128 MiB too big). A 3.2 MB gradient served from a 4 MiB free chunk
therefore counts 4 MiB. Memory grows in regions (2 MiB first, doubling) whose chunks never merge across
region boundaries. This class replays allocations and frees with those rules.

Examples
--------
>>> bfc = BFCAllocator()
>>> a = bfc.allocate(4 << 20)
>>> keep = bfc.allocate(4 << 20)     # keeps the freed 4 MiB from merging with the rest of the region
>>> bfc.free(a)
>>> b = bfc.allocate(3_200_000)      # reuses the free 4 MiB chunk whole: 3.2 MB is more than half of it
>>> bfc.in_use_bytes                  # 4 MiB + the 4 MiB kept
8388608
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

MIN_ALLOCATION = 256
NUM_BINS = 21
MAX_INTERNAL_FRAGMENTATION = 128 << 20
INITIAL_REGION = 2 << 20


def rounded_bytes(nbytes: int) -> int:
    """Bytes the BFC allocator reserves for a request of ``nbytes`` (before chunk reuse)."""
    return max(MIN_ALLOCATION, -(-nbytes // MIN_ALLOCATION) * MIN_ALLOCATION)


def _bin(size: int) -> int:
    return min(max(size // MIN_ALLOCATION, 1).bit_length() - 1, NUM_BINS - 1)


@dataclass
class _Chunk:
    ptr: int
    size: int
    region: int
    in_use: bool = False
    prev: _Chunk | None = None
    next: _Chunk | None = None


class BFCAllocator:
    """Replays BFC allocation; ``in_use_bytes`` and ``peak_bytes`` match TF's ``get_memory_info``."""

    def __init__(self, limit_bytes: int = 1 << 50, allow_growth: bool = False) -> None:
        # The testbed's device reserves its budget up front: a first 2 MiB region, then one region of the rest
        # (a GPU's BFC is one region of the whole memory). allow_growth starts at 2 MiB and doubles instead.
        self.limit_bytes = limit_bytes
        self.region_bytes = 0
        self.next_region = INITIAL_REGION
        self.bins: list[list[tuple[int, int]]] = [[] for _ in range(NUM_BINS)]  # sorted (size, ptr)
        self.free_chunks: dict[int, _Chunk] = {}
        self.in_use_bytes = 0
        self.peak_bytes = 0
        self._handles: dict[int, _Chunk] = {}
        self._next_handle = 0
        self.failures = 0          # requests no free chunk could serve within the limit (TF: out of memory)
        if not allow_growth:  # TF's first region (2 MiB), then the rest in one: what the testbed reserves
            self._extend(INITIAL_REGION)
            rest = limit_bytes - self.region_bytes
            if rest > 0:  # none when the limit is 2 MiB or less (a region of 0 bytes would never grow)
                self.next_region = rest
                self._extend(rest)

    def allocate(self, nbytes: int) -> int:
        """Allocate ``nbytes``; returns a handle for ``free``."""
        size = rounded_bytes(nbytes)
        chunk = self._find(size)
        if chunk is None:
            self._extend(size)
            chunk = self._find(size)
        if chunk is None:  # beyond the limit: count it anyway so the simulator can report the overshoot
            self.failures += 1
            chunk = _Chunk(-1 - self._next_handle, size, -1)
        chunk.in_use = True
        self.in_use_bytes += chunk.size
        self.peak_bytes = max(self.peak_bytes, self.in_use_bytes)
        self._next_handle += 1
        self._handles[self._next_handle] = chunk
        return self._next_handle

    def free(self, handle: int) -> None:
        chunk = self._handles.pop(handle)
        chunk.in_use = False
        self.in_use_bytes -= chunk.size
        if chunk.region < 0:
            return
        after = chunk.next
        if after is not None and not after.in_use:
            self._unbin(after)
            self._merge(chunk, after)
        before = chunk.prev
        if before is not None and not before.in_use:
            self._unbin(before)
            chunk = self._merge(before, chunk)
        self._bin_chunk(chunk)

    def _find(self, size: int) -> _Chunk | None:
        for b in range(_bin(size), NUM_BINS):
            entries = self.bins[b]
            i = bisect.bisect_left(entries, (size, -(1 << 62)))
            if i < len(entries):
                chunk = self.free_chunks[entries[i][1]]
                self._unbin(chunk)
                if chunk.size >= 2 * size or chunk.size - size >= MAX_INTERNAL_FRAGMENTATION:
                    self._split(chunk, size)
                return chunk
        return None

    def _extend(self, size: int) -> None:
        available = self.limit_bytes - self.region_bytes
        grew = False
        while size > self.next_region:
            self.next_region *= 2
            grew = True
        nbytes = min(self.next_region, available)
        if nbytes < size:
            return
        if not grew:
            self.next_region *= 2
        chunk = _Chunk(self.region_bytes, nbytes, self.region_bytes)
        self.region_bytes += nbytes
        self._bin_chunk(chunk)

    def _split(self, chunk: _Chunk, size: int) -> None:
        rest = _Chunk(chunk.ptr + size, chunk.size - size, chunk.region, prev=chunk, next=chunk.next)
        if chunk.next is not None:
            chunk.next.prev = rest
        chunk.next, chunk.size = rest, size
        self._bin_chunk(rest)

    def _merge(self, first: _Chunk, second: _Chunk) -> _Chunk:
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        return first

    def _bin_chunk(self, chunk: _Chunk) -> None:
        self.free_chunks[chunk.ptr] = chunk
        bisect.insort(self.bins[_bin(chunk.size)], (chunk.size, chunk.ptr))

    def _unbin(self, chunk: _Chunk) -> None:
        entries = self.bins[_bin(chunk.size)]
        del entries[bisect.bisect_left(entries, (chunk.size, chunk.ptr))]
        del self.free_chunks[chunk.ptr]
