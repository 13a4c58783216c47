"""Which callables and array methods leave their array arguments alone.

The analyzer assumes the worst of a call it does not know: it may write every array passed to it and
return a view of it.  These tables name the common ones that only read (their result is a new value)
and the ones whose result is a view of their argument.
"""

from __future__ import annotations

import builtins
import math
import types
from typing import Any

import numpy as np

_PURE_BUILTINS = {
    "abs", "min", "max", "len", "int", "float", "bool", "complex", "round", "range", "sum", "pow", "divmod",
    "enumerate", "zip", "isinstance", "print", "hash", "reversed", "sorted", "any", "all", "tuple", "list",
}
_PURE_NUMPY = {
    "dot", "vdot", "inner", "outer", "matmul", "sum", "mean", "prod", "cumsum", "cumprod", "max", "min", "amax",
    "amin", "argmax", "argmin", "argsort", "sort", "std", "var", "median", "zeros", "ones", "empty", "full",
    "zeros_like", "ones_like", "empty_like", "full_like", "copy", "array", "arange", "linspace", "where",
    "searchsorted", "clip", "isnan", "isfinite", "isinf", "all", "any", "nonzero", "count_nonzero", "concatenate",
    "stack", "hstack", "vstack", "interp", "sign", "log1p", "expm1", "allclose", "array_equal", "unique",
    "bincount", "histogram", "digitize", "trace", "einsum", "float64", "float32", "int64", "int32", "int8",
    "uint8", "int16", "uint16", "uint32", "uint64", "bool_", "nan_to_num",
}
_VIEW_NUMPY = {
    "asarray", "ascontiguousarray", "asfortranarray", "ravel", "reshape", "transpose", "squeeze", "atleast_1d",
    "atleast_2d", "atleast_3d", "expand_dims", "swapaxes", "moveaxis", "diagonal", "broadcast_to", "real", "imag",
}
READONLY_METHODS = {
    "sum", "mean", "max", "min", "argmax", "argmin", "copy", "dot", "any", "all", "prod", "std", "var", "astype",
    "tolist", "item", "cumsum", "cumprod", "nonzero", "searchsorted", "argsort", "tobytes", "conj", "round",
    "clip", "flatten", "trace", "get", "keys", "values", "items", "index", "count",
}
VIEW_METHODS = {"reshape", "ravel", "view", "transpose", "squeeze", "swapaxes", "diagonal"}
NO_READ_ATTRS = {"shape", "size", "ndim", "dtype", "itemsize", "nbytes", "strides"}
VIEW_ATTRS = {"T", "real", "imag", "flat"}


_PURE_ATTR = "__orion_pure__"


def pure(fn: Any) -> Any:
    """Declare that ``fn`` only reads its arguments and returns a new value (it touches no shared array).

    ``parallel_for`` then treats a call of ``fn`` like ``np.dot``: its array arguments are read, nothing is
    written, and its source is not analysed.  Use it for functions whose source cannot be read (made by
    ``exec``, wrappers of C code) or that the analyzer cannot follow.  A wrong declaration makes a wrong
    plan.  The function is called as it is, so a compiled body needs it to be a numba function.

    Examples
    --------
    >>> @pure
    ... def sigmoid(x):
    ...     return 1.0 / (1.0 + math.exp(-x))
    >>> call_kind(sigmoid)
    'pure'
    """
    for target in {id(fn): fn, id(getattr(fn, "py_func", fn)): getattr(fn, "py_func", fn)}.values():
        try:
            setattr(target, _PURE_ATTR, True)
        except AttributeError as e:
            raise TypeError(f"orion_par.pure: cannot mark {fn!r}; wrap it in a def and mark that.") from e
    return fn


def is_declared_pure(fn: Any) -> bool:
    try:
        return getattr(fn, _PURE_ATTR, False) is True
    except Exception:  # an object whose __getattr__ raises something else than AttributeError
        return False


def call_kind(fn: Any) -> str:
    """``"pure"`` (reads its args, returns a new value), ``"view"`` (returns a view of its argument) or
    ``"unknown"`` (may write its arguments).

    Examples
    --------
    >>> call_kind(np.dot), call_kind(np.asarray), call_kind(np.random.shuffle), call_kind(math.exp)
    ('pure', 'view', 'unknown', 'pure')
    """
    if fn is None:
        return "unknown"
    if is_declared_pure(fn):
        return "pure"
    if isinstance(fn, np.ufunc):
        return "pure"  # a ufunc writes only through out=, which the analyzer checks separately
    try:
        module = str(getattr(fn, "__module__", None) or "")
        name = str(getattr(fn, "__name__", ""))
    except Exception:  # an object whose __getattr__ raises something else than AttributeError
        return "unknown"
    if fn is getattr(builtins, name, None):
        return "pure" if name in _PURE_BUILTINS else "unknown"
    if isinstance(fn, types.BuiltinFunctionType) and module == "math" or fn is getattr(math, name, None):
        return "pure"
    if module.startswith("numpy.random") or fn is getattr(np.random, name, None):
        return "unknown" if name in {"shuffle", "permuted"} else "pure"
    if module.startswith("numpy") or fn is getattr(np, name, None):
        if name in _VIEW_NUMPY:
            return "view"
        if name in _PURE_NUMPY:
            return "pure"
    return "unknown"
