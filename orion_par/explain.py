"""Words for plans and refusals: which accesses decided the scheme, and how to fix a refusal."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from orion_par.accumulate import RETURNED
from orion_par.body import BodySource
from orion_par.dependence import DepVec, Interval, lex_positive_boxes
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
                    key_names: Sequence[str]) -> str:
    """The text of ``NotParallelizableError``: the conflicts, their lines, and the two fixes."""
    deps = [d for d in deps if not d.same_key_only()]
    # The dependences that no key field can absorb decide the refusal; otherwise it is their combination.
    hard = [d for d in deps if not any(iv == (0, 0) for iv in d.distance)] or deps
    seen: dict[str, DepVec] = {}
    for d in sorted(hard, key=lambda d: (d.array, not d.source.is_write, d.source.line, d.sink.line)):
        seen.setdefault(d.array, d)
    lines = [f"`{body.name}` ({body.filename}:{body.tree.lineno}) cannot run in parallel without changing its "
             f"result{' (ordered=True)' if ordered else ''}:"]
    for d in seen.values():
        lines.append(f"  - {d.describe(tuple(key_names))}: {why(d)}")
    need = ("every dependence pointing forward (>= 0) in two key fields" if ordered else
            "one key field at distance 0 in every dependence (1d), or one of two fields in each (2d)")
    lines.append(f"  A parallel plan needs {need}; the key has {key_ndim} field(s).")
    arrays = ", ".join(seen)
    lines.append(f"  Fixes: wrap {arrays} in orion_par.Buffer(...) if its updates may be applied late (counts, "
                 f"gradients), or pass allow_data_parallel=True to hand {arrays} to the parameter server; "
                 "a subscript tied to the key (key[j] + c) instead of a computed one also removes the conflict.")
    return "\n".join(lines)
