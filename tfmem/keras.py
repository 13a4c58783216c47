"""``tfmem.keras.MemoryBudget``: a callback that makes ``model.fit`` train under a device budget (Keras 3 on the
TensorFlow backend, and tf_keras).

    model.fit(x, y, batch_size=64, callbacks=[tfmem.keras.MemoryBudget("6GiB", host="/CPU:0")])

At the start of training it replaces ``model.train_function`` (what ``fit`` calls once per batch) with one that
runs the model's own ``train_step`` through ``tfmem.function`` (and, when asked, ``test_function`` and
``predict_function`` with ``test_step`` and ``predict_step``): planned for the first batch's shapes, on the
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
    """Plan each training step of ``fit`` to fit ``budget`` bytes of device memory (see the module docstring).

    With ``evaluate=True`` (``predict=True``) the steps of ``evaluate`` (``predict``) with this callback, and the
    validation of ``fit``, are planned to the same budget as well.
    """

    def __init__(self, budget: int | str, *, host: str | None = None, device: str | None = None,
                 passes: str | Sequence[str] | None = "auto", evaluate: bool = False, predict: bool = False) -> None:
        super().__init__()
        self.budget, self.host, self.device, self.passes = budget, host, device, passes
        self.evaluate, self.predict = evaluate, predict
        self.steps: dict[str, PlannedFunction] = {}   # "train", "test", "predict"
        self._planned_for: dict[str, Any] = {}

    @property
    def step(self) -> PlannedFunction | None:
        """The planned training step (after the first batch of ``fit``)."""
        return self.steps.get("train")

    @property
    def report(self) -> Report:
        """The training step's plan report (after the first batch)."""
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
        self._check(model)
        if getattr(model, "jit_compile", False):
            warnings.warn("MemoryBudget: the planned step runs without XLA (jit_compile): tfmem plans the TensorFlow "
                          "graph that XLA would replace", UserWarning, stacklevel=2)
        step = self._planned("train", model.train_step)

        def train_function(iterator: Any) -> Any:
            data = iterator.get_next() if hasattr(iterator, "get_next") else next(iter(iterator))
            return step(data)

        model.train_function = train_function

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        # tf_keras's evaluate and predict take the model's function before on_test_begin/on_predict_begin, Keras
        # 3's after: installed here (each plans at its first call) and again there, both see the planned one.
        self._install_test_and_predict()

    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._install_test_and_predict()

    def on_predict_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._install_test_and_predict()

    def _install_test_and_predict(self) -> None:
        model = self.model
        if model is None:
            return

        def test_function(iterator: Any) -> Any:
            data = iterator.get_next() if hasattr(iterator, "get_next") else next(iter(iterator))
            return self._planned("test", model.test_step)(data)

        def predict_function(data: Any) -> Any:
            if hasattr(data, "get_next"):   # tf_keras hands it the iterator
                data = data.get_next()
            elif isinstance(data, list) and len(data) == 1:   # Keras 3 a list of steps_per_execution batches
                data = data[0]
            return self._planned("predict", model.predict_step)(data)

        # (once per callback: a function this callback installed stays, with the plans it made)
        if self.evaluate and getattr(model.test_function, "_tfmem_owner", None) is not self:
            test_function._tfmem_owner = self  # type: ignore[attr-defined]
            model.test_function = test_function
        if self.predict and getattr(model.predict_function, "_tfmem_owner", None) is not self:
            predict_function._tfmem_owner = self  # type: ignore[attr-defined]
            model.predict_function = predict_function

    def _check(self, model: Any) -> None:
        steps = getattr(model, "steps_per_execution", 1)   # tf_keras keeps it in a variable
        steps = int(steps.numpy()) if hasattr(steps, "numpy") else int(steps or 1)
        if steps != 1:
            raise BadInputError(f"MemoryBudget plans one step per call; this model runs {steps} in one loop: "
                                "compile it with steps_per_execution=1")
        if tf.distribute.has_strategy() or model.distribute_strategy is not tf.distribute.get_strategy():
            raise BadInputError("MemoryBudget plans a step on one device; fit() runs under a distribution strategy "
                                "here: build and fit the model outside its scope")

    def _planned(self, kind: str, model_step: Any) -> PlannedFunction:
        """The planned ``kind`` step. A later call keeps the plans while the model has the same variables and
        optimizer (a recompile or a change of trainable layers makes another step, traced and planned anew)."""
        model = self.model
        key = (id(model), id(getattr(model, "optimizer", None)), tuple(id(v) for v in model.trainable_variables))
        if kind not in self.steps or self._planned_for.get(kind) != key:
            self._check(model)
            def step(data: Any) -> Any:
                return model_step(data)

            step.__name__ = f"{kind}_step"
            original = tf.function(step, jit_compile=False)
            self.steps[kind] = PlannedFunction(
                original, budget=self.budget, device=self.device, host=self.host, passes=self.passes,
                inter_op_threads=None, unplanned_hint=(
                    "To plan every step, give a batch size that divides the data, or a tf.data dataset batched "
                    "with drop_remainder=True."))
            self._planned_for[kind] = key
        return self.steps[kind]
