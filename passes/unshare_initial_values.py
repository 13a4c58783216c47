"""Give every variable initialised to a constant a buffer of its own, so training never copies it mid-step.

A session initialises a resource variable by making it hold its initial value's buffer. Where that value is a
constant, the buffer is not the variable's alone: Grappler merges identical constants, so the zero slots of
same-shaped weights (Adam, momentum), zero biases and unit batch-norm gammas hold one buffer, and while the
init graph's kernels live (one session for init and training, the common TF1 workflow) each ``Const`` kernel
holds a reference too. The first in-place update of such a variable (``ResourceApplyAdam``...) then copies it
into a new chunk (TF's copy-on-write), allocated in the middle of the first step and kept for the session
(``tfmem.ir.shared_init``). Those small chunks sit between the first step's activations and split the device's
free memory for every later step (``tests/test_guarantee.py``: a ResNet-20 with momentum at 112 MiB).

This pass routes each such initializer through a ``DeepCopy``: the variable starts out holding a fresh buffer
that nothing else references, so no update copies it (``tests/test_unshare_initial_values.py`` measures the
updates' allocations in a one-session workflow). The copies are made once, when the user runs the
initializers, next to the other variables; ``DeepCopy`` is stateful, so neither Grappler nor the executor
folds or merges it back into a shared constant.

Only initializers are changed: assignments the step itself runs are left alone (a copy there would cost
every step), as are variables no op updates in place (nothing copies them) and dtypes other than floating
point (the slots, biases and scales this is about; ``DeepCopy`` kernels for other dtypes vary by device).

Requires: nothing. Ensures: the same values (``DeepCopy`` copies bytes); the user's initializer ops keep their
names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tensorflow.core.framework import attr_value_pb2

from tfmem.ir.colocation import COLOCATION_ATTR
from tfmem.ir.editor import GraphEditor
from tfmem.ir.execution import ExecutionGraph
from tfmem.ir.graph import GraphIR, TensorRef
from tfmem.ir.shared_init import constant_key, updated_in_place, variable_of
from tfmem.pipeline import PassContext, PassReport, PassResult
from tfmem.units import format_bytes

# dtypes (as ``TensorSpec.dtype`` names them) whose initializers are copied: the slots, biases and scales that
# start at a constant are floating point, and DeepCopy has kernels for these on CPU and GPU.
COPIED_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})


def _colocated_with(var: str) -> attr_value_pb2.AttrValue:
    """TF's colocation constraint: the copy goes wherever ``var`` does (placing a variable on the host moves the
    ops colocated with it too, ``passes.place_persistent.persistent_groups``)."""
    return attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(s=[f"loc:@{var}".encode()]))


@dataclass(frozen=True)
class UnshareInitialValues:
    """Route each constant initializer of an in-place-updated variable through a ``DeepCopy``.

    Examples
    --------
    >>> import tensorflow as tf
    >>> from tfmem.ir.loading import load
    >>> from tfmem.pipeline import PassContext
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     a = tf.compat.v1.get_variable("a", initializer=tf.zeros([64]), use_resource=True)
    ...     b = tf.compat.v1.get_variable("b", initializer=tf.zeros([64]), use_resource=True)
    ...     step = tf.group(a.assign_add(tf.ones([64])), b.assign_add(tf.ones([64])), name="step")
    >>> result = UnshareInitialValues().run(load(g), PassContext(("step",)))
    >>> [str(result.graph[f"{v}/Assign"].inputs[1]) for v in "ab"]
    ['a/tfmem_initial_copy:0', 'b/tfmem_initial_copy:0']
    """

    name: ClassVar[str] = "unshare_initial_values"
    # It does not depend on the budget: optimize runs it once, before planning and before the lower bound.
    budget_independent: ClassVar[bool] = True
    peak_non_increasing: ClassVar[bool] = False

    def run(self, graph: GraphIR, ctx: PassContext) -> PassResult:
        step = ExecutionGraph.build(graph, ctx.fetches, ctx.feed_shapes).needed
        updated = updated_in_place(graph)
        editor = GraphEditor(graph)
        copied: dict[str, int] = {}
        for node in graph.nodes:
            if node.op != "AssignVariableOp" or len(node.inputs) < 2 or node.name in step:
                continue
            var, value = variable_of(graph, node.inputs[0]), node.inputs[1]
            spec = graph.spec(value)
            if (var is None or var not in updated or spec.dtype not in COPIED_DTYPES
                    or constant_key(graph, value) is None):
                continue
            copy = editor.add_op(editor.unique_name(f"{var}/tfmem_initial_copy"), "DeepCopy", [value], [spec],
                                 device=node.device,
                                 attrs={"T": node.attrs["dtype"], COLOCATION_ATTR: _colocated_with(var)})
            editor.rewire(node.name, value, TensorRef(copy.name, 0))
            copied[var] = spec.nbytes or 0
        if not copied:
            return PassResult(graph, False, PassReport.empty(
                self.name, "no variable updated in place starts from a constant"))
        note = (f"{len(copied)} variable(s) initialised from a constant now start with a buffer of their own "
                f"({format_bytes(sum(copied.values()))}), so the first step copies none of them")
        return PassResult(editor.finish(), True, PassReport(self.name, changed=True, notes=(note,),
                                                            details={"copied": sorted(copied)}))
