"""Read a loop body's source and the variables it captures from its globals and closure.

Line numbers in the parsed tree are the lines of the body's own file, so every message (and numba's,
see ``codegen``) points at the user's code.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import textwrap
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from orion_par.errors import BadBodyError

_MISSING = object()


@dataclass(frozen=True)
class BodySource:
    """A parsed loop body ``def body(key, value): ...``."""

    fn: types.FunctionType
    name: str
    filename: str
    tree: ast.FunctionDef
    source_lines: tuple[str, ...]  # the function's lines, dedented; source_lines[0] is file line first_line
    first_line: int
    key_param: str
    value_param: str
    captured: tuple[str, ...]  # free names the body reads (globals, closure cells, builtins)

    def line_text(self, line: int) -> str:
        i = line - self.first_line
        return self.source_lines[i].strip() if 0 <= i < len(self.source_lines) else ""


def load_body(fn: Callable[..., Any]) -> BodySource:
    """Parse ``fn``'s source; check it has the signature ``(key, value)``.

    Raises
    ------
    BadBodyError
        If ``fn`` is not a plain function with retrievable source and exactly two positional parameters.
    """
    inner = getattr(fn, "py_func", None)
    if isinstance(inner, types.FunctionType):
        raise BadBodyError(
            f"parallel_for: {inner.__qualname__} (line {inner.__code__.co_firstlineno}) is already a numba function; "
            "decorate the plain `def` (parallel_for compiles it itself): drop @numba.njit or put @parallel_for "
            "below it."
        )
    if not isinstance(fn, types.FunctionType):
        raise BadBodyError(f"parallel_for decorates a function `def body(key, value)`; got {type(fn).__name__}.")
    line = fn.__code__.co_firstlineno
    if fn.__name__ == "<lambda>":
        raise BadBodyError(f"parallel_for needs a `def` body, not a lambda (line {line}): its source cannot be "
                           "analysed alone.")
    if hasattr(fn, "__wrapped__"):
        raise BadBodyError(
            f"parallel_for: {fn.__qualname__} (line {line}) is wrapped by another decorator, whose code parallel_for "
            "cannot see; put @parallel_for directly on the `def`, below the other decorators."
        )
    if fn.__code__.co_flags & (inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR):
        raise BadBodyError(
            f"parallel_for: {fn.__qualname__} (line {line}) is a generator or async function; calling it would not "
            "run its statements. Write it as a plain `def` that does its work and returns."
        )
    try:
        lines, first = inspect.getsourcelines(fn)
    except (OSError, TypeError) as e:
        raise BadBodyError(
            f"parallel_for: cannot read the source of {fn.__qualname__} ({e}); define it in a .py file."
        ) from e
    src = textwrap.dedent("".join(lines))
    tree = ast.parse(src)
    ast.increment_lineno(tree, first - 1)
    fdef = tree.body[0]
    if not isinstance(fdef, ast.FunctionDef):
        raise BadBodyError(f"parallel_for: {fn.__qualname__} (line {first}) is not a plain `def` (async or class?).")
    args = fdef.args
    params = [a.arg for a in args.posonlyargs + args.args]
    if len(params) != 2 or args.vararg or args.kwarg or args.kwonlyargs or args.defaults:
        raise BadBodyError(
            f"parallel_for: {fn.__qualname__} (line {fdef.lineno}) must take exactly (key, value); "
            f"it takes ({ast.unparse(args)})."
        )
    return BodySource(
        fn=fn,
        name=fn.__qualname__,
        filename=inspect.getsourcefile(fn) or fn.__code__.co_filename,
        tree=fdef,
        source_lines=tuple(src.splitlines()),
        first_line=first,
        key_param=params[0],
        value_param=params[1],
        captured=free_names(fn, fdef),
    )


def free_names(fn: types.FunctionType, fdef: ast.FunctionDef) -> tuple[str, ...]:
    """Global and closure names ``fn`` reads (with code nested in it: comprehensions, inner defs)."""
    # Minus its own locals; co_names also lists attribute names, hence the intersection with Name nodes.
    names: set[str] = set()
    stack = [fn.__code__]
    while stack:
        code = stack.pop()
        names.update(code.co_names, code.co_freevars)
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    names -= set(fn.__code__.co_varnames) | set(fn.__code__.co_cellvars)
    loads = {n.id for n in ast.walk(fdef) if isinstance(n, ast.Name)}
    return tuple(sorted(names & loads))


def resolve(fn: Callable[..., Any], name: str) -> Any:
    """The current value of free name ``name`` of ``fn`` (closure, then globals, then builtins)."""
    code = fn.__code__
    if name in code.co_freevars and fn.__closure__ is not None:
        cell = fn.__closure__[code.co_freevars.index(name)]
        try:
            return cell.cell_contents
        except ValueError:
            return _MISSING
    if name in fn.__globals__:
        return fn.__globals__[name]
    return getattr(builtins, name, _MISSING)


def safe_getattr(obj: Any, name: str) -> Any:
    """``getattr(obj, name, None)`` that also absorbs what properties and ``__getattr__`` raise."""
    try:
        return getattr(obj, name, None)
    except Exception:
        return None


def is_missing(value: Any) -> bool:
    return value is _MISSING


def is_scalar_constant(value: Any) -> bool:
    """Numbers that become arguments of the compiled body (re-read at every run)."""
    return isinstance(value, (bool, int, float, complex, np.number, np.bool_))
