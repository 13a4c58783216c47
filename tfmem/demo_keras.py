"""``python -m tfmem.demo_keras``: a Keras 3 model whose ``fit`` does not fit a device, trained under its budget.

Three runs on the testbed, each in a process of its own (a process joins one testbed: ``tfmem.testbed.eager``):

1. plain ``model.fit`` on a device capped at the budget: it runs out of memory, for real;
2. the same ``fit`` with ``tfmem.keras.MemoryBudget(budget)`` under the same cap: it trains, under the budget;
3. plain ``fit`` on a roomy device: the reference. The demo compares history, weights and Adam's slots of 2 with
   it, bit for bit, prints a table and writes the plan's report and plot, and every run's figures
   (``runs.json``), to ``demo_out_keras/``.

``--tiny`` trains two batches per epoch, not three, for the test suite.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")   # the testbed's client must match its servers

import argparse
import hashlib
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

MiB = 2**20
# The MLP's plain step peaked at 39.8-65 MiB on the testbed (lowest beside the test suite); its plan, simulated at
# 27.9-28.2 MiB, measured 28.5-36.9 (the copies' timing: docs/RESULTS.md, "TensorFlow 2")
BUDGET_MIB = 38
ROOMY_MIB = 256
BATCH = 4096
CHILD_TIMEOUT_S = 600


def build_mlp(seed: int = 0) -> Any:
    """Eight 256-wide ReLU layers on 128 features with Adam, compiled without XLA."""
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((128,)), *(keras.layers.Dense(256, activation="relu") for _ in range(8)),
                              keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.Adam(), jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def training_state(model: Any) -> list[Any]:
    """Every weight and optimizer slot of ``model``."""
    return [*model.weights, *model.optimizer.variables]


def state_digest(model: Any) -> str:
    """A digest of ``training_state(model)``: equal digests, bit-identical training state."""
    return hashlib.sha256(b"".join(np.asarray(v.numpy()).tobytes() for v in training_state(model))).hexdigest()


def fit_on_testbed(cap_mib: int, planned: bool, batches: int = 3, out: Path | None = None) -> dict[str, Any]:
    """Build the MLP on a testbed capped at ``cap_mib`` and measure ``fit`` (a one-batch warm-up, then two epochs of
    ``batches`` batches), plain or with ``MemoryBudget`` at the cap; ``out``: where the plan's report goes."""
    import tensorflow as tf

    import tfmem.keras
    from tfmem.testbed import Testbed, run_keras_steps_on

    rng = np.random.default_rng(0)
    x = rng.random((batches * BATCH, 128)).astype(np.float32)
    y = rng.integers(0, 10, len(x)).astype(np.int32)
    with Testbed(f"{cap_mib}MiB") as testbed:
        remote = testbed.connect()
        with tf.device(remote.device):
            model = build_mlp()
            model.optimizer.build(model.trainable_variables)   # Adam's slots on the device too
        callbacks: list[Any] = []
        if planned:
            callbacks = [tfmem.keras.MemoryBudget(f"{cap_mib}MiB", device=remote.device, host=remote.host)]
        else:
            run_keras_steps_on(model, remote.device)
        history: list[Any] = []
        result = remote.measure(
            lambda: history.append(model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                                             callbacks=callbacks).history["loss"]),
            warmup=lambda: model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, verbose=0, callbacks=callbacks))
        row: dict[str, Any] = {
            "oom": result.oom, "error": result.error, "peak": result.device_peak_bytes,
            "host_peak": result.host_peak_bytes, "history": history[0] if history else None,
            "state": None if result.oom else state_digest(model),   # an out-of-memory stopped the servers
            "places": sorted({v.value.device for v in training_state(model)})}
        if planned and callbacks[0].step is not None:
            report = callbacks[0].report
            step = callbacks[0].step
            row.update(before=report.before.peak_bytes, after=report.after.peak_bytes,
                       placement=[(n, len(wrong)) for n, wrong in step.placement.values()])
            if out is not None:
                out.mkdir(parents=True, exist_ok=True)
                (out / "report.md").write_text(report.to_markdown())
                report.plot(out / "memory.png")
    return row


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; 0 when the budgeted fit trained under the budget identically to the reference."""
    parser = argparse.ArgumentParser(prog="python -m tfmem.demo_keras", description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="two batches per epoch, not three (for the test suite)")
    parser.add_argument("--out", default="demo_out_keras", help="where the report and plot go")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    batches = 2 if args.tiny else 3
    if args.child:
        cap, planned = int(args.child[0]), args.child[1] == "planned"
        print(json.dumps(fit_on_testbed(cap, planned, batches, Path(args.out) if planned else None)))
        return 0
    start = time.perf_counter()

    def say(message: str) -> None:
        print(f"[{time.perf_counter() - start:6.1f}s] {message}", flush=True)

    runs = [("plain fit", BUDGET_MIB, "plain"), ("fit with MemoryBudget", BUDGET_MIB, "planned"),
            ("plain fit, roomy device", ROOMY_MIB, "plain")]
    rows = {}
    for label, cap, mode in runs:
        say(f"{label} on a device of {cap} MiB (a process of its own: TensorFlow servers take ~10 s to start) ...")
        rows[label] = _child(cap, mode, batches, args.out)
    print()
    print(f"{'run':<26}{'device':>9}{'peak measured':>15}{'peak simulated':>16}  out of memory")
    for label, cap, _ in runs:
        r = rows[label]
        peak = f"{r['peak'] / MiB:.1f} MiB" if r.get("peak") else "-"
        simulated = f"{r['after'] / MiB:.1f} MiB" if r.get("after") else "-"
        print(f"{label:<26}{cap:>5} MiB{peak:>15}{simulated:>16}  {'yes' if r.get('oom') else 'no'}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "runs.json").write_text(json.dumps({"budget_mib": BUDGET_MIB, "runs": rows}, indent=2))
    planned, reference = rows["fit with MemoryBudget"], rows["plain fit, roomy device"]
    same = planned.get("state") == reference.get("state") and planned.get("history") == reference.get("history")
    print(f"\nhistory, weights and Adam's slots identical to the roomy plain fit: {'yes' if same else 'no'}")
    if planned.get("before"):
        print(f"simulated peak of the step: {planned['before'] / MiB:.1f} MiB as written, "
              f"{planned['after'] / MiB:.1f} MiB planned; report and plot in {args.out}/")
    ok = (rows["plain fit"].get("oom") and not planned.get("oom") and planned.get("peak") is not None
          and planned["peak"] <= BUDGET_MIB * MiB and same)
    say("demo done" if ok else "demo done, but a run did not behave as described above")
    return 0 if ok else 1


def _child(cap: int, mode: str, batches: int, out: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "tfmem.demo_keras", "--child", str(cap), mode, "--out", out,
           *(["--tiny"] if batches == 2 else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    if done.returncode != 0:
        said = [ln for ln in done.stderr.splitlines() if ln.startswith(("tfmem.", "Error", "Traceback"))]
        print(f"  the run failed: {said[-1] if said else done.stderr.strip()[-300:]}", flush=True)
        return {"failed": True}
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if row.get("oom"):
        print(f"  {row['error'][:200]}", flush=True)
    return row


if __name__ == "__main__":
    raise SystemExit(main())
