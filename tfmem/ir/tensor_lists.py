"""What a ``TensorList`` holds, followed from the ops that make and fill it: TF2 loops' ``variant`` lists.

A list is a ``variant`` handle (0 bytes to tfmem); its elements' shapes live in the handle's run-time data, which
a GraphDef does not carry, so TensorFlow's shape functions give ``TensorListStack``, ``TensorListGetItem`` and
``TensorListPopBack`` partial shapes wherever a list has crossed a loop or an import (the LSTM and GRU layers'
loops over time and their gradients' accumulators). ``ListInfo`` is what tfmem knows of one list: its declared
element shape, the most general shape of the items put in it, and its length. ``list_outputs`` gives the
``ListInfo`` of an op's list outputs from its inputs' (``Args``), ``read_shapes`` the shapes of the tensors an op
reads out of a list, and ``list_value`` the values of ``TensorListLength`` and ``TensorListElementShape``. The
rules follow ``tensorflow/core/ops/list_ops.cc`` and the kernels in ``tensorflow/core/kernels/list_kernels.h``.

Examples
--------
>>> import tensorflow as tf
>>> reserved = ListInfo(tf.TensorShape([None, 32]), None, 12)
>>> filled = reserved.with_item(tf.TensorShape([16, 32]))
>>> filled.element_shape(), filled.length
(TensorShape([16, 32]), 12)
>>> filled.join(reserved.with_item(tf.TensorShape([8, 32]))).element_shape()
TensorShape([None, 32])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from tfmem.ir.graph import OpNode, TensorRef


@dataclass(frozen=True)
class ListInfo:
    """One ``TensorList``: its declared element shape, the join of its items' shapes (None: no item put yet)
    and its length (None: unknown)."""

    declared: tf.TensorShape
    items: tf.TensorShape | None
    length: int | None

    def element_shape(self) -> tf.TensorShape:
        """The shape of the elements a read gets: the items' where they say more than the declaration."""
        if self.items is None or not self.items.is_compatible_with(self.declared):
            return self.declared
        return self.declared.merge_with(self.items)

    def with_item(self, shape: tf.TensorShape, length: int | None | str = "same") -> ListInfo:
        """This list after ``shape`` was put in it (``length``: the new length, if it changed)."""
        items = shape if self.items is None else _join(self.items, shape)
        return ListInfo(self.declared, items, self.length if length == "same" else length)  # type: ignore[arg-type]

    def join(self, other: ListInfo) -> ListInfo:
        """What is known of a list that is either this one or ``other`` (a loop's ``Merge``)."""
        items = other.items if self.items is None else self.items if other.items is None else _join(self.items,
                                                                                                     other.items)
        return ListInfo(_join(self.declared, other.declared), items,
                        self.length if self.length == other.length else None)


def _join(a: tf.TensorShape, b: tf.TensorShape) -> tf.TensorShape:
    return a.most_specific_compatible_shape(b)


class Args(Protocol):
    """What a rule reads of an op's inputs."""

    def shape(self, t: TensorRef) -> tf.TensorShape: ...
    def value(self, t: TensorRef) -> np.ndarray | None: ...
    def info(self, t: TensorRef) -> ListInfo | None: ...


def shape_from_value(value: np.ndarray | None) -> tf.TensorShape:
    """A shape given as a tensor (an ``element_shape`` input): -1 is an unknown dimension, a scalar -1 an unknown
    rank (``MakeShapeFromShapeTensorTreatScalarAsUnknownShape``)."""
    if value is None or value.ndim > 1 or value.ndim == 0 and int(value) != -1:
        return tf.TensorShape(None)
    if value.ndim == 0:
        return tf.TensorShape(None)
    return tf.TensorShape([None if int(d) < 0 else int(d) for d in value])


def _scalar(value: np.ndarray | None) -> int | None:
    return int(value) if value is not None and value.ndim == 0 and int(value) >= 0 else None


def _tail(shape: tf.TensorShape) -> tf.TensorShape:
    return tf.TensorShape(None) if shape.rank is None or shape.rank == 0 else shape[1:]


def _head(shape: tf.TensorShape) -> int | None:
    return None if shape.rank is None or shape.rank == 0 else shape.as_list()[0]


def _minus_one(n: int | None) -> int | None:
    return n - 1 if n else None


def _plus_one(n: int | None) -> int | None:
    return None if n is None else n + 1


ListRule = Callable[[OpNode, Args], list[ListInfo | None]]


def _from_tensor(node: OpNode, a: Args) -> list[ListInfo | None]:
    shape = a.shape(node.inputs[0])
    declared = shape_from_value(a.value(node.inputs[1]))
    items = _tail(shape)
    if items.is_compatible_with(declared):
        declared = declared.merge_with(items)
    return [ListInfo(declared, items, _head(shape))]


def _scatter(node: OpNode, a: Args) -> list[ListInfo | None]:
    """``TensorListScatter`` (V1, V2): its length is ``num_elements``, else one more than the largest index."""
    indices = a.value(node.inputs[1])
    length = _scalar(a.value(node.inputs[3])) if node.op == "TensorListScatterV2" else None
    if length is None and indices is not None and indices.size:
        length = int(indices.max()) + 1
    items = _tail(a.shape(node.inputs[0]))
    return [ListInfo(shape_from_value(a.value(node.inputs[2])), items, length)]


def _split(node: OpNode, a: Args) -> list[ListInfo | None]:
    lengths = a.value(node.inputs[2])
    rows = int(lengths[0]) if lengths is not None and lengths.size and (lengths == lengths[0]).all() else None
    items = _tail(a.shape(node.inputs[0]))
    items = tf.TensorShape([rows]).concatenate(_tail(items)) if items.rank else tf.TensorShape(None)
    return [ListInfo(shape_from_value(a.value(node.inputs[1])), items, _head(a.shape(node.inputs[2])))]


def _updated(change: Callable[[ListInfo, OpNode, Args], ListInfo]) -> ListRule:
    def rule(node: OpNode, a: Args) -> list[ListInfo | None]:
        info = a.info(node.inputs[0])
        return [None if info is None else change(info, node, a)]
    return rule


def _set_item(info: ListInfo, node: OpNode, a: Args) -> ListInfo:
    resize = "resize_if_index_out_of_bounds" in node.attrs and node.attrs["resize_if_index_out_of_bounds"].b
    return info.with_item(a.shape(node.inputs[2]), None if resize else "same")


def _scatter_into(info: ListInfo, node: OpNode, a: Args) -> ListInfo:
    indices = a.value(node.inputs[2])   # the list grows to hold the largest index
    length = None if info.length is None or indices is None else max([info.length, *(int(i) + 1 for i in indices.flat)])
    return info.with_item(_tail(a.shape(node.inputs[1])), length)


def _pass_through(node: OpNode, a: Args) -> list[ListInfo | None]:
    """Ops that hand their input lists on unchanged (identities, v1 frames, ``ZerosLike``: zeros of each item)."""
    n = len(node.inputs) if node.op == "IdentityN" else 1
    infos = [a.info(t) for t in node.inputs[:n]]
    return infos * 2 if node.op in ("Switch", "RefSwitch") else infos


def _joined(node: OpNode, a: Args) -> list[ListInfo | None]:
    """``AddN`` of lists (gradients of a list summed): each element the sum of theirs."""
    infos = [i for i in (a.info(t) for t in node.inputs) if i is not None]
    if len(infos) < len(node.inputs) or not infos:
        return [None]
    out = infos[0]
    for other in infos[1:]:
        out = out.join(other)
    return [out]


LIST_RULES: Mapping[str, ListRule] = {
    "EmptyTensorList": lambda node, a: [ListInfo(shape_from_value(a.value(node.inputs[0])), None, 0)],
    "TensorListReserve": lambda node, a: [ListInfo(shape_from_value(a.value(node.inputs[0])), None,
                                                   _scalar(a.value(node.inputs[1])))],
    "TensorListFromTensor": _from_tensor,
    "TensorListScatter": _scatter,
    "TensorListScatterV2": _scatter,
    "TensorListSplit": _split,
    "TensorListSetItem": _updated(_set_item),
    "TensorListPushBack": _updated(lambda info, node, a: info.with_item(a.shape(node.inputs[1]),
                                                                        _plus_one(info.length))),
    "TensorListPopBack": lambda node, a: [None if (i := a.info(node.inputs[0])) is None
                                          else ListInfo(i.declared, i.items, _minus_one(i.length)), None],
    "TensorListResize": _updated(lambda info, node, a: ListInfo(info.declared, info.items,
                                                                _scalar(a.value(node.inputs[1])))),
    "TensorListScatterIntoExistingList": _updated(_scatter_into),
    **dict.fromkeys(("Identity", "Snapshot", "StopGradient", "IdentityN", "Enter", "RefEnter", "Exit", "RefExit",
                     "Switch", "RefSwitch", "NextIteration", "RefNextIteration", "ZerosLike"), _pass_through),
    "AddN": _joined,
}


def list_outputs(node: OpNode, args: Args) -> list[ListInfo | None] | None:
    """The ``ListInfo`` of each output of ``node`` (None where it is no list or nothing is known), or None for
    an op that makes no list. ``Merge`` is the caller's: only it knows which of its inputs are computed yet."""
    rule = LIST_RULES.get(node.op)
    return None if rule is None else rule(node, args)


def _read(info: ListInfo, given: tf.TensorShape) -> tf.TensorShape:
    shape = info.element_shape()
    return shape.merge_with(given) if shape.is_compatible_with(given) else given


def read_shapes(node: OpNode, args: Args) -> list[tf.TensorShape] | None:
    """The shapes of the tensors ``node`` reads out of a list (None for other ops, or an unknown list)."""
    op = node.op
    if op not in _READS:
        return None
    info = args.info(node.inputs[0])
    if info is None:
        return None
    given = shape_from_value(args.value(node.inputs[_READS[op]])) if _READS[op] >= 0 else tf.TensorShape(None)
    if op == "TensorListConcat" and "element_shape" in node.attrs:
        given = tf.TensorShape(node.attrs["element_shape"].shape)
    element = _read(info, given)
    if op in ("TensorListGetItem", "TensorListPopBack"):
        return [tf.TensorShape([]), element] if op == "TensorListPopBack" else [element]
    if op == "TensorListStack":
        count = _attr_int(node.attrs, "num_elements")
        length = info.length if info.length is not None else (count if count >= 0 else None)
        return [tf.TensorShape([length]).concatenate(element)]
    if op == "TensorListGather":
        return [tf.TensorShape([_head(args.shape(node.inputs[1]))]).concatenate(element)]
    # TensorListConcat(V2): the elements joined along their first dimension, and each one's length
    rows = _head(element)
    total = None if rows is None or info.length is None else rows * info.length
    rest = _tail(element)
    return [tf.TensorShape([total]).concatenate(rest) if element.rank else tf.TensorShape(None),
            tf.TensorShape([info.length])]


# The reading ops, and which input is their ``element_shape`` (-1: none)
_READS = {"TensorListGetItem": 2, "TensorListPopBack": 1, "TensorListStack": 1, "TensorListGather": 2,
          "TensorListConcatV2": 1, "TensorListConcat": -1}


def _attr_int(attrs: Mapping[str, attr_value_pb2.AttrValue], key: str) -> int:
    return int(attrs[key].i) if key in attrs else -1


def list_value(node: OpNode, args: Args, dtype: np.dtype) -> np.ndarray | None:
    """The value of ``TensorListLength`` (the list's length) or ``TensorListElementShape`` (its declared element
    shape, -1 for each unknown dimension, as the kernel returns it), where known statically."""
    if node.op not in ("TensorListLength", "TensorListElementShape"):
        return None
    info = args.info(node.inputs[0])
    if info is None:
        return None
    if node.op == "TensorListLength":
        return None if info.length is None else np.array(info.length, dtype=dtype)
    if info.declared.rank is None:
        return np.array(-1, dtype=dtype)
    return np.array([-1 if d is None else d for d in info.declared.as_list()], dtype=dtype)


# The ops that make a list from no list: where following lists starts
LIST_SOURCES = frozenset({"EmptyTensorList", "TensorListReserve", "TensorListFromTensor", "TensorListScatter",
                          "TensorListScatterV2", "TensorListSplit"})
