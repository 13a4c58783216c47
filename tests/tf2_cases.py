"""TF2 steps for tests/test_function.py, each run in a fresh process: ``python -m tests.tf2_cases CASE``.

A fresh process can split the CPU into two logical devices before TensorFlow starts (the test process's
TensorFlow is already running), so that a plan has a ``host`` to swap to: ``/CPU:0`` is the device and
``/CPU:1`` the host. Each case prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import numpy as np
import tensorflow as tf

DEVICE = "/job:localhost/replica:0/task:0/device:CPU:0"
HOST = "/job:localhost/replica:0/task:0/device:CPU:1"


def _two_cpus() -> None:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)


def _keras_mlp(seed: int = 0) -> tuple[Any, Any, Any]:
    """A Keras 3 MLP, its Adam and a custom training step (a plain Python function)."""
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((128,)), *(keras.layers.Dense(256, activation="relu") for _ in range(8)),
                              keras.layers.Dense(10)])
    optimizer = keras.optimizers.Adam()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return {"loss": loss, "first": grads[0][0, :4]}

    return model, optimizer, step


def _state(model: Any, optimizer: Any) -> list[np.ndarray]:
    return [np.asarray(v.numpy()) for v in [*model.weights, *optimizer.variables]]


def keras_step(fraction: float) -> dict[str, Any]:
    """A Keras 3 step planned at ``fraction`` of its simulated peak, against a twin run by ``tf.function``."""
    import tfmem
    from tfmem.traced import trace

    rng = np.random.default_rng(0)
    x = rng.random((4096, 128)).astype(np.float32)
    y = rng.integers(0, 10, 4096).astype(np.int32)
    model, optimizer, step = _keras_mlp()
    twin_model, twin_optimizer, twin_step = _keras_mlp()
    reference = tf.function(twin_step)
    traced = trace(reference.get_concrete_function(x, y))
    vanilla = tfmem.unoptimized_profile(traced.graph_def, traced.fetches, device=DEVICE, host=HOST).peak_bytes
    budget = int(vanilla * fraction)
    planned = tfmem.function(step, budget=budget, host=HOST)
    same_outputs = True
    for _ in range(3):
        got, want = planned(x, y), reference(x, y)
        same_outputs &= all(np.array_equal(got[k].numpy(), want[k].numpy()) for k in want)
    report = planned.report
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        partial = [planned(x[:100], y[:100])["loss"].numpy() for _ in range(2)]
    twin_partial = [reference(x[:100], y[:100])["loss"].numpy() for _ in range(2)]
    return {"budget": budget, "vanilla": vanilla, "before": report.before.peak_bytes,
            "after": report.after.peak_bytes, "same_outputs": bool(same_outputs),
            "same_state": all(np.array_equal(a, b) for a, b in zip(_state(model, optimizer),
                                                                   _state(twin_model, twin_optimizer), strict=True)),
            "swapped": sum(n.op == "Identity" and n.device == HOST for n in planned.plans[next(iter(planned.plans))]
                           .optimized.graph_def.node),
            "warnings": [str(w.message) for w in caught],
            "placement": [(n, len(wrong)) for n, wrong in planned.placement.values()],
            "partial_same": bool(np.array_equal(partial, twin_partial))}


def _compiled_mlp() -> Any:
    import keras

    model, _, _ = _keras_mlp()
    model.compile(optimizer=keras.optimizers.Adam(), jit_compile=False,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _fit_twins(compiled: Any, rows: int, budget_mib: float, slots: Any, refit: bool) -> dict[str, Any]:
    """``fit`` with ``MemoryBudget`` against plain ``fit`` of a twin (``refit``: then one more ``fit`` of each);
    ``slots(model)`` lists the optimizer's variables (a property in Keras 3, a method in tf_keras)."""
    import tfmem.keras

    rng = np.random.default_rng(0)
    x = rng.random((rows, 128)).astype(np.float32)
    y = rng.integers(0, 10, len(x)).astype(np.int32)
    planned_model, reference = compiled(), compiled()
    budget = tfmem.keras.MemoryBudget(f"{budget_mib}MiB", host=HOST)
    runs = [2, 1] if refit else [2]   # epochs per fit() call
    planned, steps = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epochs in runs:
            planned.append(planned_model.fit(x, y, batch_size=4096, epochs=epochs, shuffle=False, verbose=0,
                                             callbacks=[budget]).history)
            steps.append(budget.step)
    plain = [reference.fit(x, y, batch_size=4096, epochs=e, shuffle=False, verbose=0).history for e in runs]
    state = [np.asarray(v.numpy()) for v in [*planned_model.weights, *slots(planned_model)]]
    twin = [np.asarray(v.numpy()) for v in [*reference.weights, *slots(reference)]]
    return {"before": budget.report.before.peak_bytes, "after": budget.report.after.peak_bytes,
            "budget": budget.report.budget_bytes, "history": planned[0]["loss"], "same_history": planned == plain,
            "plan_kept": all(s is steps[0] for s in steps) and len(steps[0].plans) == 1,
            "same_state": all(np.array_equal(a, b) for a, b in zip(state, twin, strict=True)),
            "unplanned_warnings": [str(w.message) for w in caught if "unplanned" in str(w.message)]}


def keras_fit(budget_mib: float) -> dict[str, Any]:
    """Keras 3: 3 full batches and a partial one, then a second ``fit`` that must keep the plan."""
    return _fit_twins(_compiled_mlp, 3 * 4096 + 100, budget_mib, lambda m: m.optimizer.variables, refit=True)


def keras_evaluate_predict(budget_mib: float, tf_keras: float = 0) -> dict[str, Any]:
    """``MemoryBudget(evaluate=True, predict=True)``: ``fit`` with validation, ``evaluate`` and ``predict``, each
    step planned, against a twin run plainly; Keras 3, or tf_keras when ``tf_keras`` is 1."""
    import tfmem.keras

    rng = np.random.default_rng(0)
    x, xv = rng.random((2 * 4096, 128)).astype(np.float32), rng.random((4096, 128)).astype(np.float32)
    y, yv = rng.integers(0, 10, len(x)).astype(np.int32), rng.integers(0, 10, len(xv)).astype(np.int32)
    compiled = _compiled_tf_keras_mlp if tf_keras else _compiled_mlp
    planned_model, reference = compiled(), compiled()
    budget = tfmem.keras.MemoryBudget(f"{budget_mib}MiB", host=HOST, evaluate=True, predict=True)
    said, planned_by_fit = [], []
    for model, callbacks in ((planned_model, [budget]), (reference, [])):
        history = model.fit(x, y, batch_size=4096, epochs=2, shuffle=False, verbose=0, validation_data=(xv, yv),
                            callbacks=callbacks).history
        if callbacks:
            planned_by_fit = sorted(budget.steps)   # fit's validation ran the planned test step
        evaluated = model.evaluate(xv, yv, batch_size=4096, verbose=0, callbacks=callbacks)
        predicted = model.predict(xv, batch_size=4096, verbose=0, callbacks=callbacks)
        slots = model.optimizer.variables() if tf_keras else model.optimizer.variables
        said.append((history, evaluated, predicted, [np.asarray(v.numpy()) for v in [*model.weights, *slots]]))
    (history, evaluated, predicted, state), (twin_history, twin_evaluated, twin_predicted, twin_state) = said
    return {"planned": sorted(budget.steps), "planned_by_fit": planned_by_fit, "same_history": history == twin_history,
            "val_loss": history["val_loss"], "same_evaluate": evaluated == twin_evaluated,
            "same_predict": bool(np.array_equal(predicted, twin_predicted)),
            "same_state": all(np.array_equal(a, b) for a, b in zip(state, twin_state, strict=True)),
            "placement": {kind: [(n, len(wrong)) for n, wrong in step.placement.values()]
                          for kind, step in budget.steps.items()},
            "train_after": budget.report.after.peak_bytes, "budget": budget.report.budget_bytes}


def _compiled_tf_keras_mlp() -> Any:
    import tf_keras

    tf_keras.utils.set_random_seed(0)
    model = tf_keras.Sequential([tf_keras.Input((128,)),
                                 *(tf_keras.layers.Dense(256, activation="relu") for _ in range(8)),
                                 tf_keras.layers.Dense(10)])
    model.compile(optimizer=tf_keras.optimizers.Adam(), jit_compile=False,
                  loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def tf_keras_fit(budget_mib: float) -> dict[str, Any]:
    """The same with tf_keras (Keras 2) and data the batch size divides: every step is planned."""
    return _fit_twins(_compiled_tf_keras_mlp, 2 * 4096, budget_mib, lambda m: m.optimizer.variables(), refit=False)


def testbed_refusals() -> dict[str, Any]:
    """What ``Testbed.connect`` refuses, each with the fix: a client with oneDNN on, a second testbed in the
    process, and a session run on a connected testbed."""
    from tfmem.errors import BadInputError
    from tfmem.testbed import Testbed

    said: dict[str, Any] = {}
    with Testbed("16MiB") as first, Testbed("16MiB") as second:
        os.environ["TF_ENABLE_ONEDNN_OPTS"] = "1"   # what the check reads; TensorFlow read "0" at import
        try:
            first.connect()
        except BadInputError as e:
            said["onednn"] = str(e)
        os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"   # the fix the message gives
        remote = first.connect()
        with tf.device(remote.device):
            said["fixed"] = float(tf.reduce_sum(tf.ones(8)).numpy())
        for key, call in (("second", second.connect), ("session", lambda: first.run(tf.Graph(), []))):
            try:
                call()
            except BadInputError as e:
                said[key] = str(e)
    return said


class _FitTwins(NamedTuple):
    plain: int
    budget: Any
    planned_model: Any
    reference: Any
    history: Any
    twin: Any

    def summary(self) -> dict[str, Any]:
        """Peaks and whether the budgeted fit ended as plain fit did (history, weights, optimizer slots)."""
        report = self.budget.report
        return {"plain": self.plain, "budget": report.budget_bytes, "before": report.before.peak_bytes,
                "after": report.after.peak_bytes, "same_history": self.history.history == self.twin.history,
                "same_state": all(np.array_equal(a, b) for a, b in zip(
                    _state(self.planned_model, self.planned_model.optimizer),
                    _state(self.reference, self.reference.optimizer), strict=True))}


def _budgeted_fit_twins(built: Callable[[], tuple[Any, np.ndarray, np.ndarray, int]],
                        fraction: float) -> _FitTwins:
    """Two epochs of ``fit`` with ``MemoryBudget`` at ``fraction`` of the plain step's simulated peak, and of plain
    ``fit`` of a twin; ``built`` makes a compiled model and its data, the same each call."""
    import tfmem
    import tfmem.keras
    from tfmem.traced import trace

    probe, x, y, batch = built()   # traced for the plain step's peak, never run
    traced = trace(tf.function(lambda data: probe.train_step(data), jit_compile=False).get_concrete_function(
        (tf.constant(x[:batch]), tf.constant(y[:batch]))))
    plain = tfmem.unoptimized_profile(traced.graph_def, traced.fetches, device=DEVICE, host=HOST).peak_bytes
    planned_model, reference = built()[0], built()[0]
    budget = tfmem.keras.MemoryBudget(int(plain * fraction), device=DEVICE, host=HOST)
    history = planned_model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0, callbacks=[budget])
    twin = reference.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    return _FitTwins(plain, budget, planned_model, reference, history, twin)


def moe_fit(fraction: float) -> dict[str, Any]:
    """A mixture of experts created in host memory (``tfmem.on_host``), ``fit`` with ``MemoryBudget`` at
    ``fraction`` of its plain step's simulated peak, against plain ``fit`` of a twin built alike."""
    import keras

    from models.keras3 import moe

    def built() -> tuple[Any, np.ndarray, np.ndarray, int]:
        keras.utils.set_random_seed(0)
        with tf.device(DEVICE):
            model, x, y, batch = moe(np.random.default_rng(0), HOST, experts=8, hidden=512, width=128, batch=256)
            model.optimizer.build(model.trainable_variables)
        return model, x, y.astype(np.int32), batch

    run = _budgeted_fit_twins(built, fraction)
    budget, report, planned_model = run.budget, run.budget.report, run.planned_model
    plan = next(iter(budget.step.plans.values()))
    nodes = {n.name: n for n in plan.optimized.graph_def.node}
    prefetched = {n.input[0].split(":")[0] for n in nodes.values() if "_tfmem_prefetch" in n.attr}
    experts = {name for name, v in plan.traced.variables.items()   # the weights (Adam's slots are "adam/...")
               if "expert" in v.name and not v.name.startswith("adam")}
    return {**run.summary(),
            "experts_on_host": sorted({v.value.device == HOST for v in planned_model.weights if "expert" in v.path}),
            # expert weights read through a timed prefetch
            "prefetched_experts": len({i.split(":")[0] for n in plan.optimized.graph_def.node if n.name in prefetched
                                       for i in n.input if i.split(":")[0] in experts}),
            # Adam's arithmetic on the experts runs on the host, beside them: their slots are never copied
            "update_on_host": sorted({nodes[c.input[1].split(":")[0]].device == HOST for c in nodes.values()
                                      if c.op == "AssignSubVariableOp" and c.input[0] in experts}),
            "experts": len(experts),
            "notes": [n for p in report.passes if p.changed for n in p.notes]}


def lstm_fit(fraction: float) -> dict[str, Any]:
    """Two stacked Keras 3 LSTM layers, ``fit`` with ``MemoryBudget`` at ``fraction`` of the plain step's
    simulated peak, against plain ``fit`` of a twin. The step's peak is in the second layer's gradient loop, while
    the first layer's forward loop holds its activations in lists for its own gradient loop: only swapping those
    lists (handed from loop to loop) brings it down."""
    import keras

    from models.keras3 import lstm

    def built() -> tuple[Any, np.ndarray, np.ndarray, int]:   # 2 x LSTM(64) over 64 steps, batch 128
        keras.utils.set_random_seed(0)
        model, x, y, batch = lstm(np.random.default_rng(0))
        model.optimizer.build(model.trainable_variables)
        return model, x, y.astype(np.int32), batch   # three batches

    run = _budgeted_fit_twins(built, fraction)
    budget, report = run.budget, run.budget.report
    swapped = [d["tensor"] for p in report.passes if p.changed
               for d in p.details.get("decisions", ()) if d["kind"] == "swap"]  # type: ignore[attr-defined]
    return {**run.summary(),
            "swapped": swapped,
            "placement": [(n, len(wrong)) for n, wrong in budget.step.placement.values()]}


def attention_fit(fraction: float) -> dict[str, Any]:
    """Two Keras 3 self-attention blocks, ``fit`` with ``MemoryBudget`` at ``fraction`` of the plain step's
    simulated peak, against plain ``fit`` of a twin. The runtime folds each layer norm's add tree
    (``x * s + (beta - mean * s)``) into ``(x * s + -mean * s) + beta`` only while no add of it has a control edge
    or another reader: the plan's fences and swaps took that away until split_addn wrote the folded order in."""
    import keras

    from models.keras3 import attention

    def built() -> tuple[Any, np.ndarray, np.ndarray, int]:
        keras.utils.set_random_seed(0)
        with tf.device(DEVICE):
            model, x, y, batch = attention(np.random.default_rng(0))
            model.optimizer.build(model.trainable_variables)
        return model, x, y.astype(np.int32), batch

    run = _budgeted_fit_twins(built, fraction)
    passes = {p.name: p for p in run.budget.report.passes}
    return {**run.summary(), "sums": sorted(passes["split_addn"].details.get("split", {})),  # type: ignore[arg-type]
            "decisions": len(passes["planner"].details.get("decisions", ()))}  # type: ignore[arg-type]


def _testbed_ending(ending: str) -> dict[str, Any]:
    """How a connected measurement ends: a step over the cap (``oom``: reported without TensorFlow's 10 s
    allocation retry), or a device server killed mid-step (``crash``: not a client waiting forever); and
    what a measurement after it says."""
    import signal
    import threading
    import time

    from tfmem.errors import TestbedCrashError, TestbedError
    from tfmem.testbed import Testbed

    said: dict[str, Any] = {}
    with Testbed("16MiB") as testbed:
        remote = testbed.connect()

        @tf.function
        def step(n: Any) -> Any:   # a 32 MiB tensor on a 16 MiB device, or a few seconds of small matmuls
            with tf.device(remote.device):
                if ending == "oom":
                    return tf.reduce_sum(tf.fill((8 * 2**20,), tf.cast(n, tf.float32)))   # not folded
                x = tf.ones((128, 128))
                return tf.reduce_sum(tf.while_loop(lambda i, y: i < n, lambda i, y: (i + 1, tf.tanh(y @ x)),
                                                   (0, x))[1])

        if ending == "crash":
            worker = testbed.pids["worker:0"]
            threading.Timer(2.0, lambda: os.kill(worker, signal.SIGKILL)).start()
        start = time.monotonic()
        try:
            result = remote.measure(lambda: step(tf.constant(10**7)).numpy())
            said = {"oom": result.oom, "error": result.error}
        except TestbedCrashError as e:
            said = {"crash": str(e)}
        said["seconds"] = time.monotonic() - start
        try:
            remote.measure(lambda: None)
        except TestbedError as e:
            said["after"] = str(e)
    return said


def testbed_oom() -> dict[str, Any]:
    return _testbed_ending("oom")


def testbed_crash() -> dict[str, Any]:
    return _testbed_ending("crash")


CASES = {"keras_step": keras_step, "testbed_oom": testbed_oom, "testbed_crash": testbed_crash, "moe_fit": moe_fit, "lstm_fit": lstm_fit, "attention_fit": attention_fit, "testbed_refusals": testbed_refusals, "keras_fit": keras_fit, "keras_evaluate_predict": keras_evaluate_predict,
         "tf_keras_fit": tf_keras_fit}


def main(argv: list[str]) -> int:
    name, *args = argv
    if not name.startswith("testbed"):   # the testbed's device and host are its servers
        _two_cpus()
    print(json.dumps(CASES[name](*(float(a) for a in args))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
