"""Words for plans and refusals: which accesses decided the scheme, and how to fix a refusal."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from orion_par.access import AnySub
from orion_par.accumulate import RETURNED, check_usage
from orion_par.body import BodySource
from orion_par.dependence import DepVec, Interval, lex_positive_boxes
from orion_par.errors import NotParallelizableError
from orion_par.scheme import ParallelScheme, why


def _name(key_names: Sequence[str], j: int | None) -> str:
    if j is None:
        return "?"
    return f"key[{j}] ({key_names[j]})" if j < len(key_names) and key_names[j] else f"key[{j}]"


def _hull(ivs: Iterable[Interval]) -> Interval:
    ivs = list(ivs)
    lo = None if any(i[0] is None for i in ivs) else min(i[0] for i in ivs)  # type: ignore[type-var]
    hi = None if any(i[1] is None for i in ivs) else max(i[1] for i in ivs)  # type: ignore[type-var]
    return lo, hi


def _fmt(iv: Interval) -> str:
    lo, hi = iv
    if lo is None and hi is None:
        return "*"
    if lo == hi:
        return str(lo)
    return f"{'-inf' if lo is None else lo}..{'inf' if hi is None else hi}"


def summarize(deps: Iterable[DepVec], ordered: bool = False) -> dict[str, tuple[str, list[int]]]:
    """Per array: its dependence distances, e.g. ``"(0, *)"``, and the lines involved.

    Unordered loops show the hull of the distances; ordered loops list the forward (lexicographically
    positive) distances, which are what a wavefront has to respect.
    """
    by: dict[str, list[DepVec]] = {}
    for d in deps:
        if not d.same_key_only():
            by.setdefault(d.array, []).append(d)
    out = {}
    for name, ds in sorted(by.items()):
        lines = sorted({d.source.line for d in ds} | {d.sink.line for d in ds})
        if ordered:
            boxes = sorted({b for d in ds for b in lex_positive_boxes(d.distance)}, key=repr)
            text = " ".join("(" + ", ".join(_fmt(iv) for iv in b) + ")" for b in boxes)
        else:
            dims = len(ds[0].distance)
            text = "(" + ", ".join(_fmt(_hull(d.distance[j] for d in ds)) for j in range(dims)) + ")"
        out[name] = (text, lines)
    return out


def explain_plan(body: BodySource, p: Mapping[str, Any], distinct: Sequence[int]) -> str:
    """The text of ``str(plan)``."""
    names = p["key_names"]
    scheme: ParallelScheme = p["scheme"]
    lines = [f"parallel_for plan for `{body.name}` ({body.filename}:{body.tree.lineno}): scheme {scheme}"]
    lines.append("  key fields: " + ", ".join(f"{_name(names, j)} [{n} distinct]" for j, n in enumerate(distinct)))
    lines.append("  accesses (each subscript classified as key[j] + c, ':' or unknown):")
    for a in p["accesses"]:
        lines.append(f"    line {a.line:<4} {'write' if a.is_write else 'read ':5}  {a.text:<22} -> "
                     f"{a.array}[{', '.join(s.describe(names) for s in a.subs)}]")
    summary = summarize(p["dependences"], ordered=p["ordered"])
    kind = "forward key distances" if p["ordered"] else "key distance between conflicting iterations"
    lines.append(f"  dependences ({kind}, * = any):")
    for name, (dist, ls) in summary.items():
        lines.append(f"    {name}: {dist}   lines {', '.join(map(str, ls))}")
    if not summary:
        lines.append("    none between iterations with different keys")
    lines.append("  decision: " + _decision(p, summary, names))
    for name, delay in sorted(p["buffered"].items()):
        lines.append(f"  buffered: {name} (Buffer, max_delay={delay}): workers' updates are added every {delay} step(s)")
    for name, op in sorted(p["accumulators"].items()):
        what = "the body's return values" if name == RETURNED else f"{name} (Accumulator)"
        lines.append(f"  accumulated: {what}, a {op} over each worker's records, combined in worker order "
                     "every epoch")
    for name in p["data_parallel"]:
        lines.append(f"  data parallel: {name} goes to the parameter server (allow_data_parallel=True); "
                     "each worker updates a copy, merged additively every step")
    return "\n".join(lines)


def _decision(p: Mapping[str, Any], summary: Mapping[str, tuple[str, list[int]]], names: Sequence[str]) -> str:
    scheme, s, t = p["scheme"], p["space_dim"], p["time_dim"]
    if scheme is ParallelScheme.NONE:
        return "no two iterations with different keys conflict, so records are split freely among workers."
    if scheme is ParallelScheme.ONE_D:
        arrays = ", ".join(summary) or "no array"
        return (f"every dependence ({arrays}) has distance 0 in {_name(names, s)}, so partitioning by it keeps "
                "conflicting iterations on one worker (1d); results equal the serial loop in data order.")
    space = [a for a in summary if a in p["space_arrays"]]
    time = [a for a in summary if a not in p["space_arrays"]]
    blocking = "; ".join(f"{a} {d}" for a, (d, _) in summary.items())
    if scheme is ParallelScheme.TWO_D:
        return (f"no single key field has distance 0 in every dependence ({blocking}), so 1d is out; each has 0 "
                f"in {_name(names, s)} or {_name(names, t)}: 2d with space = {_name(names, s)} "
                f"(rows that stay with their worker: {', '.join(space) or 'none'}) and time = {_name(names, t)} "
                f"(rows that rotate between workers: {', '.join(time) or 'none'}).")
    return (f"ordered=True and the dependences ({blocking}) point forward in both {_name(names, s)} and "
            f"{_name(names, t)}: blocks run as a wavefront, block (i, j) after (i-1, j) and (i, j-1), which "
            "keeps the serial result (the data must be sorted by key).")


def refusal_message(body: BodySource, deps: Iterable[DepVec], key_ndim: int, ordered: bool,
                    key_names: Sequence[str], captured: Mapping[str, Any] | None = None) -> tuple[str, tuple[str, ...]]:
    """The text of ``NotParallelizableError`` (the conflicts, their lines, the fixes that apply) and the
    fixes offered, by code (``FIXES``).

    ``captured``: the body's data by name (what each conflicting name holds decides the fixes).
    """
    captured = captured or {}
    deps = [d for d in deps if not d.same_key_only()]
    # The dependences that no key field can absorb decide the refusal; otherwise it is their combination.
    hard = [d for d in deps if not any(iv == (0, 0) for iv in d.distance)] or deps
    seen: dict[str, DepVec] = {}
    # The full sort key last: the same refusal names the same pair in every process (sets iterate by hash).
    for d in sorted(hard, key=lambda d: (d.array, not d.source.is_write, d.source.line, d.sink.line, d.sort_key())):
        seen.setdefault(d.array, d)
    lines = [f"`{body.name}` ({body.filename}:{body.tree.lineno}) cannot run in parallel without changing its "
             f"result{' (ordered=True)' if ordered else ''}:"]
    for d in seen.values():
        lines.append(f"  - {d.describe(tuple(key_names))}: {why(d)}")
    need = ("every dependence pointing forward (>= 0) in two key fields" if ordered else
            "one key field at distance 0 in every dependence (1d), or one of two fields in each (2d)")
    lines.append(f"  A parallel plan needs {need}; the key has {key_ndim} field(s).")
    fixes = _fixes(body, seen, captured, key_ndim, ordered, key_names)
    lines.append("  Fixes:")
    lines += [f"    - {text}" for _, text in fixes]
    return "\n".join(lines), tuple(dict.fromkeys(code for code, _ in fixes))


# What each fix code means (tests/orion_par/test_orion_fixes.py applies every one to a body it is offered for).
# (No "ordered=False" fix: every dependence set with an unordered plan also has an ordered one, a wavefront
# or 1d, so an ordered refusal never has an unordered plan.)
FIXES = ("name_arrays", "return", "accumulator", "buffer", "data_parallel", "key_subscript", "series_key", "run_serial")


def _fixes(body: BodySource, seen: Mapping[str, DepVec], captured: Mapping[str, Any], key_ndim: int,
           ordered: bool, key_names: Sequence[str]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    arrays = [n for n in seen if isinstance(captured.get(n), np.ndarray)]
    holders = [n for n in seen if n not in arrays and _holds_arrays(captured.get(n))]
    others = [n for n in seen if n not in arrays and n not in holders]
    for name in holders:
        item = _example_item(seen[name]) or f"{name}[...]"
        label = item[len(name) + 2:-2] if item[len(name) + 1:len(name) + 2] in "'\"" else ""
        var = label if label.isidentifier() else "X"
        out.append(("name_arrays", f"{name} holds arrays, and parallel_for partitions only arrays it can name: bind "
                                   f"each to a name outside the body (`{var} = {item}`) and use that name inside."))
    for name in others:
        out.append(("return", f"{name} is a Python {type(captured.get(name)).__name__} that every record changes. To "
                              "sum a value over the records, `return` it from the body (RunStats.returned)."))
        out.append(("accumulator", f"or add it to an orion_par.Accumulator('sum') (also 'count', 'min', 'max') "
                                   f"instead of {name}; keep state per key in a DistArray indexed by the key."))
    if not arrays:
        return out
    names = ", ".join(arrays)
    unknown = any(_unknown_subscript(seen[n]) for n in arrays)
    if ordered:
        if key_ndim == 1:
            out.append(("series_key", "if the records form several independent series, add the series id as a "
                                      "first key field (keys (series, t)): the series then run in parallel."))
    else:
        summed = [n for n in arrays if only_added_to(body, n) and not (seen[n].source.via or seen[n].sink.via)]
        if summed:
            out.append(("accumulator", f"{', '.join(summed)} is only added to: make it an orion_par.Accumulator"
                                       "('sum', shape) (reset every epoch, each worker sums its records) and read "
                                       "it after run()."))
        out.append(("buffer", f"wrap {names} in orion_par.Buffer(...) if its updates may be applied late (counts, "
                              "gradients)."))
        out.append(("data_parallel", f"pass allow_data_parallel=True to hand {names} to the parameter server (each "
                                     "worker updates a copy; the copies' changes are added every step)."))
    if unknown:
        field = next((k for k in key_names if k), "key[0]")
        out.append(("key_subscript", f"index {names} by the key (e.g. `[{field}]`) instead of a computed subscript, "
                                     "if each record's update belongs to its key."))
    out.append(("run_serial", "or run the loop serially, compiled: f.run_serial()."))
    return out


def _holds_arrays(value: Any) -> bool:
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return any(isinstance(v, np.ndarray) for v in items)


def _example_item(dep: DepVec) -> str:
    # "PARAMS['W'][u, 0]" -> "PARAMS['W']"
    text = dep.source.text.split(" in `")[0]
    cut = text.find("]")
    return text[: cut + 1] if cut > 0 else ""


def _unknown_subscript(dep: DepVec) -> bool:
    return any(isinstance(s, AnySub) and s.why == "unknown" for a in (dep.source, dep.sink) for s in a.subs)


def only_added_to(body: BodySource, name: str) -> bool:
    """Whether the body uses ``name``, and only in updates ``name[...] += x`` (x not reading it)."""
    if not any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(body.tree)):
        return False
    try:
        check_usage(body, {name: "sum"}, {})
    except NotParallelizableError:
        return False
    return True
