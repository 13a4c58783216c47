"""Compile a loop body with numba (``nogil=True``) or, when numba cannot, keep it as plain Python.

Compiled code follows numpy's rules for arithmetic errors (``error_model="numpy"``): dividing an array
element by zero gives inf or nan, as it does in plain Python on numpy scalars, rather than raising.

The body's source is copied into a generated module whose lines keep the user's line numbers (blank
lines pad the top), with every captured array and number turned into a parameter: numba would freeze a
global array as a constant, and a parameter is re-read at every run.  A second function runs the body
over a range of records.  The module lives in a cache directory named by a hash of its text, so numba's
on-disk cache (``cache=True``) survives between processes.
"""

from __future__ import annotations

import ast
import builtins
import hashlib
import importlib.util
import os
import re
import sys
import tempfile
import textwrap
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numba
import numpy as np

from orion_par import helpers, prefetch, sync
from orion_par.accumulate import RETURNED
from orion_par.body import BodySource
from orion_par.errors import CompileFallbackWarning
from orion_par.helpers import CallGraph, apply_edits, call_edits, helper_source

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_LOADED: dict[tuple[str, bool, bool], Any] = {}


@dataclass
class CompiledBody:
    """``block(keys, values, start, stop, *params)`` runs the body on records ``start .. stop-1``."""

    name: str
    source: str
    param_names: tuple[str, ...]
    injected: dict[str, Any]
    block: Callable[..., None] = field(repr=False)
    seed: Callable[[int], None] = field(repr=False)
    compiled: bool = True
    fallback_reason: str = ""
    # drive(keys, values, calls, first, done, spin, clock, *params): the generated ``_orion_drive``, compiled on
    # its first call (None for the Python fallback)
    drive: Callable[..., int] | None = field(default=None, repr=False)
    boundscheck: bool = False


def cache_dir() -> Path:
    """Where generated modules and numba's cache go (``$ORION_PAR_CACHE_DIR`` overrides)."""
    root = os.environ.get("ORION_PAR_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "orion_par"
    )
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
        return Path(root)
    except OSError:
        fallback = Path(tempfile.gettempdir()) / "orion_par_cache"
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


def generate_source(body: BodySource, param_names: tuple[str, ...], key_ndim: int,
                    prefetch_rows: tuple[prefetch.Row, ...] = (), graph: CallGraph | None = None) -> str:
    """The generated module's text: ``_orion_body``, ``_orion_block``, ``_orion_seed`` and ``_orion_drive``
    (a worker's calls of ``_orion_block`` with the token waits between them, all without the GIL), and
    the functions the body calls, rewritten to take their data as parameters (``helpers``).

    ``prefetch_rows`` (``prefetch.rows``): subscripts whose rows ``_orion_block`` prefetches
    ``prefetch.DISTANCE`` records ahead."""
    graph = graph if graph is not None else CallGraph()
    returns = RETURNED in param_names  # the body returns a value: the block sums it into _orion_ret[0]
    body_params = tuple(n for n in param_names if n != RETURNED)
    tree = body.tree
    first_stmt = tree.body[0].lineno
    params = ", ".join((body.key_param, body.value_param, *body_params))
    head = f"def _orion_body({params}):"
    if first_stmt > tree.lineno and first_stmt - 1 >= 1:
        # Keep the user's line numbers: numba's messages and tracebacks then point at their file's lines.
        lines = apply_edits(list(body.source_lines), body.first_line, call_edits(body.fn, tree, graph))
        start = first_stmt - body.first_line
        stop = tree.end_lineno - body.first_line + 1  # type: ignore[operator]
        text = "\n" * (first_stmt - 2) + head + "\n" + "\n".join(lines[start:stop])
    else:
        one_line = list(body.source_lines[: tree.end_lineno - body.first_line + 1])  # type: ignore[operator]
        edited = apply_edits(one_line, body.first_line, call_edits(body.fn, tree, graph))
        inner = ast.parse(textwrap.dedent("\n".join(edited))).body[0]
        assert isinstance(inner, ast.FunctionDef)
        stmts = ast.unparse(ast.Module(body=inner.body, type_ignores=[]))
        text = head + "\n" + "\n".join("    " + ln for ln in stmts.splitlines())
    for h in graph.helpers.values():
        text += "\n\n\n" + helper_source(h, graph)
    options = {h.gen_name: h.options for h in graph.helpers.values() if h.options}
    text += f"\n\n\n_orion_options = {options!r}\n" if options else ""
    key = "(" + ", ".join(f"keys[_orion_r, {j}]" for j in range(key_ndim)) + ("," if key_ndim == 1 else "") + ")"
    rest = ", ".join(body_params)
    args = f"{key}, values[_orion_r]" + (f", {rest}" if rest else "")
    tail = f", {', '.join(param_names)}" if param_names else ""
    call = f"{RETURNED}[0] += _orion_body({args})" if returns else f"_orion_body({args})"
    return (
        text + "\n\n\n"
        f"def _orion_block(keys, values, start, stop{tail}):\n"
        f"    for _orion_r in range(start, stop):\n"
        + (f"        if _orion_r + {prefetch.DISTANCE} < stop:\n"
           + prefetch.prefetch_lines(prefetch_rows, f"_orion_r + {prefetch.DISTANCE}", "            ") + "\n"
           if prefetch_rows else "")
        + f"        {call}\n\n\n"
        "def _orion_seed(seed):\n"
        "    _orion_np.random.seed(seed)\n\n\n"
        # A worker's calls (rows: start, stop, token, uses of the token to wait for, tasks in the call), from
        # call `first` on; returns the first call whose token did not arrive within `spin` cycles (or the end).
        f"def _orion_drive(keys, values, calls, first, done, spin, clock{tail}):  # sync v{sync.VERSION}\n"
        "    t0 = _orion_sync.now()\n"
        "    c = first\n"
        "    while c < calls.shape[0]:\n"
        "        if not _orion_sync.wait(done, calls[c, 2], calls[c, 3], spin, clock):\n"
        "            break\n"
        f"        _orion_block(keys, values, calls[c, 0], calls[c, 1]{tail})\n"
        "        _orion_sync.post(done, calls[c, 2], calls[c, 3] + calls[c, 4])\n"
        "        c += 1\n"
        "    clock[1] += _orion_sync.now() - t0\n"
        "    return c\n"
    )


def injected_globals(body: BodySource, captured: dict[str, Any], param_names: tuple[str, ...],
                     graph: CallGraph | None = None) -> dict[str, Any]:
    """Captured names that stay globals of the generated module (modules, functions), and the globals the
    rewritten helpers need; the helpers themselves are generated, not injected."""
    graph = graph if graph is not None else CallGraph()
    out: dict[str, Any] = {"_orion_np": np, "_orion_sync": sync, "_orion_mem": prefetch}
    for name, value in captured.items():
        if name in param_names or value is getattr(builtins, name, object()) or graph.helper(value) is not None:
            continue
        out[name] = value
    out.update(helpers.injected(graph))
    return out


def _cacheable(injected: dict[str, Any]) -> bool:
    # numba's disk cache does not notice a changed global; allow it only for modules and jitted functions.
    return all(isinstance(v, (types.ModuleType, numba.core.registry.CPUDispatcher)) for v in injected.values())


def load_module(source: str, injected: dict[str, Any]) -> types.ModuleType:
    """Write ``source`` to the cache directory (once) and import it with ``injected`` as globals."""
    digest = hashlib.sha1((source + numba.__version__ + repr(sorted(injected))).encode()).hexdigest()[:16]
    path = cache_dir() / f"orion_body_{digest}.py"
    if not path.exists():
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        os.replace(tmp, path)
    modname = f"_orion_gen_{digest}"
    spec = importlib.util.spec_from_file_location(modname, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    mod.__dict__.update(injected)
    spec.loader.exec_module(mod)
    # numba's cache records the module by name and imports it when loading in another process (a Ray
    # actor); registering it makes that import find this module.
    sys.modules.setdefault(modname, mod)
    return mod


def _jit_module(source: str, injected: dict[str, Any], cache: bool, boundscheck: bool = False) -> types.ModuleType:
    key = (source + repr(sorted(injected)), cache, boundscheck)
    if key not in _LOADED:
        mod = load_module(source, injected)
        # error_model="numpy": a division by zero gives inf/nan (integers: 0) as numpy does for array
        # elements, instead of a check per division that raises ZeroDivisionError; that check also keeps
        # LLVM from vectorising loops that divide (LDA's per-topic loop runs ~1.5x faster without it).
        jit = numba.njit(nogil=True, cache=cache, error_model="numpy", boundscheck=boundscheck)
        # inline="always" puts the body into the block loop at numba IR level: no call per record.
        mod.__dict__["_orion_body"] = numba.njit(nogil=True, cache=cache, inline="always", error_model="numpy",
                                                 boundscheck=boundscheck)(mod.__dict__["_orion_body"])
        for name in [n for n in mod.__dict__ if n.startswith("_orion_fn_")]:  # the body's helpers
            options = mod.__dict__.get("_orion_options", {}).get(name, {})
            mod.__dict__[name] = numba.njit(nogil=True, cache=cache, error_model="numpy", boundscheck=boundscheck,
                                            **options)(mod.__dict__[name])
        mod.__dict__["_orion_block"] = jit(mod.__dict__["_orion_block"])  # _orion_drive calls the compiled one
        mod.__dict__["_orion_jit"] = (mod.__dict__["_orion_block"], jit(mod.__dict__["_orion_seed"]),
                                      jit(mod.__dict__["_orion_drive"]))
        _LOADED[key] = mod
    loaded: types.ModuleType = _LOADED[key]
    return loaded


def compile_body(name: str, source: str, param_names: tuple[str, ...], injected: dict[str, Any],
                 sample_args: tuple[Any, ...], line_text: Callable[[int], str] | None = None,
                 boundscheck: bool = False, python_reason: str = "") -> CompiledBody:
    """Compile with numba for the types of ``sample_args``; fall back to Python with a warning.

    ``sample_args`` are the block's arguments (``keys, values, 0, 0, *params``): calling the block on an
    empty range compiles it without running the body, so any exception here comes from compilation.
    ``boundscheck``: every subscript is checked (an ``IndexError`` instead of undefined behaviour).
    ``python_reason``: numba would compile this body wrongly; run it as Python (with the reason in the warning).
    """
    reason = python_reason
    # A stale disk cache must not cost speed; no compile at all when numba would get the body wrong.
    caches: tuple[bool, ...] = () if python_reason else (False,) if boundscheck else (_cacheable(injected), False)
    for cache in dict.fromkeys(caches):
        block, seed, drive = _jit_module(source, injected, cache, boundscheck).__dict__["_orion_jit"]
        try:
            block(*sample_args)
        except Exception as e:
            reason = reason or _reason(str(e), line_text)
            continue
        try:  # compile the driver now too (no calls), so that no run's timing includes it
            keys, values, params = sample_args[0], sample_args[1], sample_args[4:]
            drive(keys, values, np.zeros((0, 5), np.int64), 0, np.zeros(1, np.int64), 0, np.zeros(2, np.int64), *params)
        except Exception:
            drive = None
        return CompiledBody(name, source, param_names, injected, block, seed, drive=drive, boundscheck=boundscheck)
    py_mod = python_module(source, injected)
    warnings.warn(
        f"orion_par: numba cannot compile `{name}`: {reason}. Running the body as plain Python instead: the "
        "results are the same, but it is slower and holds the GIL (workers take turns). Rewrite that "
        "construct with numba-supported code to get compiled speed.",
        CompileFallbackWarning,
        stacklevel=3,
    )
    return CompiledBody(name, source, param_names, injected, py_mod.__dict__["_orion_block"], py_mod.__dict__["_orion_seed"],
                        compiled=False, fallback_reason=reason, boundscheck=boundscheck)


def python_module(source: str, injected: dict[str, Any]) -> types.ModuleType:
    """A fresh, uncompiled copy of the generated module: its functions are plain Python (prefetch hints
    are no-ops there)."""
    return load_module(source, {**injected, "_orion_mem": _NoPrefetch})


class _NoPrefetch:
    """``prefetch``'s functions for the Python fallback: hints cost time in Python and do nothing."""

    @staticmethod
    def prefetch_read(arr: Any, offset: int, span: int) -> None:
        return None

    prefetch_write = prefetch_read


def _reason(message: str, line_text: Callable[[int], str] | None) -> str:
    """The construct numba stopped at: the line, its text, and numba's first line of explanation."""
    text = _ANSI.sub("", message)
    lines = [ln.strip() for ln in text.splitlines()]
    skip = ("Failed in", "During:", "File ", "^", "This error", "For more", "Please", "<source")
    what = next((ln for ln in lines if ln and not ln.startswith(skip)), lines[0] if lines else "unknown error")
    locs = [int(m.group(1)) for m in re.finditer(r'File "[^"]*orion_body_[0-9a-f]+\.py", line (\d+)', text)]
    # The body's own lines have text; the generated block function's lines (past the body) have none.
    located = [(ln, line_text(ln)) for ln in locs if line_text and line_text(ln)]
    if located:
        line, src = located[0]
        return f"line {line} `{src}` stopped it ({what[:200]})"
    return what[:300]
