"""Plan a SavedModel's function to fit a device budget and save a new SavedModel that runs the plan.

    tfmem optimize saved/ --function train_step --budget 6GiB --host /CPU:0 -o saved_planned/

``optimize_saved_model`` loads the SavedModel, plans each concrete function of the named function (a
``tf.function`` saved with an ``input_signature`` has one) as ``tfmem.function`` plans a step, and saves the
loaded object again with that function replaced by a ``tf.function`` that runs the planned graphs. The
new function captures the loaded variables, so the new SavedModel's checkpoint holds the same values; the
source's other attributes and signatures are saved as they were. The plan's device strings are saved in the
graph: load the new SavedModel where ``host`` exists (TensorFlow soft-places an op on a missing device, and a
copy to a host that is not there would stay on the device).
"""

from __future__ import annotations

import inspect
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tensorflow as tf

from tfmem.errors import BadInputError, MalformedGraphError, first_line
from tfmem.planned_function import Plan, PlannedFunction, check_exists, function
from tfmem.report import Report

SAVED_MODEL_FILES = ("saved_model.pb", "saved_model.pbtxt")


@dataclass(frozen=True)
class PlannedSavedModel:
    """What ``optimize_saved_model`` wrote: the new SavedModel's directory and one plan per concrete function."""

    out_dir: str
    function_name: str
    signatures: tuple[str, ...]    # each planned concrete function's arguments, e.g. "(x: float32[64, 784])"
    plans: tuple[Plan, ...]        # in the same order

    @property
    def reports(self) -> tuple[Report, ...]:
        return tuple(p.optimized.report for p in self.plans)


def is_saved_model(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding a SavedModel (``saved_model.pb`` or ``.pbtxt``)."""
    p = Path(path)
    return p.is_dir() and any((p / name).is_file() for name in SAVED_MODEL_FILES)


def optimize_saved_model(src_dir: str | Path, function_name: str, out_dir: str | Path, *, budget: int | str,
                         device: str | None = None, host: str | None = None,
                         passes: str | Sequence[str] | None = "auto",
                         inter_op_threads: int | None = None) -> PlannedSavedModel:
    """Plan the function ``function_name`` of the SavedModel in ``src_dir`` and save the result to ``out_dir``.

    Parameters
    ----------
    src_dir : a SavedModel directory (``tf.saved_model.save``)
    function_name : an attribute of the loaded object (``train_step``), a dotted path to one
        (``trainer.train_step``), or a key of its ``signatures``; its concrete functions must have fully
        defined input shapes (save it with ``@tf.function(input_signature=[...])``)
    out_dir : where to write the new SavedModel; it must not exist or be empty
    budget, device, host, passes, inter_op_threads : as for ``tfmem.function``; ``device`` and ``host`` must be
        devices of this process (``host`` is where activations may be swapped; without it nothing is)

    Returns
    -------
    PlannedSavedModel
        The output directory, and the plan (with its report) of each concrete function.

    Raises
    ------
    BadInputError
        For a missing directory or one without a SavedModel, an unknown function (the message lists them), a
        function without fully defined concrete signatures, an XLA-compiled function, a non-empty ``out_dir``,
        or a device this process does not have.
    InfeasibleBudgetError
        When a concrete function cannot be planned within ``budget``, with the lower bound.

    Examples
    --------
    >>> import tempfile, tensorflow as tf
    >>> module = tf.Module()
    >>> module.v = tf.Variable(tf.ones((256, 256)))
    >>> @tf.function(input_signature=[tf.TensorSpec((256, 256), tf.float32)])
    ... def step(x):
    ...     module.v.assign_add(tf.matmul(x, x))
    ...     return tf.reduce_sum(module.v)
    >>> module.step = step
    >>> src, out = tempfile.mkdtemp(), tempfile.mkdtemp()
    >>> tf.saved_model.save(module, src)
    >>> planned = optimize_saved_model(src, "step", out, budget="64MiB")
    >>> planned.signatures
    ('(x: float32[256, 256])',)
    >>> loaded = tf.saved_model.load(out)      # kept: its function does not keep the variables alive
    >>> float(loaded.step(tf.ones((256, 256))))
    16842752.0
    """
    src, out = _check_directories(src_dir, out_dir)
    for name, value in (("device", device), ("host", host)):
        if value is not None:
            check_exists(value, name)
    loaded = _load(src)
    owner, attribute, target = _find(loaded, function_name)
    concretes = _concrete_functions(target, function_name)
    planned = function(target, budget=budget, device=device, host=host, passes=passes,
                       inter_op_threads=inter_op_threads)
    plans = []
    for concrete in concretes:
        args, kwargs = _examples(concrete)
        plans.append(planned.plan(*args, **kwargs))
    replacement = _planned_tf_function(planned, target, concretes)
    signatures = dict(getattr(loaded, "signatures", {}))   # saved again only when given
    if owner is None:   # a signature: this one planned
        signatures[attribute] = replacement.get_concrete_function(**concretes[0].structured_input_signature[1])
    else:
        setattr(owner, attribute, replacement)
    _save(loaded, out, signatures)
    return PlannedSavedModel(str(out), function_name, tuple(describe_inputs(c) for c in concretes),
                             tuple(plans))


def describe_inputs(concrete: Any) -> str:
    """A concrete function's arguments in one line, e.g. ``(x: float32[64, 784], y: int32[64])``."""
    args, kwargs = concrete.structured_input_signature
    names = [p.name for p in concrete.function_type.parameters.values()]
    parts = []
    for name, value in [*zip(names, args, strict=False), *sorted(kwargs.items())]:
        leaves = tf.nest.flatten(value, expand_composites=True)
        shown = ", ".join(f"{s.dtype.name}{s.shape.as_list() if s.shape.rank is not None else '[...]'}"
                          if isinstance(s, tf.TensorSpec) else repr(s) for s in leaves)
        parts.append(f"{name}: {shown}" if len(leaves) == 1 else f"{name}: ({shown})")
    return "(" + ", ".join(parts) + ")"


def _check_directories(src_dir: str | Path, out_dir: str | Path | None) -> tuple[Path, Path]:
    src, out = Path(src_dir), Path(out_dir if out_dir is not None else src_dir)
    if not src.exists():
        raise BadInputError(f"SavedModel directory {str(src)!r} does not exist")
    if not is_saved_model(src):
        raise BadInputError(f"{str(src)!r} is not a SavedModel directory (it has no saved_model.pb); write one "
                            "with tf.saved_model.save(obj, path)")
    if out_dir is not None and out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BadInputError(f"output {str(out)!r} exists and is not an empty directory; choose another -o "
                            "(tfmem does not overwrite a SavedModel)")
    return src, out


def _load(src: Path) -> Any:
    try:
        return tf.saved_model.load(str(src))
    except Exception as e:   # TensorFlow raises many types for an unreadable SavedModel
        raise BadInputError(f"TensorFlow cannot load the SavedModel in {str(src)!r}: {first_line(e)}") from e


def _find(loaded: Any, name: str) -> tuple[Any | None, str, Any]:
    """The object holding the function (None for a signature), its attribute or signature key, the function."""
    owner, parts = loaded, name.split(".")
    for part in parts[:-1]:
        owner = getattr(owner, part, None) if part and not part.startswith("_") else None
    target = getattr(owner, parts[-1], None) if owner is not None and not parts[-1].startswith("_") else None
    if _is_function(target):
        return owner, parts[-1], target
    signatures = getattr(loaded, "signatures", {})
    if name in signatures:
        return None, name, signatures[name]
    known = ", ".join(function_names(loaded)) or "none"
    raise BadInputError(f"the SavedModel has no function {name!r}; its functions and signatures: {known}")


def saved_model_functions(src_dir: str | Path) -> list[str]:
    """The names ``optimize_saved_model`` takes for the SavedModel in ``src_dir`` (see ``function_names``)."""
    src, _ = _check_directories(src_dir, None)
    return function_names(_load(src))


def function_names(loaded: Any) -> list[str]:
    """The functions of a loaded SavedModel ``optimize_saved_model`` can name: attributes of the root and of its
    attributes (dotted), then signature keys."""
    names = []
    for attr, value in _public(loaded):
        if _is_function(value):
            names.append(attr)
        elif not callable(value):
            names += [f"{attr}.{a}" for a, v in _public(value) if _is_function(v)]
    signatures = getattr(loaded, "signatures", {})
    return names + [f"{key} (signature)" for key in signatures]


def _public(obj: Any) -> list[tuple[str, Any]]:
    try:
        items = sorted(vars(obj).items())
    except TypeError:
        return []
    return [(k, v) for k, v in items if not k.startswith("_") and k != "signatures"]


def _is_function(value: Any) -> bool:
    return hasattr(value, "concrete_functions") or isinstance(value, tf.types.experimental.ConcreteFunction)


def _concrete_functions(target: Any, name: str) -> list[Any]:
    """The concrete functions to plan; each must have fully known input shapes."""
    concretes = list(getattr(target, "concrete_functions", None) or [target] * isinstance(
        target, tf.types.experimental.ConcreteFunction))
    if not concretes:
        raise BadInputError(f"{name} was saved without a concrete function (never traced): save it with "
                            "@tf.function(input_signature=[tf.TensorSpec(shape, dtype), ...])")
    unknown = [describe_inputs(c) for c in concretes if not all(
        s.shape.is_fully_defined() for s in tf.nest.flatten(c.structured_input_signature, expand_composites=True)
        if isinstance(s, tf.TensorSpec))]
    if unknown:
        raise BadInputError(f"{name} has inputs of unknown shape, which tfmem cannot size: {'; '.join(unknown)}; "
                            "save it with a fully defined @tf.function(input_signature=[...]) (e.g. the batch size "
                            "given)")
    return concretes


def _examples(concrete: Any) -> tuple[list[Any], dict[str, Any]]:
    """Arguments of ``concrete``'s signature to plan it with: zeros for tensors (on the CPU; only their shapes
    and dtypes matter), Python values as they are."""
    def example(spec: Any) -> Any:
        return tf.zeros(spec.shape, spec.dtype) if isinstance(spec, tf.TensorSpec) else spec

    args, kwargs = concrete.structured_input_signature
    with tf.device("/CPU:0"):
        return (tf.nest.map_structure(example, list(args)),
                tf.nest.map_structure(example, dict(kwargs)))


def _planned_tf_function(planned: PlannedFunction, target: Any, concretes: list[Any]) -> Any:
    """A ``tf.function`` with ``target``'s parameters that calls the plan of each of its concrete functions."""
    def body(*args: Any, **kwargs: Any) -> Any:
        return planned(*args, **kwargs)

    kind = target.function_type if hasattr(target, "concrete_functions") else concretes[0].function_type
    body.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(p.name, p.kind) for p in kind.parameters.values()])
    body.__name__ = getattr(planned, "__name__", "step")
    input_signature = getattr(target, "input_signature", None)
    wrapped = tf.function(body, input_signature=input_signature)
    if input_signature is None:
        for concrete in concretes:
            args, kwargs = concrete.structured_input_signature
            wrapped.get_concrete_function(*args, **kwargs)
    return wrapped


def _save(loaded: Any, out: Path, signatures: dict[str, Any]) -> None:
    existed = out.exists()
    try:
        tf.saved_model.save(loaded, str(out), signatures=signatures or None)
    except Exception as e:
        if not existed:
            shutil.rmtree(out, ignore_errors=True)
        raise MalformedGraphError(f"TensorFlow cannot save the planned SavedModel to {str(out)!r}: "
                                  f"{first_line(e)}") from e
