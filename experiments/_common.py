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


def testbed_run(budget: int, graph: Any, built: Any, steps: int, step_timeout_s: float = 120.0,
                config: Any = None) -> Any:
    """Run ``graph`` (fetches and feeds from ``built``) on a fresh testbed capped at ``budget``, with ``config``
    (``Optimized.config``, whose thread pool the testbed follows).

    A device server that crashes or a phase past its time limit is a failed run (``ending`` ``"crash"`` or
    ``"timeout"``, the reason in ``error``), never hidden and never called an out-of-memory.
    """
    from tfmem.errors import TestbedError
    from tfmem.testbed import RunResult, Testbed

    try:
        with Testbed(budget, step_timeout_s=step_timeout_s) as tb:
            return tb.run(graph, built.fetches, built.feeds, steps=steps, config=config)
    except TestbedError as e:   # a timeout or a crash: ``ending`` says which, never an OOM
        return RunResult.failed(e)


# --- shared by the per-model tables (peak_memory, baselines) ---------------------------------------------------

NAMED_GPU = "V100+PCIe3"   # the cost model's device + link for step-time estimates that do not come from the testbed


def load_average() -> dict[str, float]:
    """The machine's 1/5/15-minute load averages, to store with step times measured on shared cores."""
    one, five, fifteen = os.getloadavg()
    return {"1m": round(one, 2), "5m": round(five, 2), "15m": round(fifteen, 2)}


def code_state() -> dict[str, Any]:
    """The checkout's commit and the tfmem/passes/models files that differ from it (edited while measuring)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30).stdout
            return out.rstrip("\n")  # not strip(): porcelain lines start with a status column that may be blank
        except (OSError, subprocess.SubprocessError):
            return ""

    changed = git("status", "--porcelain", "--", "tfmem", "passes", "models")
    return {"commit": git("rev-parse", "HEAD").strip() or None,
            "uncommitted": [line[3:] for line in changed.splitlines()]}


def table_models(tiny: bool) -> dict[str, Any]:
    """The benchmark models at sizes that run in seconds on the testbed (simulated peaks 40-110 MiB).

    ``tiny``: one small MLP for a CI smoke run (as in ``experiments.swap_placement``).
    """
    from models import deepspeech, moe_transformer, resnet, transformer, wgan_gp
    from tfmem import examples

    if tiny:
        return {"mlp-small": examples.mlp(batch=512, dims=(256, 1024, 1024, 1024, 10))}
    return {
        "moe_transformer": moe_transformer.build(experts=4, layers=2, d_model=128, d_ff=512, seq=64, batch=16),
        "deepspeech": deepspeech.build(seq_len=16, batch=16, freq=64, hidden=128),
        "resnet": resnet.build(depth=20, batch=16, image=32),
        "transformer": transformer.build(layers=1, d_model=128, d_ff=512, seq=64, batch=32),
        "wgan_gp": wgan_gp.build(batch=256, data_dim=512, z_dim=128, hidden=1024, layers=3),
    }


DEFAULT_FRACTION = 0.7
# DeepSpeech's roomy BFC peak (64.6 MiB) sits far above what it needs: capped at 0.7x (45 MiB) vanilla still ran,
# peaking at 40.7 MiB (peak_memory run of 2026-11-23 05:19), so its budget goes lower for vanilla to run out;
# at 0.55x (35 MiB) tfmem refused every row (lower bound 29.2 MiB; run of 05:51).
# The smoke run's MLP: at 0.7x the planner's best plan fits in total but not with the capacity replay's margin.
FRACTIONS = {"deepspeech": 0.6, "mlp-small": 0.8}


def fraction_for(model: str, fraction: float | None) -> float:
    """The budget fraction for ``model``: ``fraction`` when given, else its entry in ``FRACTIONS`` or the default."""
    return fraction if fraction is not None else FRACTIONS.get(model, DEFAULT_FRACTION)


def budget_at(peak_bytes: int, fraction: float) -> int:
    """``fraction`` x ``peak_bytes``, rounded down to whole MiB (the testbed's cap unit), at least 2 MiB."""
    return max(int(peak_bytes * fraction) // 2**20, 2) * 2**20


def run_on(tb: Any, graph: Any, built: Any, steps: int, config: Any = None) -> Any:
    """``tb.run`` that records a timeout, a crashed server or a TF error as a failed run (``ending``, ``error``)."""
    from tfmem.errors import TestbedError
    from tfmem.testbed import RunResult

    try:
        return tb.run(graph, list(built.fetches), built.feeds, steps=steps, config=config)
    except TestbedError as e:   # a timeout or a crash: ``ending`` says which, never an OOM
        return RunResult.failed(e)


def outputs_equal(reference: Any, run: Any) -> bool | None:
    """Whether ``run`` fetched bit-identical values to ``reference``; None when ``run`` produced none (OOM)."""
    import numpy as np

    if run.oom or not run.outputs:
        return None
    return set(run.outputs) == set(reference.outputs) and all(
        np.array_equal(reference.outputs[k], run.outputs[k]) for k in reference.outputs)


def max_relative_difference(reference: Any, run: Any) -> float | None:
    """The largest ``|run - reference| / max(|reference|, 1e-30)`` over every fetched value; None without outputs."""
    import numpy as np

    if run.oom or not run.outputs or set(run.outputs) != set(reference.outputs):
        return None
    worst = 0.0
    for k, ref in reference.outputs.items():
        ref64, got = np.asarray(ref, dtype=np.float64), np.asarray(run.outputs[k], dtype=np.float64)
        if ref64.size:
            worst = max(worst, float(np.max(np.abs(got - ref64) / np.maximum(np.abs(ref64), 1e-30))))
    return worst


def run_record(run: Any, reference: Any) -> dict[str, Any]:
    """One testbed run as JSON: OOM, error, measured peaks, step time, its ratio to ``reference``'s, same outputs."""
    ratio = (run.step_time_s / reference.step_time_s) if run.step_time_s and reference.step_time_s else None
    return {"ending": run.ending, "oom": run.oom, "error": run.error, "peak_bytes": run.device_peak_bytes,
            "host_peak_bytes": run.host_peak_bytes, "step_s": run.step_time_s, "step_vs_vanilla": ratio,
            "outputs_equal_vanilla": outputs_equal(reference, run),
            "max_relative_difference": max_relative_difference(reference, run)}


def fmt_run(r: dict[str, Any] | None) -> str:
    """A table cell for ``run_record``'s output: 'OOM', 'failed' or the measured peak."""
    from tfmem.units import format_bytes

    if not r:
        return "-"
    if failed_run(r):
        return str(r.get("ending") or "failed")
    return "OOM" if r["oom"] else format_bytes(r["peak_bytes"])


def failed_run(r: dict[str, Any]) -> bool:
    """Whether a ``run_record`` is a run that neither ran nor ran out of memory (timeout, crash, TF error); older
    results files said so in ``error``."""
    return r.get("ending") in ("timeout", "crash", "failed") or "testbed failure" in str(r.get("error"))


def fmt_same(r: dict[str, Any]) -> str:
    """A table cell for whether a run's outputs equal vanilla's: 'yes', 'NO (max rel. diff x)' or '-'."""
    same = r.get("outputs_equal_vanilla")
    if same is None:
        return "-"
    return "yes" if same else f"NO (max rel. diff {r.get('max_relative_difference') or 0:.1e})"
