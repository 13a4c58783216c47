"""The per-graph half of a simulation, cached, and the cost-model step-time estimate.

Passes simulate one graph many times (candidate orders, candidate parallelism limits); what depends only on
the graph -- its execution graph, per-unit durations, which ops TF would treat as expensive -- is computed
once per graph and fetches and kept here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from tfmem.errors import ScheduleError
from tfmem.ir.devices import Placement
from tfmem.ir.execution import ExecutionGraph
from tfmem.ir.graph import GraphIR, TensorRef
from tfmem.ir.ops import ALIAS_OPS, BUFFER_FORWARDING_INPUTS, PERSISTENT_OUTPUT_OPS, VARIABLE_READ_OPS
from tfmem.ir.shapes import require_known
from tfmem.sim import costmodel
from tfmem.sim.graphcache import GraphCache
from tfmem.sim.opmemory import VIEW_RULES, temp_bytes, viewed_input
from tfmem.sim.schedule import Schedule
from tfmem.sim.tensor_list_memory import ListHoldings, list_holdings


@dataclass(frozen=True)
class Analysis:
    ir: GraphIR                      # the graph analysed (``views`` reads it)
    eg: ExecutionGraph
    durations: dict[str, float]
    expensive: dict[str, bool]       # TF's executor hands it to the thread pool (``costmodel.is_expensive``)
    parallel: dict[str, bool]        # big enough to use the intra-op threads (the step-time estimate)

    @cached_property
    def schedules(self) -> dict[tuple[bool, int], Schedule]:
        """Emulated schedules by (GPU?, inter-op threads), kept by ``tfmem.sim.memsim.simulate``."""
        return {}

    @cached_property
    def drawn_schedules(self) -> dict[tuple[bool, int], tuple[Schedule, ...]]:
        """Every distinct emulated schedule over the draws of TF's hashed orders, by (GPU?, inter-op threads)."""
        return {}

    @cached_property
    def transfers(self) -> dict[tuple[object, ...], dict[str, list[Transfer]]]:
        """``transfers_into`` results by (placement, link), kept by ``tfmem.sim.memsim.simulate``."""
        return {}

    @cached_property
    def bystanders(self) -> dict[Placement, frozenset[str]]:
        """``tfmem.sim.replay.bystanders`` by placement, kept by ``tfmem.sim.memsim.simulate``."""
        return {}

    @cached_property
    def lists(self) -> ListHoldings:
        """The items each list handle holds (``tfmem.sim.tensor_list_memory``)."""
        return list_holdings(self.eg)

    @cached_property
    def footprints(self) -> FootprintModel:
        return FootprintModel(self.eg, self.lists)

    @cached_property
    def views(self) -> dict[TensorRef, int]:
        """Outputs that are views into an input's buffer (``tfmem.sim.opmemory.VIEW_RULES``): tensor -> input."""
        out = {}
        for u in self.eg.units:
            if not self.eg.is_region(u) and self.ir[u].op in VIEW_RULES:
                for t in self.eg.outputs_of(u):
                    viewed = viewed_input(self.ir[u], self.ir, t.index)
                    if viewed is not None:
                        out[t] = viewed
        return out


_ANALYSES: GraphCache[Analysis] = GraphCache(kept=8)


def analyse(ir: GraphIR, fetches: list[str], feeds: list[str], device: costmodel.DeviceSpec) -> Analysis:
    """The per-graph part of a simulation, cached: passes simulate one graph many times (orders, k values)."""
    key = (tuple(fetches), tuple(sorted(feeds)), device)
    cached = _ANALYSES.get(ir, key)
    if cached is not None:
        return cached
    eg = ExecutionGraph.build(ir, fetches, feeds)
    require_known(ir, _sized_tensors(eg))
    durations = {u: unit_time_s(eg, u, device) for u in eg.units}
    parallel = {u: eg.is_region(u) or costmodel.uses_intra_op_threads(ir[u], ir, device) for u in eg.units}
    analysis = Analysis(ir, eg, durations, expensive_of(eg, ir, device, gpu=False), parallel)
    _ANALYSES.put(ir, key, analysis)
    return analysis


def expensive_of(eg: ExecutionGraph, ir: GraphIR, device: costmodel.DeviceSpec, gpu: bool) -> dict[str, bool]:
    """Per unit: would TF's executor treat it as expensive (hand it to another thread)?"""
    return {u: not gpu and (eg.is_region(u) or costmodel.is_expensive(ir[u], ir, device)) for u in eg.units}


@dataclass(frozen=True)
class Transfer:
    """One host<->device copy a unit waits for: the tensor, its producer's unit, seconds, and the direction."""

    tensor: TensorRef
    producer: str
    seconds: float
    to_host: bool


def transfers_into(eg: ExecutionGraph, placement: Placement, device: costmodel.DeviceSpec,
                   ) -> dict[str, list[Transfer]]:
    """Per unit, the copies over ``device``'s link that it waits for (inputs made in the other memory domain).

    Fed tensors are left out: every plan of a graph feeds the same ones.
    """
    domain = {u: placement.domain(eg.graph[eg.members[u][0]].device) for u in eg.units}
    out: dict[str, list[Transfer]] = {}
    for u in eg.units:
        for t in eg.unit_inputs[u]:
            p = eg.unit_of.get(t.node)
            if p is None or t in eg.fed or {domain[p], domain[u]} != {"device", "host"}:
                continue
            seconds = device.transfer_s(eg.graph.spec(t).nbytes or 0)
            out.setdefault(u, []).append(Transfer(t, p, seconds, domain[u] == "host"))
    return out


def step_time_estimate(eg: ExecutionGraph, durations: dict[str, float], parallel: dict[str, bool],
                       cores: int, transfers: Mapping[str, Sequence[Transfer]] | None = None,
                       transfer_cpu_share: float = 0.0) -> float:
    """Step time if big ops spread over ``cores`` (intra-op parallelism) and ops share the cores.

    The largest of three bounds: the critical path (big ops at ``cores``-fold speed, small ones on one core,
    each host<->device copy on the edges it feeds), the total work over ``cores``, and the busier direction of
    the link (it carries one copy at a time each way). A copy also takes ``transfer_cpu_share`` of the cores for
    its whole link time (0 for a DMA engine; on the testbed the "link" is gRPC between two processes on the
    same cores, and each copy keeps both ends busy). Limiting inter-op parallelism costs time only where it
    lengthens the critical path. ``transfers`` comes from ``transfers_into``; a tensor that several units on
    the other side read is copied once.
    """
    transfers = transfers or {}
    finish: dict[str, float] = {}
    for u in _topological(eg):  # GraphDef order need not be topological
        own = durations[u] / cores if parallel[u] else durations[u]
        ready = max((finish[p] for p in eg.unit_preds[u]), default=0.0)
        for copy in transfers.get(u, ()):
            ready = max(ready, finish.get(copy.producer, 0.0) + copy.seconds)
        finish[u] = own + ready
    critical = max(finish.values(), default=0.0)
    copies = {(c.tensor, c.to_host): c.seconds for into in transfers.values() for c in into}
    work = sum(durations.values()) + transfer_cpu_share * cores * sum(copies.values())
    link = max(sum(s for (_, to_host), s in copies.items() if to_host == d) for d in (False, True))
    return max(critical, work / cores, link)


def _topological(eg: ExecutionGraph) -> list[str]:
    pending = {u: len(eg.unit_preds[u]) for u in eg.units}
    ready = [u for u in eg.units if pending[u] == 0]
    order = []
    while ready:
        u = ready.pop()
        order.append(u)
        for s in eg.unit_succs[u]:
            pending[s] -= 1
            if pending[s] == 0:
                ready.append(s)
    return order


def _sized_tensors(eg: ExecutionGraph) -> list[TensorRef]:
    out: list[TensorRef] = []
    for u in eg.units:
        if not eg.is_region(u):
            out.extend(t for t in eg.outputs_of(u) if eg.graph[t.node].op not in ALIAS_OPS)
    return out


def units_in(eg: ExecutionGraph, order: Sequence[str]) -> list[str]:
    units = list(dict.fromkeys(eg.unit_of[n] for n in order if n in eg.unit_of))
    given = set(units)
    missing = [u for u in eg.units if u not in given]
    if missing:
        raise ScheduleError(f"order omits {len(missing)} executed op(s), e.g. {', '.join(missing[:5])}")
    return units


def unit_time_s(eg: ExecutionGraph, unit: str, device: costmodel.DeviceSpec) -> float:
    return sum(costmodel.op_time_s(eg.graph[n], eg.graph, device) for n in eg.members[unit])


@dataclass(frozen=True)
class OrderFootprint:
    """A cheap liveness model of one sequential order, and a bound for running slices of it concurrently.

    ``alloc[i]`` is what unit ``order[i]`` adds while it runs: its new output buffers and its scratch
    (aliases, constants, variable reads and outputs written in place into a dying input add nothing).
    ``carried[i]`` is the bytes of transient buffers made before unit ``i`` and still needed at or after it
    (fetched tensors stay to the end). Persistent and fed bytes are left out, and sizes are not rounded as
    the allocator would: this ranks orders and bounds partitions; the simulator stays the measure.

    Examples
    --------
    >>> fp = OrderFootprint(("a", "b", "c"), alloc=(4, 4, 2), carried=(0, 4, 8))
    >>> fp.peak_bytes          # c runs while a's and b's outputs are alive: 8 + 2
    10
    >>> fp.slice_bound(1, 3)   # b and c in any interleaving, a done: a's output + everything b and c add
    10
    """

    order: tuple[str, ...]
    alloc: tuple[int, ...]
    carried: tuple[int, ...]

    @cached_property
    def _prefix(self) -> tuple[int, ...]:
        acc, out = 0, [0]
        for a in self.alloc:
            acc += a
            out.append(acc)
        return tuple(out)

    @cached_property
    def peak_bytes(self) -> int:
        """Transient peak of running the order on one thread."""
        return max((c + a for c, a in zip(self.carried, self.alloc, strict=True)), default=0)

    def slice_bound(self, start: int, stop: int) -> int:
        """Transient bytes live at most while ``order[start:stop]`` run in any interleaving (all units
        before ``start`` done, none after ``stop`` started)."""
        return self.carried[start] + self._prefix[stop] - self._prefix[start]


def order_footprint(eg: ExecutionGraph, order: Sequence[str]) -> OrderFootprint:
    """The ``OrderFootprint`` of running the units ``order`` one at a time, in that order.

    Follows the simulator's rules without its allocator: a buffer is freed after its last reader, aliases
    (``ALIAS_OPS``, ``ReadVariableOp``) and views (``tfmem.sim.opmemory.VIEW_RULES``) share their input's buffer,
    and element-wise ops write into an input buffer they are the last reader of
    (``tfmem.ir.ops.BUFFER_FORWARDING_INPUTS``). Callers that score many orders of one graph should keep a
    ``FootprintModel`` instead.
    """
    return FootprintModel(eg).footprint(order)


class FootprintModel:
    """What ``order_footprint`` needs about each unit, computed once per graph; ``footprint`` is then cheap."""

    def __init__(self, eg: ExecutionGraph, lists: ListHoldings | None = None) -> None:
        graph = eg.graph
        lists = list_holdings(eg) if lists is None else lists
        self.list_bytes, self.list_shares = lists.bytes_of, lists.shares
        self.ids: dict[TensorRef, int] = {}  # every output a unit makes visible, numbered
        for unit in eg.units:
            for t in eg.outputs_of(unit):
                self.ids[t] = len(self.ids)
        self.scratch: dict[str, int] = {}
        # per unit: (tensor id, bytes, reads, id of the input it aliases or -1, ids of forwardable inputs)
        self.outputs: dict[str, list[tuple[int, int, int, int, tuple[int, ...]]]] = {}
        self.inputs = {u: tuple(self.ids[t] for t in eg.unit_inputs[u] if t in self.ids) for u in eg.units}
        for unit in eg.units:
            scratch = sum(graph.spec(t).nbytes or 0 for t in eg.internal_tensors(unit))
            if not eg.is_region(unit):
                scratch += sum(temp_bytes(graph[unit], graph))
            self.scratch[unit] = scratch
            self.outputs[unit] = [self._output(eg, unit, t) for t in eg.outputs_of(unit)]

    def _output(self, eg: ExecutionGraph, unit: str, t: TensorRef) -> tuple[int, int, int, int, tuple[int, ...]]:
        graph, node, tid = eg.graph, eg.graph[t.node], self.ids[t]
        reads = len(eg.consumers(t)) + (1 << 30 if t in eg.fetched else 0)  # fetched: held to the end
        nbytes = 0 if node.op in PERSISTENT_OUTPUT_OPS else (graph.spec(t).nbytes or 0) + self.list_bytes.get(t, 0)
        if t in self.list_shares:   # a list a loop hands on, like an alias
            return tid, 0, reads, self.ids.get(self.list_shares[t], len(self.ids)), ()
        viewed = None if eg.is_region(unit) else viewed_input(node, graph, t.index)
        if viewed is not None:  # a view into an input's buffer, like an alias
            return tid, 0, reads, self.ids.get(node.inputs[viewed], len(self.ids)), ()
        if t.index != 0 or eg.is_region(unit) or not node.inputs:
            return tid, nbytes, reads, -1, ()
        if node.op in ALIAS_OPS or node.op in VARIABLE_READ_OPS:  # an alias of a fed tensor aliases nothing
            return tid, 0, reads, self.ids.get(node.inputs[0], len(self.ids)), ()
        want = graph.spec(t)
        forwardable = tuple(
            self.ids[ref] for idx, ref in enumerate(node.inputs) if idx in BUFFER_FORWARDING_INPUTS.get(node.op, ())
            and ref in self.ids and graph.spec(ref).nbytes == want.nbytes and graph.spec(ref).dtype == want.dtype
            and self.list_bytes.get(ref, 0) == self.list_bytes.get(t, 0)
            and sum(1 for x in node.inputs if x == ref) == 1
        )
        return tid, nbytes, reads, -1, forwardable

    def footprint(self, order: Sequence[str]) -> OrderFootprint:
        """The ``OrderFootprint`` of running ``order`` one unit at a time."""
        nothing = [0, 0]
        buffer_of: list[list[int]] = [nothing] * len(self.ids)  # tensor id -> [bytes, reads left], shared
        alloc, carried, live = [], [], 0
        for unit in order:
            carried.append(live)
            added = self.scratch[unit]
            for tid, nbytes, reads, alias, forwardable in self.outputs[unit]:
                shared = (buffer_of[alias] if alias < len(buffer_of) else [0, 0]) if alias >= 0 else next(
                    (buffer_of[f] for f in forwardable if buffer_of[f][1] == 1 and buffer_of[f][0]), None)
                if shared is not None:  # an alias, or written in place into an input only this unit still reads
                    shared[1] += reads
                    buffer_of[tid] = shared
                    continue
                buffer_of[tid] = [nbytes, reads]
                added += nbytes
                live += nbytes
            alloc.append(added)
            for tid in self.inputs[unit]:
                buf = buffer_of[tid]
                buf[1] -= 1
                if buf[1] == 0:
                    live -= buf[0]
                    buf[0] = 0
            for tid, *_ in self.outputs[unit]:
                buf = buffer_of[tid]
                if buf[1] == 0 and buf[0]:  # nobody reads it
                    live -= buf[0]
                    buf[0] = 0
        return OrderFootprint(tuple(order), tuple(alloc), tuple(carried))
