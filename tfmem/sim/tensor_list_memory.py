"""The memory a ``TensorList`` holds: the items put in it, charged to the ``variant`` handle that carries it.

A list is a ``variant`` handle (0 bytes to ``tfmem.ir.shapes``), but the tensors written into it live as long as
the list does. In an RNN's training step the forward loop pushes every time step's activations into lists
(while_v2's gradient accumulators, a ``TensorArray``'s ``TensorListSetItem``) and the gradient loop pops them;
freed at their last direct use (the push) they would be missed, and the simulator undercounted a tf_keras LSTM's
step by 7x (``tests/test_tensorlist_memory.py``). ``list_holdings`` gives each list handle that one unit of
``tfmem.ir.execution.ExecutionGraph`` hands to another (a plain op's output, a v1 frame's ``Exit``) the bytes of
the items it holds, and the replay allocates them with the handle and frees them when its last reader is done.

The model, conservative where the graph does not say:

* ``TensorListFromTensor``, ``TensorListScatter`` and ``TensorListSplit`` copy their tensor into the items;
  ``EmptyTensorList`` and ``TensorListReserve`` hold nothing; ``ZerosLike`` of a list makes zeros of each item;
  ``AddN`` of lists (a gradient accumulator) holds as much as its largest input (``TensorListBinaryAdd`` adds
  lists of one length, item by item); identities and v1 control flow hand a list on.
* A push or a write adds its item; a pop outside loops hands the item out (it then lives as any tensor).
* Loops are not unrolled (a v1 frame is one unit): a list carried through a loop holds what it entered with, plus
  the loop's trip count times what one iteration puts in it (what a pop takes out is not subtracted: the list is
  charged whole until its last reader, a gradient loop, ends). A list of known length written by index
  (``TensorListSetItem`` only) holds at most its length in items. The trip count is read off the loop's
  condition (``counter < limit``, the limit static or another loop's final count); where it cannot be, the
  growth is not counted and the profile says so.
* An item is counted where a fresh buffer is made for it each iteration; a loop-invariant tensor (entered from
  outside, a constant, a variable's value) pushed every iteration is one buffer, counted where it is made.
  An item read out of another list (``TensorListGetItem``) is counted again: the two lists may outlive each
  other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from tensorflow.python.framework import tensor_util

from tfmem.ir.execution import ExecutionGraph
from tfmem.ir.graph import GraphIR, TensorRef
from tfmem.ir.ops import (
    ALIAS_OPS,
    CONST_OPS,
    ENTER_OPS,
    EXIT_OPS,
    IDENTITY_OPS,
    MERGE_OPS,
    NEXT_ITERATION_OPS,
    PERSISTENT_OUTPUT_OPS,
    SWITCH_OPS,
    VARIABLE_READ_OPS,
)


@dataclass(frozen=True)
class ListHoldings:
    """Bytes of items held by each list handle passed between units, and what could not be counted."""

    bytes_of: Mapping[TensorRef, int]
    # a loop's Exit of a list the loop only reads -> the list that entered the loop: one buffer of items
    shares: Mapping[TensorRef, TensorRef] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


# Ops that make a list holding a copy of their input tensor
_COPYING_SOURCES = frozenset({"TensorListFromTensor", "TensorListScatter", "TensorListScatterV2", "TensorListSplit"})
# Ops that hand input 0's list on unchanged
_PASSING = IDENTITY_OPS | ENTER_OPS | EXIT_OPS | SWITCH_OPS | NEXT_ITERATION_OPS | {"ZerosLike", "IdentityN"}
# The item input of the ops that put one item in a list
_ITEM_INPUT = {"TensorListPushBack": 1, "TensorListSetItem": 2}
_COMPARISONS = {"Less": (0, 1, 0), "LessEqual": (0, 1, 1), "Greater": (1, 0, 0), "GreaterEqual": (1, 0, 1)}


def list_holdings(eg: ExecutionGraph) -> ListHoldings:
    """The ``ListHoldings`` of the list handles ``eg``'s units make visible to each other.

    Examples
    --------
    >>> import tensorflow as tf
    >>> g = tf.Graph()
    >>> with g.as_default():
    ...     x = tf.zeros((8, 256))
    ...     lst = tf.raw_ops.TensorListFromTensor(tensor=x, element_shape=[256], name="lst")
    ...     y = tf.raw_ops.TensorListStack(input_handle=lst, element_shape=[256], element_dtype=tf.float32)
    >>> from tfmem.ir.shapes import annotate
    >>> eg = ExecutionGraph.build(annotate(g.as_graph_def()), [y.name])
    >>> dict(list_holdings(eg).bytes_of)                 # the 8 items of 1 KiB each, copied out of x
    {TensorRef(node='lst', index=0): 8192}
    """
    model = _Lists(eg.graph)
    out, shares = {}, {}
    for unit in eg.units:
        for t in eg.outputs_of(unit):
            if eg.graph.spec(t).dtype == "variant":
                held = model.held(t)
                if held > 0:
                    out[t] = held
                    entered = model.entered_unchanged(t)
                    if entered is not None and eg.unit_of.get(entered.node) not in (None, unit):
                        shares[t] = entered
    return ListHoldings(out, shares, tuple(sorted(set(model.notes))))


class _Lists:
    def __init__(self, graph: GraphIR) -> None:
        self.graph = graph
        self.memo: dict[TensorRef, int] = {}
        self.trips: dict[str, int | None] = {}
        self.notes: list[str] = []
        self.unchanged: set[TensorRef] = set()   # loops' Merges of lists that each iteration hands on as they are

    def nbytes(self, t: TensorRef) -> int:
        spec = self.graph.spec(t)
        return 0 if spec.dtype in ("variant", "resource") else spec.nbytes or 0

    def held(self, t: TensorRef) -> int:
        """Bytes of the items list ``t`` holds (at the end of its loop, for a list carried through one)."""
        if t not in self.memo:
            self.memo[t] = 0   # a cycle not through a loop's Merge holds nothing more
            self.memo[t] = self._held(t)
        return self.memo[t]

    def _held(self, t: TensorRef) -> int:
        node = self.graph[t.node]
        op, ins = node.op, node.inputs
        if op in _COPYING_SOURCES:
            return self.nbytes(ins[0])
        if op in _ITEM_INPUT and t.index == 0:
            return self.held(ins[0]) + self.nbytes(ins[_ITEM_INPUT[op]])
        if op == "TensorListPopBack" and t.index == 0:
            return max(0, self.held(ins[0]) - self.nbytes(TensorRef(t.node, 1)))
        if op == "TensorListScatterIntoExistingList":
            return self.held(ins[0]) + self.nbytes(ins[1])
        if op == "TensorListResize":
            return self.held(ins[0])
        if op in _PASSING and ins:
            return self.held(ins[t.index if op == "IdentityN" else 0])
        if op == "AddN":
            return max((self.held(i) for i in ins), default=0)
        if op in MERGE_OPS and t.index == 0:
            back = [i for i in ins if self.graph[i.node].op in NEXT_ITERATION_OPS]
            return self._loop_held(t, back[0]) if back else max((self.held(i) for i in ins), default=0)
        return 0   # list sources that hold nothing, and ops tfmem does not follow

    def _loop_held(self, merge: TensorRef, back: TensorRef) -> int:
        """A loop-carried list at the loop's end: what it entered with, plus the trip count's iterations."""
        entered = max((self.held(i) for i in self.graph[merge.node].inputs if i != back), default=0)
        floor = [entered]   # an AddN's other inputs: the accumulator holds at least as much as each
        reaches, added, by_index = self._iteration(self.graph[back.node].inputs[0], merge, set(), floor)
        entered = max(floor)
        if not reaches:   # a list made afresh in each iteration
            return max(entered, added)
        if added == 0:
            if max(floor[1:], default=0) == 0:
                self.unchanged.add(merge)
            return entered
        trips = self._trips_of(merge)
        if trips is None:
            self.notes.append(f"loop of {merge.node}: trip count unknown; the items its lists gain are not counted")
            return entered
        grown = entered + trips * added
        length = self._length(merge, set()) if by_index else None
        return grown if length is None else max(entered, min(grown, length * added))

    def entered_unchanged(self, t: TensorRef) -> TensorRef | None:
        """For a loop's ``Exit`` of a list that no iteration adds to: the list that entered the loop."""
        node = self.graph[t.node]
        if node.op not in EXIT_OPS or not node.inputs or self.graph[node.inputs[0].node].op not in SWITCH_OPS:
            return None
        merge = self.graph[node.inputs[0].node].inputs[0]
        if merge not in self.unchanged:
            return None
        entering = [i for i in self.graph[merge.node].inputs if self.graph[i.node].op in ENTER_OPS]
        return self.graph[entering[0].node].inputs[0] if len(entering) == 1 else None

    def _iteration(self, t: TensorRef, merge: TensorRef, seen: set[TensorRef], floor: list[int],
                   ) -> tuple[bool, int, bool]:
        """Walk one iteration's list back from the ``NextIteration`` to ``merge``: (reaches it, bytes of fresh
        items put in per iteration, written by index only)."""
        if t == merge or t in seen:
            return t == merge, 0, True
        seen.add(t)
        node = self.graph[t.node]
        op, ins = node.op, node.inputs
        if op in _ITEM_INPUT and t.index == 0:
            reaches, added, by_index = self._iteration(ins[0], merge, seen, floor)
            return reaches, added + self._fresh(ins[_ITEM_INPUT[op]]), by_index and op == "TensorListSetItem"
        if (op in _PASSING or op in MERGE_OPS or op == "TensorListPopBack" or op == "TensorListResize") and ins:
            return self._iteration(ins[t.index if op == "IdentityN" else 0], merge, seen, floor)
        if op == "AddN":
            for i in ins:
                reaches, added, by_index = self._iteration(i, merge, seen, floor)
                if reaches:
                    floor.extend(self.held(j) for j in ins if j != i)
                    return True, added, by_index
        return False, self.held(t), True

    def _fresh(self, item: TensorRef) -> int:
        """Bytes a push of ``item`` adds each iteration: none for a buffer that is the same every iteration."""
        t = item
        while True:
            node = self.graph[t.node]
            if node.op in ENTER_OPS or node.op in PERSISTENT_OUTPUT_OPS or node.op in VARIABLE_READ_OPS:
                return 0
            if node.op in MERGE_OPS and self._carried_unchanged(node.name):
                return self._fresh(next(i for i in node.inputs if self.graph[i.node].op not in NEXT_ITERATION_OPS))
            if node.op in MERGE_OPS or node.op not in ALIAS_OPS or not node.inputs:
                return self.nbytes(item)
            t = node.inputs[0]

    def _carried_unchanged(self, merge: str) -> bool:
        """A loop variable each iteration hands on as it is (a limit, a loop-invariant carried by while_v2)."""
        ins = self.graph[merge].inputs
        back = [i for i in ins if self.graph[i.node].op in NEXT_ITERATION_OPS]
        return len(ins) == 2 and len(back) == 1 and self._counter_of(self.graph[back[0].node].inputs[0]) == merge

    def _length(self, t: TensorRef, seen: set[TensorRef]) -> int | None:
        """The length of the list ``t`` where its source fixes it (``TensorListReserve``, a copied tensor)."""
        if t in seen:
            return None
        seen.add(t)
        node = self.graph[t.node]
        if node.op == "TensorListReserve":
            value = self._static(node.inputs[1])
            return None if value is None or value < 0 else value
        if node.op == "TensorListFromTensor":
            shape = self.graph.spec(node.inputs[0]).shape
            return shape[0] if shape else None
        if node.op in MERGE_OPS:
            lengths = [self._length(i, seen) for i in node.inputs if self.graph[i.node].op not in NEXT_ITERATION_OPS]
            return None if not lengths or None in lengths else max(x for x in lengths if x is not None)
        if (node.op in _PASSING or node.op == "TensorListSetItem") and node.inputs:
            return self._length(node.inputs[0], seen)
        if node.op == "AddN":   # lists added item by item have one length
            known = [x for x in (self._length(i, seen) for i in node.inputs) if x is not None]
            return max(known) if known else None
        return None

    # -- trip counts -------------------------------------------------------------------------------------------

    def _trips_of(self, merge: TensorRef) -> int | None:
        """The trip count of the loop ``merge`` belongs to, from the ``LoopCond`` its ``Switch`` takes."""
        for consumer in self.graph.consumers.get(merge, ()):
            node = self.graph[consumer]
            if node.op in SWITCH_OPS and len(node.inputs) > 1:
                pred = node.inputs[1]
                cond = self.graph[pred.node]
                if cond.op == "LoopCond":
                    if cond.name not in self.trips:
                        self.trips[cond.name] = None   # a loop bounded by its own count: unknown
                        self.trips[cond.name] = self._bound(cond.inputs[0])
                    return self.trips[cond.name]
        return None

    def _bound(self, pred: TensorRef) -> int | None:
        """The most iterations ``pred`` allows: the least of its ``counter < limit`` conjuncts."""
        node = self.graph[pred.node]
        if node.op in IDENTITY_OPS and node.inputs:
            return self._bound(node.inputs[0])
        if node.op == "LogicalAnd":
            bounds = [b for b in (self._bound(i) for i in node.inputs) if b is not None]
            return min(bounds) if bounds else None
        if node.op not in _COMPARISONS or len(node.inputs) != 2:
            return None
        low, high, inclusive = _COMPARISONS[node.op]
        counter, limit = self._counter(node.inputs[low]), self._final(node.inputs[high])
        if counter is None or limit is None:
            return None
        start, step = counter
        return max(0, -(-(limit - start + inclusive) // step))

    def _counter(self, t: TensorRef) -> tuple[int, int] | None:
        """(start, step) of a loop counter: a ``Merge`` of a static start and itself plus a static step."""
        node = self.graph[t.node]
        while node.op in IDENTITY_OPS | SWITCH_OPS and node.inputs:
            node = self.graph[node.inputs[0].node]
        if node.op not in MERGE_OPS or len(node.inputs) != 2:
            return None
        enter, back = sorted(node.inputs, key=lambda i: self.graph[i.node].op in NEXT_ITERATION_OPS)
        if self.graph[back.node].op not in NEXT_ITERATION_OPS:
            return None
        start = self._final(enter)
        add = self.graph[self.graph[back.node].inputs[0].node]
        while add.op in IDENTITY_OPS and add.inputs:   # a lowered functional loop's body output identities
            add = self.graph[add.inputs[0].node]
        if start is None or add.op not in ("Add", "AddV2") or len(add.inputs) != 2:
            return None
        for own, other in (add.inputs, add.inputs[::-1]):
            step = self._static(other)
            if step is not None and step > 0 and self._counter_of(own) == node.name:
                return start, step
        return None

    def _counter_of(self, t: TensorRef) -> str:
        node = self.graph[t.node]
        while node.op in IDENTITY_OPS | SWITCH_OPS and node.inputs:
            node = self.graph[node.inputs[0].node]
        return node.name

    def _final(self, t: TensorRef) -> int | None:
        """A loop-invariant integer: a constant entered into the loop, or another loop's final count."""
        node = self.graph[t.node]
        while node.op in IDENTITY_OPS | ENTER_OPS and node.inputs:
            t = node.inputs[0]
            node = self.graph[t.node]
        if node.op in MERGE_OPS and self._carried_unchanged(node.name):   # a limit the loop carries
            return self._final(next(i for i in node.inputs if self.graph[i.node].op not in NEXT_ITERATION_OPS))
        if node.op in EXIT_OPS and node.inputs:   # start + trips * step of the other loop's counter
            counter = self._counter(node.inputs[0])
            switch = self.graph[node.inputs[0].node]
            merge = switch.inputs[0] if switch.op in SWITCH_OPS else None
            trips = None if merge is None or counter is None else self._trips_of(merge)
            return None if trips is None or counter is None else counter[0] + trips * counter[1]
        return self._static(t)

    def _static(self, t: TensorRef) -> int | None:
        node = self.graph[t.node]
        while node.op in IDENTITY_OPS and node.inputs:
            node = self.graph[node.inputs[0].node]
        if node.op not in CONST_OPS or "value" not in node.attrs:
            return None
        value = tensor_util.MakeNdarray(node.attrs["value"].tensor)
        return int(value) if value.ndim == 0 and np.issubdtype(value.dtype, np.integer) else None
