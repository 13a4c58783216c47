"""``run(check_bounds=True)``: find the record and the line behind an out-of-range subscript.

Compiled with ``boundscheck=True``, numba raises ``IndexError("index is out of bounds")`` without saying
where.  ``locate`` puts the arrays back as they were before the run and replays the run's serial order
with the body as plain Python (the generated module keeps the user's line numbers), which raises at the
first out-of-range subscript with a traceback; then it puts the arrays back again
(``tests/orion_par/test_orion_bounds.py``).
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from typing import Any

import numpy as np

from orion_par.accumulate import RETURNED
from orion_par.body import BodySource
from orion_par.codegen import CompiledBody, python_module
from orion_par.errors import BadBodyError


def snapshot(params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Copies of the arrays a run may change."""
    return {n: np.array(v, copy=True) for n, v in params.items() if isinstance(v, np.ndarray)}


def _restore(saved: Mapping[str, np.ndarray], params: Mapping[str, Any]) -> None:
    for n, v in saved.items():
        params[n][...] = v


def locate(body: BodySource, compiled: CompiledBody, saved: Mapping[str, np.ndarray], params: Mapping[str, Any],
           keys: np.ndarray, values: np.ndarray, order: np.ndarray) -> BadBodyError:
    """The error for the first record of ``order`` whose body raises ``IndexError`` (arrays restored)."""
    _restore(saved, params)
    mod = python_module(compiled.source, compiled.injected)
    fn = mod.__dict__["_orion_body"]
    names = [n for n in compiled.param_names if n != RETURNED]
    args = tuple(params[n] for n in names)
    try:
        for r in order:
            key = tuple(keys[r])
            fn(key, values[r], *args)
    except IndexError as e:
        line, via = _body_line(e, compiled.source)
        text = body.line_text(line) if line else ""
        where = f"line {line} `{text}`" + (f" (in `{via}`)" if via else "") if line else "a subscript"
        return BadBodyError(
            f"{body.name}: {where} indexes outside its array for record {int(r)} (key {tuple(int(k) for k in key)}, "
            f"value {np.asarray(values[r]).tolist()!r}): {e}. The arrays are as they were before the run. Make the array larger or "
            "check the index before using it."
        )
    finally:
        _restore(saved, params)
    return BadBodyError(
        f"{body.name}: the compiled body raised IndexError (an out-of-range subscript), but replaying the run in "
        "plain Python raised none (a random draw or a race decided it). The arrays are as they were before the run."
    )


def _body_line(e: BaseException, source: str) -> tuple[int | None, str]:
    """The body's line in the traceback of ``e`` (the call's line when a helper raised), and the helper."""
    frames = traceback.extract_tb(e.__traceback__)
    line, via = None, ""
    for f in frames:
        if f.name == "_orion_body":
            line = f.lineno
        elif f.name.startswith("_orion_fn_") and line is not None and not via:
            via = _helper_name(source, f.name)
    return line, via


def _helper_name(source: str, gen_name: str) -> str:
    # The generated module writes "# <qualname> (<file>:<line>)" above each helper.
    lines = source.splitlines()
    for i, text in enumerate(lines):
        if text.startswith(f"def {gen_name}(") and i > 0 and lines[i - 1].startswith("# "):
            return lines[i - 1][2:]
    return gen_name
