"""``tfmem.optimize`` (defined here): load a graph, run the memory passes for a budget, and hand back what to run.

The result keeps every node name, so the user's feeds and fetches work unchanged on ``Optimized.graph``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import takewhile

import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import config_pb2

from passes import DEFAULT_PASSES, FINAL_REWRITES, LEADING_REWRITES, PASSES
from passes.planner import COMPARE_SINGLE_MAX_OPS
from tfmem.errors import BadInputError, InfeasibleBudgetError
from tfmem.gcpause import without_gc_pauses
from tfmem.ir.devices import DEFAULT_DEVICE, same_device, with_default_device
from tfmem.ir.execution import ExecutionGraph, parse_fetches
from tfmem.ir.graph import GraphIR
from tfmem.ir.loading import GraphSource, load
from tfmem.ir.shapes import FeedShapes
from tfmem.ir.tags import strip_tags
from tfmem.pipeline import Pass, PassContext, PassReport, run_pipeline
from tfmem.report import Report
from tfmem.sim.bounds import fed_layout_floor, largest_working_set
from tfmem.sim.grappler import grappler_rejects
from tfmem.sim.profile import MemoryProfile
from tfmem.units import format_bytes, parse_bytes

# Above this many ops the graph is simulated as written, and the report says so: at 20,000 ops one simulation
# after Grappler outlasts optimize's whole run as written (experiments/results/optimize_speed.md).
GRAPPLER_SIMULATION_MAX_OPS = 10_000
# A plan aims for the budget less 5%, at least 4 MiB: simulated peaks are a few percent off measured ones, and a
# plan's measured peak varies with the executor's order (experiments/results/simulator_accuracy.md, peak_variance.md).
SAFETY_MARGIN = 0.05
SAFETY_MARGIN_MIN_BYTES = 4 * 2**20
# A plan's allocator-layout replay must serve every request on a device this share and 4 MiB smaller than the
# budget (``layout_room``): near its cap the testbed lays tensors out a few MiB worse (tests/test_guarantee.py).
CAPACITY_SLACK = 0.02
# What passes="auto" falls back on when every plan of the planner fits in total but not in the allocator's layout.
ALTERNATIVE_PIPELINE = ("partition", "limit_parallelism", "place_persistent", "swap_activations", "recompute")
# In that replay a request of half the device or more must also leave this much in its free chunk: where it lands
# depends on every tensor placed before it (``BFCAllocator.large_request_fits``; tests/test_guarantee.py, the U-Net).
LARGE_REQUEST_MARGIN = 4 * 2**20
# After a layout refusal, passes="auto" also plans each strategy alone (up to COMPARE_SINGLE_MAX_OPS ops) and keeps
# the quickest fitting plan: a replan for less can be slower than one strategy (tests/test_optimize.py, _quickest).
SINGLE_STRATEGY_PIPELINES = (
    ("partition", "limit_parallelism", "swap_activations"),
    ("partition", "limit_parallelism", "recompute"),
)
CAPACITY_RETRIES = 6   # replans after layout refusals; each costs one planner run
REFINE_STEPS = 3   # plans between the last target the layout refused and the first it took (``_refined``)


def target_bytes_for(budget_bytes: int) -> int:
    """The highest target a plan may aim for so that running it within ``budget_bytes`` does not run out of
    memory: the budget less the safety margin."""
    return budget_bytes - max(int(budget_bytes * SAFETY_MARGIN), SAFETY_MARGIN_MIN_BYTES)


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
    """Turn ``"auto"``, ``None``/``[]`` or a list of pass names/objects into pass objects."""
    if passes is None:
        return []
    if isinstance(passes, str):
        if passes == "auto":
            return list(DEFAULT_PASSES)
        passes = [passes]
    out: list[Pass] = []
    for p in passes:
        if isinstance(p, str):
            if p not in PASSES:
                known = ", ".join(sorted(PASSES)) or "none yet"
                raise BadInputError(f"unknown pass {p!r}; available passes: {known} (or passes='auto')")
            out.append(PASSES[p])
        else:
            out.append(p)
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
) -> Optimized:
    """Rewrite ``graph`` so that computing ``fetches`` needs less device memory, with identical results.

    Parameters
    ----------
    graph : tf.Graph, GraphDef, MetaGraphDef or a .pb/.pbtxt path
    fetches : what each step computes, as for ``Session.run`` (``"loss:0"``, ``"train_op"``)
    budget : device memory to fit in, as bytes or a string such as ``"8GiB"``; None means "as low as is cheap"
    feed_shapes : full shapes for fed tensors whose static shape is partial, e.g. ``{"x:0": (64, 784)}``
    device, host : device strings; default: ops stay where they are, ``host`` is where swapped tensors go
    passes : ``"auto"``, or a list of pass names such as ``["partition", "limit_parallelism"]``
    check : verify the graph after every pass
    inter_op_threads : the inter-op thread pool the session will run with (default: TF's, one per core);
        how much parallelism is safe to keep depends on it
    grappler : simulate the graph after Grappler's rewrites, as the session runs it; default: for graphs of
        up to ``GRAPPLER_SIMULATION_MAX_OPS`` ops
    layout_check : also replay each plan on the device allocator's layout and plan again for less where a
        request would go unserved (the guarantee; switch it off only to study what the planner reaches)

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
    budget_bytes = parse_bytes(budget, what="budget") if budget is not None else None
    if host is not None and device is None and same_device(DEFAULT_DEVICE, host):
        raise BadInputError(f"host={host!r} could also name the device that unplaced ops run on; pass "
                            "device= as well, e.g. device='/GPU:0', host='/CPU:0'")
    ir = load(graph, feed_shapes)
    fetch_list = [fetches] if isinstance(fetches, str) else [str(getattr(f, "name", f)) for f in fetches]
    parse_fetches(ir, fetch_list)  # fail early, with the fetch's name, on a typo
    faithful = len(ir) <= GRAPPLER_SIMULATION_MAX_OPS if grappler is None else grappler
    max_target = target_bytes_for(budget_bytes) if budget_bytes is not None else None
    shapes = {k: tuple(v) for k, v in (feed_shapes or {}).items()}
    config = session_config()
    grappler_off = grappler_rejects(with_default_device(ir.to_graph_def(), device or DEFAULT_DEVICE), fetch_list)
    if grappler_off:
        # The user's session runs this graph without Grappler's rewrites; the rewritten graph must run the same
        # way (Grappler may well accept it, and its rewrites change the arithmetic), and is planned so.
        config.graph_options.rewrite_options.disable_meta_optimizer = True
    notes: list[str] = []
    base = PassContext(tuple(fetch_list), None, device, host, shapes, check=check,
                       inter_op_threads=inter_op_threads, grappler=faithful, session_config=config)
    before = base.simulate(ir)  # the budget does not change the unoptimized graph's peak
    pipeline = resolve_passes(passes)
    auto = passes == "auto"
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
        bound, _ = lower_bound_bytes(ir, ctx)
        feeds_floor, _ = fed_layout_floor(ExecutionGraph.build(ir, ctx.fetches, ctx.feed_shapes))
        if bound > max_target or feeds_floor > layout_room(budget_bytes):
            raise _infeasible(ir, ctx, budget_bytes, before, unplanned=True)
    fit = _fit(ir, pipeline, base, max_target, bound, budget_bytes, before, notes, layout_check)
    layout_refused = fit.layout_refused
    if auto and budget_bytes is not None and not fit.fits and fit.layout_refused:
        # The planner's plans fit in total but not in the allocator's layout; the single strategies applied in
        # turn lay memory out differently (tests/test_optimize.py). Not tried when the planner's plans miss in
        # total: there this fallback's plans can be accepted and still run out of memory.
        alternative = [PASSES[n] for n in ALTERNATIVE_PIPELINE] + list(FINAL_REWRITES)
        alt_notes: list[str] = []
        alt = _fit(ir, alternative, base, max_target, bound, budget_bytes, before, alt_notes, layout_check)
        if alt.fits:
            notes = [*alt_notes, "the planner's plans fit in total but not in the device allocator's chunks; "
                     + ", ".join(ALTERNATIVE_PIPELINE) + " applied in turn did"]
            fit = alt
    if (auto and fit.fits and layout_refused and budget_bytes is not None and max_target is not None
            and len(ir) <= COMPARE_SINGLE_MAX_OPS):
        fit, notes = _quickest(ir, fit, notes, base, max_target, bound, budget_bytes, before)
    new_ir, after, ctx = fit.ir, fit.after, fit.ctx
    reports = leading_reports + fit.reports
    report = Report(budget_bytes, before, after, reports)
    if grappler_off:
        report.notes.append("TensorFlow's graph optimizer (Grappler) fails on this graph, so a session runs it as "
                            "written; run the result with Optimized.config, which turns Grappler off, for identical "
                            "results")
    report.notes.extend(notes)
    if not faithful and not grappler_off:
        report.notes.append(f"simulated as written, without Grappler's rewrites ({len(ir)} ops; "
                            "pass grappler=True to simulate what the session runs, slower on large graphs)")
    if budget_bytes is not None:
        report.notes.append(f"planned for {format_bytes(fit.target_bytes or 0)}: the budget less a safety margin "
                            "for allocator rounding, fragmentation and executor order")
    if not fit.fits:
        assert budget_bytes is not None and max_target is not None
        raise _infeasible(new_ir, ctx, budget_bytes, after, fragmented=after.peak_bytes <= max_target,
                          reachable=_reachable_floor(reports))
    graph_def = new_ir.to_graph_def()
    tf_graph = tf.Graph()
    with tf_graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    return Optimized(tf_graph, graph_def, config, report, new_ir)


@dataclass
class _Fitted:
    """What ``_fit`` found: the graph and its simulation, and whether it passed both checks of the budget."""

    ir: GraphIR
    reports: list[PassReport]
    after: MemoryProfile
    ctx: PassContext
    target_bytes: int | None  # what the plan kept aimed for
    fits: bool  # within the highest target in total and, replayed, in the allocator's layout
    layout_refused: bool = False  # some plan fitted in total but not in the allocator's layout


def layout_room(budget_bytes: int) -> int:
    """The device size a plan's allocator-layout replay must fit in (``CAPACITY_SLACK`` and 4 MiB less)."""
    return max(budget_bytes - int(budget_bytes * CAPACITY_SLACK) - SAFETY_MARGIN_MIN_BYTES, 1)


def _fit(ir: GraphIR, pipeline: Sequence[Pass], base: PassContext, max_target: int | None, bound: int,
         budget_bytes: int | None, before: MemoryProfile, notes: list[str], layout_check: bool = True) -> _Fitted:
    """Run ``pipeline`` so that the result fits ``max_target`` in total and ``budget_bytes`` in the allocator's
    layout (the second check skipped without ``layout_check``).

    A plan that fits in total but not in the layout is planned again for less (why is appended to ``notes``), by
    what its layout needed beyond the room, down to the lower bound ``bound``, for at most ``CAPACITY_RETRIES``
    replans; once a plan fits after a refusal, up to ``REFINE_STEPS`` more bisect back up toward the refused
    target (``_refined``). On failure the plan to report is returned (one that fitted in total if any did), with
    ``fits`` False."""
    if budget_bytes is None or max_target is None:
        return _Fitted(*_planned(ir, pipeline, base, max_target, before), max_target, fits=True)
    room = layout_room(budget_bytes)
    target_bytes = min(max_target, room)  # the layout replay never needs less than the plan's total
    best: _Fitted | None = None
    layout_refused = False
    refused_for: int | None = None   # the last target whose plan fitted in total but not in the layout
    for _ in range(CAPACITY_RETRIES + 1):
        tried = _Fitted(*_planned(ir, pipeline, base, target_bytes, before), target_bytes, fits=False)
        new_ir, after, ctx = tried.ir, tried.after, tried.ctx
        if after.peak_bytes > max_target:
            # Missed in total. Not planned again for less: a plan asked for less than the planner reaches can
            # measure far above its simulation (tests/test_guarantee.py, the unrolled RNN at 36 MiB).
            best = best or tried  # a plan that fitted in total, if an earlier try made one
            break
        # The plan fits in total; check it against the device's real layout, where each request needs one free
        # chunk and a nearly full BFC hands out whole chunks. Replayed on ``room`` (``layout_room``), no request
        # may go unserved; otherwise plan again for less.
        # This check is the guarantee, so it always replays what the session runs, after Grappler's rewrites,
        # even on graphs large enough to plan as written (an as-written replay of a deep ResNet fits rooms that
        # its session overruns).
        if not layout_check or _fits_layout(tried, room):
            tried.fits, tried.layout_refused = True, layout_refused
            if refused_for is not None:
                return _refined(ir, pipeline, base, max_target, before, room, tried, refused_for)
            return tried
        layout_refused, best, refused_for = True, tried, target_bytes  # it fits in total: what a refusal should report
        # How much the layout adds on top of this plan's total predicts how much less the next plan must need
        # (stepping a fixed 5% at a time takes more replans).
        needed = smallest_fitting_device(dataclasses.replace(ctx, grappler=True), new_ir, room,
                                         room + budget_bytes // 2)
        step = budget_bytes // 20 if needed is None else max(budget_bytes // 50, needed - room)
        lower = max(target_bytes - step, bound)
        floor = _reachable_floor(tried.reports)
        if floor is not None and lower < floor < target_bytes:
            # Not past the planner's reachable floor in one step: asked for less, it makes the same plan as for its
            # floor, and the targets in between, where a plan may fit the layout, would go untried.
            lower = floor
        notes.append(f"a plan for {format_bytes(target_bytes)} (peak {format_bytes(after.peak_bytes)}) does not fit the "
                     f"device allocator's chunks with {format_bytes(budget_bytes - room)} to spare"
                     + ("" if needed is None else f" (its layout needs a {format_bytes(needed)} device)")
                     + f"; planned again for {format_bytes(lower)}")
        if target_bytes <= bound:  # no plan can go lower
            break
        target_bytes = lower
    assert best is not None
    best.layout_refused = layout_refused
    return best


def _quickest(ir: GraphIR, fit: _Fitted, notes: list[str], base: PassContext, max_target: int, bound: int,
              budget_bytes: int, before: MemoryProfile) -> tuple[_Fitted, list[str]]:
    """``fit`` (the planner's plan) or the plan of one of ``SINGLE_STRATEGY_PIPELINES``, whichever fits (in total
    and in the layout) at the least estimated step time; with the notes of the plan kept.

    ``optimize`` asks only after a layout refusal, and only once the planner's plan fits: where it misses, a
    strategy alone can be accepted and still run out of memory (see the ``ALTERNATIVE_PIPELINE`` fallback there).
    """
    for names in SINGLE_STRATEGY_PIPELINES:
        single_notes: list[str] = []
        single = _fit(ir, [PASSES[n] for n in names] + list(FINAL_REWRITES), base, max_target, bound, budget_bytes,
                      before, single_notes)
        if single.fits and single.after.estimated_step_s < fit.after.estimated_step_s:
            notes = [*single_notes, f"{names[-1]} alone (after {', '.join(names[:-1])}) made a plan estimated "
                     f"quicker than the planner's ({single.after.estimated_step_s * 1e3:.1f} vs "
                     f"{fit.after.estimated_step_s * 1e3:.1f} ms a step), and it was kept"]
            fit = single
    return fit, notes


def _refined(ir: GraphIR, pipeline: Sequence[Pass], base: PassContext, max_target: int, before: MemoryProfile,
             room: int, fitted: _Fitted, refused_for: int) -> _Fitted:
    """Plans between the target that fitted the layout and the one refused, bisecting; the quickest wins.

    The step down after a layout refusal is what the refused plan's layout needed, which overshoots when a
    different plan would lay out better, and a plan for much less can be much slower. Each of ``REFINE_STEPS``
    tries goes halfway: up from a target whose plan fitted the layout, down from one whose plan did not
    (``tests/test_optimize.py::test_after_a_layout_refusal_plans_in_between_are_tried_and_the_quickest_kept``).
    """
    assert fitted.target_bytes is not None
    best, low, high = fitted, fitted.target_bytes, refused_for
    for _ in range(REFINE_STEPS):
        if high - low < 2 * 2**20:
            break
        middle = (low + high) // 2
        tried = _Fitted(*_planned(ir, pipeline, base, middle, before), middle, fits=False)
        if tried.after.peak_bytes <= max_target and _fits_layout(tried, room):
            low = middle
            if tried.after.estimated_step_s < best.after.estimated_step_s:
                tried.fits, tried.layout_refused = True, True
                best = tried
        else:
            high = middle
    return best


def _fits_layout(fitted: _Fitted, room: int) -> bool:
    """Whether the session's graph (after Grappler) serves every request on a device of ``room`` bytes."""
    return layout_failures(dataclasses.replace(fitted.ctx, grappler=True), fitted.ir, room) == 0


def layout_failures(ctx: PassContext, graph: GraphIR, device_memory: int) -> int:
    """Requests the allocator replay of ``graph`` on ``device_memory`` bytes leaves unserved, large ones held to
    ``LARGE_REQUEST_MARGIN``, in the worst of the session's emulated interleaving and the one-thread order.

    Where a request lands depends on which ops ran side by side before it, and the executor's interleaving
    varies from run to run (``experiments/results/peak_variance.md``): one plan's replay can fail in the
    one-thread order while the emulated interleaving fits.
    """
    return max(ctx.simulate(graph, device_memory=device_memory, large_request_margin=LARGE_REQUEST_MARGIN,
                            inter_op_threads=threads).allocation_failures
               for threads in sorted({ctx.threads, 1}))


def _planned(ir: GraphIR, pipeline: Sequence[Pass], base: PassContext, target_bytes: int | None, before: MemoryProfile,
             ) -> tuple[GraphIR, list[PassReport], MemoryProfile, PassContext]:
    """``pipeline`` run for ``target_bytes``: the graph (tags stripped), the reports, its simulation and the context."""
    ctx = dataclasses.replace(base, target_bytes=target_bytes)
    new_ir, reports = run_pipeline(ir, pipeline, ctx)
    new_ir = strip_tags(new_ir)
    return new_ir, reports, ctx.simulate(new_ir) if any(r.changed for r in reports) else before, ctx


def smallest_fitting_device(ctx: PassContext, graph: GraphIR, low: int, high: int) -> int | None:
    """The smallest device size in ``(low, high]`` (to 1 MiB) on which replaying ``graph`` serves every request
    (``layout_failures``, as ``_fits_layout`` asks).

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


def lower_bound_bytes(ir: GraphIR, ctx: PassContext) -> tuple[int, str]:
    """A peak no plan can beat: the largest single-op working set, fed tensors included (``largest_working_set``)."""
    eg = ExecutionGraph.build(ir, ctx.fetches, ctx.feed_shapes)
    op, working = largest_working_set(eg)
    return working, op


def device_floor_bytes(ir: GraphIR, ctx: PassContext) -> tuple[int, str]:
    """A device size no plan fits below: the peak bound, or what the fed tensors' layout needs if more.

    The second is about the allocator, not the sum of live bytes: BFC can hand a fed tensor a whole chunk
    near twice its size (``tfmem.sim.bounds.fed_layout_floor``). A plan is accepted only if its layout replay fits
    ``layout_room(budget)``, so a budget whose room is below this floor is refused before planning.
    """
    working, op = lower_bound_bytes(ir, ctx)
    layout, why = fed_layout_floor(ExecutionGraph.build(ir, ctx.fetches, ctx.feed_shapes))
    return (layout, why) if layout > working else (working, f"working set of {op}")


def _reachable_floor(reports: Sequence[PassReport]) -> int | None:
    """The planner's floor: the lowest peak every option it had, taken at once, could reach on its order."""
    floors = [r.details["reachable_floor_bytes"] for r in reports if "reachable_floor_bytes" in r.details]
    return int(floors[-1]) if floors else None  # type: ignore[call-overload]


def _infeasible(ir: GraphIR, ctx: PassContext, budget: int, after: MemoryProfile,
                fragmented: bool = False, unplanned: bool = False, reachable: int | None = None,
                ) -> InfeasibleBudgetError:
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
        f"(the budget less {SAFETY_MARGIN:.0%} or {format_bytes(SAFETY_MARGIN_MIN_BYTES)}, whichever is more, for "
        f"allocator rounding and fragmentation); lower bound {format_bytes(bound)} ({where}){floor}; "
        f"largest live: {top}. "
        + ("The best plan fits in total but not in the device allocator's chunks with a safe margin. "
           if fragmented else "")
        + "Give a larger budget, or enable more passes (passes='auto').",
        budget_bytes=budget, best_peak_bytes=after.peak_bytes, lower_bound_bytes=bound,
        live_at_peak=after.live_at_peak[:10],
    )
