"""Write Grappler's kernel fusions (``MatMul + BiasAdd`` -> ``_FusedMatMul``...) into the graph, as the session does.

Grappler's remapper fuses a contraction with the ops after it only where the graph lets it: the contraction
must have no other consumer, no control edge and no preserve mark. Passes add control edges (barriers),
consumers (swap-outs) and marks, so after them the same ``MatMul + BiasAdd`` may run unfused, and the fused
kernel rounds differently (``tests/test_pin_fusions.py``). This pass reads the fusions Grappler makes on the
user's graph and puts those fused nodes in the graph itself, under the fused node's name, so every later
rewrite keeps them.

Requires: an annotated graph. Ensures: the session runs the same kernels as for the user's graph; the
absorbed ops (the ``MatMul``) are left without consumers, so the session prunes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from tensorflow.core.framework import attr_value_pb2

from tfmem.ir.editor import DO_NOT_REMOVE
from tfmem.ir.frames import find_regions
from tfmem.ir.graph import GraphIR, OpNode, TensorRef
from tfmem.pipeline import PassContext, PassReport, PassResult
from tfmem.sim.grappler import runtime_nodes

FUSED_PREFIX = "_Fused"   # the remapper's fused kernels: _FusedMatMul, _FusedConv2D, _FusedBatchNormEx...
# A contraction fused with a residual add is oneDNN's kernel, which a session's graph rewrite makes of the
# remapper's node only where the remapper made it: pinned into the graph, the plain CPU kernel runs it and fails
# ("Fusion is not implemented: [BiasAdd,Add]", TF-Slim ResNet-v2-50 on the testbed;
# tests/test_pin_fusions.py::test_a_residual_add_fusion_is_left_to_the_session). The session fuses those itself.
_RESIDUAL_ADDS = frozenset({"Add", "AddV2"})
# Attrs of the runtime node that describe the placement or shapes Grappler saw, not the kernel.
_DROPPED_ATTRS = frozenset({"_input_shapes", "_output_shapes"})


@dataclass(frozen=True)
class PinFusions:
    """Replace each node Grappler would fuse by the fused node it would run, with the same name.

    Examples
    --------
    >>> import tensorflow as tf
    >>> from tfmem.pipeline import PassContext
    >>> from tfmem.ir.shapes import annotate
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     x = tf.compat.v1.placeholder(tf.float32, (64, 32), name="x")
    ...     w, b = tf.ones((32, 16)), tf.compat.v1.placeholder(tf.float32, (16,), name="b")
    ...     _ = tf.nn.bias_add(tf.matmul(x, w * 2.0), b, name="y")
    >>> result = PinFusions().run(annotate(g.as_graph_def()), PassContext(("y:0",)))
    >>> result.graph["y"].op
    '_FusedMatMul'
    """

    name: ClassVar[str] = "pin_fusions"
    budget_independent: ClassVar[bool] = True
    peak_non_increasing: ClassVar[bool] = False

    def run(self, graph: GraphIR, ctx: PassContext) -> PassResult:
        in_frames = find_regions(graph)
        pinned: dict[str, OpNode] = {}
        for rt in runtime_nodes(graph, ctx.fetches, ctx.device, ctx.session_config):
            if not rt.op.startswith(FUSED_PREFIX) or rt.name not in graph or rt.name in in_frames:
                continue
            node = graph[rt.name]
            if node.op == rt.op or len(node.outputs) != 1:
                continue
            inputs = [TensorRef.parse(s) for s in rt.input if not s.startswith("^")]
            if not all(t.node in graph and t.index < len(graph[t.node].outputs) for t in inputs):
                continue
            fused = [op.decode() for op in rt.attr["fused_ops"].list.s] if "fused_ops" in rt.attr else []
            if _RESIDUAL_ADDS & set(fused):
                continue
            attrs = {k: v for k, v in rt.attr.items() if k not in _DROPPED_ATTRS}
            attrs[DO_NOT_REMOVE] = attr_value_pb2.AttrValue(b=True)
            pinned[node.name] = OpNode(node.name, rt.op, tuple(inputs), node.control_inputs, node.device,
                                       node.outputs, MappingProxyType(attrs))
        if not pinned:
            return PassResult(graph, False, PassReport.empty(self.name, "Grappler fuses nothing here"))
        new = graph.replace_nodes(tuple(pinned.get(n.name, n) for n in graph.nodes))
        ops = sorted({n.op for n in pinned.values()})
        note = f"{len(pinned)} node(s) fused as the session fuses them ({', '.join(ops)}), before any rewrite"
        return PassResult(new, True, PassReport(self.name, changed=True, notes=(note,),
                                                details={"pinned": sorted(pinned)}))

