"""What every experiment shares: where results go and the provenance written beside the numbers."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def provenance(argv: list[str] | None, **extra: Any) -> dict[str, Any]:
    """Command, date, versions and machine, to store with the numbers."""
    import numpy as np
    import tensorflow as tf

    return {
        "command": " ".join(["python", "-m", _module_name(), *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"python": platform.python_version(), "tensorflow": tf.__version__, "numpy": np.__version__},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        **extra,
    }


def _module_name() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None else "experiments"


def write(name: str, result: dict[str, Any], markdown: str, out_dir: Path = RESULTS) -> tuple[Path, Path]:
    """Write ``NAME.json`` and ``NAME.md`` under ``out_dir``; returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
    json_path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    md_path.write_text(markdown)
    return json_path, md_path


def testbed_run(budget: int, graph: Any, built: Any, steps: int, step_timeout_s: float = 120.0) -> Any:
    """Run ``graph`` (fetches and feeds from ``built``) on a fresh testbed capped at ``budget``.

    A device server that crashes (TF's gRPC receive path can crash instead of raising out-of-memory) or a step
    that exceeds ``step_timeout_s`` is a failed run: ``oom=True`` with the reason in ``error``, never hidden.
    """
    from tfmem.errors import TestbedError
    from tfmem.testbed import RunResult, Testbed

    try:
        with Testbed(budget, step_timeout_s=step_timeout_s) as tb:
            return tb.run(graph, built.fetches, built.feeds, steps=steps)
    except TestbedError as e:
        return RunResult(oom=True, error=f"testbed failure: {str(e).splitlines()[0][:200]}", device_peak_bytes=None,
                         host_peak_bytes=None, step_time_s=None)
