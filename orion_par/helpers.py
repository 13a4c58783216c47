"""Functions a loop body calls: find them, name the arrays they reach, and rewrite them for the executor.

A body may call plain Python functions or numba dispatchers of the user's own code (``helpers``).  A
helper can read and write arrays the body never names (``HG_I[i] = ...`` through a global), so the
analyzer walks into it (``analyzer``), and those arrays become shared arrays of the loop like the body's
own.  Every array or number a helper reaches through its globals or closure gets one *canonical* name: the
body's name for the same array when the body captures it too, else the helper's own name made unique.

The executor cannot leave a helper as it is: numba freezes a global array into a compiled function as a
constant (stale values, and writes to a copy), and a Ray worker would update its own module's copy.  So
``helper_source`` writes each helper again as ``_orion_fn_<name>(_orion_d_<canonical name>, ..., <its own
parameters>)``, with the data it and its callees reach as parameters, and ``call_edits`` rewrites the body's
calls to pass them (``tests/orion_par/test_orion_calls.py``, ``test_orion_calls_property.py``).

Library code (numpy, the standard library, anything installed in site-packages) is not walked: it cannot
name the user's arrays, so the tables in ``purity`` decide what it may do to its arguments.
"""

from __future__ import annotations

import ast
import builtins
import copy
import functools
import inspect
import re
import sys
import sysconfig
import textwrap
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numba
import numpy as np

from orion_par.body import BodySource, free_names, is_missing, is_scalar_constant, resolve, safe_getattr
from orion_par.errors import NotParallelizableError
from orion_par.purity import call_kind, is_declared_pure

_NOT_SET = object()
MAX_DEPTH = 16  # calls nested deeper than this are refused


def _library_roots() -> tuple[str, ...]:
    # The standard library and installed packages; an editable install of the user's project is neither.
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots |= {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    return tuple(sorted(str(Path(r).resolve()) for r in roots))


_LIBRARY_ROOTS = _library_roots()


def _has(obj: Any, name: str) -> bool:
    try:
        return hasattr(obj, name)
    except Exception:
        return False


def python_function(obj: Any) -> types.FunctionType | None:
    """The Python function behind ``obj`` if it is the user's own (a ``def`` or a numba dispatcher of one).

    Functions from the standard library and installed packages return None: they are library code, and so
    does a function wrapped by a decorator (``opaque_callable`` refuses those).
    """
    fn = obj.py_func if isinstance(obj, numba.core.dispatcher.Dispatcher) else obj
    if not _users_function(fn) or is_declared_pure(fn) or _has(fn, "__wrapped__"):
        return None
    return fn  # type: ignore[no-any-return]


def _users_function(fn: Any) -> bool:
    """A plain Python function defined outside the standard library and installed packages."""
    if not isinstance(fn, types.FunctionType):
        return False
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    if module is not None and (module.__name__.split(".")[0] in {"numpy", "numba", "orion_par"}):
        return False
    filename = fn.__code__.co_filename
    if filename.startswith("<"):
        return True  # exec'd or interactive: the user's own, and its source cannot be read (refused later)
    path = str(Path(filename).resolve())
    return not any(path.startswith(root + "/") for root in _LIBRARY_ROOTS)


def opaque_callable(obj: Any) -> bool:
    """A callable of the user's whose code cannot be followed: a bound method, a partial, an instance.

    Library callables (C functions, numpy's Python functions, classes) are not opaque: they cannot name
    the user's arrays, so what they may do to their arguments is all that matters.
    """
    if is_declared_pure(obj) or call_kind(obj) != "unknown":
        return False  # known to the tables in purity
    if _has(obj, "__wrapped__") and not isinstance(obj, numba.core.dispatcher.Dispatcher):
        # functools.wraps, lru_cache, staticmethod around the user's code: the wrapper may do anything.
        # (numpy's functions wrap numpy's own code.)
        try:
            inner = inspect.unwrap(obj)
        except ValueError:
            return True
        return _users_function(inner) or _users_function(obj)
    owner = safe_getattr(obj, "__self__")
    if owner is not None and not isinstance(owner, types.ModuleType) and python_function(owner) is not None:
        return True  # f.__call__ of the user's function f
    if isinstance(obj, functools.partial):
        return opaque_callable(obj.func) or python_function(obj.func) is not None
    if isinstance(obj, types.MethodType):
        return python_function(obj.__func__) is not None
    if isinstance(obj, type):
        if issubclass(obj, tuple) and hasattr(obj, "_fields"):
            return False  # a namedtuple: its constructor only stores its arguments
        # A class of the user's: its __init__ (or __new__, __post_init__) may touch any array.
        for klass in obj.__mro__:
            for method in ("__init__", "__new__", "__post_init__"):
                fn = klass.__dict__.get(method)
                if _users_function(getattr(fn, "__func__", fn)):
                    return True
        return False
    if not callable(obj):
        return False
    call = type(obj).__dict__.get("__call__")  # a user class's __call__ (its code is not followed)
    return isinstance(call, types.FunctionType) and python_function(call) is not None


def jit_options(obj: Any) -> dict[str, Any]:
    """The numba options of a dispatcher that change results (``fastmath``), to compile its copy alike."""
    opts = getattr(obj, "targetoptions", None) or {}
    return {k: opts[k] for k in ("fastmath",) if k in opts}


@dataclass(frozen=True)
class Helper:
    """One function a body reaches through calls."""

    fn: types.FunctionType
    tree: ast.FunctionDef
    filename: str
    gen_name: str  # its name in the generated module
    options: dict[str, Any]
    data: dict[str, str]  # its free names that hold arrays or numbers -> canonical name
    others: dict[str, str]  # its other free names (modules, functions) -> name in the generated module
    params: tuple[str, ...] = ()  # canonical data names it and its callees use (its leading parameters)
    callees: tuple[int, ...] = ()  # id(fn) of helpers it calls

    @property
    def name(self) -> str:
        return self.fn.__qualname__


@dataclass
class CallGraph:
    """The helpers a body reaches, and where each canonical data name comes from."""

    helpers: dict[int, Helper] = field(default_factory=dict)  # by id(fn)
    origin: dict[str, tuple[types.FunctionType, str]] = field(default_factory=dict)  # canonical -> (fn, free name)

    def helper(self, obj: Any) -> Helper | None:
        fn = python_function(obj)
        return None if fn is None else self.helpers.get(id(fn))

    def values(self) -> dict[str, Any]:
        """The current value of every canonical data name the helpers add."""
        out = {}
        for name, (fn, free) in self.origin.items():
            value = resolve(fn, free)
            if not is_missing(value):
                out[name] = value
        return out


def is_data(value: Any) -> bool:
    """Values that become parameters of compiled code (re-read at every run)."""
    return isinstance(value, np.ndarray) or is_scalar_constant(value)


def parse_function(fn: types.FunctionType) -> tuple[ast.FunctionDef, str]:
    """``fn``'s ``def`` with the line numbers of its file.

    Raises
    ------
    OSError, TypeError, SyntaxError
        When the source cannot be read (the caller turns that into a refusal).
    """
    lines, first = inspect.getsourcelines(fn)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    ast.increment_lineno(tree, first - 1)
    fdef = tree.body[0]
    if not isinstance(fdef, ast.FunctionDef):
        raise TypeError(f"{fn.__qualname__} is not a plain def")
    return fdef, inspect.getsourcefile(fn) or fn.__code__.co_filename


def call_target(fn: types.FunctionType, local_names: set[str], node: ast.expr) -> Any:
    """The object a call's function expression names in ``fn``'s scope (None for locals and other shapes)."""
    if isinstance(node, ast.Name):
        if node.id in local_names:
            return None
        value = resolve(fn, node.id)
        return None if is_missing(value) else value
    if isinstance(node, ast.Attribute):
        base = call_target(fn, local_names, node.value)
        return None if base is None else safe_getattr(base, node.attr)
    return None


def _local_names(fn: types.FunctionType) -> set[str]:
    return set(fn.__code__.co_varnames) | set(fn.__code__.co_cellvars)


def discover(body_fn: types.FunctionType, body_tree: ast.FunctionDef, body_captured: Mapping[str, Any],
             reserved: set[str]) -> CallGraph:
    """Find every helper reachable from the body and give each datum they reach a canonical name.

    ``body_captured`` are the body's own free names and values (canonical already); ``reserved`` are
    names the generated code may not reuse (the body's parameters and free names).

    Raises
    ------
    NotParallelizableError
        When a reachable function's source cannot be read, or functions call each other recursively.
    """
    graph = CallGraph()
    by_id = {id(v): n for n, v in body_captured.items() if isinstance(v, np.ndarray)}
    taken = set(reserved) | set(body_captured)
    globals_taken: dict[str, Any] = {n: v for n, v in body_captured.items() if not is_data(v)}
    order: list[types.FunctionType] = []
    pending: dict[int, tuple[ast.FunctionDef, str, types.FunctionType, Any]] = {}

    def visit(fn: types.FunctionType, fdef: ast.FunctionDef, where: str, stack: tuple[int, ...]) -> list[int]:
        found = []
        for call in _calls(fdef):
            obj = call_target(fn, _local_names(fn), call.func)
            target = python_function(obj) if obj is not None else None
            if target is None:
                continue
            site = f"{where} line {call.lineno} calls `{ast.unparse(call.func)}`"
            if id(target) in stack:
                raise NotParallelizableError(
                    f"{site}, which calls itself (recursion): parallel_for cannot bound the arrays a "
                    "recursive call touches. Rewrite it as a loop."
                )
            if len(stack) >= MAX_DEPTH:
                raise NotParallelizableError(f"{site}: calls nest deeper than {MAX_DEPTH}; flatten them.")
            found.append(id(target))
            if id(target) in pending:
                continue
            try:
                tdef, filename = parse_function(target)
            except (OSError, TypeError, SyntaxError) as e:
                raise NotParallelizableError(
                    f"{site}, whose source parallel_for cannot read ({e}), so it cannot tell which arrays it "
                    f"touches. Define `{target.__qualname__}` with `def` in a .py file, or, if it only reads "
                    "its arguments, declare it with @orion_par.pure."
                ) from e
            bad = [d for d in (*(target.__defaults__ or ()), *(target.__kwdefaults__ or {}).values()) if not _literal(d)]
            if bad:
                raise NotParallelizableError(
                    f"{site}, whose default argument is a {type(bad[0]).__name__}: parallel_for cannot share a value "
                    "held by a function. Pass it in the call, or make it a global the function reads."
                )
            pending[id(target)] = (tdef, filename, target, obj)
            order.append(target)
            callees[id(target)] = visit(target, tdef, f"`{target.__qualname__}` ({filename})", (*stack, id(target)))
        return found

    callees: dict[int, list[int]] = {}  # the helpers each function calls, by id
    visit(body_fn, body_tree, "the body", (id(body_fn),))

    used_gen: set[str] = set()
    for target in order:
        tdef, filename, _, obj = pending[id(target)]
        data: dict[str, str] = {}
        others: dict[str, str] = {}
        for free in free_names(target, tdef):
            value = resolve(target, free)
            if is_missing(value) or python_function(value) is not None and id(python_function(value)) in pending:
                continue  # a helper: its calls are rewritten
            if is_data(value):
                canonical = by_id.get(id(value)) if isinstance(value, np.ndarray) else None
                if canonical is None and body_captured.get(free, _NOT_SET) is value:
                    canonical = free  # the body's own constant under the same name
                if canonical is None:
                    canonical = _unique(free, taken | set(globals_taken))
                    taken.add(canonical)
                    graph.origin[canonical] = (target, free)
                    if isinstance(value, np.ndarray):
                        by_id[id(value)] = canonical
                data[free] = canonical
            elif value is getattr(builtins, free, object()):
                continue
            else:
                if free in taken or free in globals_taken and globals_taken[free] is not value:
                    name = _unique(f"_orion_g_{free}", set(globals_taken) | taken)
                else:
                    name = free
                globals_taken[name] = value
                others[free] = name
        gen = _unique("_orion_fn_" + re.sub(r"\W", "_", target.__name__), used_gen)
        used_gen.add(gen)
        graph.helpers[id(target)] = Helper(target, tdef, filename, gen, jit_options(obj), data, others,
                                           callees=tuple(dict.fromkeys(callees[id(target)])))
    # A helper's leading parameters: the data it and everything it calls reach (a fixed point, sorted).
    changed = True
    while changed:
        changed = False
        for target in order:
            h = graph.helpers[id(target)]
            params = set(h.params) | set(h.data.values())
            for c in h.callees:
                params |= set(graph.helpers[c].params)
            if params != set(h.params):
                graph.helpers[id(target)] = replace(h, params=tuple(sorted(params)))
                changed = True
    return graph


def _unique(name: str, taken: set[str]) -> str:
    if name not in taken:
        return name
    n = 1
    while f"{name}_{n}" in taken:
        n += 1
    return f"{name}_{n}"


def _calls(fdef: ast.FunctionDef) -> Iterator[ast.Call]:
    """The calls in the function's statements (not in its decorators or default values, which ran once)."""
    for stmt in fdef.body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call):
                yield node


def injected(graph: CallGraph) -> dict[str, Any]:
    """Globals the rewritten helpers need in the generated module (modules, library functions)."""
    out: dict[str, Any] = {}
    for h in graph.helpers.values():
        for free, name in h.others.items():
            out[name] = resolve(h.fn, free)
    return out


class _Rewriter(ast.NodeTransformer):
    """Rename a helper's data and globals to their generated names; route calls to rewritten helpers."""

    def __init__(self, h: Helper, graph: CallGraph) -> None:
        self.h, self.graph = h, graph
        self.rename = {**{free: data_param(c) for free, c in h.data.items()}, **h.others}

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if node.id in self.rename:
            return ast.copy_location(ast.Name(self.rename[node.id], node.ctx), node)
        return node

    def visit_Call(self, node: ast.Call) -> ast.AST:
        callee = self.graph.helper(call_target(self.h.fn, _local_names(self.h.fn), node.func))
        self.generic_visit(node)
        if callee is None:
            return node
        node.func = ast.copy_location(ast.Name(callee.gen_name, ast.Load()), node.func)
        node.args = [ast.Name(data_param(p), ast.Load()) for p in callee.params] + list(node.args)
        return node


def _literal(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, complex, str, np.number, np.bool_))


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def data_param(canonical: str) -> str:
    """A datum's parameter name inside a rewritten helper (never one of the helper's own names)."""
    return f"_orion_d_{canonical}"


def helper_source(h: Helper, graph: CallGraph) -> str:
    """The helper written again for the generated module: data as leading parameters, calls rerouted."""
    fdef = copy.deepcopy(h.tree)
    fdef = _Rewriter(h, graph).visit(fdef)
    fdef.name = h.gen_name
    fdef.decorator_list = []
    fdef.args.posonlyargs = []
    fdef.args.args = [ast.arg(data_param(p)) for p in h.params] + list(h.tree.args.posonlyargs) + list(h.tree.args.args)
    # Defaults as the values the function holds (their expressions may name things the module lacks).
    fdef.args.defaults = [ast.Constant(_plain(v)) for v in h.fn.__defaults__ or ()]
    kw = h.fn.__kwdefaults__ or {}
    fdef.args.kw_defaults = [ast.Constant(_plain(kw[a.arg])) if a.arg in kw else None for a in fdef.args.kwonlyargs]
    ast.fix_missing_locations(fdef)
    return f"# {h.name} ({h.filename}:{h.tree.lineno})\n" + ast.unparse(fdef)


def call_edits(fn: types.FunctionType, fdef: ast.FunctionDef, graph: CallGraph) -> list[tuple[int, int, int, str]]:
    """Text edits that route the body's calls of helpers to their rewritten copies.

    Each edit is ``(line, start column, end column, new text)`` in the body's lines (columns in UTF-8
    bytes, as ``ast`` gives them); edits keep every line where it was, so messages keep the user's line
    numbers.
    """
    edits = []
    locals_ = _local_names(fn)
    for call in _calls(fdef):
        h = graph.helper(call_target(fn, locals_, call.func))
        if h is None:
            continue
        f = call.func
        prefix = "".join(f"{p}, " for p in h.params)
        edits.append((f.lineno, f.col_offset, f.end_col_offset or f.col_offset, h.gen_name))
        # Insert the data right after the call's "(": the first byte after the function expression that is "(".
        edits.append((f.end_lineno or f.lineno, -1 - (f.end_col_offset or 0), 0, prefix))
    return edits


def apply_edits(lines: list[str], first_line: int, edits: list[tuple[int, int, int, str]]) -> list[str]:
    """Apply ``call_edits`` to ``lines`` (``lines[0]`` is file line ``first_line``)."""
    out = [ln.encode() for ln in lines]
    # Right to left within a line, so earlier columns stay valid.
    for line, start, end, text in sorted(edits, key=lambda e: (e[0], _col(e)), reverse=True):
        i = line - first_line
        b = out[i]
        if start < 0:  # insert after the first "(" at or after column -1 - start
            col = b.index(b"(", -1 - start) + 1
            out[i] = b[:col] + text.encode() + b[col:]
        else:
            out[i] = b[:start] + text.encode() + b[end:]
    return [b.decode() for b in out]


def _col(edit: tuple[int, int, int, str]) -> int:
    return -1 - edit[1] if edit[1] < 0 else edit[1]


def body_graph(body: BodySource, captured: Mapping[str, Any]) -> CallGraph:
    """``discover`` for a loaded body; ``captured`` holds at least the body's own free names."""
    own = {n: captured[n] for n in body.captured if n in captured}
    reserved = {body.key_param, body.value_param, *body.captured, *_local_names(body.fn)}
    return discover(body.fn, body.tree, own, reserved)
