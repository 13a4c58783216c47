"""The simulator's replay: walk one schedule of a step, allocating and freeing every buffer as TensorFlow's
executor would, through a model of its BFC allocator, and record the memory timeline (``tfmem.sim.memsim``
describes the rules and is the entry point)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from tfmem.ir.devices import Placement
from tfmem.ir.execution import ExecutionGraph
from tfmem.ir.graph import OpNode, TensorRef
from tfmem.ir.ops import (
    ALIAS_OPS,
    BUFFER_FORWARDING_INPUTS,
    FUNCTIONAL_OPS,
    IN_PLACE_UPDATE_OPS,
    PERSISTENT_OUTPUT_OPS,
    RESOURCE_VARIABLE_OPS,
    VARIABLE_OPS,
    VARIABLE_READ_OPS,
)
from tfmem.ir.shared_init import sharing_groups, updates_in_place
from tfmem.sim.bfc import BFCAllocator, rounded_bytes
from tfmem.sim.executor_folding import FOLDED_ATTR
from tfmem.sim.opmemory import temp_bytes
from tfmem.sim.profile import LiveTensor, MemoryProfile, variable_bytes
from tfmem.sim.schedule import Schedule
from tfmem.sim.tensor_list_memory import ListHoldings, list_holdings

# Dense training updates (not ResourceSparseApply*, whose copy turns the variable copy-on-read): every resource
# handle they take is updated in place.
DENSE_UPDATE_PREFIX = "ResourceApply"


@dataclass
class _Buffer:
    tensor: TensorRef
    nbytes: int
    domain: str
    kind: str
    uses: int = 0
    held: bool = False
    freed: bool = False
    viewed: bool = False   # an op returned a view into it: TF never writes into such a buffer in place
    readers: list[str] = field(default_factory=list)
    handle: int = -1


class _Unlaid:
    """Stands in for an allocator where nothing reads the layout: every request is served, none placed."""

    in_use_bytes = 0
    failures = 0

    def allocate(self, nbytes: int) -> int:
        return 0

    def free(self, handle: int) -> None:
        pass


class Replay:
    """Replays a schedule, tracking buffers per memory domain ("device", "host", "other")."""

    def __init__(self, eg: ExecutionGraph, placement: Placement, device_memory: int | None = None,
                 views: dict[TensorRef, int] | None = None, feed_order: Sequence[TensorRef] | None = None,
                 sharing: dict[Hashable, list[str]] | None = None,
                 copy_order: str = "schedule", idle_variables: Sequence[tuple[str, int, str]] = (),
                 lists: ListHoldings | None = None, bystanders: frozenset[str] | None = None) -> None:
        self.eg, self.graph = eg, eg.graph
        # the items each list handle holds, allocated and freed with it (``tfmem.sim.tensor_list_memory``)
        self.lists = list_holdings(eg) if lists is None else lists
        self.placement = placement
        self.idle_variables = tuple(idle_variables)   # (name, bytes, device): held all step, run by no op
        self._idle_names = {name for name, _, _ in self.idle_variables}
        # variables that start out holding one buffer (``tfmem.ir.shared_init``; default: from ``eg``'s graph), and
        # the order their first updates are taken in: the schedule's or the graph's (``relocations``)
        self.sharing = sharing_groups(eg.graph) if sharing is None else sharing
        self.copy_order = copy_order
        # the order fed tensors are allocated in (default: by name, a fixed order for a reproducible layout)
        self.feed_order = tuple(feed_order) if feed_order is not None else tuple(sorted(eg.fed, key=str))
        self.views = views or {}   # output -> the input whose buffer it views (Analysis.views)
        self.domain = {u: unit_domain(eg, placement, u) for u in eg.units}
        # Other devices' buffers (another machine's, planned on its own) take no layout: nothing reads it, and a
        # graph over M machines would spend most of a replay on them.
        self.allocators: dict[str, BFCAllocator | _Unlaid] = {"device": BFCAllocator(), "host": BFCAllocator(),
                                                              "other": _Unlaid()}
        self.bounded = device_memory is not None
        if device_memory is not None:
            self.allocators["device"] = BFCAllocator(limit_bytes=device_memory)
        self.persistent = {"device": 0, "host": 0, "other": 0}
        # Units whose replay cannot change the device's or the host's buffers: only their outputs' copies into
        # those domains are replayed (``_copies_out``). Default: ``bystanders(eg, placement)``.
        self.bystanders = bystanders_of(eg, self.domain) if bystanders is None else bystanders
        self.buffers: dict[tuple[TensorRef, str], _Buffer] = {}   # (tensor, domain) -> buffer
        self.var_storage: dict[str, _Buffer] = {}
        self.temps: dict[str, list[_Buffer]] = {}
        self.peak = {"device": -1, "host": 0}   # sampled after each event; the allocator sees within-op peaks
        self.peak_info: tuple[str, float, int] = ("", 0.0, 0)   # unit, time, length of the device log
        self.device_log: list[tuple[bool, _Buffer]] = []         # (allocated?, buffer), device domain only
        self.timeline: list[tuple[float, int, int, str]] = []

    def _nbytes(self, tensor: TensorRef) -> int:
        """A tensor's bytes; for a list handle, the items it holds."""
        return (self.graph.spec(tensor).nbytes or 0) + self.lists.bytes_of.get(tensor, 0)

    def _uses(self, tensor: TensorRef, domain: str) -> int:
        return sum(1 for c in self.eg.consumers(tensor) if self.domain[c] == domain)

    def _alloc(self, tensor: TensorRef, nbytes: int, domain: str, kind: str) -> _Buffer:
        buf = _Buffer(tensor, rounded_bytes(nbytes), domain, kind, held=tensor in self.eg.fetched)
        if domain == "device":
            self.device_log.append((True, buf))
        if kind == "persistent":  # allocated at initialisation, before the step, and never freed
            self.persistent[domain] += buf.nbytes
        buf.handle = self.allocators[domain].allocate(nbytes)
        return buf

    def _free(self, buf: _Buffer) -> None:
        if not buf.freed and buf.kind != "persistent" and not buf.held:
            buf.freed = True
            self.allocators[buf.domain].free(buf.handle)
            if buf.domain == "device":
                self.device_log.append((False, buf))

    def run(self, sched: Schedule) -> MemoryProfile:
        # With a capacity, where buffers sit decides what fits: replay the session's first step first, as the
        # testbed runs a warm-up step before it measures, and report the step after it.
        relocated = self.relocations(sched)
        self._allocate_persistent(share=self.bounded)
        if relocated:
            self._allocate_fed()
            self._replay(sched, relocated)
            self._end_step()
        self._allocate_fed()
        self._record(0.0, "<start>")
        self._replay(sched, {})
        return self._profile(sched)

    def _replay(self, sched: Schedule, relocated: dict[str, set[str]]) -> None:
        events = sorted(
            [(s, 1, i) for i, s in enumerate(sched.start_s)] + [(e, 0, i) for i, e in enumerate(sched.end_s)]
        )
        for time_s, is_start, i in events:
            unit = sched.order[i]
            if unit in self.bystanders:
                if not is_start:
                    self._copies_out(unit)
            elif is_start:
                for var in sorted(relocated.get(unit, ())):  # copy-on-write of a shared slot: its own chunk here
                    self.var_storage[var] = self._alloc(TensorRef(var, 0), variable_bytes(self.graph[var]),
                                                        self.domain[self.eg.unit_of[var]], "persistent")
                self._start(unit)
            else:
                self._end(unit)
            self._record(time_s, unit)

    def relocations(self, sched: Schedule) -> dict[str, set[str]]:
        """The first step's copies of shared variables (``first_update_copies``) in this replay's copy order;
        none without a capacity (the layout then decides nothing)."""
        if not self.bounded:
            return {}
        return first_update_copies(self.eg, self.sharing, sched.order if self.copy_order == "schedule" else None)

    def _end_step(self) -> None:
        """Free what the step left (fed and fetched tensors) and start the next step's accounting afresh."""
        for buf in list(self.buffers.values()):
            if buf.kind != "persistent" and not buf.freed:
                buf.held = False
                self._free(buf)
        self.buffers = {k: b for k, b in self.buffers.items() if b.kind == "persistent"}
        self.temps.clear()
        kept = {id(b): b for b in [*self.buffers.values(), *self.var_storage.values()]}
        self.device_log = [(True, b) for b in kept.values() if b.domain == "device"]
        self.peak = {"device": -1, "host": 0}
        self.peak_info = ("", 0.0, 0)
        self.timeline = []

    def _allocate_persistent(self, share: bool = False) -> None:
        """Constants and variable storage; with ``share``, variables that start out sharing a buffer (as a
        session's do before its first step) get one between them."""
        first_of = {v: members[0] for members in self.sharing.values() for v in members} if share else {}
        holders: dict[str, _Buffer] = {}
        # Variables first: initialising them ran before this graph's first step, whose Const kernels then
        # allocate their tensors, the executor's own folded constants last (its graph lists them after the
        # rest). The order decides which buffers land in the BFC's first 2 MiB region.
        nodes = [(u, self.graph[n]) for u in self.eg.units for n in self.eg.members[u]]
        def rank(un: tuple[str, OpNode]) -> int:
            return 0 if un[1].op in VARIABLE_OPS else 2 if un[1].attr_bool(FOLDED_ATTR) else 1

        idle_pending = True
        for u, node in sorted(nodes, key=rank):  # stable: graph order kept
            if idle_pending and rank((u, node)) > 0:
                idle_pending = False
                self._allocate_idle_variables()
            if node.op in PERSISTENT_OUTPUT_OPS:
                ref = TensorRef(node.name, 0)
                self.buffers[(ref, self.domain[u])] = self._alloc(
                    ref, node.outputs[0].nbytes or 0, self.domain[u], "persistent")
            elif node.op in RESOURCE_VARIABLE_OPS:
                group = first_of.get(node.name)
                if group is not None and group in holders:
                    self.var_storage[node.name] = holders[group]
                    continue
                self.var_storage[node.name] = self._alloc(TensorRef(node.name, 0), variable_bytes(node),
                                                          self.domain[u], "persistent")
                if group is not None:
                    holders[group] = self.var_storage[node.name]
        if idle_pending:
            self._allocate_idle_variables()

    def _allocate_idle_variables(self) -> None:
        """The variables no op of the step runs, each in its own buffer. Some may share their initial buffer
        with another in the session, but the step does not say which, so none is assumed to: an overestimate,
        never an under (``tests/test_memsim.py::test_idle_variable_is_measured_as_simulated``)."""
        for name, nbytes, device in self.idle_variables:
            self.var_storage[name] = self._alloc(TensorRef(name, 0), nbytes, self.placement.domain(device),
                                                 "persistent")

    def _allocate_fed(self) -> None:
        for ref in self.feed_order:
            domain = fed_domain(self.eg, self.placement, ref)
            buf = self._alloc(ref, self.graph.spec(ref).nbytes or 0, domain, "fed")
            buf.uses = self._uses(ref, domain)
            buf.held = True  # the step's feed table references every fed tensor until the step ends
            self.buffers[(ref, domain)] = buf

    def _start(self, unit: str) -> None:
        domain = self.domain[unit]
        if not self.eg.is_region(unit):
            self._copy_on_write(self.graph[unit])
        for t in self.eg.outputs_of(unit):
            if (t, domain) not in self.buffers:
                self.buffers[(t, domain)] = self._output_buffer(unit, t, domain)
        temps = [self.graph.spec(t).nbytes or 0 for t in self.eg.internal_tensors(unit)]
        if not self.eg.is_region(unit):
            temps += temp_bytes(self.graph[unit], self.graph)
        self.temps[unit] = [self._alloc(TensorRef(unit, -1), n, domain, "scratch") for n in temps if n > 0]

    def _copy_on_write(self, node: OpNode) -> None:
        """A dense in-place update of a resource variable whose value a reader still holds (a ``ReadVariableOp``
        output with consumers yet to run) copies the variable into a new buffer first, which the variable keeps;
        the old one is freed after its last reader (TF's ``PrepareToUpdateVariable``: the buffer's reference
        count is not one; ``tests/test_memsim.py::test_an_update_while_a_read_is_held_copies_the_variable``)."""
        if node.op.startswith(DENSE_UPDATE_PREFIX):   # the variable and its slots: every handle it takes
            handles = node.inputs
        elif node.op in IN_PLACE_UPDATE_OPS:
            handles = node.inputs[:1]
        else:
            return
        for ref in handles:
            old = self.var_storage.get(ref.node)
            if old is None or old.uses <= 0 or self.graph[ref.node].op not in RESOURCE_VARIABLE_OPS:
                continue
            self.var_storage[ref.node] = self._alloc(ref, variable_bytes(self.graph[ref.node]), old.domain,
                                                     "persistent")
            if not any(b is old for b in self.var_storage.values()):   # a variable sharing it keeps it
                old.kind = "transient"
                self.persistent[old.domain] -= old.nbytes

    def _output_buffer(self, unit: str, t: TensorRef, domain: str) -> _Buffer:
        node = self.graph[t.node]
        uses = self._uses(t, domain)
        shared = None
        viewed = self.views.get(t)
        if t in self.lists.shares:   # a list a loop hands on: the items that entered it
            shared = self.buffers.get((self.lists.shares[t], domain))
        elif t.index == 0 and node.op in ALIAS_OPS and node.inputs:
            shared = self.buffers.get((node.inputs[0], domain))
        elif viewed is not None:
            shared = self.buffers.get((node.inputs[viewed], domain))
            if shared is not None:
                shared.viewed = True
        elif t.index == 0 and node.op in VARIABLE_READ_OPS and node.inputs:
            shared = self.var_storage.get(node.inputs[0].node)
        elif t.index == 0 and node.op in BUFFER_FORWARDING_INPUTS and not self.eg.is_region(unit):
            shared = self._forwardable(unit, node.op, t, domain)
        if shared is not None and not shared.freed:
            shared.uses += uses
            shared.held = shared.held or t in self.eg.fetched
            shared.readers.extend(self.eg.consumers(t))
            return shared
        buf = self._alloc(t, self._nbytes(t), domain, "transient")
        buf.uses = uses
        buf.readers.extend(self.eg.consumers(t))
        return buf

    def _forwardable(self, unit: str, op: str, out: TensorRef, domain: str) -> _Buffer | None:
        node = self.graph[unit]
        want = self.graph.spec(out)
        for idx in BUFFER_FORWARDING_INPUTS[op]:
            if idx >= len(node.inputs):
                break
            ref = node.inputs[idx]
            buf = self.buffers.get((ref, domain))
            spec = self.graph.spec(ref)
            if (buf is None or buf.kind != "transient" or buf.held or buf.freed or buf.viewed or buf.uses != 1
                    or spec.nbytes != want.nbytes or spec.dtype != want.dtype or self._nbytes(ref) != self._nbytes(out)
                    or sum(1 for t in node.inputs if t == ref) != 1):
                continue
            return buf
        return None

    def _end(self, unit: str) -> None:
        domain = self.domain[unit]
        for t in self.eg.unit_inputs[unit]:
            buf = self.buffers.get((t, domain))
            if buf is None:
                continue
            buf.uses -= 1
            if buf.uses <= 0:
                self._free(buf)
        for t in self.eg.outputs_of(unit):
            buf = self.buffers[(t, domain)]
            self._copy_into(t, {self.domain[c] for c in self.eg.consumers(t)} - {domain})
            if buf.uses <= 0:
                self._free(buf)
        for scratch in self.temps.pop(unit, ()):
            self._free(scratch)

    def _copies_out(self, unit: str) -> None:
        """What an other device's unit does to the device and host when it ends: their copies of its outputs."""
        for t in self.eg.outputs_of(unit):
            self._copy_into(t, {self.domain[c] for c in self.eg.consumers(t)} - {"other"})

    def _copy_into(self, tensor: TensorRef, domains: set[str]) -> None:
        """A copy of ``tensor`` in each of ``domains`` (whose ops read it), made when its producer ends."""
        for domain in sorted(domains):
            copy = self._alloc(tensor, self._nbytes(tensor), domain, "copy")
            copy.uses = self._uses(tensor, domain)
            self.buffers[(tensor, domain)] = copy

    def _record(self, time_s: float, unit: str) -> None:
        device, host = self.allocators["device"].in_use_bytes, self.allocators["host"].in_use_bytes
        self.timeline.append((time_s, device, host, unit))
        if device > self.peak["device"]:
            self.peak["device"] = device
            self.peak_info = (unit, time_s, len(self.device_log))
        self.peak["host"] = max(self.peak["host"], host)

    def _profile(self, sched: Schedule) -> MemoryProfile:
        unit, time_s, log_length = self.peak_info
        seen: dict[int, _Buffer] = {}
        for allocated, buf in self.device_log[:log_length]:  # replay the log to the peak: O(events), once
            if allocated:
                seen[id(buf)] = buf
            else:
                seen.pop(id(buf), None)
        tensors = sorted(
            (LiveTensor(_tensor_name(b.tensor), b.nbytes,
                        self.graph[b.tensor.node].op if b.tensor.node in self.graph
                        else "idle variable" if b.tensor.node in self._idle_names else "v1 loop frame",
                        tuple(dict.fromkeys(b.readers)), "fetched" if b.held and b.kind == "transient" else b.kind)
             for b in seen.values()),
            key=lambda lt: (-lt.nbytes, lt.tensor),
        )
        notes = tuple(
            f"opaque op {n.name} ({n.op}): memory inside its function is not modelled"
            for n in (self.graph[x] for x in self.eg.needed) if n.op in FUNCTIONAL_OPS
        ) + self.lists.notes
        return MemoryProfile(
            peak_bytes=self.peak["device"], peak_unit=unit, peak_time_s=time_s,
            live_at_peak=tuple(tensors), persistent_bytes=self.persistent["device"],
            host_peak_bytes=self.peak["host"], host_persistent_bytes=self.persistent["host"],
            timeline=tuple(self.timeline), schedule=sched, notes=notes,
            allocation_failures=self.allocators["device"].failures,
        )


def first_update_copies(eg: ExecutionGraph, sharing: Mapping[Hashable, list[str]],
                        order: Sequence[str] | None = None) -> dict[str, set[str]]:
    """Variables that share their initial buffer, by the update op that gives each its own in the first step.

    Variables initialised to one constant hold one buffer after initialisation (``tfmem.ir.shared_init``); the
    first in-place update of each finds it shared and copies it into a new chunk, allocated mid-step and kept
    for the session, so every later step runs around it (``tests/test_unshare_initial_values.py`` measures
    the copies in real sessions; ``tests/test_memsim.py`` checks the ones predicted here).
    The holder updated last (in ``order``, a schedule's; default: the graph's) finds the buffer its own by
    then and copies nothing, unless a variable this step does not update still holds it. ``sharing``:
    ``tfmem.ir.shared_init.sharing_groups``.
    """
    position = {u: i for i, u in enumerate(order if order is not None else eg.units)}
    out: dict[str, set[str]] = {}
    for members in sharing.values():
        here = [v for v in members if v in eg.unit_of]
        first: dict[str, str] = {}   # variable -> the unit of its first in-place update
        for v in here:
            updates = [eg.unit_of[c] for c in eg.graph.consumers.get(TensorRef(v, 0), ())
                       if c in eg.unit_of and updates_in_place(eg.graph[c].op)]
            if updates:
                first[v] = min(updates, key=position.__getitem__)
        copying = sorted(first, key=lambda v: position[first[v]])
        if len(copying) == len(members):
            copying = copying[:-1]
        for v in copying:
            out.setdefault(first[v], set()).add(v)
    return out


def unit_domain(eg: ExecutionGraph, placement: Placement, unit: str) -> str:
    """The memory domain a unit's buffers live in: its (first) op's device's, as ``placement`` classes it."""
    return placement.domain(eg.graph[eg.members[unit][0]].device)


def fed_domain(eg: ExecutionGraph, placement: Placement, tensor: TensorRef) -> str:
    """The domain a fed tensor is allocated in: its first consumer's (the device when nothing reads it)."""
    consumers = eg.consumers(tensor)
    return unit_domain(eg, placement, consumers[0]) if consumers else "device"


def bystanders(eg: ExecutionGraph, placement: Placement) -> frozenset[str]:
    """The units of ``eg`` on other devices than ``placement``'s device and host whose replay can be skipped
    but for the copies of their outputs into those two (``Replay._copies_out``): all of them, or none."""
    return bystanders_of(eg, {u: unit_domain(eg, placement, u) for u in eg.units})


def bystanders_of(eg: ExecutionGraph, domain: Mapping[str, str]) -> frozenset[str]:
    """``bystanders`` by each unit's domain. An other-domain unit touches the device's and host's buffers only
    through the copies of its outputs they consume, unless a resource variable is read or updated across the
    boundary (a read's output is then the variable's buffer, and an update's copy-on-write counts its readers):
    then none is skipped (``tests/test_memsim.py::test_other_devices_are_replayed_only_through_their_copies``)."""
    other = {u for u in eg.units if domain[u] == "other"}
    if not other:
        return frozenset()
    graph = eg.graph
    for u in eg.units:
        for n in eg.members[u]:
            for t in graph[n].inputs:
                owner = eg.unit_of.get(t.node)
                if owner is not None and graph[t.node].op in RESOURCE_VARIABLE_OPS and (u in other) != (owner in other):
                    return frozenset()
    return frozenset(other)


def _tensor_name(ref: TensorRef) -> str:
    return f"{ref.node} (scratch)" if ref.index < 0 else str(ref)
