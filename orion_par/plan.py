"""Turn a body's accesses into a ``Plan``: the scheme, the arrays each worker owns, and why.

``make_plan`` runs the analyzer, drops the arrays whose conflicts the user relaxed (``Buffer``s, and
with ``allow_data_parallel=True`` the arrays that stand in the way of every scheme), computes the
dependence vectors of the rest and picks a scheme, or raises ``NotParallelizableError`` naming the
conflicting accesses, their lines, and the fixes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from orion_par.access import Access
from orion_par.accumulate import RETURNED, check_usage, returns_value
from orion_par.analyzer import analyze_body
from orion_par.body import BodySource
from orion_par.checks import check_no_aliases
from orion_par.dependence import DepVec, dependence_vectors
from orion_par.distarray import Accumulator, Buffer
from orion_par.errors import NotParallelizableError
from orion_par.explain import explain_plan, refusal_message
from orion_par.scheme import ParallelScheme, SchemeChoice, candidates, choose_scheme, satisfies, violations


@dataclass(frozen=True)
class Plan:
    """How ``parallel_for`` will run a body; ``str(plan)`` explains the decision in words.

    Attributes
    ----------
    scheme : ParallelScheme
        ``"none"``, ``"1d"``, ``"2d"`` or ``"2d_ordered"`` (compares equal to those strings).
    space_dim, time_dim : int or None
        Key fields partitioned across workers (1D uses ``space_dim`` only) and rotated (2D).
    buffered : mapping of str to int
        Arrays updated through a Buffer, with their ``max_delay``.
    data_parallel : tuple of str
        Arrays handed to the parameter server (``allow_data_parallel=True``); merged like a Buffer with
        ``max_delay=1``.
    space_arrays : tuple of str
        Written arrays whose elements only one space partition touches (they never travel).
    accumulators : mapping of str to str
        ``Accumulator`` arrays with their reduction; ``accumulate.RETURNED`` (a sum) when the body returns
        a value.
    miscompiles : str
        Why numba would compile this body wrongly (it then runs as Python); empty when it would not.
    """

    scheme: ParallelScheme
    space_dim: int | None
    time_dim: int | None
    ordered: bool
    key_names: tuple[str, ...]
    accesses: tuple[Access, ...]
    dependences: tuple[DepVec, ...]
    buffered: Mapping[str, int]
    data_parallel: tuple[str, ...]
    written: tuple[str, ...]
    space_arrays: tuple[str, ...]
    accumulators: Mapping[str, str]
    miscompiles: str
    explanation: str

    def __str__(self) -> str:
        return self.explanation

    @property
    def relaxed(self) -> dict[str, int]:
        """Arrays merged late, with the number of steps between merges."""
        out = dict(self.buffered)
        out.update({name: 1 for name in self.data_parallel})
        return out


def make_plan(
    body: BodySource, captured: Mapping[str, Any], keys: np.ndarray, values: np.ndarray, *, ordered: bool,
    allow_data_parallel: bool,
) -> Plan:
    """Analyse ``body`` against the dataset's ``keys`` and choose a scheme (see the module docstring)."""
    key_ndim = keys.shape[1]
    analysis = analyze_body(body, captured, key_ndim, values.ndim)
    arrays = {n: v for n, v in captured.items() if isinstance(v, np.ndarray)}
    first_write: dict[str, int] = {}
    for a in sorted(analysis.accesses, key=lambda a: a.line):
        if a.is_write:
            first_write.setdefault(a.array, a.line)
    check_no_aliases(arrays, dict(sorted(first_write.items())), values)
    buffered = {n: int(v.max_delay) for n, v in arrays.items() if isinstance(v, Buffer)}
    accumulators = {n: v.op for n, v in arrays.items() if isinstance(v, Accumulator)}
    check_usage(body, accumulators, {a.array: a.line for a in analysis.accesses if a.via and a.array in accumulators})
    returns = returns_value(body)
    shared = [a for a in analysis.accesses if a.array not in buffered and a.array not in accumulators]
    deps: set[DepVec] = dependence_vectors(shared, key_ndim)
    distinct = [int(np.unique(keys[:, j]).size) if keys.size else 0 for j in range(key_ndim)]
    choice = choose_scheme(deps, key_ndim, ordered=ordered, distinct=distinct, space_bytes=_space_bytes(deps, arrays))
    data_parallel: tuple[str, ...] = ()
    if choice is None:
        if not allow_data_parallel:
            ordered_deps: list[DepVec] = sorted(deps, key=DepVec.sort_key)
            text, fixes = refusal_message(body, deps, key_ndim, ordered, analysis.key_names, captured)
            raise NotParallelizableError(text, tuple(ordered_deps), fixes)
        choice, data_parallel = _cheapest_relaxation(deps, key_ndim, ordered, arrays)
        deps = {d for d in deps if d.array not in data_parallel}
    written = tuple(sorted({a.array for a in analysis.accesses if a.is_write}))
    space = _space_arrays(choice, deps, written, set(buffered) | set(data_parallel) | set(accumulators))
    if returns:
        accumulators[RETURNED] = "sum"
    plan_args = dict(
        scheme=choice.scheme, space_dim=choice.space_dim, time_dim=choice.time_dim, ordered=ordered,
        key_names=analysis.key_names, accesses=analysis.accesses, dependences=tuple(sorted(deps, key=lambda d: d.sort_key())),
        buffered=buffered, data_parallel=data_parallel, written=written, space_arrays=space,
        accumulators=accumulators, miscompiles=analysis.miscompiles,
    )
    return Plan(**plan_args, explanation=explain_plan(body, plan_args, distinct))  # type: ignore[arg-type]


def _space_bytes(deps: set[DepVec], arrays: Mapping[str, np.ndarray]) -> dict[int, int]:
    # Bytes of arrays that stay in place if key field j is the space field: those that conflict only
    # between iterations with equal key[j].
    out: dict[int, int] = {}
    names = {d.array for d in deps}
    for name in names:
        mine = [d for d in deps if d.array == name]
        for j in range(len(mine[0].distance)):
            if all(d.is_zero(j) or d.same_key_only() for d in mine):
                out[j] = out.get(j, 0) + int(arrays[name].nbytes) if name in arrays else out.get(j, 0)
    return out


def _cheapest_relaxation(
    deps: set[DepVec], key_ndim: int, ordered: bool, arrays: Mapping[str, np.ndarray]
) -> tuple[SchemeChoice, tuple[str, ...]]:
    # Orion's data-parallel fallback: the scheme whose conflicting arrays cost least to merge (bytes),
    # preferring the simpler scheme on ties.
    best: tuple[int, int, SchemeChoice, tuple[str, ...]] | None = None
    for rank, choice in enumerate(candidates(key_ndim, ordered)):
        names = tuple(sorted({d.array for d in violations(choice, deps)}))
        rest = [d for d in deps if d.array not in names]
        if not all(satisfies(choice, d) for d in rest):
            continue
        cost = sum(int(arrays[n].nbytes) for n in names if n in arrays)
        if best is None or (cost, rank) < (best[0], best[1]):
            best = (cost, rank, choice, names)
    assert best is not None  # "none" with every conflicting array relaxed is always valid
    return best[2], best[3]


def _space_arrays(choice: SchemeChoice, deps: set[DepVec], written: tuple[str, ...], relaxed: set[str]) -> tuple[str, ...]:
    if choice.scheme in (ParallelScheme.NONE, ParallelScheme.ONE_D):
        return tuple(n for n in written if n not in relaxed)
    s = choice.space_dim
    out = []
    for name in written:
        if name in relaxed:
            continue
        if all(d.same_key_only() or d.is_zero(s) for d in deps if d.array == name):  # type: ignore[arg-type]
            out.append(name)
    return tuple(out)
