"""``tfmem.optimize`` (defined here): load a graph, run the memory passes for a budget, and hand back what to run.

The result keeps every node name, so the user's feeds and fetches work unchanged on ``Optimized.graph``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import takewhile

import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import config_pb2

from passes import DEFAULT_PASSES, FINAL_REWRITES, LEADING_REWRITES, PASSES
from passes.place_persistent import host_capable_ops
from tfmem.errors import BadInputError, InfeasibleBudgetError, TfmemError, on_device
from tfmem.gcpause import without_gc_pauses
from tfmem.ir.colocation import placed_as_tensorflow_would
from tfmem.ir.devices import DEFAULT_DEVICE, Placement, check_devices, same_device, with_default_device
from tfmem.ir.execution import ExecutionGraph, parse_fetches
from tfmem.ir.graph import GraphIR
from tfmem.ir.loading import GraphSource, load, to_graph_def
from tfmem.ir.shapes import FeedShapes
from tfmem.lowering import has_functional_loops, lower_functional
from tfmem.pipeline import Pass, PassContext, run_pipeline
from tfmem.report import Report
from tfmem.rounding import rounding_caveat
from tfmem.search import Candidate, Search, SearchLog
from tfmem.sim.arguments import check_count, checked_arguments
from tfmem.sim.bounds import fed_layout_floor, largest_working_set
from tfmem.sim.grappler import grappler_rejects
from tfmem.sim.profile import MemoryProfile
from tfmem.testbed.graph import initializer_names
from tfmem.units import format_bytes, parse_bytes

# Rounds of planning every device (``_plan_across``): the second replans only the devices that a later device's
# plan pushed over their budget.
ACROSS_ROUNDS = 2
# Above this many ops the graph is simulated as written, and the report says so: at 20,000 ops one simulation
# after Grappler outlasts optimize's whole run as written (experiments/results/optimize_speed.md).
GRAPPLER_SIMULATION_MAX_OPS = 10_000
# A plan aims for the budget less 5%, at least 4 MiB (``target_bytes_for``), and its allocator replay must fit the
# budget less 2% and 4 MiB (``layout_room``): on the testbed a plan can need a whole swapped tensor more than its
# replay, as copies to and from the host land earlier or later than replayed (a 1024x1024 MLP's plan: replay
# within 16.3 MiB, out of memory at 18.2 MiB with 14.1 MiB in use and a 4 MiB request; WGAN-GP: 5 MiB more,
# experiments/results/allocator_fit.md, plans; peak_variance.md). A share alone does not cover that quantum.
PLAN_MARGIN_SHARE = 0.05
PLAN_MARGIN_MIN_BYTES = 4 * 2**20
LAYOUT_MARGIN_SHARE = 0.02
LAYOUT_MARGIN_BYTES = 4 * 2**20
# A graph kept as it is (``_kept_as_is``) must fit the allocator replay, every draw of TF's hashed orders, on the
# budget less 3.5%: of 20 graph/pool pairs, the most the testbed needed beyond that replay was 2.9% of the cap
# (a ResNet-20 on one thread: the replay fits 82.6 MiB, the testbed ran 1 of 2 times at 85 MiB, both at 86);
# DeepSpeech's replay fits 43.2 MiB and the testbed ran at 43 (docs/RESULTS.md, "The smallest device").
AS_IS_MARGIN_SHARE = 0.035


def as_is_room(budget_bytes: int) -> int:
    """The device size on which a graph's replay must fit for ``optimize`` to keep it as it is."""
    return budget_bytes - int(budget_bytes * AS_IS_MARGIN_SHARE)


def target_bytes_for(budget_bytes: int) -> int:
    """The simulated peak a plan may reach within ``budget_bytes``: the budget less 5%, at least 4 MiB."""
    return budget_bytes - max(int(budget_bytes * PLAN_MARGIN_SHARE), PLAN_MARGIN_MIN_BYTES)


def layout_room(budget_bytes: int, largest_transfer: int = 0) -> int:
    """The device a plan's allocator replay must serve every request on: the budget less 2% and a whole swapped
    tensor, the plan's largest (``largest_transfer_bytes``), at least 4 MiB. A copy to or from the host lands
    earlier or later than replayed, and the chunk it takes or leaves moves the layout by its size: TF-Slim VGG-16's
    plan at 0.7x replayed within its budget with room to spare, and on the testbed its 392 MiB gradient sum found
    no chunk, also with 10% more memory (docs/RESULTS.md, "The model zoos")."""
    margin = max(LAYOUT_MARGIN_BYTES, largest_transfer)
    return max(budget_bytes - int(budget_bytes * LAYOUT_MARGIN_SHARE) - margin, 1)


def largest_transfer_bytes(graph: GraphIR, placement: Placement) -> int:
    """The largest tensor a step of ``graph`` copies between the device and the host (0 when none)."""
    largest = 0
    domains = {n.name: placement.domain(n.device) for n in graph.nodes}
    for node in graph.nodes:
        here = domains[node.name]
        for ref in node.inputs:
            there = domains.get(ref.node)
            if there is not None and {here, there} == {"device", "host"}:
                largest = max(largest, graph.spec(ref).nbytes or 0)
    return largest


@dataclass(frozen=True)
class Optimized:
    """What ``optimize`` returns: run ``graph`` with ``config``; ``report`` says what changed and why."""

    graph: tf.Graph
    graph_def: graph_pb2.GraphDef
    config: config_pb2.ConfigProto
    report: Report
    ir: GraphIR


def session_config() -> config_pb2.ConfigProto:
    """The ``ConfigProto`` to run optimized graphs with: Grappler stays on; inserted ops opt out of it."""
    return config_pb2.ConfigProto()


def resolve_passes(passes: str | Sequence[str | Pass] | None) -> list[Pass]:
    """Turn ``"auto"``, ``None``/``[]`` or a list of pass names/objects into pass objects.

    Raises
    ------
    BadInputError
        For an unknown pass name, or an entry that is neither a name nor a pass; the message lists the passes.

    Examples
    --------
    >>> [p.name for p in resolve_passes(["partition"])]
    ['partition']
    >>> resolve_passes([3])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    tfmem.errors.BadInputError: passes[0] is 3 (int), neither a pass name nor a pass; give names from ...
    """
    if passes is None:
        return []
    known = f"{', '.join(sorted(PASSES))}; or passes='auto' for the default pipeline, passes=[] for none"
    if isinstance(passes, str):
        if passes == "auto":
            return list(DEFAULT_PASSES)
        passes = [passes]
    if not isinstance(passes, Iterable) or isinstance(passes, bytes | Mapping):
        raise BadInputError(f"passes must be 'auto', None or a list of pass names, got {passes!r} "
                            f"({type(passes).__name__}); give names from {known}")
    out: list[Pass] = []
    for i, p in enumerate(passes):
        if isinstance(p, str):
            if p not in PASSES:
                raise BadInputError(f"unknown pass {p!r}; available passes: {known}")
            out.append(PASSES[p])
        elif isinstance(getattr(p, "name", None), str) and callable(getattr(p, "run", None)):
            out.append(p)
        else:
            raise BadInputError(f"passes[{i}] is {p!r} ({type(p).__name__}), neither a pass name nor a pass; "
                                f"give names from {known}")
    return out


@without_gc_pauses
def optimize(
    graph: GraphSource,
    fetches: Iterable[str] | str,
    *,
    budget: int | str | None = None,
    feed_shapes: FeedShapes | None = None,
    device: str | None = None,
    host: str | None = None,
    passes: str | Sequence[str | Pass] | None = "auto",
    check: bool = True,
    inter_op_threads: int | None = None,
    grappler: bool | None = None,
    layout_check: bool = True,
    devices: Mapping[str, str | None] | None = None,
) -> Optimized:
    """Rewrite ``graph`` so that computing ``fetches`` needs less device memory, with identical results.

    Parameters
    ----------
    graph : tf.Graph, GraphDef, MetaGraphDef or a .pb/.pbtxt path; a graph with functional ``While`` loops has
        them (and its ``If`` ops) lowered to v1 frames, as the session's runtime lowers them (``tfmem.lowering``),
        and the result is that graph
    fetches : what each step computes, as for ``Session.run`` (``"loss:0"``, ``"train_op"``)
    budget : device memory to fit in, as bytes or a string such as ``"8GiB"``; None means "as low as is cheap".
        Positive and at most 2**62 bytes; a fractional number of bytes is rounded down (``tfmem.parse_bytes``)
    feed_shapes : full shapes for fed tensors whose static shape is partial, e.g. ``{"x:0": (64, 784)}``
        (non-negative ints; keys are tensor names or tensors)
    device, host : device strings; default: ops stay where they are, ``host`` is where swapped tensors go
    devices : for a graph over several devices (machines of TensorFlow's distributed runtime), each device mapped
        to its own host (or None), e.g. ``{"/job:worker/task:0/device:GPU:0": "/job:worker/task:0/device:CPU:0",
        ...}``, instead of ``device``/``host``: every device is planned against ``budget``, moving its tensors
        only to its own host. Ops with no device run on the first device, unless TensorFlow colocates them with
        a placed op (a variable's reads and updates). ``report.devices`` has each device's report; ``report``'s
        own figures are those of the device with the highest peak after
    passes : ``"auto"``, ``None`` or ``[]`` for none, or a list of pass names such as ``["partition",
        "limit_parallelism"]`` (or pass objects)
    check : verify the graph after every pass
    inter_op_threads : the inter-op thread pool the session will run with (default, None or 0: TF's, one per
        core); how much parallelism is safe to keep depends on it
    grappler : simulate the graph after Grappler's rewrites, as the session runs it; default: for graphs of
        up to ``GRAPPLER_SIMULATION_MAX_OPS`` ops
    layout_check : keep the graph as it is where its allocator replay fits, and replay each plan on the device
        allocator's layout and plan again for less where a request would go unserved (the guarantee; switch it
        off only to study what the planner reaches: it then always plans)

    Raises
    ------
    InfeasibleBudgetError
        When the best graph found still needs more than ``budget``; carries the lower bound.
    BadInputError, MalformedGraphError, UnknownShapeError
        For bad arguments or graphs.

    Examples
    --------
    >>> import tensorflow as tf
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     x = tf.compat.v1.placeholder(tf.float32, (256, 256), name="x")
    ...     y = tf.reduce_sum(tf.matmul(x, x), name="y")
    >>> opt = optimize(g, ["y:0"], budget="64MiB")
    >>> opt.report.after.peak_bytes <= 64 * 2**20
    True
    """
    # Arguments are checked before any work, each by the check its value meets first (tfmem.sim.arguments).
    budget_bytes = parse_bytes(budget, what="budget", minimum=1) if budget is not None else None
    fetch_list, shapes_given, _ = checked_arguments(fetches, feed_shapes, device, host)
    if inter_op_threads is not None:
        check_count(inter_op_threads, "inter_op_threads (None or 0: TF's default)")
    pairs = check_devices(devices, device, host) if devices is not None else None
    if host is not None and device is None and same_device(DEFAULT_DEVICE, host):
        raise BadInputError(f"host={host!r} could also name the device that unplaced ops run on; pass "
                            "device= as well, e.g. device='/GPU:0', host='/CPU:0'")
    if host is not None and device is not None and same_device(device, host):
        raise BadInputError(f"host={host!r} and device={device!r} can name the same device; swapped tensors must "
                            "leave the device: pass two different devices, e.g. device='/GPU:0', host='/CPU:0'")
    pipeline = resolve_passes(passes)
    ir = _loaded(graph, fetch_list, shapes_given)
    how = _How(fetch_list, shapes_given or {}, budget_bytes, pipeline, check, inter_op_threads, grappler,
               layout_check)
    if pairs is None:
        new_ir, config, report = _plan(ir, how, device, host)
    else:
        new_ir, config, report = _plan_across(ir, how, pairs)
    if report.caveat is not None:
        warnings.warn(report.caveat, stacklevel=3)   # the caller of optimize, past without_gc_pauses
    return _optimized(new_ir, config, report)


@dataclass(frozen=True)
class _How:
    """``optimize``'s checked arguments that every device's plan shares."""

    fetches: list[str]
    shapes: dict[str, tuple[int, ...]]
    budget_bytes: int | None
    pipeline: list[Pass]
    check: bool
    inter_op_threads: int | None
    grappler: bool | None
    layout_check: bool


def _plan(ir: GraphIR, how: _How, device: str | None, host: str | None,
          grappler_off: bool | None = None) -> tuple[GraphIR, config_pb2.ConfigProto, Report]:
    """Plan ``ir`` for one device (and its host): the graph, its session config and the report; raises
    ``InfeasibleBudgetError`` when nothing fits. ``grappler_off``: whether the session runs without Grappler
    (default: when Grappler rejects ``ir``)."""
    budget_bytes, fetch_list, pipeline = how.budget_bytes, how.fetches, how.pipeline
    all_passes = {p.name for p in resolve_passes("auto")} <= {p.name for p in pipeline}
    max_target = target_bytes_for(budget_bytes) if budget_bytes is not None else None
    notes: list[str] = []
    base, grappler_off = _session_context(ir, fetch_list, how.shapes, device, host, how.check, how.inter_op_threads,
                                          how.grappler, grappler_off)
    faithful = base.grappler
    before = base.simulate(ir)  # the budget does not change the unoptimized graph's peak
    if budget_bytes is not None and how.layout_check:   # keeping the graph rests on the same allocator replay
        kept = _kept_as_is(ir, base, budget_bytes, before)
        if kept is not None:
            return kept
    if pipeline:
        # Any rewrite may change how Grappler fuses kernels, orders the graph's sums and associates its chains of
        # products (renamed inputs, clones and control edges block its folding): pin all three first, so results
        # stay bit-identical. Large-scratch kernels are chained first too, and copies to host fenced last, so the
        # session cannot exceed the simulated peak.
        named = {p.name for p in pipeline}
        pipeline = ([p for p in LEADING_REWRITES if p.name not in named] + pipeline
                    + [p for p in FINAL_REWRITES if p.name not in named])
    # LEADING_REWRITES (all budget_independent) run once, first: they can lower the lower bound itself, so the bound
    # is taken on their output, and every replan starts from it.
    leading = list(takewhile(lambda p: any(p is q for q in LEADING_REWRITES), pipeline))
    pipeline = pipeline[len(leading):]
    ir, leading_reports = run_pipeline(ir, leading, dataclasses.replace(base, target_bytes=max_target))
    bound = 0
    if max_target is not None and budget_bytes is not None:
        # No rewrite goes below the lower bound, so a plan that simulates under it would be a simulator error:
        # refuse before planning (tests/test_optimize.py::test_budget_below_any_plan_raises_with_lower_bound).
        ctx = dataclasses.replace(base, target_bytes=max_target)
        inputs = _bound_inputs(ir, ctx)   # (the step's ExecutionGraph and its host-capable ops: built once)
        bound, _ = lower_bound_bytes(ir, ctx, inputs)
        feeds_floor, _ = fed_layout_floor(*inputs)
        if bound > max_target or feeds_floor > layout_room(budget_bytes):
            raise _infeasible(ir, ctx, budget_bytes, before, unplanned=True, all_passes=all_passes,
                              smallest=smallest_planned_budget(bound, feeds_floor))
    search = Search(ir, pipeline, base, before)
    first = None
    if budget_bytes is not None and max_target is not None:
        room = layout_room(budget_bytes)
        first = min(max_target, room)   # the layout replay never needs less than the plan's total
        if how.layout_check:
            search.fits_layout = lambda c: layout_fits(base, c.ir, c.target_bytes, budget_bytes)
            search.layout_step = lambda c: _layout_step(base, c, budget_bytes)
    chosen, fits = search.run(max_target, first, bound)
    notes.extend(search.notes)
    new_ir, after = chosen.ir, chosen.profile
    ctx = dataclasses.replace(base, target_bytes=chosen.target_bytes)
    reports = leading_reports + list(chosen.reports)
    report = Report(budget_bytes, before, after, reports, search=search.log)
    if grappler_off:
        report.notes.append("TensorFlow's graph optimizer (Grappler) fails on this graph (or, across devices, on "
                            "the user's), so a session runs it as written; run the result with Optimized.config, "
                            "which turns Grappler off, for identical results")
    report.notes.extend(notes)
    if not faithful and not grappler_off:
        report.notes.append(f"simulated as written, without Grappler's rewrites ({len(ir)} ops; "
                            "pass grappler=True to simulate what the session runs, slower on large graphs)")
    if budget_bytes is not None:
        report.notes.append(f"planned for {format_bytes(chosen.target_bytes or 0)}: the budget less a safety margin "
                            "for the run-to-run spread of the executor's order")
    report.notes.append(search.log.summary())
    caveat = rounding_caveat(new_ir, reports, fetch_list) if fits else None
    if caveat is not None:   # never silent: in the report, and once as a warning (by optimize)
        report.notes.append(caveat)
        report.caveat = caveat
    if not fits:
        assert budget_bytes is not None and max_target is not None
        raise _infeasible(new_ir, ctx, budget_bytes, after, fragmented=after.peak_bytes <= max_target,
                          reachable=chosen.floor_bytes, search=search.log, all_passes=all_passes)
    return new_ir, base.session_config or session_config(), report


def _plan_across(ir: GraphIR, how: _How,
                 pairs: list[tuple[str, str | None]]) -> tuple[GraphIR, config_pb2.ConfigProto, Report]:
    """Plan every device of ``pairs`` (device, its host) against the budget, one after another, each plan on the
    graph the previous ones left; then check every device again on the final graph and plan once more those
    that no longer fit, up to ``ACROSS_ROUNDS`` rounds.

    Ops with no device are first given the device TensorFlow's placer runs them on (``tfmem.ir.colocation``:
    with the variable they read or are colocated with, else the first device), so each device's plan counts
    exactly its own ops. A device's plan only moves its own tensors, to its own host: the passes rewrite the
    ops ``Placement(device, host)`` puts in the device domain and place what they add on that device or host.
    """
    ir = placed_as_tensorflow_would(ir, pairs[0][0])
    hosts = dict(pairs)
    rejected_before = grappler_rejects(ir.to_graph_def(), how.fetches)
    befores = {d: _context(ir, how, d, h, rejected_before).simulate(ir) for d, h in pairs}
    reports: dict[str, Report] = {}
    configs: dict[str, config_pb2.ConfigProto] = {}   # a device planned again replaces its config
    pending = [d for d, _ in pairs]
    afters: dict[str, MemoryProfile] = {}
    for _ in range(ACROSS_ROUNDS):
        for device in pending:
            # Once the session is to run without Grappler (it rejects the user's graph, or a plan turned it off),
            # every later plan is simulated so too, though Grappler may accept the graph a plan left.
            off = rejected_before or any(c.graph_options.rewrite_options.disable_meta_optimizer
                                         for c in configs.values())
            try:
                ir, configs[device], reports[device] = _plan(ir, how, device, hosts[device], True if off else None)
            except InfeasibleBudgetError as e:
                raise on_device(e, device) from None
        config = merged_config(list(configs.values()))
        rejected = (config.graph_options.rewrite_options.disable_meta_optimizer
                    or grappler_rejects(ir.to_graph_def(), how.fetches))
        afters, pending = _recheck(ir, how, pairs, rejected)
        if not pending:
            break
    if pending:
        device = pending[0]
        base = _context(ir, how, device, hosts[device], rejected)
        assert how.budget_bytes is not None   # only a budget makes a device fail the recheck
        fragmented = afters[device].peak_bytes <= target_bytes_for(how.budget_bytes)
        raise on_device(_infeasible(ir, base, how.budget_bytes, afters[device], fragmented=fragmented), device)
    for device, report in reports.items():
        report.before, report.after = befores[device], afters[device]
    worst = max(reports, key=lambda d: afters[d].peak_bytes)
    report = Report(how.budget_bytes, befores[worst], afters[worst],
                    [p for r in reports.values() for p in r.passes], devices=reports)
    report.notes.append(f"planned {len(pairs)} devices one after another, each against the budget with its own host; "
                        f"the figures are those of {worst}, the device with the highest peak after")
    if rejected:   # as a session runs it anyway, and as it was rechecked
        config.graph_options.rewrite_options.disable_meta_optimizer = True
    caveats = [f"{d}: {r.caveat}" for d, r in reports.items() if r.caveat]
    if rejected and not rejected_before:
        # Grappler fails on some acyclic graphs ("couldn't be sorted in topological order"), and a plan can make
        # the user's graph one of them: the session then runs it without Grappler's rewrites, which can change
        # float results in the last bits. Said, never silent.
        caveats.append("TensorFlow's graph optimizer (Grappler) fails on the planned graph though not on the "
                       "original, so the session runs it without Grappler's rewrites (Optimized.config says so): "
                       "outputs may differ from the unoptimized session's in the last bits")
        report.notes.append(caveats[-1])
    report.caveat = " ".join(caveats) or None
    return ir, config, report


def _context(ir: GraphIR, how: _How, device: str, host: str | None, rejected: bool) -> PassContext:
    """How the session runs ``ir`` for ``device`` of a plan across devices (``rejected``: without Grappler)."""
    return _session_context(ir, how.fetches, how.shapes, device, host, False, how.inter_op_threads, how.grappler,
                            rejected)[0]


def _recheck(ir: GraphIR, how: _How, pairs: list[tuple[str, str | None]],
             rejected: bool) -> tuple[dict[str, MemoryProfile], list[str]]:
    """Every device's profile on the final graph as the session runs it (``rejected``: without Grappler), and the
    devices it no longer fits: a plan made later can hold an earlier device's tensors longer (its control edges
    delay what that device waits for)."""
    afters: dict[str, MemoryProfile] = {}
    failing: list[str] = []
    for device, host in pairs:
        base = _context(ir, how, device, host, rejected)
        afters[device] = base.simulate(ir)
        if how.budget_bytes is None:
            continue
        target = target_bytes_for(how.budget_bytes)
        planned_fits = afters[device].peak_bytes <= target and (
            not how.layout_check or layout_fits(base, ir, target, how.budget_bytes))
        # or as a device's graph is kept as it is (_kept_as_is), which its plan may have been
        if not planned_fits and (not how.layout_check or layout_failures(
                dataclasses.replace(base, grappler=True), ir, as_is_room(how.budget_bytes), every_order=True)):
            failing.append(device)
    return afters, failing


def merged_config(configs: Sequence[config_pb2.ConfigProto]) -> config_pb2.ConfigProto:
    """One session config that honours each plan's: Grappler off if any plan needs it off, and the fewest
    inter-op threads any plan asked for."""
    merged = session_config()
    threads = [c.inter_op_parallelism_threads for c in configs if c.inter_op_parallelism_threads]
    if threads:
        merged.inter_op_parallelism_threads = min(threads)
    if any(c.graph_options.rewrite_options.disable_meta_optimizer for c in configs):
        merged.graph_options.rewrite_options.disable_meta_optimizer = True
    return merged


def _optimized(ir: GraphIR, config: config_pb2.ConfigProto, report: Report) -> Optimized:
    """What ``optimize`` returns for ``ir``: its GraphDef and a ``tf.Graph`` imported from it."""
    graph_def = ir.to_graph_def()
    tf_graph = tf.Graph()
    with tf_graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    return Optimized(tf_graph, graph_def, config, report, ir)


def _session_context(ir: GraphIR, fetch_list: list[str], shapes: dict[str, tuple[int, ...]], device: str | None,
                     host: str | None, check: bool, inter_op_threads: int | None, grappler: bool | None,
                     rejected: bool | None = None) -> tuple[PassContext, bool]:
    """How the user's session runs the graph (its threads, whether Grappler rewrites it, its config), and
    whether Grappler rejects the graph (the session then runs it unrewritten); ``rejected``, when given, says
    so already (a graph with every op placed gets one answer for all its devices)."""
    faithful = len(ir) <= GRAPPLER_SIMULATION_MAX_OPS if grappler is None else grappler
    config = session_config()
    grappler_off = rejected if rejected is not None else grappler_rejects(
        with_default_device(ir.to_graph_def(), device or DEFAULT_DEVICE), fetch_list)
    if grappler_off:
        # The user's session runs this graph without Grappler's rewrites; the rewritten graph must run the same
        # way (Grappler may well accept it, and its rewrites change the arithmetic), and is planned so.
        config.graph_options.rewrite_options.disable_meta_optimizer = True
    base = PassContext(tuple(fetch_list), None, device, host, shapes, check=check,
                       inter_op_threads=inter_op_threads, grappler=faithful, session_config=config)
    return base, grappler_off


def unoptimized_profile(graph: GraphSource, fetches: Iterable[str] | str, *, feed_shapes: FeedShapes | None = None,
                        device: str | None = None, host: str | None = None,
                        inter_op_threads: int | None = None) -> MemoryProfile:
    """The simulated step of ``graph`` as the session runs it unchanged: ``optimize``'s "before" (the same
    inter-op threads, Grappler's rewrites where optimize simulates them, the same session config).
    ``tfmem analyze`` reports this, so that both commands give one vanilla peak
    (``tests/test_cli.py::test_analyze_and_optimize_report_one_vanilla_peak``)."""
    fetch_list, shapes_given, _ = checked_arguments(fetches, feed_shapes, device, host)
    ir = _loaded(graph, fetch_list, shapes_given)
    base, _ = _session_context(ir, fetch_list, shapes_given or {}, device, host, False, inter_op_threads, None)
    return base.simulate(ir)


def _loaded(graph: GraphSource, fetch_list: list[str], shapes: FeedShapes | None) -> GraphIR:
    """``graph`` as ``optimize`` plans it: loaded, and where it has functional loops, with ``While``/``If``
    lowered to v1 frames as the session's runtime lowers them (``tfmem.lowering``); a fetch it lacks fails early,
    with its name."""
    source = to_graph_def(graph)
    if has_functional_loops(source):
        parse_fetches(load(source, shapes), fetch_list)   # named as the user wrote the graph
        fed = [name.split(":")[0] for name in (shapes or {})]   # a fed loop output must keep its name too
        source = lower_functional(source, sorted({name.split(":")[0] for name in fetch_list} | set(fed)))
    ir = load(source, shapes)
    parse_fetches(ir, fetch_list)
    return ir


def _kept_as_is(ir: GraphIR, base: PassContext, budget_bytes: int,
                before: MemoryProfile) -> tuple[GraphIR, config_pb2.ConfigProto, Report] | None:
    """The graph unchanged, when the session already runs it within ``budget_bytes``: with the session's pool,
    or else with one inter-op thread (``Optimized.config`` then says so). None when neither fits.

    Nothing a rewrite adds makes a step quicker, so a graph that fits is never planned
    (tests/test_optimize.py::test_a_budget_the_graph_meets_returns_it_unchanged). Fits means the allocator
    replay of what the session runs (after Grappler), in every draw of TF's hashed orders, serves every request
    on ``as_is_room(budget_bytes)``: the replay's smallest fitting device is checked against the testbed's in
    experiments/results/allocator_fit.md.
    """
    device_memory = as_is_room(budget_bytes)
    if device_memory <= 0:
        return None
    config = config_pb2.ConfigProto()
    config.CopyFrom(base.session_config or session_config())
    for threads in dict.fromkeys((base.threads, 1)):
        ctx = dataclasses.replace(base, inter_op_threads=threads, grappler=True)
        if layout_failures(ctx, ir, device_memory, every_order=True):
            continue
        after = before if threads == base.threads else base.simulate(ir, inter_op_threads=threads)
        report = Report(budget_bytes, before, after, [])
        how = "as it is" if threads == base.threads else "with one inter-op thread (Optimized.config sets it)"
        report.notes.append(f"the graph already runs within the budget {how}: its allocator replay serves every "
                            f"request on {format_bytes(device_memory)} (the budget less {AS_IS_MARGIN_SHARE:.1%}), "
                            "so it is returned unchanged (functional loops, if any, lowered as the session runs them)")
        if threads != base.threads:
            # One thread runs the ops in one order; the executor's default pool runs some side by side and
            # together they need more than the budget (the replay of that interleaving does not fit).
            config.inter_op_parallelism_threads = 1
        return ir, config, report
    return None


def _room_for(base: PassContext, ir: GraphIR, budget_bytes: int) -> int:
    """The device ``ir``'s layout replay must fit: ``layout_room`` less its largest transfer."""
    return layout_room(budget_bytes, largest_transfer_bytes(ir, placement_of(base)))


def layout_fits(base: PassContext, ir: GraphIR, target_bytes: int | None, budget_bytes: int) -> bool:
    """Whether the session's graph (after Grappler) serves every request on the budget's ``layout_room`` (less
    the graph's largest transfer).

    This check is the guarantee, so it always replays what the session runs, after Grappler's rewrites, even on
    graphs large enough to plan as written (an as-written replay of a deep ResNet fits rooms its session overruns).
    A plan the median order fits is replayed in every draw of TF's hashed orders too, as the plan margin was
    measured (experiments/results/allocator_fit.md, plans); most refusals cost the one order.
    """
    ctx = dataclasses.replace(base, target_bytes=target_bytes, grappler=True)
    room = _room_for(base, ir, budget_bytes)
    return (layout_failures(ctx, ir, room) == 0
            and layout_failures(ctx, ir, room, every_order=True) == 0
            and initialisation_failures(ctx, ir, layout_room(budget_bytes)) == 0)


def initialisation_failures(ctx: PassContext, graph: GraphIR, device_memory: int) -> int:
    """Requests the allocator replay of running every variable's initializer (``v/Assign``, as
    ``global_variables_initializer`` does) on ``device_memory`` bytes leaves unserved.

    Initialisers hold each variable's initial value beside the variables already there: a plan that keeps more
    variables on the device than the step itself needs room for can fit its step and not its initialisation
    (tf_keras VGG19 at 0.7x: step planned at 346.7 MiB, out of memory while initialising at 373 MiB;
    tests/test_optimize.py::test_a_plan_whose_initialisation_overflows_is_not_accepted).
    """
    init = _initialisation(ctx, graph)
    try:
        return 0 if init is None else layout_failures(init, graph, device_memory)
    except TfmemError:   # an initializer that reads a feed, say: the step's replay is what can be checked
        return 0


def _initialisation(ctx: PassContext, graph: GraphIR) -> PassContext | None:
    """``ctx`` fetching every variable's initializer instead of the step; None when the graph names none."""
    inits = initializer_names(graph.to_graph_def())
    return dataclasses.replace(ctx, fetches=tuple(inits)) if inits else None


def _layout_step(base: PassContext, candidate: Candidate, budget_bytes: int) -> tuple[int, str]:
    """How much lower to plan after the layout refused ``candidate``, and the reason for the note: what its
    layout needed beyond the room (stepping a fixed 5% at a time takes more replans), at least 2% of the budget."""
    ctx = dataclasses.replace(base, target_bytes=candidate.target_bytes, grappler=True)
    room = _room_for(base, candidate.ir, budget_bytes)
    needed = smallest_fitting_device(ctx, candidate.ir, room, room + budget_bytes // 2)
    if needed is None:
        return budget_bytes // 20, ""
    step = (max(budget_bytes // 50, needed - room),
            f" with {format_bytes(budget_bytes - room)} to spare (its layout needs a {format_bytes(needed)} device)")
    init_room = layout_room(budget_bytes)
    if not initialisation_failures(ctx, candidate.ir, init_room):
        return step
    # The step fits and its initialisation does not: plan lower by what the initialisation needs beyond the room,
    # so that the planner leaves that many more bytes of variables on the host.
    init = _initialisation(ctx, candidate.ir)
    assert init is not None
    init_needed = smallest_fitting_device(init, candidate.ir, init_room, init_room + budget_bytes)
    if init_needed is None:
        return budget_bytes // 20, " (its variables' initialisation does not fit)"
    return (max(step[0], init_needed - init_room),
            f" (its variables' initialisation needs a {format_bytes(init_needed)} device)")


def layout_failures(ctx: PassContext, graph: GraphIR, device_memory: int, every_order: bool = False) -> int:
    """Requests the allocator replay of ``graph`` on ``device_memory`` bytes leaves unserved, in the worst of the
    session's emulated interleaving and the one-thread order (``every_order``: and of TF's hashed orders).

    Where a request lands depends on which ops ran side by side before it, and the executor's interleaving
    varies from run to run (``experiments/results/peak_variance.md``): one plan's replay can fail in the
    one-thread order while the emulated interleaving fits.
    """
    return max(ctx.simulate(graph, device_memory=device_memory, inter_op_threads=threads,
                            every_order=every_order).allocation_failures
               for threads in sorted({ctx.threads, 1}))


def smallest_fitting_device(ctx: PassContext, graph: GraphIR, low: int, high: int) -> int | None:
    """The smallest device size in ``(low, high]`` (to 1 MiB) on which replaying ``graph`` serves every request
    (``layout_failures``, as ``layout_fits`` asks).

    None when even ``high`` does not serve them all. Each try is one capped replay of the same graph.
    """
    if layout_failures(ctx, graph, high):
        return None
    while high - low > 2**20:
        mid = (low + high) // 2
        if layout_failures(ctx, graph, mid):
            low = mid
        else:
            high = mid
    return high


def lower_bound_bytes(ir: GraphIR, ctx: PassContext,
                      inputs: tuple[ExecutionGraph, Placement, frozenset[str]] | None = None) -> tuple[int, str]:
    """A peak no plan can beat: the largest single-op working set, fed tensors included (``largest_working_set``)."""
    op, working = largest_working_set(*(inputs or _bound_inputs(ir, ctx)))
    return working, op


def _bound_inputs(ir: GraphIR, ctx: PassContext) -> tuple[ExecutionGraph, Placement, frozenset[str]]:
    """What the bounds read: the step, the placement, and the ops a plan may run on the host (with a host)."""
    eg = ExecutionGraph.build(ir, ctx.fetches, ctx.feed_shapes)
    placement = placement_of(ctx)
    return eg, placement, host_capable_ops(ir, eg, placement)


def placement_of(ctx: PassContext) -> Placement:
    """What the context's device and host make of each op's device string (the bounds count the device's ops)."""
    return Placement(ctx.device, ctx.host)


def device_floor_bytes(ir: GraphIR, ctx: PassContext) -> tuple[int, str]:
    """A device size no plan fits below: the peak bound, or what the fed tensors' layout needs if more.

    The second is about the allocator, not the sum of live bytes: BFC can hand a fed tensor a whole chunk
    near twice its size (``tfmem.sim.bounds.fed_layout_floor``). A plan is accepted only if its layout replay fits
    ``layout_room(budget)``, so a budget whose room is below this floor is refused before planning.
    """
    inputs = _bound_inputs(ir, ctx)
    working, op = lower_bound_bytes(ir, ctx, inputs)
    layout, why = fed_layout_floor(*inputs)
    return (layout, why) if layout > working else (working, f"working set of {op}")


def smallest_planned_budget(bound: int, feeds_floor: int) -> int:
    """The smallest budget ``optimize`` plans for (rather than refusing at once) when no plan goes below ``bound``
    and the fed tensors' layout needs ``feeds_floor``: its target must reach the one and its replay room the other."""
    budget = max(bound + PLAN_MARGIN_MIN_BYTES, -(-bound * 100 // 95),
                 -(-(feeds_floor + LAYOUT_MARGIN_BYTES) * 100 // 98))
    while target_bytes_for(budget) < bound or layout_room(budget) < feeds_floor:
        budget += 1024
    return budget


def _advice(ctx: PassContext, all_passes: bool, smallest: int | None) -> str:
    """What to change after a refusal: only what could help (tests/test_optimize.py::test_refusal_advice)."""
    # in whole MiB, rounded up: a figure the user can pass back as it is
    options = [f"a budget of at least {-(-smallest // 2**20)} MiB (the least optimize plans for)"
               if smallest is not None else "a larger budget"]
    if not all_passes:
        options.append("more passes (passes='auto')")
    if ctx.host is None:
        options.append("host memory to swap to (host=, or --host in the CLI)")
    return "Give " + (", or ".join(options)) + "."


def _infeasible(ir: GraphIR, ctx: PassContext, budget: int, after: MemoryProfile,
                fragmented: bool = False, unplanned: bool = False, reachable: int | None = None,
                search: SearchLog | None = None, all_passes: bool = True,
                smallest: int | None = None) -> InfeasibleBudgetError:
    bound, where = device_floor_bytes(ir, ctx)
    # The planner's reachable floor is said, not reported as the bound: it holds for its moves on one order, and
    # a plan made for another budget, on another order, can go below it.
    floor = (f"; the planner's moves, all taken at once on its order, leave {format_bytes(reachable)}"
             if reachable is not None and reachable > bound else "")
    top = ", ".join(f"{t.tensor} {format_bytes(t.nbytes)}" for t in after.live_at_peak[:3])
    return InfeasibleBudgetError(
        f"budget {format_bytes(budget)} unreachable: "
        + ("the lower bound alone exceeds it less its safety margin, so nothing was tried; vanilla peak "
           if unplanned else "best peak found ")
        + f"{format_bytes(after.peak_bytes)} "
        f"(simulator) at {after.peak_unit}; a plan must stay under {format_bytes(max(target_bytes_for(budget), 0))} "
        f"(the budget less {PLAN_MARGIN_SHARE:.0%} or {format_bytes(PLAN_MARGIN_MIN_BYTES)}, whichever is more, for "
        f"the run-to-run spread of the executor's order and the copies' timing); lower bound "
        f"{format_bytes(bound)} ({where}){floor}; "
        f"largest live: {top}. "
        + ("The best plan fits in total but not in the device allocator's chunks. " if fragmented else "")
        + _advice(ctx, all_passes, smallest)
        + (f" ({search.summary()})" if search is not None else ""),
        budget_bytes=budget, best_peak_bytes=after.peak_bytes, lower_bound_bytes=bound,
        live_at_peak=after.live_at_peak[:10], search=search,
    )
