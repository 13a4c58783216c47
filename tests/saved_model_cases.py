"""SavedModels for tests/test_saved_model.py, each case run in a fresh process:
``python -m tests.saved_model_cases CASE ARGS...``.

As in tests/tf2_cases.py, a fresh process splits the CPU into two logical devices before TensorFlow starts, so
that ``/CPU:1`` is a host to swap to (the ``tfmem`` CLI does the same with ``--logical-cpus 2``). Each case
prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

import numpy as np
import tensorflow as tf

DEVICE = "/job:localhost/replica:0/task:0/device:CPU:0"
HOST = "/job:localhost/replica:0/task:0/device:CPU:1"
BATCH, FEATURES, CLASSES = 4096, 128, 10


def _two_cpus() -> None:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)


def _trainer() -> tf.Module:
    """A Keras 3 MLP (8 layers of 256) with Adam in a ``tf.Module``: a training step saved with a fully defined
    input signature, and functions the CLI must refuse (unknown batch, never traced, XLA)."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((FEATURES,)),
                              *(keras.layers.Dense(256, activation="relu") for _ in range(8)),
                              keras.layers.Dense(CLASSES)])
    optimizer = keras.optimizers.Adam()
    optimizer.build(model.trainable_variables)   # its slots exist before the step is traced
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    module = tf.Module()
    module.model, module.optimizer = model, optimizer

    @tf.function(input_signature=[tf.TensorSpec((BATCH, FEATURES), tf.float32), tf.TensorSpec((BATCH,), tf.int32)])
    def train_step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return {"loss": loss}

    @tf.function(input_signature=[tf.TensorSpec((None, FEATURES), tf.float32)])
    def predict(x: Any) -> Any:
        return model(x)

    module.train_step, module.predict = train_step, predict
    module.untraced = tf.function(lambda x: x * 2.0)
    module.xla_step = tf.function(lambda x: tf.reduce_sum(x * x), jit_compile=True,
                                  input_signature=[tf.TensorSpec((4,), tf.float32)])
    return module


def build(path: str) -> dict[str, Any]:
    """Save the trainer (``serving_default``: ``predict``) to ``path``."""
    module = _trainer()
    tf.saved_model.save(module, path, signatures={"serving_default": module.predict})
    return {"saved": path}


def _data(steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((BATCH, FEATURES)).astype(np.float32),
             rng.integers(0, CLASSES, BATCH).astype(np.int32)) for _ in range(steps)]


def _variables(loaded: Any) -> list[np.ndarray]:
    """Every variable of a loaded SavedModel, in its object graph's order (the same for both SavedModels)."""
    seen: dict[int, np.ndarray] = {}
    for obj in tf.train.TrackableView(loaded).descendants():
        if isinstance(obj, tf.Variable) and id(obj) not in seen:
            seen[id(obj)] = np.asarray(obj.numpy())
    return list(seen.values())


def train(source: str, planned: str, steps: str) -> dict[str, Any]:
    """Load both SavedModels, run ``steps`` training steps of each on the same data, compare losses and variables;
    also the simulated peak of each loaded step (the planned one must be the plan, not the original)."""
    import tfmem
    from tfmem.traced import trace

    data = _data(int(steps))
    result: dict[str, Any] = {}
    runs = {}
    for name, path in (("source", source), ("planned", planned)):
        loaded = tf.saved_model.load(path)
        losses = [loaded.train_step(x, y)["loss"].numpy() for x, y in data]
        traced = trace(loaded.train_step.concrete_functions[0])
        result[f"{name}_peak"] = tfmem.unoptimized_profile(traced.graph_def, traced.fetches, device=DEVICE,
                                                           host=HOST).peak_bytes
        result[f"{name}_on_host"] = sum(n.device == HOST for n in traced.graph_def.node)
        result[f"{name}_tfmem_ops"] = sum("tfmem" in n.name for n in traced.graph_def.node)
        result[f"{name}_signatures"] = sorted(loaded.signatures)
        runs[name] = (losses, _variables(loaded))
    (losses, state), (planned_losses, planned_state) = runs["source"], runs["planned"]
    result["losses"] = [float(v) for v in losses]
    result["same_losses"] = bool(np.array_equal(losses, planned_losses))
    result["variables"] = len(state)
    result["same_state"] = len(state) == len(planned_state) and all(
        np.array_equal(a, b) for a, b in zip(state, planned_state, strict=True))
    result["state_changed"] = not all(np.array_equal(a, b) for a, b in zip(state, _variables(
        tf.saved_model.load(source)), strict=True))
    return result


CASES = {"build": build, "train": train}


def main(argv: list[str]) -> int:
    _two_cpus()
    name, *args = argv
    print(json.dumps(CASES[name](*args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
