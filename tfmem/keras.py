"""``tfmem.keras.MemoryBudget``: a callback that makes ``model.fit`` train under a device budget (Keras 3 on the
TensorFlow backend, and tf_keras).

    model.fit(x, y, batch_size=64, callbacks=[tfmem.keras.MemoryBudget("6GiB", host="/CPU:0")])

At the start of training it replaces ``model.train_function`` (what ``fit`` calls once per batch) with one that
runs the model's own ``train_step`` through ``tfmem.function``: planned for the first batch's shapes, on the
same variables, so weights, optimizer state and history are those of ``fit`` without it. A partial last batch
runs the step unplanned, with one warning. XLA (``jit_compile``) is not used for the planned step (tfmem plans
the TensorFlow graph XLA would replace); ``steps_per_execution`` above 1 and distribution strategies are refused.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from tfmem.errors import BadInputError
from tfmem.planned_function import PlannedFunction
from tfmem.report import Report


class MemoryBudget(keras.callbacks.Callback):  # type: ignore[misc]
    """Plan each training step of ``fit`` to fit ``budget`` bytes of device memory (see the module docstring)."""

    def __init__(self, budget: int | str, *, host: str | None = None, device: str | None = None,
                 passes: str | Sequence[str] | None = "auto") -> None:
        super().__init__()
        self.budget, self.host, self.device, self.passes = budget, host, device, passes
        self.step: PlannedFunction | None = None
        self._planned_for: Any = None

    @property
    def report(self) -> Report:
        """The plan's report (after the first batch)."""
        if self.step is None:
            raise BadInputError("MemoryBudget has no plan yet: it plans at the first batch of fit()")
        return self.step.report

    # tf_keras's CallbackList asks these of every callback (Keras 3's does not): MemoryBudget works in both.
    _supports_tf_logs = True
    _chief_worker_only = None

    def _implements_train_batch_hooks(self) -> bool:
        return False

    def _implements_test_batch_hooks(self) -> bool:
        return False

    def _implements_predict_batch_hooks(self) -> bool:
        return False

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        model = self.model
        steps = getattr(model, "steps_per_execution", 1)   # tf_keras keeps it in a variable
        steps = int(steps.numpy()) if hasattr(steps, "numpy") else int(steps or 1)
        if steps != 1:
            raise BadInputError(f"MemoryBudget plans one step per call; this model runs {steps} in one loop: "
                                "compile it with steps_per_execution=1")
        if tf.distribute.has_strategy() or model.distribute_strategy is not tf.distribute.get_strategy():
            raise BadInputError("MemoryBudget plans a step on one device; fit() runs under a distribution strategy "
                                "here: build and fit the model outside its scope")
        if getattr(model, "jit_compile", False):
            warnings.warn("MemoryBudget: the planned step runs without XLA (jit_compile): tfmem plans the TensorFlow "
                          "graph that XLA would replace", UserWarning, stacklevel=2)

        # A later fit() keeps the plans while the model trains the same variables with the same optimizer (a
        # recompile or a change of trainable layers makes another step, traced and planned anew).
        key = (id(model), id(model.optimizer), tuple(id(v) for v in model.trainable_variables))
        if self.step is None or self._planned_for != key:
            self.step, self._planned_for = self._planned(model), key
        step = self.step

        def train_function(iterator: Any) -> Any:
            data = iterator.get_next() if hasattr(iterator, "get_next") else next(iter(iterator))
            return step(data)

        model.train_function = train_function

    def _planned(self, model: Any) -> PlannedFunction:
        def train_step(data: Any) -> Any:
            return model.train_step(data)

        original = tf.function(train_step, jit_compile=False)
        return PlannedFunction(original, budget=self.budget, device=self.device, host=self.host, passes=self.passes,
                               inter_op_threads=None, unplanned_hint=(
                                   "To plan every step, give fit a batch size that divides the data, or a tf.data "
                                   "dataset batched with drop_remainder=True."))
