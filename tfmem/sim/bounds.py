"""Lower bounds on the device peak: no rewrite tfmem can make goes below these.

Every op on the device needs its inputs, outputs and scratch there at once while it runs, and the fed tensors
the device holds are there throughout (``largest_working_set``). Ops on the host or on another device need
nothing of this device beyond the copies its own ops read (given a ``Placement``; without one every op counts). The device must also hold those bytes as TF's allocator lays them
out: the fed tensors, the first requests of every step, can take whole chunks near twice their size
(``fed_layout_floor``).
"""

from __future__ import annotations

from tfmem.ir.devices import Placement
from tfmem.ir.execution import ExecutionGraph
from tfmem.ir.graph import GraphIR, TensorRef
from tfmem.ir.ops import ALIAS_OPS
from tfmem.sim.bfc import INITIAL_REGION, MIN_ALLOCATION, BFCAllocator, rounded_bytes
from tfmem.sim.memsim import feed_orders
from tfmem.sim.opmemory import temp_bytes, viewed_input
from tfmem.units import format_bytes


def op_working_set_bytes(graph: GraphIR, name: str) -> int:
    """Bytes ``name`` needs on its device while it runs: distinct inputs, outputs and scratch."""
    node = graph[name]
    if node.op in ALIAS_OPS:
        return 0
    inputs = {t: graph.spec(t).nbytes or 0 for t in node.inputs}
    # an output that is a view of an input (IdentityN's, a slice's rows) holds no bytes of its own
    outputs = [s.nbytes or 0 for i, s in enumerate(node.outputs) if viewed_input(node, graph, i) is None]
    return sum(rounded_bytes(n) for n in (*inputs.values(), *outputs, *temp_bytes(node, graph)) if n)


def _on_device(eg: ExecutionGraph, placement: Placement | None, movable: frozenset[str] = frozenset()) -> set[str]:
    """The executed ops that run on the device (all of them without a placement), less ``movable``: ops a plan
    can run on the host instead."""
    if placement is None:
        return set(eg.needed) - movable
    return {name for name in eg.needed if placement.domain(eg.graph[name].device) == "device"} - movable


def _device_feeds(eg: ExecutionGraph, on_device: set[str]) -> dict[TensorRef, int]:
    """Bytes of each fed tensor the device holds: fed there, or read there (a copy arrives with the step)."""
    readers: set[TensorRef] = {t for name in on_device for t in eg.graph[name].inputs}
    return {t: rounded_bytes(eg.graph.spec(t).nbytes or 0) for t in eg.fed
            if t.node in on_device or t in readers}


def largest_working_set(eg: ExecutionGraph, placement: Placement | None = None,
                        movable: frozenset[str] = frozenset()) -> tuple[str, int]:
    """The executed device op with the largest working set, and that set's bytes, fed tensors included.

    Fed tensors arrive before the step and stay on the device to its end (TF never forwards or frees them
    early), so they count at every op, not only at the ops that read them. With ``placement``, ops on the host
    or another device do not count, nor fed tensors the device neither holds nor reads; nor ``movable`` ops.
    """
    on_device = _on_device(eg, placement, movable)
    fed = _device_feeds(eg, on_device)
    best = ("", 0)
    for name in eg.needed:
        if eg.unit_of[name] == name and name in on_device:
            node = eg.graph[name]
            size = op_working_set_bytes(eg.graph, name) if node.op not in ALIAS_OPS else 0
            size += sum(n for t, n in fed.items() if t not in node.inputs)
            if size > best[1]:
                best = (name, size)
    return best


def largest_unfed_working_set(eg: ExecutionGraph, placement: Placement | None = None,
                              movable: frozenset[str] = frozenset()) -> tuple[str, int]:
    """The executed device op whose working set, less the fed tensors it reads, is largest, and those bytes."""
    on_device = _on_device(eg, placement, movable)
    fed = _device_feeds(eg, on_device)
    best = ("", 0)
    for name in eg.needed:
        node = eg.graph[name]
        if eg.unit_of[name] != name or node.op in ALIAS_OPS or name not in on_device:
            continue
        size = op_working_set_bytes(eg.graph, name) - sum(fed.get(t, 0) for t in set(node.inputs))
        if size > best[1]:
            best = (name, size)
    return best


def fed_layout_floor(eg: ExecutionGraph, placement: Placement | None = None,
                     movable: frozenset[str] = frozenset()) -> tuple[int, str]:
    """The smallest device on which TF's allocator lays out the fed tensors and still has room for any op.

    The fed tensors are the first requests of every step, made in an order the session chooses
    (``tfmem.sim.memsim.feed_orders`` lists the ones the layout replay checks), and they stay to the step's end.
    BFC hands a request a whole free chunk unless the chunk is twice the request, so on a small device one
    feed can take everything the others left: an unrolled RNN fed ``x`` (6 MiB) then ``target`` (12 MiB)
    gives ``target`` the whole rest of a device under 32 MiB, and no op can run. Whatever else the step holds
    (persistent tensors, the plan's own tensors) only takes more, so no plan fits a smaller device than
    ``feeds_floor`` finds for the feeds and the largest working set less the fed tensors it reads
    (``largest_unfed_working_set``). Returns the bytes and why. With ``placement``, only the device's ops and
    the fed tensors it holds count; ``movable`` ops (a plan can run them on the host) do not.
    """

    fed = _device_feeds(eg, _on_device(eg, placement, movable))
    op, unfed = largest_unfed_working_set(eg, placement, movable)
    floor, split = feeds_floor([[fed[t] for t in order if t in fed] for order in feed_orders(eg)], unfed)
    if floor - unfed < unfed // 10:   # the feeds and the chunks they waste are small beside the op: name the op
        return floor, (f"the working set of {op or 'the largest op'} ({format_bytes(unfed)}: its inputs and outputs "
                       f"at once), with the fed tensors ({format_bytes(sum(fed.values()))})")
    if split:
        return floor, f"the fed tensors and the working set of {op or 'the largest op'}"
    sizes = ", ".join(f"{t} {format_bytes(fed[t])}" for t in sorted(fed, key=lambda t: -fed[t])[:3])
    return floor, (f"the fed tensors ({sizes}) laid out by TF's allocator, which hands a request a whole free "
                   f"chunk under twice its size, leave too little room for the working set of {op or 'any op'} "
                   f"({format_bytes(unfed)}) on a smaller device")


def feeds_floor(orders: list[list[int]], unfed: int, resolution: int = 4096) -> tuple[int, bool]:
    """A device size below which, for some order of the feed sizes in ``orders``, BFC cannot serve every feed and
    leave ``unfed`` bytes free; and whether that is just their sum (no chunk wasted).

    What is left free after the feeds grows with the device (each feed either splits its chunk off the rest or
    takes the rest whole), so the boundary is found by bisection, to ``resolution``; the bound returned is one
    byte above the largest size found too small, so it never overstates.

    Examples
    --------
    >>> MiB = 2**20
    >>> x, target = 6 * MiB, 12 * MiB      # an unrolled RNN's feeds, in both orders; ops need 4 MiB more
    >>> floor, _ = feeds_floor([[x, target], [target, x]], 4 * MiB)
    >>> round(floor / MiB, 2)              # 2 MiB first region + x + twice target: target's chunk then splits
    32.0
    >>> round(feeds_floor([[x]], 4 * MiB)[0] / MiB, 2)   # not 10: x would take a region of 8 MiB whole
    14.0
    """
    unfed = max(unfed, MIN_ALLOCATION)  # some op always runs
    total = max((sum(o) for o in orders), default=0) + unfed
    if feeds_fit(orders, unfed, total):
        return total, True
    low, high = total, 2 * total + INITIAL_REGION    # at ``high`` every feed splits off its chunk
    while high - low > resolution:
        middle = (low + high) // 2
        if feeds_fit(orders, unfed, middle):
            high = middle
        else:
            low = middle
    return low + 1, False


def feeds_fit(orders: list[list[int]], unfed: int, device: int) -> bool:
    """Whether, in every order, a BFC device of ``device`` bytes serves each feed and leaves ``unfed`` bytes free."""
    for order in orders:
        bfc = BFCAllocator(limit_bytes=device)
        for nbytes in order:
            bfc.allocate(nbytes)
        if bfc.failures or device - bfc.in_use_bytes < max(unfed, MIN_ALLOCATION):
            return False
    return True
