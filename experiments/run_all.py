"""``make bench``: run every experiment in full, one after another, and list the results files.

Experiments are the modules of this package with a ``main(argv)``; private modules (``_*``), this one and
modules that set ``BENCH = False`` (a generic harness run through other modules) are skipped. A failing experiment is reported and the rest still run; the exit code says whether all passed.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time
import traceback

import experiments


def experiment_names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(experiments.__path__)
                  if not m.name.startswith("_") and m.name != "run_all")


def main(argv: list[str] | None = None) -> int:
    only = set(argv if argv is not None else sys.argv[1:])
    failed = []
    for name in experiment_names():
        if only and name not in only:
            continue
        module = importlib.import_module(f"experiments.{name}")
        if not hasattr(module, "main") or (not getattr(module, "BENCH", True) and name not in only):
            continue
        print(f"== experiments.{name}", flush=True)
        start = time.perf_counter()
        try:
            code = module.main([])
        except Exception:
            traceback.print_exc()
            code = 1
        print(f"== experiments.{name}: exit {code} in {time.perf_counter() - start:.0f} s", flush=True)
        if code:
            failed.append(name)
    if failed:
        print("failed: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
