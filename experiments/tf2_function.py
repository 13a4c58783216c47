"""A custom training loop of the Keras 3 models on the testbed: the step a ``tf.function``, and a
``tfmem.function`` at budgets plain runs out of memory at (issue 33). The measurements of ``experiments.tf2_keras``
for ``model.fit``, here for a ``GradientTape`` step a user writes; results in ``tf2_function.md``.

    python -m experiments.tf2_function            # = python -m experiments.tf2_keras --step function
"""

from __future__ import annotations

import sys

from experiments import tf2_keras


def main(argv: list[str] | None = None) -> int:
    return tf2_keras.main(["--step", "function", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
