"""``tfmem.function``: a TF2 step (a ``tf.function`` or a plain Python function) planned to fit a device budget.

    step = tfmem.function(train_step, budget="6GiB", host="/CPU:0")
    for x, y in batches:
        loss = step(x, y)          # reads and updates the same tf.Variables the original step does

The first call traces the step for its arguments' shapes and dtypes (``PlannedFunction.plan`` plans more
ahead of time), flattens the traced graph (``tfmem.traced``), plans it with ``tfmem.optimize`` and
rebuilds a function on the same variables. A later call with arguments of another signature (a partial last
batch) runs the original step, with one warning. ``.report`` and ``.concrete_function`` say what was done.
Variables stay where they were created (a TF2 variable cannot move); activations go to ``host``.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from tfmem.errors import BadInputError
from tfmem.ir.devices import same_device
from tfmem.optimizer import Optimized, optimize
from tfmem.placement_check import Misplaced, call_collecting, misplaced
from tfmem.report import Report
from tfmem.traced import TracedStep, rebuild, trace

Signature = tuple[Any, ...]


@dataclass(frozen=True)
class Plan:
    """One planned signature: the traced step, what ``optimize`` made of it and the rebuilt function."""

    traced: TracedStep
    optimized: Optimized
    concrete_function: Any


class PlannedFunction:
    """A step planned per input signature; call it as the step itself. See ``tfmem.function``."""

    def __init__(self, step: Callable[..., Any], *, budget: int | str, device: str | None, host: str | None,
                 passes: str | Sequence[str] | None, inter_op_threads: int | None, unplanned_hint: str = "") -> None:
        python = getattr(step, "python_function", step)
        if not callable(python):
            raise BadInputError(f"tfmem.function needs a callable step, got {type(step).__name__}")
        self._original = step if hasattr(step, "get_concrete_function") else tf.function(step)
        self._signature = inspect.signature(python)
        for name, value in (("device", device), ("host", host)):
            if value is not None:
                check_exists(value, name)
        self._budget, self._device, self._host = budget, device or default_device(), host
        self._passes, self._threads = passes, inter_op_threads
        self._plans: dict[Signature, Plan] = {}
        self._placement: dict[Signature, tuple[int, list[Misplaced]]] = {}
        self._warned = False
        self._hint = unplanned_hint
        self.__name__ = getattr(python, "__name__", "step")
        self.__doc__ = getattr(python, "__doc__", None)

    @property
    def plans(self) -> dict[Signature, Plan]:
        """The planned signatures (shapes and dtypes of the tensor arguments, values of the others)."""
        return dict(self._plans)

    @property
    def report(self) -> Report:
        """The report of the first plan (``plans`` has one per signature)."""
        return self._first().optimized.report

    @property
    def concrete_function(self) -> Any:
        """The rebuilt function of the first plan: flat tensor arguments in, flat outputs out."""
        return self._first().concrete_function

    @property
    def placement(self) -> dict[Signature, tuple[int, list[Misplaced]]]:
        """Per planned signature that ran: how many placed ops were checked at its first call, and those that
        ran on another device than planned (``tfmem.placement_check``)."""
        return dict(self._placement)

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """Trace and plan the step for these arguments' signature now (a no-op when it is planned already).

        Raises ``InfeasibleBudgetError`` when the budget cannot be met, with the lower bound.
        """
        values = self._bound(args, kwargs)
        key = signature_of(values)
        if key not in self._plans:
            concrete = self._original.get_concrete_function(*args, **kwargs)
            check_arguments(values, concrete, self.__name__)
            traced = trace(concrete)
            threads = self._threads or tf.config.threading.get_inter_op_parallelism_threads() or None
            optimized = optimize(traced.graph_def, traced.fetches, budget=self._budget, device=self._device,
                                 host=self._host, passes=self._passes, inter_op_threads=threads)
            check_config(optimized)
            placed = place_unplaced(optimized.graph_def, self._device, set(traced.inputs))
            self._plans[key] = Plan(traced, optimized, rebuild(traced, placed))
        return self._plans[key]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        values = self._bound(args, kwargs)
        key = signature_of(values)
        plan = self._plans.get(key)
        if plan is None and not self._plans:
            plan = self.plan(*args, **kwargs)
        if plan is None:
            if not self._warned:
                self._warned = True
                warnings.warn(f"tfmem.function: {self.__name__} was planned for "
                              f"{describe(next(iter(self._plans)))}, not {describe(key)}; this call "
                              "and others like it run the step unplanned (it may not fit the budget). "
                              + (self._hint or f"Plan them too with {self.__name__}.plan(...) before the loop."),
                              UserWarning, stacklevel=2)
            return self._original(*args, **kwargs)
        tensors = [tf.convert_to_tensor(v) for v in tf.nest.flatten(values, expand_composites=True)
                   if is_tensor_like(v)]
        if key in self._placement or not tf.executing_eagerly():   # traced into another function: nothing runs
            flat = plan.concrete_function(*tensors)
        else:
            flat, metadata = call_collecting(lambda: plan.concrete_function(*tensors))
            self._placement[key] = misplaced(plan.concrete_function.graph.as_graph_def(), metadata)
            _warn_misplaced(self.__name__, self._placement[key][1])
        flat = flat[:len(plan.traced.outputs)]   # then the updates' (None)
        if plan.traced.structured_outputs is None:
            return None
        return tf.nest.pack_sequence_as(plan.traced.structured_outputs, list(flat), expand_composites=True)

    def _bound(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as e:
            raise BadInputError(f"{self.__name__}{self._signature}: {e}") from None
        bound.apply_defaults()
        return list(bound.arguments.values())

    def _first(self) -> Plan:
        if not self._plans:
            raise BadInputError(f"{self.__name__} has no plan yet: call it, or call {self.__name__}.plan(...) with "
                                "example arguments")
        return next(iter(self._plans.values()))


def function(step: Callable[..., Any] | None = None, *, budget: int | str, device: str | None = None,
             host: str | None = None, passes: str | Sequence[str] | None = "auto",
             inter_op_threads: int | None = None) -> Any:
    """Plan a TF2 step to run within ``budget`` bytes of device memory; use as a decorator or a call.

    Parameters are ``tfmem.optimize``'s: ``device`` is where the step's unplaced ops run (default: the first GPU,
    else the CPU), ``host`` where activations may be swapped (default: none, so nothing is swapped).

    Examples
    --------
    >>> import tensorflow as tf
    >>> v = tf.Variable(tf.zeros((256, 256)))
    >>> @function(budget="64MiB")
    ... def step(x):
    ...     v.assign_add(tf.matmul(x, x))
    ...     return tf.reduce_sum(v)
    >>> float(step(tf.ones((256, 256))))
    16777216.0
    >>> step.report.after.peak_bytes <= 64 * 2**20
    True
    """
    def wrap(fn: Callable[..., Any]) -> PlannedFunction:
        return PlannedFunction(fn, budget=budget, device=device, host=host, passes=passes,
                               inter_op_threads=inter_op_threads)

    return wrap if step is None else wrap(step)


def _warn_misplaced(name: str, wrong: list[Misplaced]) -> None:
    if wrong:
        first = wrong[0]
        warnings.warn(f"tfmem.function: {len(wrong)} op(s) of {name}'s plan ran on another device than planned "
                      f"(TensorFlow's soft placement), e.g. {first.op} planned on {first.planned} ran on "
                      f"{first.ran_on}: the plan's memory figures do not hold for this step. Plan for devices that "
                      "have kernels for the step's ops (PlannedFunction.placement lists them all)",
                      UserWarning, stacklevel=3)


def check_arguments(values: list[Any], concrete: Any, name: str) -> None:
    """Refuse arguments whose tensors do not line up with the traced function's inputs one by one (a call passes
    them flat, in this order): a mismatch would otherwise feed one argument's tensor to another's input."""
    given = [(tuple(v.shape), tf.as_dtype(v.dtype)) for v in tf.nest.flatten(values, expand_composites=True)
             if is_tensor_like(v)]
    inputs = concrete.inputs[:len(concrete.inputs) - len(concrete.captured_inputs)]
    wanted = [(tuple(t.shape), t.dtype) for t in inputs]
    if given != wanted:
        raise BadInputError(f"{name}'s arguments give tensors {given} where its traced function takes {wanted}; pass "
                            "its changing values as tensors or arrays, positionally or by name")


def check_config(optimized: Optimized) -> None:
    """Refuse a plan that needs a session setting a TF2 call cannot take per call (TF2 sets them per process).

    ``optimize`` asks for one inter-op thread where the graph fits as it is only so, and for Grappler off where
    Grappler fails on the graph (the session then runs it unrewritten).
    """
    config = optimized.config
    if config.inter_op_parallelism_threads == 1 and tf.config.threading.get_inter_op_parallelism_threads() != 1:
        raise BadInputError("the step fits the budget only with one inter-op thread, which TF2 sets per process: "
                            "call tf.config.threading.set_inter_op_parallelism_threads(1) before TensorFlow starts")
    if config.graph_options.rewrite_options.disable_meta_optimizer:
        raise BadInputError("Grappler fails on this step, so its plan must run without Grappler, which TF2 sets per "
                            "process: call tf.config.optimizer.set_experimental_options({'disable_meta_optimizer': "
                            "True}) before the first call")


def check_exists(name: str, what: str) -> None:
    """Raise when TensorFlow has no device ``name``: a function's ops soft-place elsewhere without a word, and a
    plan's copies to a host that does not exist would stay on the device."""
    known = [d.name for d in tf.config.list_logical_devices()]
    try:
        found = any(same_device(name, d) for d in known)
    except ValueError:
        found = False
    if not found:
        raise BadInputError(f"{what}={name!r} is not a device TensorFlow has here; pass one of {', '.join(known)}")


def place_unplaced(graph_def: graph_pb2.GraphDef, device: str, arguments: set[str]) -> graph_pb2.GraphDef:
    """A copy of ``graph_def`` with each unplaced op but the arguments on ``device``, where the plan simulated it:
    left unplaced, a function's ops run on the caller's default device (a client's CPU when the device is remote,
    tests/test_demo.py, the Keras demo). Arguments stay where the caller's tensors are."""
    out = graph_pb2.GraphDef()
    out.CopyFrom(graph_def)
    names = {a.split(":")[0] for a in arguments}
    for node in out.node:
        if not node.device and node.name not in names:
            node.device = device
    return out


def default_device() -> str:
    """Where TensorFlow places a function's unplaced ops: the first GPU, else the first CPU."""
    kind = "GPU" if tf.config.list_logical_devices("GPU") else "CPU"
    return f"/job:localhost/replica:0/task:0/device:{kind}:0"


def is_tensor_like(value: Any) -> bool:
    return isinstance(value, (tf.Tensor, np.ndarray, np.generic, tf.Variable)) or tf.is_tensor(value)


def signature_of(values: list[Any]) -> Signature:
    """The key a plan is kept under: each tensor argument's shape and dtype, each other argument's value."""
    key: list[tuple[Any, ...]] = []
    for leaf in tf.nest.flatten(values, expand_composites=True):
        if is_tensor_like(leaf):
            key.append(("tensor", tuple(leaf.shape), tf.as_dtype(leaf.dtype).name))
        else:
            key.append(("value", repr(leaf)))
    return tuple(key)


def describe(key: Signature) -> str:
    return "(" + ", ".join(f"{k[2]}{list(k[1])}" if k[0] == "tensor" else k[1] for k in key) + ")"
