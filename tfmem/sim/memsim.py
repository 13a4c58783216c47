"""The static memory simulator: replay one step of a graph and account for every buffer.

It follows TensorFlow's executor and allocator:

* with Grappler, the graph is the one the session runs: Grappler's rewrites, then the executor's own constant
  folding (``tfmem.sim.executor_folding``);
* the order is ``tfmem.sim.schedule.emulate`` (TF's ready-queue policy; of several draws of the successor orders
  TF hashes, the one with the median peak) unless an explicit order is given;
* an op's outputs are allocated when it starts and each buffer is freed when its last reader finishes;
* ``Identity``/``Reshape``-like ops, ``ReadVariableOp`` and dim-0 slices of whole aligned rows
  (``tfmem.sim.opmemory.VIEW_RULES``) share their input's buffer;
* element-wise kernels reuse an input buffer of the same size when they are its last reader (TF's
  ``forward_input_or_allocate_output``);
* constants and variable storage are persistent (variables allocated first: they were initialised before the
  step); fed tensors arrive before the step and, like fetched ones, are held to its end; a tensor crossing devices occupies both until the receiver is done with its copy;
* a dense in-place update of a resource variable whose value a reader still holds copies the variable into a
  new buffer first (TF's copy-on-write), and the old one lives until that reader is done;
* kernels' scratch buffers (``tfmem.sim.opmemory``, XLA-compiled grouped-convolution gradients included) live
  while their op runs;
* a ``TensorList`` handle holds the items put in it (an RNN's activations, kept from its forward loop to its
  gradient loop): they are allocated with the handle one op or loop hands to another and freed when its last
  reader is done (``tfmem.sim.tensor_list_memory``);
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

import collections
import dataclasses
import os
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence

from tensorflow.core.protobuf import config_pb2

from tfmem.ir.devices import DEFAULT_DEVICE, Placement, with_default_device
from tfmem.ir.execution import ExecutionGraph
from tfmem.ir.graph import GraphIR, TensorRef
from tfmem.ir.loading import GraphSource, load, to_graph_def
from tfmem.ir.ops import (
    VARIABLE_OPS,
)
from tfmem.ir.shapes import FeedShapes, annotate
from tfmem.ir.shared_init import sharing_groups
from tfmem.ir.tags import strip_tags
from tfmem.sim import costmodel
from tfmem.sim.analysis import Analysis, analyse, step_time_estimate, transfers_into, units_in
from tfmem.sim.arguments import checked_arguments
from tfmem.sim.executor_folding import fold_like_executor
from tfmem.sim.graphcache import GraphCache
from tfmem.sim.grappler import runtime_graph_def
from tfmem.sim.profile import MemoryProfile, declared_variable_bytes
from tfmem.sim.replay import Replay, bystanders, fed_domain, first_update_copies
from tfmem.sim.schedule import Schedule, emulate, fixed


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
    every_order: bool = False,
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
        capacity the BFC hands out free chunks whole, so the peak TF reports depends on the capacity: compare a
        testbed's measured peak with the simulation at the testbed's ``device_memory``, never with the unbounded
        one (``tests/test_accuracy.py``; the planned U-Net of ``experiments/results/simulator_accuracy.md``).
        With a capacity the replay also runs the session's first step before the reported one (the testbed
        measures after a warm-up step): there TF copies each variable that shares its initial buffer with others
        (Adam or momentum slots, biases: ``tfmem.ir.shared_init``) into a new chunk mid-region as it first
        updates it, and later steps run around those chunks; and the fed tensors are allocated in each of
        ``feed_orders`` (a session follows the caller's feed dict), the worst replay reported
    every_order : replay every distinct draw of TF's hashed successor orders (``ORDER_SAMPLES``), not only the
        median one, and report the worst: a session draws one per process, and near a cap one draw can fail
        where the median fits (a ResNet-20 on one thread: experiments/results/allocator_fit.md)

    Raises
    ------
    UnknownShapeError
        Listing every executed tensor whose size is unknown.
    """
    fetch_names, feed_shapes, device_memory = checked_arguments(fetches, feed_shapes, device, host, device_memory, inter_op_threads)
    if grappler:
        # optimize replays one plan on several device sizes: Grappler's rewrite (seconds on large graphs) is kept
        # per graph object, as tags on the graph carry into the rewrite.
        runtime_key = (tuple(fetch_names), device, None if config is None else config.SerializeToString(),
                       tuple(sorted((k, tuple(v)) for k, v in (feed_shapes or {}).items())))
        ir = _RUNTIME.get(graph, runtime_key) if isinstance(graph, GraphIR) else None
        if ir is None:
            # The session never sees the passes' tags (``tfmem.ir.tags``), and a tag can keep Grappler's common-
            # subgraph elimination from merging two ops: rewrite the untagged graph, so that every tagging of one
            # program gets the one answer, and the cache here and Grappler's (by bytes) serve them all.
            source = strip_tags(graph) if isinstance(graph, GraphIR) else graph
            placed = with_default_device(to_graph_def(source), device or DEFAULT_DEVICE)
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
           every_order)
    if grappler:   # keyed by the graph given: the variables it shares and holds idle come from it
        cached = _GRAPPLER_PROFILES.get(graph, (runtime_key, key)) if isinstance(graph, GraphIR) else None
    else:
        cached = _PROFILES.get(ir, key)
    if cached is not None:
        return cached
    WORK["simulations"] += 1
    analysis = analyse(ir, fetch_names, feed_names, cost_device)
    eg, durations, expensive = analysis.eg, analysis.durations, analysis.expensive
    placement = Placement(device, host)
    if order is not None:
        scheds: tuple[Schedule, ...] = (fixed(units_in(eg, order), durations.__getitem__),)
    else:
        gpu = "GPU" in (device or "").upper()  # TF's GPU kernels all count as cheap: everything runs inline
        key_s = (gpu, inter_op_threads)  # the same graph is often scored again with another capacity or cores
        is_expensive = (lambda u: False) if gpu else expensive.__getitem__
        if every_order:
            scheds = analysis.drawn_schedules.get(key_s) or analysis.drawn_schedules.setdefault(
                key_s, _drawn_schedules(analysis, is_expensive, inter_op_threads))
        else:
            scheds = (analysis.schedules.get(key_s) or analysis.schedules.setdefault(key_s, _typical_schedule(
                analysis, is_expensive, inter_op_threads)),)
    sched = scheds[0]
    # With a capacity, where the fed tensors land decides what fits, and TF allocates them in the order of the
    # caller's feed dict, which the graph does not say: replay a few orders and report the worst.
    # The initializers that decide which variables share a buffer are pruned from Grappler's rewrite of the step.
    sharing: dict[Hashable, list[str]] = {}   # without a capacity no layout is replayed: nothing shares
    if device_memory is not None:
        known = _SHARING.get(graph, ()) if isinstance(graph, GraphIR) else None
        if known is None:
            source = graph if isinstance(graph, GraphIR) else GraphIR.from_graph_def(to_graph_def(graph))
            known = sharing_groups(source)
            if isinstance(graph, GraphIR):
                _SHARING.put(graph, (), known)
        sharing = known
    # Which holder of a shared buffer is updated last, and so keeps it, is the executor's order; the emulated one
    # can differ, and one small chunk moved decides whether a large request finds room: replay both orders and
    # report the worst (tests/test_guarantee.py: a ResNet-20 with momentum).
    copy_orders = ("schedule", "graph") if sharing else ("schedule",)
    idle = _IDLE.get(graph, tuple(fetch_names)) if isinstance(graph, GraphIR) else None
    if idle is None:
        idle = idle_variables(graph, eg)
        if isinstance(graph, GraphIR):
            _IDLE.put(graph, tuple(fetch_names), idle)
    skipped = analysis.bystanders.get(placement)
    if skipped is None:
        skipped = analysis.bystanders[placement] = bystanders(eg, placement)

    def distinct_copy_orders(sched: Schedule) -> list[str]:
        # Copy orders that relocate the same variables of this device (a bystander's take no layout) replay the
        # same (``Replay.relocations``): the first stands for them, as max keeps the first of equals.
        kept, seen = [], set()
        for c in copy_orders:
            moved = first_update_copies(eg, sharing, sched.order if c == "schedule" else None)
            key = bool(moved), tuple(sorted((u, tuple(sorted(v))) for u, v in moved.items() if u not in skipped))
            if key not in seen:
                seen.add(key)
                kept.append(c)
        return kept

    fed_in = feed_orders(eg, placement) if device_memory is not None else [None]

    def replays() -> Iterator[MemoryProfile]:
        for sc in scheds:
            kept = distinct_copy_orders(sc) if len(copy_orders) > 1 else list(copy_orders)
            for o in fed_in:
                for c in kept:
                    yield Replay(eg, placement, device_memory, analysis.views, feed_order=o, sharing=sharing,
                                 copy_order=c, idle_variables=idle, lists=analysis.lists, bystanders=skipped).run(sc)

    profile = max(replays(), key=lambda p: (p.allocation_failures, p.peak_bytes))
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
    elif isinstance(graph, GraphIR):
        _GRAPPLER_PROFILES.put(graph, (runtime_key, key), profile)
    return profile


def feed_orders(eg: ExecutionGraph, placement: Placement | None = None) -> list[tuple[TensorRef, ...]]:
    """Orders in which a session may allocate the fed tensors: by name, by size either way, and reversed; with
    ``placement``, only those that differ in the order of the tensors fed to its device or host (another
    device's allocations take no layout in the replay, so their order changes nothing it reports).

    The order matters near a capacity: BFC hands a free chunk out whole unless it is twice the request, and
    the feeds arrive when the region is nearly empty: one order can fail where another fits
    (``tests/test_memsim.py::test_a_capacity_replays_the_feeds_in_their_worst_order``).

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
    seen: set[tuple[TensorRef, ...]] = set()
    for order in (by_name, by_name[::-1], by_size, by_size[::-1]):
        here = tuple(t for t in order if placement is None or fed_domain(eg, placement, t) != "other")
        if here not in seen:
            seen.add(here)
            orders.append(tuple(order))
    return orders


# Draws of TF's hashed successor orders (``ExecutionGraph.activation_order``) emulated per simulation.
ORDER_SAMPLES = 5


def _drawn_schedules(analysis: Analysis, expensive: Callable[[str], bool], threads: int) -> tuple[Schedule, ...]:
    """The distinct emulated schedules over ``ORDER_SAMPLES`` draws of TF's hashed orders, the median one first."""
    eg, durations = analysis.eg, analysis.durations
    typical = _typical_schedule(analysis, expensive, threads)
    drawn = {typical.order: typical}
    for seed in range(ORDER_SAMPLES):
        s = emulate(eg.units, eg.unit_preds, eg.activation_order(seed), durations.__getitem__, expensive, threads,
                    seed=seed)
        drawn.setdefault(s.order, s)
    return tuple(drawn.values())


def _typical_schedule(analysis: Analysis, expensive: Callable[[str], bool], threads: int) -> Schedule:
    """The emulated schedule whose peak is the median over ``ORDER_SAMPLES`` draws of TF's hashed orders.

    Where a node has more out-edges than TF keeps in order, TF's order differs from process to process
    (``tests/test_memsim.py::test_successors_past_eight_out_edges_come_in_hashed_order``) and so does the peak
    (``experiments/results/peak_variance.md``). One draw would be a lottery; the median draw is
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


# Simulations computed in this process (not answered from a cache): the budget search reports its work in them.
WORK: collections.Counter[str] = collections.Counter()
# Recent simulations of graphs as written (not Grappler's rewrite of them), keyed by the other arguments.
_PROFILES: GraphCache[MemoryProfile] = GraphCache(kept=8)
# Grappler's rewrites of recent graphs (annotated), keyed by fetches, device, config and feed shapes; tags aside,
# as they are stripped before the rewrite.
_RUNTIME: GraphCache[GraphIR] = GraphCache(kept=4)
# Recent simulations after Grappler's rewrites, keyed by the graph given and the other arguments.
_GRAPPLER_PROFILES: GraphCache[MemoryProfile] = GraphCache(kept=8)
# Variables sharing an initial buffer (``tfmem.ir.shared_init``) of recent graph objects: a layout check replays one
# plan on several device sizes and in two thread orders.
_SHARING: GraphCache[dict[Hashable, list[str]]] = GraphCache(kept=4, same_object=True)
# The variables each graph holds beyond those its step runs (``idle_variables``), keyed by fetches.
_IDLE: GraphCache[tuple[tuple[str, int, str], ...]] = GraphCache(kept=4, same_object=True)


def idle_variables(graph: GraphSource, eg: ExecutionGraph) -> tuple[tuple[str, int, str], ...]:
    """``(name, bytes, device)`` of the variables of ``graph`` that the step ``eg`` does not run.

    A session keeps every variable it has initialised where it was placed, used by the step or not
    (``tests/test_memsim.py::test_idle_variable_is_measured_as_simulated``). Grappler's rewrite of the step
    prunes the others, so they are taken from the graph as given.
    """
    if isinstance(graph, GraphIR):
        nodes = ((n.name, n.op, n.attrs, n.device) for n in graph.nodes)
    else:
        nodes = ((n.name, n.op, n.attr, n.device) for n in to_graph_def(graph).node)
    return tuple((name, declared_variable_bytes(attrs), device) for name, op, attrs, device in nodes
                 if op in VARIABLE_OPS and name not in eg.unit_of)
