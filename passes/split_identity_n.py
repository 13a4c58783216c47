"""Split each ``IdentityN`` into one ``Identity`` per tensor: the same values without the barrier.

``IdentityN`` passes N tensors through unchanged, but starts only when all N exist, so all N are on the device
together. Keras 3 passes every gradient of a step through one (``tf.custom_gradient`` around the optimizer's
update), which makes the whole gradient a working set: a mixture of experts cannot update one expert while the
next expert's gradient is computed, and its lower bound is every expert's gradient at once
(``tests/test_split_identity_n.py``). Separate identities let each tensor flow on as soon as it exists.

Only a barrier that bounds the plan is split: one whose tensors together exceed every other op's working set
(the lower bound of any plan, ``tfmem.sim.bounds``). Elsewhere the barrier costs a plan nothing, and splitting
it changes the order in which memory is freed: a Keras 3 MLP's plan at 0.75x of its peak then failed the
allocator replay (``tests/test_function.py``, the Keras step). Control edges into the ``IdentityN`` are kept on
every identity. An ``IdentityN`` that is fetched, that others wait for through a control edge, or that sits in
a v1 loop frame is left alone (its name or its timing is part of the graph's contract there).

Requires: nothing. Ensures: the same values (identities copy nothing); the outputs' consumers read the new
identities.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from tensorflow.core.framework import attr_value_pb2

from tfmem.ir.editor import DO_NOT_REMOVE, claim_name
from tfmem.ir.execution import ExecutionGraph
from tfmem.ir.frames import find_regions
from tfmem.ir.graph import GraphIR, OpNode, TensorRef
from tfmem.pipeline import PassContext, PassReport, PassResult
from tfmem.sim.bounds import op_working_set_bytes
from tfmem.units import format_bytes


@dataclass(frozen=True)
class SplitIdentityN:
    """Replace each ``IdentityN`` of 2+ tensors by an ``Identity`` per tensor (see the module docstring).

    Examples
    --------
    >>> import tensorflow as tf
    >>> from tfmem.ir.loading import load
    >>> from tfmem.pipeline import PassContext
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     xs = [tf.fill((64,), float(i)) for i in range(4)]
    ...     ys = tf.identity_n(xs, name="all")        # all four at once: the largest working set here
    ...     _ = [tf.negative(y, name=f"neg{i}") for i, y in enumerate(ys)]
    >>> result = SplitIdentityN().run(load(g), PassContext(tuple(f"neg{i}:0" for i in range(4))))
    >>> [str(t) for t in result.graph["neg2"].inputs]
    ['all/tfmem_split_2:0']
    """

    name: ClassVar[str] = "split_identity_n"
    # It does not depend on the budget: optimize runs it once, before planning and before the lower bound.
    budget_independent: ClassVar[bool] = True
    peak_non_increasing: ClassVar[bool] = False

    def run(self, graph: GraphIR, ctx: PassContext) -> PassResult:
        fetched = {f.split(":")[0].lstrip("^") for f in ctx.fetches}
        waited_for = {c for n in graph.nodes for c in n.control_inputs}
        in_frames = find_regions(graph)
        barriers = [n for n in graph.nodes if n.op == "IdentityN" and len(n.inputs) > 1 and n.name not in fetched
                    and n.name not in waited_for and n.name not in in_frames]
        if not barriers:
            return PassResult(graph, False, PassReport.empty(self.name, "no IdentityN barriers to split"))
        eg = ExecutionGraph.build(graph, ctx.fetches, ctx.feed_shapes)
        others = max((op_working_set_bytes(graph, n) for n in eg.needed
                      if eg.unit_of[n] == n and graph[n].op != "IdentityN"), default=0)
        held = {n.name: op_working_set_bytes(graph, n.name) for n in barriers if n.name in eg.needed}
        splits = [n for n in barriers if held.get(n.name, 0) > others]
        if not splits:
            return PassResult(graph, False, PassReport.empty(
                self.name, f"no IdentityN barrier bounds the plan (another op's working set, "
                f"{format_bytes(others)}, is larger)"))
        taken = set(graph.by_name)
        renamed: dict[TensorRef, TensorRef] = {}
        replacement: dict[str, list[OpNode]] = {}
        for node in splits:
            replacement[node.name] = []
            for i, t in enumerate(node.inputs):
                name = claim_name(taken, f"{node.name}/tfmem_split_{i}")
                attrs = {"T": attr_value_pb2.AttrValue(type=node.attrs["T"].list.type[i]),
                         DO_NOT_REMOVE: attr_value_pb2.AttrValue(b=True)}
                replacement[node.name].append(OpNode(name, "Identity", (t,), node.control_inputs, node.device,
                                                     (node.outputs[i],), MappingProxyType(attrs)))
                renamed[TensorRef(node.name, i)] = TensorRef(name, 0)
        nodes: list[OpNode] = []
        for node in graph.nodes:
            inputs = tuple(renamed.get(t, t) for t in node.inputs)
            nodes += replacement.get(node.name, [node if inputs == node.inputs
                                                 else dataclasses.replace(node, inputs=inputs)])
        largest = max(splits, key=lambda n: held[n.name])
        notes = (f"{len(splits)} IdentityN barrier(s) split into {len(renamed)} identities; largest: {largest.name} "
                 f"({len(largest.inputs)} tensors, {format_bytes(held[largest.name])} that no longer wait for each "
                 "other)",)
        return PassResult(graph.replace_nodes(tuple(nodes)), True, PassReport(
            self.name, changed=True, nodes_added=len(renamed) - len(splits), notes=notes,
            details={"split": {n.name: len(n.inputs) for n in splits}}))
