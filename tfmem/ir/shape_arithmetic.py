"""The integer ops of shape-computing subgraphs, evaluated with numpy as TensorFlow's CPU kernels would.

``tfmem.ir.static_values`` asks ``evaluate`` for the value of an op in ``SHAPE_ARITHMETIC_OPS`` whose inputs it
knows: a few dozen numbers, where a scratch graph and a session cost milliseconds per op. Each rule gives
TensorFlow's result or raises: ``Unsupported`` for a form it does not cover (the caller asks TensorFlow), any
other exception for inputs TensorFlow would refuse too (the value stays unknown). A rule never guesses: where
numpy's semantics differ from TensorFlow's (negative gather indices, a zero divisor) it checks first.

Examples
--------
>>> import numpy as np
>>> from tensorflow.core.framework import attr_value_pb2
>>> evaluate("Pack", {"axis": attr_value_pb2.AttrValue(i=0)}, [np.int32(8), np.int32(4)])
array([8, 4], dtype=int32)
>>> evaluate("FloorDiv", {}, [np.array([7, -7], np.int32), np.array(2, np.int32)])
array([ 3, -4], dtype=int32)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

Attrs = Mapping[str, attr_value_pb2.AttrValue]
Rule = Callable[[Attrs, Sequence[np.ndarray], int], np.ndarray]


class Unsupported(Exception):
    """A form of the op that no rule here covers (e.g. a ``StridedSlice`` with an ellipsis)."""


def evaluate(op: str, attrs: Attrs, inputs: Sequence[np.ndarray], index: int = 0) -> np.ndarray:
    """Output ``index`` of ``op`` on ``inputs`` (numpy arrays of the inputs' dtypes).

    Raises
    ------
    Unsupported
        For an op or a form of it that has no rule here.
    Exception
        Whatever numpy raises, or ``ValueError``, for inputs TensorFlow refuses.
    """
    rule = RULES.get(op)
    if rule is None:
        raise Unsupported(op)
    with np.errstate(all="raise"):   # a scalar's overflow: no value rather than numpy's warning and wrapped result
        return np.asarray(rule(attrs, [np.asarray(v) for v in inputs], index))


def _int(attrs: Attrs, key: str, default: int = 0) -> int:
    return int(attrs[key].i) if key in attrs else default


def _axes(value: np.ndarray) -> tuple[int, ...]:
    return tuple(int(a) for a in np.atleast_1d(value))


def _binary(fn: Callable[[np.ndarray, np.ndarray], np.ndarray], nonzero_divisor: bool = False) -> Rule:
    def rule(attrs: Attrs, xs: Sequence[np.ndarray], index: int) -> np.ndarray:
        if nonzero_divisor and np.any(xs[1] == 0):
            raise ValueError("integer division by zero")
        return np.asarray(fn(xs[0], xs[1]), dtype=xs[0].dtype)
    return rule


def _reduction(fn: Callable[..., np.ndarray]) -> Rule:
    def rule(attrs: Attrs, xs: Sequence[np.ndarray], index: int) -> np.ndarray:
        keep = bool(attrs["keep_dims"].b) if "keep_dims" in attrs else False
        return np.asarray(fn(xs[0], axis=_axes(xs[1]), keepdims=keep), dtype=xs[0].dtype)
    return rule


def _strided_slice(attrs: Attrs, xs: Sequence[np.ndarray], index: int) -> np.ndarray:
    x, begin, end, strides = xs
    if _int(attrs, "ellipsis_mask") or _int(attrs, "new_axis_mask") or not (begin.ndim == end.ndim == strides.ndim == 1):
        raise Unsupported("StridedSlice with an ellipsis or a new axis")
    if not len(begin) == len(end) == len(strides) <= x.ndim:
        raise ValueError("begin, end and strides must have one entry per sliced dimension")
    begin_mask, end_mask, shrink = _int(attrs, "begin_mask"), _int(attrs, "end_mask"), _int(attrs, "shrink_axis_mask")
    key: list[int | slice] = []
    for i, (b, e, s) in enumerate(zip(begin.tolist(), end.tolist(), strides.tolist(), strict=True)):
        if shrink >> i & 1:
            at = b + x.shape[i] if b < 0 else b
            if not 0 <= at < x.shape[i]:
                raise IndexError(f"index {b} out of range for dimension {i}")
            key.append(at)
        elif s == 0:
            raise ValueError("stride 0")
        else:   # TensorFlow clamps begin and end as Python does
            key.append(slice(None if begin_mask >> i & 1 else b, None if end_mask >> i & 1 else e, s))
    return x[tuple(key)]


def _slice(attrs: Attrs, xs: Sequence[np.ndarray], index: int) -> np.ndarray:
    x, begin, size = xs
    key = []
    for i, (b, n) in enumerate(zip(begin.tolist(), size.tolist(), strict=True)):
        n = x.shape[i] - b if n == -1 else n
        if b < 0 or n < 0 or b + n > x.shape[i]:
            raise IndexError(f"slice of dimension {i} out of range")
        key.append(slice(b, b + n))
    if len(key) != x.ndim:
        raise ValueError("begin and size must have one entry per dimension")
    return x[tuple(key)]


def _gather(attrs: Attrs, xs: Sequence[np.ndarray], index: int) -> np.ndarray:
    params, indices = xs[0], xs[1]
    if _int(attrs, "batch_dims"):
        raise Unsupported("GatherV2 with batch_dims")
    axis = int(xs[2]) if len(xs) > 2 else 0
    axis = axis + params.ndim if axis < 0 else axis
    if not 0 <= axis < params.ndim or np.any((indices < 0) | (indices >= params.shape[axis])):
        raise IndexError("gather index out of range")   # numpy would wrap a negative index
    return np.take(params, indices, axis=axis)


def _transpose(attrs: Attrs, xs: Sequence[np.ndarray], index: int) -> np.ndarray:
    perm = xs[1].tolist()
    if sorted(perm) != list(range(xs[0].ndim)):
        raise ValueError(f"{perm} is not a permutation")   # numpy would take negative axes
    return np.transpose(xs[0], perm)


def _reshape(attrs: Attrs, xs: Sequence[np.ndarray], index: int) -> np.ndarray:
    if xs[1].ndim != 1:
        raise ValueError("the shape must be a vector")
    return np.reshape(xs[0], tuple(xs[1].tolist()))


def _squeeze(attrs: Attrs, xs: Sequence[np.ndarray], index: int) -> np.ndarray:
    dims = tuple(attrs["squeeze_dims"].list.i) if "squeeze_dims" in attrs else ()
    return np.squeeze(xs[0], axis=dims or None)


def _broadcast_gradient_args(attrs: Attrs, xs: Sequence[np.ndarray], index: int) -> np.ndarray:
    """The axes a broadcast gradient sums over for operand ``index``: every axis where it is 1 or absent, unless
    the operands' shapes are equal (``BCastList`` in tensorflow/core/util/bcast.h)."""
    shapes = [tuple(int(d) for d in x.reshape(-1)) for x in xs]
    out = np.broadcast_shapes(*shapes)   # raises where TensorFlow would refuse them too
    if all(s == shapes[0] for s in shapes):
        return np.zeros(0, dtype=xs[0].dtype)
    padded = (1,) * (len(out) - len(shapes[index])) + shapes[index]
    return np.array([i for i, d in enumerate(padded) if d == 1], dtype=xs[0].dtype)


# The longest ``Range`` evaluated: its length is an input's value (``Range(0, 2**40)``), so it is checked first.
MAX_RANGE = 4096


def _range(attrs: Attrs, xs: Sequence[np.ndarray], index: int) -> np.ndarray:
    """``Range(start, limit, delta)`` of scalars: the permutations of transposes built for any rank
    (``concat([1, 0], range(2, rank))``, as ``dynamic_rnn`` does)."""
    if any(np.asarray(x).size != 1 for x in xs):
        raise ValueError("Range needs scalars")
    start, limit, delta = (int(np.asarray(x).reshape(-1)[0]) for x in xs)
    if delta == 0 or (delta > 0 and start > limit) or (delta < 0 and start < limit):
        raise ValueError("Range needs a nonzero delta that leads from start to limit")   # as TensorFlow
    if max(0, -(-(limit - start) // delta)) > MAX_RANGE:
        raise ValueError(f"Range longer than {MAX_RANGE}: no value")
    return np.arange(start, limit, delta, dtype=xs[0].dtype)


def _invert_permutation(attrs: Attrs, xs: Sequence[np.ndarray], index: int) -> np.ndarray:
    """The inverse of a permutation vector (a transpose's gradient transposes back with it)."""
    perm = np.asarray(xs[0])
    if perm.ndim != 1 or sorted(perm.tolist()) != list(range(perm.size)):
        raise ValueError("InvertPermutation needs a permutation of 0..n-1")
    return np.argsort(perm).astype(perm.dtype)


RULES: dict[str, Rule] = {
    "Range": _range,
    "InvertPermutation": _invert_permutation,
    "Pack": lambda attrs, xs, index: np.stack(xs, axis=_int(attrs, "axis")),
    "Unpack": lambda attrs, xs, index: np.take(xs[0], index, axis=_int(attrs, "axis")),
    "ConcatV2": lambda attrs, xs, index: np.concatenate(xs[:-1], axis=int(xs[-1])),
    "Concat": lambda attrs, xs, index: np.concatenate(xs[1:], axis=int(xs[0])),
    "StridedSlice": _strided_slice,
    "Slice": _slice,
    "Gather": _gather,
    "GatherV2": _gather,
    "Cast": lambda attrs, xs, index: xs[0].astype(tf.as_dtype(attrs["DstT"].type).as_numpy_dtype),
    "Reshape": _reshape,
    "Squeeze": _squeeze,
    "ExpandDims": lambda attrs, xs, index: np.expand_dims(xs[0], int(np.asarray(xs[1]).reshape(-1)[0])),
    "Add": _binary(np.add),
    "AddV2": _binary(np.add),
    "Sub": _binary(np.subtract),
    "Mul": _binary(np.multiply),
    "FloorDiv": _binary(np.floor_divide, nonzero_divisor=True),
    "FloorMod": _binary(np.mod, nonzero_divisor=True),   # the sign of the divisor, as TensorFlow's
    "Maximum": _binary(np.maximum),
    "Minimum": _binary(np.minimum),
    "Neg": lambda attrs, xs, index: np.negative(xs[0]),
    "Prod": _reduction(np.prod),
    "Sum": _reduction(np.sum),
    "Max": _reduction(np.max),
    "Min": _reduction(np.min),
    "BroadcastArgs": lambda attrs, xs, index: np.array(
        np.broadcast_shapes(tuple(xs[0].tolist()), tuple(xs[1].tolist())), dtype=xs[0].dtype),
    "BroadcastGradientArgs": _broadcast_gradient_args,
    "Transpose": _transpose,
    "ReverseV2": lambda attrs, xs, index: np.flip(xs[0], axis=_axes(xs[1])),
}
