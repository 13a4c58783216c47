"""Find every shared-array access of a loop body, classified per subscript (Orion's static analysis).

``analyze_body`` walks the body's statements in order with an environment of ``AbsVal`` per local
name: ``if``/``else`` branches are walked separately and joined, loops are walked until the environment
stops changing, so aliases made in one iteration are seen in the next.  It handles straight-line code,
``if``/``else``, inner ``for`` and ``while`` loops, tuple unpacking of the key, ``key[j]``, index
arithmetic ``key[j] + c``, and aliases (``w = W[u]`` then ``w += g``).  Anything it cannot follow becomes
an ``unknown`` subscript or a write of a whole view, never a missed access.
"""

from __future__ import annotations

import ast
import inspect
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from orion_par.absval import (
    NOTHING,
    SCALAR,
    AbsVal,
    ArrayRef,
    IndexItem,
    index_view,
    join,
    join_env,
    region,
    views_of,
)
from orion_par.access import UNKNOWN, Access, ConstSub, Guard, KeySub
from orion_par.body import BodySource
from orion_par.errors import BadBodyError, NotParallelizableError
from orion_par.expressions import ExprEvaluator, Scope, binop, object_value
from orion_par.helpers import CallGraph, Helper, body_graph

_MAX_LOOP_PASSES = 8


@dataclass(frozen=True)
class BodyAnalysis:
    """The accesses of a body, and the names it gives the key's fields (for explanations)."""

    body: BodySource
    accesses: tuple[Access, ...]
    key_names: tuple[str, ...]
    # Why numba would compile the body wrongly (empty: it would not); the executor then runs it as Python.
    miscompiles: str = ""


def analyze_body(body: BodySource, captured: Mapping[str, Any], key_ndim: int, value_ndim: int = 1,
                 graph: CallGraph | None = None) -> BodyAnalysis:
    """Classify every subscript of a shared array in ``body``.

    Parameters
    ----------
    body : BodySource
        From ``load_body``.
    captured : mapping
        Current values of the body's free names, and of the data its helpers reach (``CallGraph.values``);
        ndarrays among them are the shared arrays.
    key_ndim : int
        Number of key fields.
    value_ndim : int
        ``values.ndim`` of the dataset (a record's value is a row when it is > 1).
    graph : CallGraph, optional
        The functions the body calls (``helpers.body_graph``; found here when not given).

    Returns
    -------
    BodyAnalysis

    Examples
    --------
    >>> import numpy as np
    >>> from orion_par.body import load_body
    >>> W = np.zeros((4, 2))
    >>> def body(key, value):
    ...     u, i = key
    ...     w = W[u]
    ...     w += value
    >>> a = analyze_body(load_body(body), {"W": W}, key_ndim=2)
    >>> [x.describe(a.key_names) for x in a.accesses]
    ['read w (line 4) = W[u, :]', 'write w (line 4) = W[u, :]']
    """
    if graph is None:
        graph = body_graph(body, captured)
        captured = {**graph.values(), **captured}
    walker = _Walker(body, captured, key_ndim, graph)
    walker.start_body(value_ndim)
    try:
        walker.walk(body.tree.body)
    except RecursionError as e:
        raise BadBodyError(
            f"{body.name} (line {body.tree.lineno}): its statements or expressions nest too deeply for the analyzer "
            "(a very long sum or elif chain); split them into shorter statements."
        ) from e
    if walker.value_writes:
        raise BadBodyError(
            f"{body.name}: line {walker.value_writes[0]} writes into the record's value `{body.value_param}`; "
            "such writes are not kept. Store per-record state in a DistArray indexed by the key."
        )
    miscompiles = ""
    if {"tuple of views", "comprehension"} <= walker.constructs:
        # numba 0.68 drops writes through an array taken out of a tuple when the function also has a
        # comprehension (tests/orion_par/test_orion_executor.py::test_a_construct_numba_miscompiles_runs_as_python).
        miscompiles = ("numba loses writes through an array taken out of a tuple when a comprehension is also "
                       "present; take the array out of the tuple or write the comprehension as a loop")
    return BodyAnalysis(body, tuple(sorted(walker.accesses, key=Access.sort_key)), tuple(walker.key_names),
                        miscompiles)


class _Walker(ExprEvaluator):
    def __init__(self, body: BodySource, captured: Mapping[str, Any], key_ndim: int, graph: CallGraph,
                 scope: Scope | None = None) -> None:
        super().__init__(body, captured, key_ndim, graph, scope)
        self.key_names = [""] * key_ndim
        self.returns: list[AbsVal] = []
        self.memo: dict[tuple[Any, ...], AbsVal] = {}

    def start_body(self, value_ndim: int) -> None:
        self.env[self.body.key_param] = AbsVal(is_key=True)
        row = ArrayRef.whole(self.body.value_param, value_ndim - 1)
        self.env[self.body.value_param] = AbsVal(views=frozenset({row})) if value_ndim > 1 else SCALAR

    # -- calls of the user's functions -------------------------------------------------------------
    def call_helper(self, node: ast.Call, helper: Helper) -> AbsVal:
        """Walk into ``helper`` with its parameters bound to the call's arguments; returns its result.

        Its accesses are the body's (reported at the calling line); its global data are read under their
        canonical names.  A call with the same arguments at the same line is walked once.
        """
        args: list[AbsVal] = []
        spread: set[ArrayRef] = set()
        for a in node.args:
            if isinstance(a, ast.Starred):
                spread |= self.eval(a.value).views
            else:
                args.append(self.eval(a))
        kws = {kw.arg: self.eval(kw.value) for kw in node.keywords if kw.arg is not None}
        for kw in node.keywords:
            if kw.arg is None:
                spread |= self.eval(kw.value).views
        site = self.scope.site if self.scope.site is not None else node.lineno
        memo_key = (id(helper.fn), site, tuple(args), tuple(sorted(kws.items())), frozenset(spread), self.guards)
        if memo_key in self.memo:
            return self.memo[memo_key]
        where = f"`{helper.name}` ({os.path.basename(helper.filename)}"
        scope = Scope(helper.fn, helper.data, site, where, (*self.scope.stack, helper.name))
        callee = _Walker(self.body, self.captured, self.key_ndim, self.graph, scope)
        callee.accesses, callee.value_writes, callee.memo = self.accesses, self.value_writes, self.memo
        callee.constructs = self.constructs
        callee.env = _bind_params(helper, args, kws, spread)
        callee.guards = self.guards
        callee.walk(helper.tree.body)
        out = NOTHING
        for r in callee.returns:
            out = join(out, r)
        if helper.fn.__code__.co_flags & inspect.CO_GENERATOR and out.views:
            out = views_of(out.views, opaque=True)  # iterating a generator gives what it yielded, not rows of it
        self.memo[memo_key] = out
        return out

    def walk(self, stmts: list[ast.stmt]) -> None:
        saved = self.guards
        for s in stmts:
            getattr(self, "stmt_" + type(s).__name__, self.stmt_generic)(s)
            if isinstance(s, ast.If):  # `if t == 0: return`: the statements after it run only for t != 0
                yes, no = self.conditions(s.test)
                if _exits(s.body) and not _exits(s.orelse):
                    self.guards += no
                elif _exits(s.orelse) and not _exits(s.body):
                    self.guards += yes
        self.guards = saved

    def conditions(self, test: ast.expr) -> tuple[tuple[Guard, ...], tuple[Guard, ...]]:
        """Conditions on the key that hold when ``test`` is true, and when it is false (what it can tell)."""
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            yes, no = self.conditions(test.operand)
            return no, yes
        if isinstance(test, ast.BoolOp):
            parts = [self.conditions(v) for v in test.values]
            if isinstance(test.op, ast.And):
                return tuple(g for y, _ in parts for g in y), ()
            return (), tuple(g for _, n in parts for g in n)
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and type(test.ops[0]) in _CMP:
            op = _CMP[type(test.ops[0])]
            a, b = self.eval(test.left).sub, self.eval(test.comparators[0]).sub
            if isinstance(b, KeySub) and isinstance(a, ConstSub):
                a, b, op = b, a, _FLIP[op]
            if isinstance(a, KeySub) and a.lo == a.hi and isinstance(b, ConstSub):
                c = b.value - a.lo  # key[j] + o op c  <=>  key[j] op c - o
                return ((a.dim, op, c),), ((a.dim, _NEGATE[op], c),)
        return (), ()

    # -- binding ---------------------------------------------------------------------------------
    def bind(self, target: ast.expr, val: AbsVal, value_node: ast.expr | None) -> None:
        if isinstance(target, ast.Name):
            self.env[target.id] = val
            if isinstance(val.sub, KeySub) and val.sub.lo == val.sub.hi == 0 and not self.key_names[val.sub.dim]:
                self.key_names[val.sub.dim] = target.id
        elif isinstance(target, (ast.Tuple, ast.List)):
            self.bind_tuple(target, val, value_node)
        elif isinstance(target, ast.Starred):
            self.bind(target.value, NOTHING, None)
        elif isinstance(target, ast.Subscript):
            base = self.eval(target.value)
            items = self.index_items(target.slice)
            for ref in base.views:
                r = index_view(ref, items)
                self.record(r, region(r), True, target)
        elif isinstance(target, ast.Attribute):
            self.read_views(self.eval(target.value), target, write=True)

    def bind_tuple(self, target: ast.Tuple | ast.List, val: AbsVal, value_node: ast.expr | None) -> None:
        elts = target.elts
        starred = any(isinstance(e, ast.Starred) for e in elts)
        if isinstance(value_node, (ast.Tuple, ast.List)) and len(value_node.elts) == len(elts) and not starred:
            for e, v in zip(elts, value_node.elts, strict=True):
                self.bind(e, self.eval(v), v)  # a, b = b, a: values were evaluated before binding
            return
        if val.is_key:
            plain = len(elts) - int(starred)
            if plain > self.key_ndim or not starred and plain != self.key_ndim:
                raise BadBodyError(
                    f"{self.body.name}: line {target.lineno} unpacks the key into {len(elts)} names "
                    f"(`{ast.unparse(target)}`), but the dataset's keys have {self.key_ndim} field(s). Unpack "
                    f"{self.key_ndim} name(s), or build the dataset with {len(elts)} key columns in "
                    "DistArray.from_coo(keys, values)."
                )
            star = next((i for i, e in enumerate(elts) if isinstance(e, ast.Starred)), len(elts))
            for i, e in enumerate(elts):
                j = i if i < star else self.key_ndim - (len(elts) - i)
                self.bind(e, AbsVal(KeySub(j), scalar=True) if i != star else NOTHING, None)
            return
        if val.views:
            self.read_views(val, target)
        for e in elts:
            self.bind(e, views_of(val.views, opaque=True), None)

    # -- simple statements -----------------------------------------------------------------------
    def stmt_Assign(self, node: ast.Assign) -> None:
        simple = all(isinstance(t, (ast.Name, ast.Tuple, ast.List)) for t in node.targets)
        val = self.eval(node.value) if simple else self.use(node.value)
        for t in node.targets:
            self.bind(t, val, node.value)
            if isinstance(node.value, ast.Lambda) and isinstance(t, ast.Name):
                self.inner_defs.add(t.id)

    def stmt_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.bind(node.target, self.eval(node.value), node.value)

    def stmt_AugAssign(self, node: ast.AugAssign) -> None:
        val = self.use(node.value)
        t = node.target
        if isinstance(t, ast.Name):
            cur = self.lookup(t.id)
            if cur.views:  # in-place on an array alias: w += g writes what w views
                self.read_views(cur, t, write=True)
            else:
                self.env[t.id] = binop(cur, node.op, val)
        elif isinstance(t, ast.Subscript):
            base = self.eval(t.value)
            items = self.index_items(t.slice)
            for ref in base.views:
                r = index_view(ref, items)
                self.record(r, region(r), False, t)
                self.record(r, region(r), True, t)
        elif isinstance(t, ast.Attribute):
            self.read_views(self.eval(t.value), t, write=True)

    def stmt_Expr(self, node: ast.Expr) -> None:
        self.use(node.value)

    def eval_Yield(self, node: ast.Yield | ast.YieldFrom) -> AbsVal:
        val = self.eval(node.value) if node.value is not None else NOTHING
        if self.scope.site is not None:
            self.returns.append(val)  # a generator helper: what it yields reaches the caller
        else:
            self.read_views(val, node)
        return NOTHING

    eval_YieldFrom = eval_Yield

    def stmt_Return(self, node: ast.Return) -> None:
        if self.scope.site is None:
            self.use(node.value)
        elif node.value is not None:
            self.returns.append(self.eval(node.value))  # the caller decides how the result is used

    def stmt_Global(self, node: ast.Global | ast.Nonlocal) -> None:
        kw = "global" if isinstance(node, ast.Global) else "nonlocal"
        names = ", ".join(node.names)
        raise NotParallelizableError(
            f"{self.body.name}: line {node.lineno} declares `{kw} {names}`: every iteration would read and "
            f"rebind the same variable (a chain dependence). To sum a value over the records, `return` it from "
            f"the body (RunStats.returned) or add it to an orion_par.Accumulator; keep state per key in a "
            f"DistArray indexed by the key."
        )

    stmt_Nonlocal = stmt_Global

    def stmt_FunctionDef(self, node: ast.FunctionDef | ast.ClassDef) -> None:
        self.closure_use(node)
        self.env[node.name] = NOTHING
        self.inner_defs.add(node.name)

    stmt_ClassDef = stmt_AsyncFunctionDef = stmt_FunctionDef

    def stmt_Delete(self, node: ast.Delete) -> None:
        for t in node.targets:
            if isinstance(t, ast.Name):
                self.env.pop(t.id, None)
            else:
                self.bind(t, NOTHING, None)

    def stmt_Import(self, node: ast.Import | ast.ImportFrom) -> None:
        for alias in node.names:
            self.env[(alias.asname or alias.name).split(".")[0]] = NOTHING

    stmt_ImportFrom = stmt_Import

    def stmt_generic(self, node: ast.stmt) -> None:
        for _name, value in ast.iter_fields(node):
            if isinstance(value, ast.expr):
                self.use(value)
            elif isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                self.walk(value)
            elif isinstance(value, list):
                for v in value:
                    if isinstance(v, ast.expr):
                        self.use(v)

    # -- control flow ----------------------------------------------------------------------------
    def branch(self, *bodies: list[ast.stmt], guards: tuple[tuple[Guard, ...], ...] = ()) -> None:
        """Walk alternative statement lists from the same environment and join the results (``guards``:
        the conditions that hold in each)."""
        start, saved = self.env, self.guards
        out: dict[str, AbsVal] | None = None
        for i, stmts in enumerate(bodies):
            self.env = dict(start)
            self.guards = saved + (guards[i] if i < len(guards) else ())
            self.walk(stmts)
            out = self.env if out is None else join_env(out, self.env)
        self.env = out if out is not None else start
        self.guards = saved

    def stmt_If(self, node: ast.If) -> None:
        self.use(node.test)
        self.branch(node.body, node.orelse, guards=self.conditions(node.test))

    def loop(self, run_once: Any) -> None:
        """Walk a loop body until the environment is stable (joined with zero iterations)."""
        entry = dict(self.env)
        for passes in range(_MAX_LOOP_PASSES):
            head = dict(self.env)
            run_once()
            self.env = join_env(head, self.env)
            if self.env == head:
                break
            if passes >= 2:
                self.env = _widen(head, self.env)
        self.env = join_env(entry, self.env)

    def stmt_For(self, node: ast.For | ast.AsyncFor) -> None:
        item = self.iteration_value(node.iter)

        def once() -> None:
            self.bind(node.target, item, None)
            self.walk(node.body)

        self.loop(once)
        self.walk(node.orelse)

    stmt_AsyncFor = stmt_For

    def stmt_While(self, node: ast.While) -> None:
        def once() -> None:
            self.use(node.test)
            self.walk(node.body)

        self.use(node.test)
        self.loop(once)
        self.walk(node.orelse)

    def stmt_Match(self, node: ast.Match) -> None:
        self.use(node.subject)
        bodies = []
        for case in node.cases:
            for n in ast.walk(case.pattern):  # a value pattern (case W.x) or a class pattern reads names
                if isinstance(n, ast.expr):
                    self.use(n)
            if case.guard is not None:
                self.use(case.guard)
            # Capture patterns bind names to parts of the subject: unknown values.
            bound = [n.name for n in ast.walk(case.pattern) if isinstance(n, (ast.MatchAs, ast.MatchStar)) and n.name]
            bodies.append([ast.Assign([ast.Name(b, ast.Store())], ast.Constant(None), lineno=case.pattern.lineno)
                           for b in bound] + case.body)
        self.branch(*bodies, [])  # no case may match

    def stmt_Try(self, node: ast.Try) -> None:
        start = dict(self.env)
        self.walk(node.body)
        after_body = join_env(start, self.env)
        handlers = [h.body for h in node.handlers]
        for h in node.handlers:
            self.use(h.type)
            if h.name:
                after_body[h.name] = NOTHING
        self.env = after_body
        self.branch(node.orelse, *handlers)
        self.walk(node.finalbody)

    stmt_TryStar = stmt_Try

    def stmt_With(self, node: ast.With | ast.AsyncWith) -> None:
        for item in node.items:
            val = self.eval(item.context_expr)
            if item.optional_vars is not None:
                self.bind(item.optional_vars, val, None)
        self.walk(node.body)

    stmt_AsyncWith = stmt_With

    def iteration_value(self, it: ast.expr) -> AbsVal:
        """The value a `for` target takes: ``key[j]+a .. key[j]+b-1`` for ``range(key[j]+a, key[j]+b)``."""
        if isinstance(it, ast.Call) and self.resolve_object(it.func) is range and not it.keywords:
            args = [self.use(a) for a in it.args]
            step_one = len(args) < 3 or args[2].sub == ConstSub(1)
            if len(args) >= 2 and step_one:
                lo, hi = args[0].sub, args[1].sub
                if isinstance(lo, KeySub) and isinstance(hi, KeySub) and lo.dim == hi.dim and lo.lo <= hi.hi - 1:
                    return AbsVal(KeySub(lo.dim, lo.lo, hi.hi - 1), scalar=True)
            return SCALAR
        val = self.eval(it)
        if not val.views:
            return NOTHING
        self.read_views(val, it)
        refs = {index_view(r, [IndexItem("index", SCALAR)]) for r in val.views}
        return views_of(r for r in refs if r.free or r.opaque) if any(r.free for r in refs) else SCALAR

    # -- comprehensions --------------------------------------------------------------------------
    def eval_ListComp(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp) -> AbsVal:
        self.constructs.add("comprehension")
        saved = self.env
        self.env = dict(saved)
        for gen in node.generators:
            self.bind(gen.target, self.iteration_value(gen.iter), None)
            for cond in gen.ifs:
                self.use(cond)
        if isinstance(node, ast.DictComp):
            self.use(node.key)
            self.use(node.value)
        else:
            self.use(node.elt)
        self.env = saved
        return NOTHING

    eval_SetComp = eval_GeneratorExp = eval_DictComp = eval_ListComp


_CMP = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}
_FLIP = {"==": "==", "!=": "!=", "<": ">", "<=": ">=", ">": "<", ">=": "<="}
_NEGATE = {"==": "!=", "!=": "==", "<": ">=", "<=": ">", ">": "<=", ">=": "<"}


def _exits(stmts: list[ast.stmt]) -> bool:
    """Whether a statement list always leaves its block (return, raise, continue, break)."""
    if not stmts:
        return False
    last = stmts[-1]
    if isinstance(last, (ast.Return, ast.Raise, ast.Continue, ast.Break)):
        return True
    return isinstance(last, ast.If) and _exits(last.body) and _exits(last.orelse)


def _bind_params(helper: Helper, args: list[AbsVal], kws: dict[str, AbsVal], spread: set[ArrayRef]) -> dict[str, AbsVal]:
    """A helper's parameters bound to a call's arguments (defaults as the function holds them)."""
    a = helper.tree.args
    positional = [p.arg for p in a.posonlyargs + a.args]
    given = helper.fn.__defaults__ or ()
    defaults = dict(zip(positional[len(positional) - len(given):], given[-len(positional):] if positional else (),
                        strict=False))
    defaults.update(helper.fn.__kwdefaults__ or {})
    unknown = views_of(spread, opaque=True) if spread else NOTHING  # *args, **kwargs: any parameter
    env: dict[str, AbsVal] = {}
    for i, name in enumerate(positional + [p.arg for p in a.kwonlyargs]):
        if i < len(positional) and i < len(args):
            val = args[i]
        elif name in kws:
            val = kws.pop(name)
        elif spread:
            val = unknown
        else:
            val = object_value(name, defaults.get(name))
        env[name] = join(val, unknown) if spread else val
    extra = args[len(positional):] + list(kws.values())
    rest = views_of({r for v in extra for r in v.views} | spread, opaque=True)
    if a.vararg is not None:
        env[a.vararg.arg] = rest
    if a.kwarg is not None:
        env[a.kwarg.arg] = rest
    return env


def _widen(old: dict[str, AbsVal], new: dict[str, AbsVal]) -> dict[str, AbsVal]:
    # An index that keeps moving inside a loop (u = u + 1) is not key[j] + c for any fixed c.
    out = dict(new)
    for name, val in new.items():
        if old.get(name) != val and val.sub != old.get(name, val).sub:
            out[name] = AbsVal(UNKNOWN, val.scalar, val.views, False)
    return out
