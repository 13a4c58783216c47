"""Accumulators: values a loop reduces over its records (``Accumulator``, and the body's ``return``).

An accumulator is not shared state: each worker reduces its records into a private copy that starts at
the reduction's identity, and ``combine`` folds the copies in worker order at the end of an epoch.  That
is only the loop's value if the body does nothing with the accumulator but update it, so ``check_usage``
refuses any other use.  A body that returns a value has an implicit sum accumulator, ``RETURNED``
(``tests/orion_par/test_orion_accumulators.py``).
"""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence

import numpy as np

from orion_par.body import BodySource
from orion_par.errors import BadBodyError, NotParallelizableError

RETURNED = "_orion_ret"  # the parameter holding the sum of the body's return values
_FORMS = {
    "sum": "`{a}[i] += x`",
    "count": "`{a}[i] += 1`",
    "min": "`{a}[i] = min({a}[i], x)`",
    "max": "`{a}[i] = max({a}[i], x)`",
}


def returns_value(body: BodySource) -> bool:
    """Whether the body returns a value (then every ``return`` must give one).

    Raises
    ------
    BadBodyError
        When some ``return`` gives a value and another gives none (or the body can end without one).
    """
    valued: list[int] = []
    bare: list[int] = []
    for node in _own_nodes(body.tree):
        if isinstance(node, ast.Return):
            (valued if node.value is not None else bare).append(node.lineno)
    if not valued:
        return False
    if bare or not _always_returns(body.tree.body):
        line = bare[0] if bare else body.tree.body[-1].end_lineno
        raise BadBodyError(
            f"{body.name}: line {valued[0]} returns a value (summed over the records into "
            f"RunStats.returned), but line {line} ends the body without one. Return a number on every "
            "path (e.g. `return 0.0`)."
        )
    return True


def _always_returns(stmts: Sequence[ast.stmt]) -> bool:
    if not stmts:
        return False
    last = stmts[-1]
    if isinstance(last, (ast.Return, ast.Raise)):
        return True
    if isinstance(last, ast.If):
        return _always_returns(last.body) and _always_returns(last.orelse)
    return False


def _own_nodes(fdef: ast.FunctionDef) -> list[ast.AST]:
    """The nodes of ``fdef`` outside nested functions and lambdas."""
    out: list[ast.AST] = []
    stack: list[ast.AST] = list(fdef.body)
    while stack:
        node = stack.pop()
        out.append(node)
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                stack.append(child)
    return out


def check_usage(body: BodySource, ops: Mapping[str, str], helper_lines: Mapping[str, int]) -> None:
    """Every use of an accumulator in the body is one update of the form its reduction allows.

    ``helper_lines``: accumulators a called function touches, with the body's line of the call.

    Raises
    ------
    NotParallelizableError
        Naming the line, the use, and the forms that are allowed.
    """
    for name, line in sorted(helper_lines.items()):
        raise NotParallelizableError(
            f"{body.name}: line {line} calls a function that uses the accumulator `{name}`; update it in the "
            f"body itself ({_FORMS[ops[name]].format(a=name)}), e.g. from a value the function returns."
        )
    allowed: set[int] = set()  # id() of Name nodes inside allowed updates
    for node in _own_nodes(body.tree):
        for target, value, kind in _updates(node):
            name = target.value.id  # type: ignore[attr-defined]
            if name not in ops or _mentions(value, name) or _mentions(target.slice, name):
                continue
            if kind == "+=" and ops[name] in ("sum", "count") or kind == ops[name]:
                allowed.add(id(target.value))
                if kind in ("min", "max"):
                    allowed |= {id(n) for n in ast.walk(node.value) if isinstance(n, ast.Name) and n.id == name}  # type: ignore[attr-defined]
    for node in _own_nodes(body.tree):
        if isinstance(node, ast.Name) and node.id in ops and id(node) not in allowed:
            op = ops[node.id]
            raise NotParallelizableError(
                f"{body.name}: line {node.lineno} uses the accumulator `{node.id}` ({op}) other than to update "
                f"it: while the loop runs each worker holds only a part of it. Update it with "
                f"{_FORMS[op].format(a=node.id)} and read it after run() (RunStats.accumulated)."
            )


def _updates(node: ast.AST) -> list[tuple[ast.Subscript, ast.expr, str]]:
    # `A[i] += x` -> (A[i], x, "+="); `A[i] = min(A[i], x)` (either order) -> (A[i], x, "min").
    if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add) and _is_named_subscript(node.target):
        return [(node.target, node.value, "+=")]  # type: ignore[list-item]
    if (isinstance(node, ast.Assign) and len(node.targets) == 1 and _is_named_subscript(node.targets[0])
            and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
            and node.value.func.id in ("min", "max") and len(node.value.args) == 2 and not node.value.keywords):
        target = node.targets[0]
        assert isinstance(target, ast.Subscript)
        same = [a for a in node.value.args if ast.dump(a) == ast.dump(ast.Subscript(target.value, target.slice, ast.Load()))]
        others = [a for a in node.value.args if a not in same]
        if len(same) == 1 and len(others) == 1:
            return [(target, others[0], node.value.func.id)]
    return []


def _is_named_subscript(node: ast.AST) -> bool:
    return isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)


def _mentions(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))


def combine(op: str, partials: Sequence[np.ndarray], out: np.ndarray) -> None:
    """Fold the workers' partial values into ``out`` in worker order (one worker: its value as it is)."""
    acc = np.array(partials[0], copy=True)
    for p in partials[1:]:
        if op in ("sum", "count"):
            acc += p
        elif op == "min":
            np.minimum(acc, p, out=acc)
        else:
            np.maximum(acc, p, out=acc)
    out[...] = acc
