"""Expression half of the analyzer: evaluate an expression to an ``AbsVal`` and record the array reads
(and, for calls that may write their arguments, the writes) it performs.

``eval`` keeps array views alive (``w = W[u]`` is an alias, not yet a read); ``use`` is ``eval`` in a
context that consumes the value, so a view it yields is read whole.
"""

from __future__ import annotations

import ast
import builtins
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from orion_par.absval import (
    NOTHING,
    SCALAR,
    AbsVal,
    ArrayRef,
    IndexItem,
    add_sub,
    const,
    index_view,
    join,
    region,
    slice_start,
    slice_sub,
    views_of,
)
from orion_par.access import UNKNOWN, Access, ConstSub, Guard, KeySub, Sub
from orion_par.body import BodySource, is_missing, resolve, safe_getattr
from orion_par.errors import BadBodyError, NotParallelizableError
from orion_par.helpers import CallGraph, Helper, opaque_callable, python_function
from orion_par.purity import NO_READ_ATTRS, READONLY_METHODS, VIEW_ATTRS, VIEW_METHODS, call_kind

_SCALAR_METHODS = {"item", "argmax", "argmin"}
# Builtins that reach variables or attributes by name at run time (refused: their effects are invisible).
_DYNAMIC_BUILTINS = ("exec", "eval", "globals", "locals", "vars", "getattr", "setattr", "delattr", "compile",
                     "__import__")


@dataclass(frozen=True)
class Scope:
    """Where an evaluator runs: the body itself, or a helper the body calls (see ``helpers``).

    In a helper, free names that hold data are read under their canonical names (``names``), and every
    access is reported at the body's line that made the call (``site``), naming the helper's own line.
    """

    fn: types.FunctionType
    names: Mapping[str, str]  # free name -> canonical name of the datum (identity in the body)
    site: int | None = None  # the body's line of the outermost call
    where: str = ""  # "helper (file.py" for messages
    stack: tuple[str, ...] = ()  # helpers entered, outermost first


class ExprEvaluator:
    """Evaluates expressions against ``self.env``; subclasses walk statements."""

    def __init__(self, body: BodySource, captured: Mapping[str, Any], key_ndim: int,
                 graph: CallGraph | None = None, scope: Scope | None = None) -> None:
        self.body = body
        self.captured = captured
        self.key_ndim = key_ndim
        self.graph = graph if graph is not None else CallGraph()
        self.scope = scope if scope is not None else Scope(body.fn, {})
        self.env: dict[str, AbsVal] = {}
        self.accesses: set[Access] = set()
        self.value_writes: list[int] = []
        self.inner_defs: set[str] = set()  # local names bound to an inner def or lambda
        self.guards: tuple[Guard, ...] = ()  # conditions on the key that hold where the walk is
        self.constructs: set[str] = set()  # constructs numba compiles wrongly in combination (analyzer)

    # -- recording -------------------------------------------------------------------------------
    def record(self, ref: ArrayRef, subs: tuple[Sub, ...], is_write: bool, node: ast.AST) -> None:
        line = getattr(node, "lineno", self.body.tree.lineno)
        text = ast.unparse(node)
        if self.scope.site is not None:
            text, line = f"{text} in {self.scope.where}:{line})", self.scope.site
        if ref.array == self.body.value_param:
            if is_write:
                self.value_writes.append(line)
            return
        self.accesses.add(Access(ref.array, subs, is_write, line, text, " > ".join(self.scope.stack), self.guards))

    def read_views(self, val: AbsVal, node: ast.AST, *, write: bool = False) -> None:
        for ref in val.views:
            self.record(ref, region(ref), False, node)
            if write:
                self.record(ref, region(ref), True, node)

    # -- entry points ----------------------------------------------------------------------------
    def use(self, node: ast.expr | None) -> AbsVal:
        if node is None:
            return NOTHING
        val = self.eval(node)
        if val.views:
            self.read_views(val, node)
            return AbsVal(val.sub, val.scalar, frozenset(), val.is_key)
        return val

    def eval(self, node: ast.expr) -> AbsVal:
        method = getattr(self, "eval_" + type(node).__name__, None)
        if method is not None:
            return method(node)  # type: ignore[no-any-return]
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                self.use(child)
        return NOTHING

    # -- names and constants ---------------------------------------------------------------------
    def lookup(self, name: str) -> AbsVal:
        if name in self.env:
            return self.env[name]
        if self.scope.site is None:
            value = self.captured.get(name)
        elif name in self.scope.names:
            name = self.scope.names[name]
            value = self.captured.get(name)
        else:
            value = resolve(self.scope.fn, name)  # a helper's module, function or constant
            value = None if is_missing(value) else value
        if isinstance(value, np.ndarray):
            return AbsVal(views=frozenset({ArrayRef.whole(name, value.ndim)}))
        return object_value(name, value)

    def eval_Name(self, node: ast.Name) -> AbsVal:
        return self.lookup(node.id)

    def eval_Constant(self, node: ast.Constant) -> AbsVal:
        if isinstance(node.value, int) and not isinstance(node.value, bool):
            return const(node.value)
        return SCALAR if isinstance(node.value, (float, bool, complex)) else NOTHING

    # -- operators -------------------------------------------------------------------------------
    def eval_BinOp(self, node: ast.BinOp) -> AbsVal:
        a, b = self.use(node.left), self.use(node.right)
        return binop(a, node.op, b)

    def eval_UnaryOp(self, node: ast.UnaryOp) -> AbsVal:
        v = self.use(node.operand)
        if isinstance(node.op, ast.USub) and isinstance(v.sub, ConstSub):
            return const(-v.sub.value)
        if isinstance(node.op, ast.UAdd):
            return v
        return AbsVal(scalar=v.scalar)

    def eval_Compare(self, node: ast.Compare) -> AbsVal:
        for child in [node.left, *node.comparators]:
            self.use(child)
        return SCALAR

    def eval_BoolOp(self, node: ast.BoolOp) -> AbsVal:
        vals = [self.eval(v) for v in node.values]
        out = vals[0]
        for v in vals[1:]:
            out = join(out, v)  # `a or b` evaluates to a or to b
        return out

    def eval_IfExp(self, node: ast.IfExp) -> AbsVal:
        self.use(node.test)
        return join(self.eval(node.body), self.eval(node.orelse))

    def eval_NamedExpr(self, node: ast.NamedExpr) -> AbsVal:
        val = self.eval(node.value)
        self.env[node.target.id] = val
        return val

    def eval_Tuple(self, node: ast.Tuple | ast.List | ast.Set) -> AbsVal:
        refs: set[ArrayRef] = set()
        for elt in node.elts:
            refs |= self.eval(elt).views
        if refs and isinstance(node, ast.Tuple):
            self.constructs.add("tuple of views")
        return views_of(refs, opaque=True)  # t = (w, h); t[0][r] += 1 still writes W

    eval_List = eval_Set = eval_Tuple

    def eval_Starred(self, node: ast.Starred) -> AbsVal:
        return self.eval(node.value)

    # -- subscripts and attributes ---------------------------------------------------------------
    def index_items(self, node: ast.expr) -> list[IndexItem]:
        elts = node.elts if isinstance(node, ast.Tuple) else [node]
        items = []
        for e in elts:
            if isinstance(e, ast.Slice):
                lo, hi = self.use(e.lower) if e.lower else None, self.use(e.upper) if e.upper else None
                self.use(e.step)
                items.append(IndexItem("slice", slice_sub=slice_sub(lo, hi, e.step is not None),
                                       slice_start=slice_start(lo, e.step is not None)))
            elif isinstance(e, ast.Starred) or (isinstance(e, ast.Constant) and e.value in (None, Ellipsis)):
                self.use(e)
                items.append(IndexItem("weird"))
            else:
                v = self.use(e)
                if v.is_key:  # A[key] indexes one dimension per key field
                    items += [IndexItem("index", AbsVal(KeySub(j), scalar=True)) for j in range(self.key_ndim)]
                else:
                    items.append(IndexItem("index", value=v))
        return items

    def eval_Subscript(self, node: ast.Subscript) -> AbsVal:
        base = self.eval(node.value)
        items = self.index_items(node.slice)
        if base.is_key:
            return self.key_item(items, node)
        if not base.views:
            return NOTHING
        views = set()
        for ref in base.views:
            r = index_view(ref, items)
            if r.free or r.opaque:
                views.add(r)
            if not r.free or r.opaque:
                self.record(r, region(r), False, node)  # one element (or maybe one) read here
        return AbsVal(views=frozenset(views)) if views else SCALAR

    def key_item(self, items: list[IndexItem], node: ast.Subscript) -> AbsVal:
        if len(items) == 1 and items[0].kind == "index" and isinstance(items[0].value.sub, ConstSub):
            j = items[0].value.sub.value
            j = j + self.key_ndim if j < 0 else j
            if 0 <= j < self.key_ndim:
                return AbsVal(KeySub(j), scalar=True)
            raise BadBodyError(
                f"{self.body.name}: line {node.lineno} reads `{ast.unparse(node)}`, but the dataset's keys have "
                f"{self.key_ndim} field(s) (key[0]..key[{self.key_ndim - 1}]). Use one of those, or build the "
                "dataset with more key columns in DistArray.from_coo(keys, values)."
            )
        return AbsVal(scalar=len(items) == 1 and items[0].kind == "index")

    def eval_Attribute(self, node: ast.Attribute) -> AbsVal:
        obj = self.resolve_object(node)
        if isinstance(obj, np.ndarray):
            raise BadBodyError(
                f"{self.body.name}: line {node.lineno} reaches the array `{ast.unparse(node)}` through an "
                f"attribute, which parallel_for cannot share between workers. Bind it to a name outside the "
                f"body (e.g. `{node.attr} = {ast.unparse(node)}`) and use that name inside."
            )
        base = self.eval(node.value)
        if base.views:
            if node.attr in NO_READ_ATTRS:
                return SCALAR if node.attr in {"size", "ndim", "itemsize", "nbytes"} else NOTHING
            if node.attr in VIEW_ATTRS:
                return views_of(base.views, opaque=True)
            if any(not ref.subs and ref.opaque for ref in base.views):
                return views_of(base.views, opaque=True)  # an attribute of shared mutable state is part of it
            self.read_views(base, node)
            return NOTHING
        return object_value(ast.unparse(node), obj) if obj is not None else NOTHING

    # -- calls -----------------------------------------------------------------------------------
    def resolve_object(self, node: ast.expr) -> Any:
        """The Python object an expression like ``np.random.rand`` names, or None if it is local."""
        if isinstance(node, ast.Name):
            if node.id in self.env:
                return None
            value = resolve(self.scope.fn, node.id)
            return None if is_missing(value) else value
        if isinstance(node, ast.Attribute):
            base = self.resolve_object(node.value)
            return None if base is None else safe_getattr(base, node.attr)
        return None

    def eval_Call(self, node: ast.Call) -> AbsVal:
        func = node.func
        if isinstance(func, ast.Attribute):
            base = self.eval(func.value)
            if base.views:
                return self.method_call(node, func.attr, base)
        elif not isinstance(func, ast.Name):
            self.use(func)
        obj = self.resolve_object(func)
        args = [*node.args, *(kw.value for kw in node.keywords)]
        if obj is len:
            for a in args:
                self.eval(a)  # len() reads a shape, not elements
            return SCALAR
        if obj is builtins.int:
            v = self.use(node.args[0]) if node.args else NOTHING
            return AbsVal(v.sub, scalar=True)
        helper = self.graph.helper(obj) if obj is not None else None
        if helper is not None:
            return self.call_helper(node, helper)
        self.check_visible(node, obj)
        return self.generic_call(node, obj, args)

    def call_helper(self, node: ast.Call, helper: Helper) -> AbsVal:
        raise NotImplementedError  # the statement walker (analyzer) walks into helpers

    def check_visible(self, node: ast.Call, obj: Any) -> None:
        """Refuse a call whose effects the analyzer cannot see (it could write any array)."""
        func = node.func
        what = None
        if obj is None and isinstance(func, ast.Name) and func.id in self.env and func.id not in self.inner_defs:
            what = (f"`{func.id}`, a local name, so parallel_for cannot tell which function runs. Call the "
                    "function by its global name")
        elif obj is None and not isinstance(func, (ast.Name, ast.Attribute, ast.Lambda)):
            what = (f"a function chosen by the expression `{ast.unparse(func)}`, so parallel_for cannot tell which "
                    "function runs. Call the function by its name")
        elif obj is not None and any(obj is getattr(builtins, n) for n in _DYNAMIC_BUILTINS):
            what = (f"`{ast.unparse(func)}`, which reaches variables by name at run time, out of the analyzer's "
                    "sight. Name the arrays directly in the body")
        elif obj is not None and python_function(obj) is not None:
            what = f"`{ast.unparse(func)}`, which it did not find before analysis. Call it by its global name"
        elif obj is not None and opaque_callable(obj):
            what = (f"`{ast.unparse(func)}` ({type(obj).__name__}), whose code parallel_for cannot read. Call a "
                    "`def` function instead, or declare the callable with @orion_par.pure if it only reads its "
                    "arguments")
        if what is not None:
            raise NotParallelizableError(
                f"{self.body.name}: line {self.scope.site or node.lineno} calls {what}."
            )

    def generic_call(self, node: ast.Call, obj: Any, args: list[ast.expr]) -> AbsVal:
        kind = call_kind(obj)
        vals = [self.eval(a) for a in args]
        outs = [kw.value for kw in node.keywords if kw.arg == "out"]
        if isinstance(obj, np.ufunc):
            outs += node.args[obj.nin:]
        for o in outs:
            self.read_views(self.eval(o), node, write=True)
        refs: set[ArrayRef] = set()
        for v in vals:
            refs |= v.views
            if kind == "pure":
                self.read_views(v, node)
            elif kind == "unknown":
                self.read_views(v, node, write=True)
        if kind == "pure":
            return AbsVal(scalar=all(v.scalar for v in vals) and obj is not range)
        return views_of(refs, opaque=True) if refs else NOTHING

    def method_call(self, node: ast.Call, name: str, base: AbsVal) -> AbsVal:
        for a in [*node.args, *(kw.value for kw in node.keywords)]:
            self.use(a)
        if name in READONLY_METHODS:
            self.read_views(base, node)
            return SCALAR if name in _SCALAR_METHODS else NOTHING
        if name in VIEW_METHODS:
            return views_of(base.views, opaque=True)
        self.read_views(base, node, write=True)  # fill, sort, put, ...: may write the view
        return views_of(base.views, opaque=True)

    # -- closures and comprehensions -------------------------------------------------------------
    def closure_use(self, node: ast.AST) -> None:
        """An inner def or lambda may do anything to the arrays it mentions, and does what the functions it
        calls do (walked as if called here, its parameters unknown)."""
        for n in ast.walk(node):
            if isinstance(n, ast.Name):
                self.read_views(views_of(self.lookup(n.id).views, opaque=True), n, write=True)
            elif isinstance(n, ast.Call):
                obj = self.resolve_object(n.func)
                helper = self.graph.helper(obj) if obj is not None else None
                if helper is not None:
                    self.call_helper(n, helper)
                elif obj is not None and opaque_callable(obj):
                    self.check_visible(n, obj)

    def eval_Lambda(self, node: ast.Lambda) -> AbsVal:
        self.closure_use(node)
        return NOTHING


def object_value(name: str, value: Any) -> AbsVal:
    """A captured non-array object: a number, something immutable or callable, or shared mutable state.

    A mutable object (a list, a dict, an instance) is modelled as a zero-dimensional shared array, so
    that storing into it or calling one of its methods is a write that every iteration may make.
    """
    if isinstance(value, (bool, np.bool_)):
        return SCALAR
    if isinstance(value, (int, np.integer)):
        return const(int(value))
    if isinstance(value, (float, complex, np.number)):
        return SCALAR
    if value is None or callable(value) or isinstance(value, (types.ModuleType, str, bytes, tuple, frozenset, range)):
        return NOTHING
    return AbsVal(views=frozenset({ArrayRef(name, (), (), True)}))


def binop(a: AbsVal, op: ast.operator, b: AbsVal) -> AbsVal:
    """Classify ``a <op> b`` for index arithmetic (``key[j] + 1``, constant folding)."""
    scalar = a.scalar and b.scalar
    if isinstance(op, (ast.Add, ast.Sub)):
        return AbsVal(add_sub(a.sub, b.sub, 1 if isinstance(op, ast.Add) else -1), scalar)
    if isinstance(a.sub, ConstSub) and isinstance(b.sub, ConstSub):
        x, y = a.sub.value, b.sub.value
        if isinstance(op, ast.Mult):
            return const(x * y)
        if isinstance(op, (ast.FloorDiv, ast.Mod)) and y:
            return const(x // y if isinstance(op, ast.FloorDiv) else x % y)
    return AbsVal(UNKNOWN, scalar)
