"""Moving a tensor between device and host memory with graph ops: what swap and placement passes share.

A tensor that lives in host memory reaches a device op through a *prefetch*: a host-side ``Identity`` whose
control input (the *trigger*, a device op that finishes a transfer-time before the consumer starts) delays
it. The delay must sit on the host side: TensorFlow's ``_Recv`` on the device is a root of the device's
partition and pulls its tensor as soon as the sender has produced it, so a delay on the device side would
bring the tensor back at once. Consumers close together in time share one prefetch; each group gets its own
copy on the device, freed when the group's last op is done.

Every op added here carries ``_grappler_do_not_remove`` (``GraphEditor``); otherwise Grappler's dependency
optimizer bypasses device-crossing ``Identity`` ops and the transfer disappears.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from passes.timeline import StepTimeline
from tfmem.ir.editor import GraphEditor
from tfmem.ir.execution import ExecutionGraph
from tfmem.ir.frames import back_edges, find_regions, maybe_dead
from tfmem.ir.graph import GraphIR, TensorRef
from tfmem.ir.ops import (
    IDENTITY_OPS,
    PERSISTENT_OUTPUT_OPS,
    PLACEHOLDER_OPS,
    RESOURCE_VARIABLE_OPS,
    VARIABLE_READ_OPS,
    VIEW_OPS,
)
from tfmem.sim.costmodel import DeviceSpec
from tfmem.sim.tensor_list_memory import ListHoldings

# Ops that do no work of their own: sources, reads of variables, and identities of those (``ready_at_start``).
NO_WORK_OPS = (PERSISTENT_OUTPUT_OPS | RESOURCE_VARIABLE_OPS | PLACEHOLDER_OPS | VARIABLE_READ_OPS | IDENTITY_OPS
               | {"PlaceholderWithDefault"})
# Tensors of these dtypes cannot be copied between devices as plain data.
UNMOVABLE_DTYPES = frozenset({"resource", "variant", "string"})


@dataclass(frozen=True)
class Prefetch:
    """One host-to-device copy: ``consumers`` read it; it starts when ``trigger`` ends."""

    consumers: tuple[str, ...]
    trigger: str | None
    transfer_s: float
    window_s: float        # simulated time between the trigger's end and the first consumer's start

    @property
    def exposed_s(self) -> float:
        """Transfer time the simulated schedule does not cover (a cost model estimate)."""
        return max(0.0, self.transfer_s - self.window_s)


def movable(graph: GraphIR, tensor: TensorRef) -> bool:
    """Whether ``tensor`` is plain data that a ``_Send``/``_Recv`` pair can copy."""
    dtype = graph.spec(tensor).dtype
    return dtype not in UNMOVABLE_DTYPES and not dtype.endswith("_ref")


def trigger_candidates(graph: GraphIR, timeline: StepTimeline) -> dict[str, bool]:
    """Units that may carry a trigger's control edge: plain ops that run in the step's order.

    Ops that are ready when the step starts (``ready_at_start``) time nothing, wherever the simulation put them;
    frames cannot take control edges from outside their body; an op in a TF1 cond's branch may be dead, and a
    copy waiting for it would be dead too (``tfmem.ir.frames.maybe_dead``).
    """
    early = ready_at_start(graph) | maybe_dead(graph)
    return {u: not timeline.eg.is_region(u) and u not in early for u in timeline.order}


def ready_at_start(graph: GraphIR) -> frozenset[str]:
    """Ops ready as soon as a step starts: those whose inputs (data and control) all come from ops that do no
    work and are themselves ready then -- constants, variables, placeholders, reads of variables, identities of
    those -- and those no-work ops.

    TensorFlow's executor runs a ready op at once, so these may run at the very start whatever the simulated
    order says, and a copy triggered by one starts then too: an MoE plan whose prefetches wait for a bias's
    ``ReadVariableOp`` brings every expert's weights to the device at once.

    Examples
    --------
    >>> import tensorflow as tf
    >>> from tfmem.ir.loading import load
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     x = tf.compat.v1.placeholder(tf.float32, (4, 4), name="x")
    ...     w = tf.Variable(tf.ones((4, 4)), name="w")
    ...     y = tf.matmul(tf.nn.relu(tf.matmul(x, w, name="first"), name="h"), w, name="y")
    >>> early = ready_at_start(load(g))
    >>> "w/Read/ReadVariableOp" in early, "first" in early, "h" in early
    (True, True, False)
    """
    # A no-work op ready at start is a source, or has only such ops as inputs: grow that set from the sources.
    # The Merge and NextIteration ops that close v1 loops wait for an iteration, so they are never counted.
    loops = back_edges(graph)
    in_loop = {n for edge in loops for n in edge}
    no_work = {n.name for n in graph.nodes if not n.predecessors and n.op in NO_WORK_OPS}
    stack = list(no_work)
    while stack:
        for succ in graph.successors.get(stack.pop(), ()):
            node = graph[succ]
            if (succ not in no_work and succ not in in_loop and node.op in NO_WORK_OPS
                    and all(p in no_work for p in node.predecessors)):
                no_work.add(succ)
                stack.append(succ)
    return frozenset(n.name for n in graph.nodes
                     if n.name not in in_loop and all(p in no_work for p in n.predecessors)) | no_work


def group_consumers(consumers: Sequence[str], timeline: StepTimeline, split_gap_s: float) -> list[tuple[str, ...]]:
    """Split consumers (in time order) wherever the device would sit idle with the copy for ``split_gap_s``."""
    ordered = sorted(consumers, key=lambda c: (timeline.start_s[c], timeline.rank[c]))
    groups: list[list[str]] = []
    last_end = 0.0
    for c in ordered:
        if groups and timeline.start_s[c] - last_end <= split_gap_s:
            groups[-1].append(c)
            last_end = max(last_end, timeline.end_s[c])
        else:
            groups.append([c])
            last_end = timeline.end_s[c]
    return [tuple(g) for g in groups]


def plan_prefetches(groups: Sequence[tuple[str, ...]], nbytes: int, timeline: StepTimeline, link: DeviceSpec,
                    usable: Mapping[str, bool], not_before: int, lead_s: float | None = None) -> list[Prefetch]:
    """A trigger for each group: ranked after ``not_before`` and after the previous group, ending ``lead_s``
    (default: the transfer's time) before the group's first reader starts where one can."""
    out = []
    transfer = link.transfer_s(nbytes)
    lead = transfer if lead_s is None else lead_s
    floor = not_before
    for group in groups:
        first = min(group, key=lambda c: timeline.rank[c])
        trigger = timeline.trigger_for(first, lead, floor, usable)
        window = timeline.start_s[first] - timeline.end_s[trigger] if trigger else 0.0
        out.append(Prefetch(group, trigger, transfer, max(window, 0.0)))
        floor = max(floor, max(timeline.rank[c] for c in group))
    return out


def identity_attrs(graph: GraphIR, tensor: TensorRef, tag: str) -> dict[str, attr_value_pb2.AttrValue]:
    """Attrs of an ``Identity`` that passes ``tensor`` on, tagged with ``tag`` (e.g. ``_tfmem_swap_in``)."""
    dtype = tf.as_dtype(graph.spec(tensor).dtype)
    return {"T": attr_value_pb2.AttrValue(type=dtype.as_datatype_enum), tag: attr_value_pb2.AttrValue(b=True)}


def readers_through_aliases(graph: GraphIR, eg: ExecutionGraph, tensor: TensorRef) -> dict[str, TensorRef]:
    """Each op that reads ``tensor``'s value, mapped to the tensor it names: ``tensor``, an identity or a view.

    ``Identity``-like ops (TF1's gradient ``tuple/control_dependency`` among them) pass the same buffer on,
    and so do reshapes (``VIEW_OPS``), so the ops that read *their* outputs keep the buffer alive too; they
    are the readers that count. They can read a swapped-in copy directly, or the same view of it
    (``add_prefetches`` rebuilds the view). A fetched identity or view stays a reader itself.

    A Transformer's feed-forward weight gradient reads the ReLU's output through a Reshape: swapping the
    ReLU's output for its ``ReluGrad`` alone would free nothing, the view holding the buffer
    (``tests/test_swap_placement.py::test_a_tensor_read_late_through_a_reshape_is_freed_and_the_view_rebuilt``).
    """
    out: dict[str, TensorRef] = {}
    stack = [tensor]
    while stack:
        t = stack.pop()
        for reader in eg.consumers(t):
            if eg.is_region(reader):  # a v1 frame reads it whole (its unit is no node of the graph)
                out.setdefault(reader, t)
                continue
            node = graph[reader]
            passes_on = ((node.op in IDENTITY_OPS and len(node.inputs) == 1)
                         or (node.op in VIEW_OPS and node.inputs[0] == t and t not in node.inputs[1:]))
            if (passes_on and TensorRef(reader, 0) not in eg.fetched
                    and eg.consumers(TensorRef(reader, 0))):
                stack.append(TensorRef(reader, 0))
            else:
                out.setdefault(reader, t)
    return out


def same_view(editor: GraphEditor, copy: TensorRef, read: TensorRef, original: TensorRef,
              made: dict[TensorRef, TensorRef]) -> TensorRef:
    """The tensor a reader of ``read`` (``original`` or an identity or view of it) should read instead, given
    ``copy`` of ``original``: ``copy`` itself, or the same chain of views rebuilt on it (shared via ``made``)."""
    if read == original:
        return copy
    if read not in made:
        node = editor.graph[read.node]
        base = same_view(editor, copy, node.inputs[0], original, made)
        if node.op in IDENTITY_OPS:
            made[read] = base
        else:
            name = editor.unique_name(f"{node.name}/tfmem_view")
            attrs = {k: v for k, v in node.attrs.items() if k != "_class"}
            editor.add_op(name, node.op, [base, *node.inputs[1:]], node.outputs[:1], device=node.device, attrs=attrs)
            made[read] = TensorRef(name, 0)
    return made[read]


def add_prefetches(editor: GraphEditor, source: TensorRef, original: TensorRef, prefetches: Sequence[Prefetch],
                   host: str, name_prefix: str, tag: str, reads: Mapping[str, TensorRef] | None = None) -> list[str]:
    """Add one host ``Identity`` of ``source`` per prefetch; its consumers read it instead of ``original``.

    ``reads`` names, per consumer, the tensor it reads when that is an identity or a view of ``original``
    (``readers_through_aliases``); a view is rebuilt on the device from the copy, once per prefetch.
    """
    graph = editor.graph
    spec = graph.spec(original)
    names = []
    for k, p in enumerate(prefetches):
        name = editor.unique_name(f"{name_prefix}_{k}")
        editor.add_op(name, "Identity", [source], [spec], control_inputs=[p.trigger] if p.trigger else [],
                      device=host, attrs=identity_attrs(graph, original, tag))
        made: dict[TensorRef, TensorRef] = {}
        for consumer in p.consumers:
            read = (reads or {}).get(consumer, original)
            copy = same_view(editor, TensorRef(name, 0), read, original, made)
            frame = consumer.startswith("frame:")   # an ExecutionGraph unit: a v1 frame reads it through its Enters
            for node in frame_readers(graph, find_regions(graph), consumer, read) if frame else [consumer]:
                editor.rewire(node, read, copy)
        names.append(name)
    return names


def frame_readers(graph: GraphIR, regions: Mapping[str, str], frame: str, tensor: TensorRef) -> list[str]:
    """The nodes of ``frame`` (a ``frame:<name>`` unit; ``regions`` is ``find_regions(graph)``) that read
    ``tensor``: the ``Enter`` ops a copy for the frame must feed."""
    name = frame.removeprefix("frame:")
    return [c for c in graph.consumers.get(tensor, ()) if regions.get(c) == name]


def held_list(tensor: TensorRef, lists: ListHoldings | None) -> bool:
    """Whether ``tensor`` is a list handle holding items of its own (not a loop's pass-through of another)."""
    return lists is not None and lists.bytes_of.get(tensor, 0) > 0 and tensor not in lists.shares


def activation_bytes(graph: GraphIR, tensor: TensorRef, lists: ListHoldings | None) -> int:
    """Bytes a swap of ``tensor`` frees: its buffer, or for a list handle the items it holds."""
    held = lists.bytes_of.get(tensor, 0) if lists is not None and tensor not in lists.shares else 0
    return (graph.spec(tensor).nbytes or 0) + held
