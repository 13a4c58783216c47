"""Benchmark: the largest ResNet depth at batch 16 and at batch 32 that trains under a fixed testbed budget, vanilla TensorFlow vs tfmem.

TensorFlowMem's table under its own name: ``experiments.max_size`` restricted to ``resnet16`` and ``resnet32``
(see that module for the search, the probes and the results files it writes). Any other argument is passed on.

    python -m experiments.max_resnet_depth              # full size
    python -m experiments.max_resnet_depth --tiny       # CI smoke run
"""

from __future__ import annotations

import sys

from experiments import max_size

FAMILIES = ["resnet16", "resnet32"]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    return max_size.main(args, default_families=FAMILIES)


if __name__ == "__main__":
    raise SystemExit(main())
