"""The static memory simulator: replay one step of a graph and account for every buffer.

It follows TensorFlow's executor and allocator:

* with Grappler, the graph is the one the session runs: Grappler's rewrites, then the executor's own constant
  folding (``tfmem.sim.executor_folding``);
* the order is ``tfmem.schedule.emulate`` (TF's ready-queue policy; of several draws of the successor orders
  TF hashes, the one with the median peak) unless an explicit order is given;
* an op's outputs are allocated when it starts and each buffer is freed when its last reader finishes;
* ``Identity``/``Reshape``-like ops, ``ReadVariableOp`` and dim-0 slices of whole aligned rows
  (``tfmem.opmemory.VIEW_RULES``) share their input's buffer;
* element-wise kernels reuse an input buffer of the same size when they are its last reader (TF's
  ``forward_input_or_allocate_output``);
* constants and variable storage are persistent (variables allocated first: they were initialised before the
  step); fed tensors arrive before the step and, like fetched ones, are held to its end; a tensor crossing devices occupies both until the receiver is done with its copy;
* kernels' scratch buffers (``tfmem.sim.opmemory``) live while their op runs;
* allocations go through a model of TF's BFC allocator (``tfmem.sim.bfc``), so peaks are chunk sizes as TF
  reports them; with a capacity (``device_memory``) a warm-up step is replayed first, as the
  testbed runs one, since where the first step leaves buffers decides what fits later.

Examples
--------
>>> import tensorflow as tf
>>> g = tf.Graph()
>>> with g.as_default():
...     x = tf.compat.v1.placeholder(tf.float32, (1024,), name="x")
...     y = tf.math.sqrt(x, name="y")          # 4 KiB, x is fed so it is not forwarded
...     z = tf.math.square(y, name="z")        # reuses y's buffer: y's last reader, same size
>>> simulate(g, ["z:0"]).peak_bytes           # x and one 4 KiB buffer
8192
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2
from tensorflow.core.protobuf import config_pb2

from tfmem.ir.devices import DEFAULT_DEVICE, Placement, with_default_device
from tfmem.ir.execution import ExecutionGraph
from tfmem.ir.graph import GraphIR, OpNode, TensorRef
from tfmem.ir.loading import GraphSource, load, to_graph_def
from tfmem.ir.ops import (
    ALIAS_OPS,
    BUFFER_FORWARDING_INPUTS,
    FUNCTIONAL_OPS,
    PERSISTENT_OUTPUT_OPS,
    RESOURCE_VARIABLE_OPS,
    VARIABLE_OPS,
    VARIABLE_READ_OPS,
)
from tfmem.ir.shapes import FeedShapes, annotate, dtype_size
from tfmem.ir.shared_init import sharing_groups, updates_in_place
from tfmem.sim import costmodel
from tfmem.sim.analysis import Analysis, analyse, step_time_estimate, transfers_into, units_in
from tfmem.sim.bfc import BFCAllocator, rounded_bytes
from tfmem.sim.executor_folding import FOLDED_ATTR, fold_like_executor
from tfmem.sim.graphcache import GraphCache
from tfmem.sim.grappler import runtime_graph_def
from tfmem.sim.opmemory import temp_bytes
from tfmem.sim.schedule import Schedule, emulate, fixed


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


def simulate(
    graph: GraphSource,
    fetches: Iterable[str] | str,
    *,
    feed_shapes: FeedShapes | None = None,
    feeds: Iterable[str] = (),
    device: str | None = None,
    host: str | None = None,
    order: Sequence[str] | None = None,
    inter_op_threads: int = 1,
    cost_device: costmodel.DeviceSpec = costmodel.DEFAULT_DEVICE,
    grappler: bool = True,
    config: config_pb2.ConfigProto | None = None,
    cores: int | None = None,
    device_memory: int | None = None,
    large_request_margin: int = 0,
) -> MemoryProfile:
    """Simulate one step of ``graph`` computing ``fetches`` and return its ``MemoryProfile``.

    Parameters
    ----------
    graph : tf.Graph, GraphDef, MetaGraphDef, path, or an annotated ``GraphIR``
    fetches : tensor names (``"loss:0"``) and op names (``"train_op"``), as for ``Session.run``
    feed_shapes : full shapes of fed tensors whose static shape is partial
    feeds : other tensors the caller feeds (placeholders are always fed)
    device, host : device strings; ops on ``host`` count toward ``host_peak_bytes``, the rest toward the device.
        With ``device`` given, ops on a third device count toward neither.
    order : run units in exactly this order (one thread) instead of emulating TF's executor
    inter_op_threads : threads of TF's inter-op pool to emulate
    grappler : simulate the graph as the session runs it, after Grappler's rewrites (``tfmem.sim.grappler``)
    config : the ``ConfigProto`` the session will use (its rewrite options steer Grappler)
    cores : compute cores for the step-time estimate (default: this machine's)
    device_memory : the device's capacity, laid out as the testbed's BFC (a 2 MiB region, then the rest);
        requests that no free chunk can serve are counted in ``MemoryProfile.allocation_failures`` (TF would
        raise out-of-memory there, even when the total in use is below the capacity: fragmentation). Near the
        capacity the BFC hands out free chunks whole (a 33.75 MiB scratch took a free 59.8 MiB chunk), so the peak
        TF reports depends on the capacity: compare a testbed's measured peak with the simulation at the testbed's
        ``device_memory``, never with the unbounded one (a planned U-Net: 42.6 MiB unbounded, 69.5 MiB at 80 MiB,
        measured 69.0 MiB there). With a capacity the replay also runs the session's first step before the
        reported one (the testbed measures after a warm-up step): there TF copies each variable that shares its
        initial buffer with others (Adam or momentum slots, biases: ``tfmem.ir.shared_init``) into a new chunk
        mid-region as it first updates it, and later steps run around those chunks; and the fed tensors are
        allocated in each of ``feed_orders`` (a session follows the caller's feed dict), the worst replay reported
    large_request_margin : with ``device_memory``, also count as failures the requests of half the device or
        more that leave less than this in their free chunk (``tfmem.bfc.BFCAllocator.large_request_fits``)

    Raises
    ------
    UnknownShapeError
        Listing every executed tensor whose size is unknown.
    """
    fetch_names = [fetches] if isinstance(fetches, str) else [str(getattr(f, "name", f)) for f in fetches]
    if grappler:
        # optimize replays one plan on several device sizes: Grappler's rewrite (seconds on large graphs) is kept
        # per graph object, as tags on the graph carry into the rewrite.
        runtime_key = (tuple(fetch_names), device, None if config is None else config.SerializeToString(),
                       tuple(sorted((k, tuple(v)) for k, v in (feed_shapes or {}).items())))
        ir = _RUNTIME.get(graph, runtime_key) if isinstance(graph, GraphIR) else None
        if ir is None:
            placed = with_default_device(to_graph_def(graph), device or DEFAULT_DEVICE)
            ir = fold_like_executor(annotate(runtime_graph_def(placed, fetch_names, config), feed_shapes),
                                    fetch_names)
            if isinstance(graph, GraphIR):
                _RUNTIME.put(graph, runtime_key, ir)
    elif isinstance(graph, GraphIR) and graph.annotated:  # feed shapes were applied when it was annotated
        ir = graph
    else:
        ir = load(graph, feed_shapes)
    feed_names = list(feeds) + list(feed_shapes or {})
    cores = cores or os.cpu_count() or 1
    # Passes score one graph more than once (a pass, then optimize's own before/after): keep the answer.
    key = (tuple(fetch_names), tuple(sorted(feed_names)), device, host,
           None if order is None else tuple(order), inter_op_threads, cost_device, cores, device_memory,
           large_request_margin)
    cached = _PROFILES.get(ir, key) if not grappler else None
    if cached is not None:
        return cached
    analysis = analyse(ir, fetch_names, feed_names, cost_device)
    eg, durations, expensive = analysis.eg, analysis.durations, analysis.expensive
    placement = Placement(device, host)
    if order is not None:
        sched = fixed(units_in(eg, order), durations.__getitem__)
    else:
        gpu = "GPU" in (device or "").upper()  # TF's GPU kernels all count as cheap: everything runs inline
        key_s = (gpu, inter_op_threads)  # the same graph is often scored again with another capacity or cores
        sched = analysis.schedules.get(key_s) or analysis.schedules.setdefault(key_s, _typical_schedule(
            analysis, (lambda u: False) if gpu else expensive.__getitem__, inter_op_threads))
    # With a capacity, where the fed tensors land decides what fits, and TF allocates them in the order of the
    # caller's feed dict, which the graph does not say: replay a few orders and report the worst.
    # The initializers that decide which variables share a buffer are pruned from Grappler's rewrite of the step.
    sharing = None
    if device_memory is not None:
        sharing = _SHARING.get(graph, ()) if isinstance(graph, GraphIR) else None
        if sharing is None:
            source = graph if isinstance(graph, GraphIR) else GraphIR.from_graph_def(to_graph_def(graph))
            sharing = sharing_groups(source)
            if isinstance(graph, GraphIR):
                _SHARING.put(graph, (), sharing)
    # Which holder of a shared buffer is updated last, and so keeps it, is the executor's order; the emulated one
    # can differ (a ResNet-20's plan: 45 of its 47 first-step copies as measured by the schedule's order, all 47 by
    # the graph's), and one small chunk moved decides whether a large request finds room: replay both orders, and
    # report the worst.
    copy_orders = ("schedule", "graph") if sharing else ("schedule",)
    idle = _IDLE.get(graph, tuple(fetch_names)) if isinstance(graph, GraphIR) else None
    if idle is None:
        idle = idle_variables(graph, eg)
        if isinstance(graph, GraphIR):
            _IDLE.put(graph, tuple(fetch_names), idle)
    profile = max((_Replay(eg, placement, device_memory, analysis.views, feed_order=o,
                           large_request_margin=large_request_margin, sharing=sharing,
                           copy_order=c, idle_variables=idle).run(sched)
                   for o in (feed_orders(eg) if device_memory is not None else [None]) for c in copy_orders),
                  key=lambda p: (p.allocation_failures, p.peak_bytes))
    # A fixed order is one thread's schedule: its length is the estimate (and scoring orders stays cheap).
    if order is not None:
        step = sched.makespan_s
    else:
        key_t = (device, host, cost_device)
        transfers = analysis.transfers.get(key_t)
        if transfers is None:
            transfers = analysis.transfers[key_t] = transfers_into(eg, placement, cost_device)
        step = step_time_estimate(eg, durations, analysis.parallel, cores, transfers, cost_device.transfer_cpu_share)
    profile = dataclasses.replace(profile, estimated_step_s=step)
    if not grappler:
        _PROFILES.put(ir, key, profile)
    return profile


def feed_orders(eg: ExecutionGraph) -> list[tuple[TensorRef, ...]]:
    """Orders in which a session may allocate the fed tensors: by name, by size either way, and reversed.

    The order matters near a capacity: BFC hands a free chunk out whole unless it is twice the request, and
    the feeds arrive when the region is nearly empty. Measured on an unrolled RNN under a 33 MiB cap: fed as
    ``{x (6 MiB), target (12 MiB)}``, ``target`` took the 20.49 MiB left after ``x`` whole; in the other order
    both would have been split off.

    >>> from types import SimpleNamespace
    >>> from tfmem.ir.graph import TensorRef
    >>> sizes = {"a:0": 8, "b:0": 4}
    >>> eg = SimpleNamespace(fed={TensorRef("a", 0), TensorRef("b", 0)},
    ...                      graph=SimpleNamespace(spec=lambda t: SimpleNamespace(nbytes=sizes[str(t)])))
    >>> [[str(t) for t in order] for order in feed_orders(eg)]
    [['a:0', 'b:0'], ['b:0', 'a:0']]
    """
    by_name = sorted(eg.fed, key=str)
    by_size = sorted(by_name, key=lambda t: eg.graph.spec(t).nbytes or 0)
    orders: list[tuple[TensorRef, ...]] = []
    for order in (by_name, by_name[::-1], by_size, by_size[::-1]):
        if tuple(order) not in orders:
            orders.append(tuple(order))
    return orders


# Draws of TF's hashed successor orders (``ExecutionGraph.activation_order``) emulated per simulation.
ORDER_SAMPLES = 5


def _typical_schedule(analysis: Analysis, expensive: Callable[[str], bool], threads: int) -> Schedule:
    """The emulated schedule whose peak is the median over ``ORDER_SAMPLES`` draws of TF's hashed orders.

    Where a node has more out-edges than TF keeps in order, TF's order differs from process to process and
    so does the peak (an Adam MLP measured 36.5 or 42 MiB). One draw would be a lottery; the median draw is
    what TF typically does. Draws are ranked by the cheap liveness model (``FootprintModel``), so only the
    chosen one is replayed through the allocator.
    """
    eg, durations = analysis.eg, analysis.durations
    schedules = [emulate(eg.units, eg.unit_preds, eg.activation_order(seed), durations.__getitem__, expensive,
                         threads, seed=seed) for seed in range(ORDER_SAMPLES)]
    if len({s.order for s in schedules}) == 1:
        return schedules[0]
    ranked = sorted(schedules, key=lambda s: analysis.footprints.footprint(s.order).peak_bytes)
    return ranked[len(ranked) // 2]


# Recent simulations of graphs as written (not Grappler's rewrite of them), keyed by the other arguments.
_PROFILES: GraphCache[MemoryProfile] = GraphCache(kept=8)
# Grappler's rewrites of recent graph objects (annotated), keyed by fetches, device, config and feed shapes.
_RUNTIME: GraphCache[GraphIR] = GraphCache(kept=4, same_object=True)
# Variables sharing an initial buffer (``tfmem.ir.shared_init``) of recent graph objects: a layout check replays one
# plan on several device sizes and in two thread orders.
_SHARING: GraphCache[dict[Hashable, list[str]]] = GraphCache(kept=4, same_object=True)
# The variables each graph holds beyond those its step runs (``idle_variables``), keyed by fetches.
_IDLE: GraphCache[tuple[tuple[str, int, str], ...]] = GraphCache(kept=4, same_object=True)


class _Replay:
    """Replays a schedule, tracking buffers per memory domain ("device", "host", "other")."""

    def __init__(self, eg: ExecutionGraph, placement: Placement, device_memory: int | None = None,
                 views: dict[TensorRef, int] | None = None, feed_order: Sequence[TensorRef] | None = None,
                 large_request_margin: int = 0, sharing: dict[Hashable, list[str]] | None = None,
                 copy_order: str = "schedule", idle_variables: Sequence[tuple[str, int, str]] = ()) -> None:
        self.eg, self.graph = eg, eg.graph
        self.placement = placement
        self.idle_variables = tuple(idle_variables)   # (name, bytes, device): held all step, run by no op
        self._idle_names = {name for name, _, _ in self.idle_variables}
        # variables that start out holding one buffer (``tfmem.ir.shared_init``; default: from ``eg``'s graph), and
        # the order their first updates are taken in: the schedule's or the graph's (``_first_update_copies``)
        self.sharing = sharing_groups(eg.graph) if sharing is None else sharing
        self.copy_order = copy_order
        # the order fed tensors are allocated in (default: by name, a fixed order for a reproducible layout)
        self.feed_order = tuple(feed_order) if feed_order is not None else tuple(sorted(eg.fed, key=str))
        self.views = views or {}   # output -> the input whose buffer it views (Analysis.views)
        self.domain = {u: placement.domain(self.graph[eg.members[u][0]].device) for u in eg.units}
        self.allocators = {d: BFCAllocator() for d in ("device", "host", "other")}
        self.bounded = device_memory is not None
        if device_memory is not None:
            self.allocators["device"] = BFCAllocator(limit_bytes=device_memory,
                                                     large_request_margin=large_request_margin)
        self.persistent = {"device": 0, "host": 0, "other": 0}
        self.buffers: dict[tuple[TensorRef, str], _Buffer] = {}   # (tensor, domain) -> buffer
        self.var_storage: dict[str, _Buffer] = {}
        self.temps: dict[str, list[_Buffer]] = {}
        self.peak = {"device": -1, "host": 0}   # sampled after each event; the allocator sees within-op peaks
        self.peak_info: tuple[str, float, int] = ("", 0.0, 0)   # unit, time, length of the device log
        self.device_log: list[tuple[bool, _Buffer]] = []         # (allocated?, buffer), device domain only
        self.timeline: list[tuple[float, int, int, str]] = []

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
        order = sched.order if self.copy_order == "schedule" else None
        relocated = self._first_update_copies(order) if self.bounded else {}
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
            if is_start:
                for var in sorted(relocated.get(unit, ())):  # copy-on-write of a shared slot: its own chunk now
                    self.var_storage[var] = self._alloc(TensorRef(var, 0), variable_bytes(self.graph[var]),
                                                        self.domain[self.eg.unit_of[var]], "persistent")
                self._start(unit)
            else:
                self._end(unit)
            self._record(time_s, unit)

    def _first_update_copies(self, order: Sequence[str] | None = None) -> dict[str, set[str]]:
        """Variables that share their initial buffer, by the update op that gives each its own in the first step.

        Variables initialised to one constant hold one buffer after initialisation (``tfmem.ir.shared_init``); the
        first in-place update of each finds it shared and copies it into a new chunk, allocated mid-step and kept
        for the session, so every later step runs around it (measured: every Adam update of a U-Net's first
        step allocates the size of its variable, later steps none; a ResNet-20 with momentum, 47 small copies).
        The holder updated last (in ``order``, the schedule's; default: the graph's) finds the buffer its own by
        then and copies nothing, unless a variable this step does not update still holds it.
        """
        position = {u: i for i, u in enumerate(order if order is not None else self.eg.units)}
        out: dict[str, set[str]] = {}
        for members in self.sharing.values():
            here = [v for v in members if v in self.eg.unit_of]
            first: dict[str, str] = {}   # variable -> the unit of its first in-place update
            for v in here:
                updates = [self.eg.unit_of[c] for c in self.graph.consumers.get(TensorRef(v, 0), ())
                           if c in self.eg.unit_of and updates_in_place(self.graph[c].op)]
                if updates:
                    first[v] = min(updates, key=position.__getitem__)
            copying = sorted(first, key=lambda v: position[first[v]])
            if len(copying) == len(members):
                copying = copying[:-1]
            for v in copying:
                out.setdefault(first[v], set()).add(v)
        return out

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
        # rest; measured in a BFC dump). The order decides which buffers land in the BFC's first 2 MiB region.
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
        with another in the session, but how much is not known here (a WGAN-GP fetching its critic loss alone:
        14.65 MiB measured; ``tfmem.ir.shared_init``'s groups would say 9.14), so none is assumed to: an
        overestimate, never an under."""
        for name, nbytes, device in self.idle_variables:
            self.var_storage[name] = self._alloc(TensorRef(name, 0), nbytes, self.placement.domain(device),
                                                 "persistent")

    def _allocate_fed(self) -> None:
        for ref in self.feed_order:
            consumers = self.eg.consumers(ref)
            domain = self.domain[consumers[0]] if consumers else "device"
            buf = self._alloc(ref, self.graph.spec(ref).nbytes or 0, domain, "fed")
            buf.uses = self._uses(ref, domain)
            buf.held = True  # the step's feed table references every fed tensor until the step ends
            self.buffers[(ref, domain)] = buf

    def _start(self, unit: str) -> None:
        domain = self.domain[unit]
        for t in self.eg.outputs_of(unit):
            if (t, domain) not in self.buffers:
                self.buffers[(t, domain)] = self._output_buffer(unit, t, domain)
        temps = [self.graph.spec(t).nbytes or 0 for t in self.eg.internal_tensors(unit)]
        if not self.eg.is_region(unit):
            temps += temp_bytes(self.graph[unit], self.graph)
        self.temps[unit] = [self._alloc(TensorRef(unit, -1), n, domain, "scratch") for n in temps if n > 0]

    def _output_buffer(self, unit: str, t: TensorRef, domain: str) -> _Buffer:
        node = self.graph[t.node]
        uses = self._uses(t, domain)
        shared = None
        viewed = self.views.get(t)
        if t.index == 0 and node.op in ALIAS_OPS and node.inputs:
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
        buf = self._alloc(t, self.graph.spec(t).nbytes or 0, domain, "transient")
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
                    or spec.nbytes != want.nbytes or spec.dtype != want.dtype
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
            for other in {self.domain[c] for c in self.eg.consumers(t)} - {domain}:
                copy = self._alloc(t, self.graph.spec(t).nbytes or 0, other, "copy")
                copy.uses = self._uses(t, other)
                self.buffers[(t, other)] = copy
            if buf.uses <= 0:
                self._free(buf)
        for scratch in self.temps.pop(unit, ()):
            self._free(scratch)

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
        )
        return MemoryProfile(
            peak_bytes=self.peak["device"], peak_unit=unit, peak_time_s=time_s,
            live_at_peak=tuple(tensors), persistent_bytes=self.persistent["device"],
            host_peak_bytes=self.peak["host"], host_persistent_bytes=self.persistent["host"],
            timeline=tuple(self.timeline), schedule=sched, notes=notes,
            allocation_failures=self.allocators["device"].failures,
        )


def _tensor_name(ref: TensorRef) -> str:
    return f"{ref.node} (scratch)" if ref.index < 0 else str(ref)


def variable_bytes(node: OpNode) -> int:
    """Bytes of the storage a ``VarHandleOp`` declares (0 when its shape is not fully known)."""
    return _declared_bytes(node.attrs)


def _declared_bytes(attrs: Mapping[str, attr_value_pb2.AttrValue]) -> int:
    shape = tf.TensorShape(attrs["shape"].shape) if "shape" in attrs else tf.TensorShape(None)
    if not shape.is_fully_defined() or "dtype" not in attrs:
        return 0
    count = 1
    for d in shape.as_list():
        count *= d
    return count * dtype_size(tf.as_dtype(attrs["dtype"].type))



def idle_variables(graph: GraphSource, eg: ExecutionGraph) -> tuple[tuple[str, int, str], ...]:
    """``(name, bytes, device)`` of the variables of ``graph`` that the step ``eg`` does not run.

    A session keeps every variable it has initialised where it was placed, used by the step or not (measured: a
    WGAN-GP fetching its critic loss alone had 14.65 MiB in use between steps, all its variables, where the
    simulator counting only what the step runs said 7.08 MiB). Grappler's rewrite of the step prunes the others,
    so they are taken from the graph as given.
    """
    if isinstance(graph, GraphIR):
        nodes = ((n.name, n.op, n.attrs, n.device) for n in graph.nodes)
    else:
        nodes = ((n.name, n.op, n.attr, n.device) for n in to_graph_def(graph).node)
    return tuple((name, _declared_bytes(attrs), device) for name, op, attrs, device in nodes
                 if op in VARIABLE_OPS and name not in eg.unit_of)
