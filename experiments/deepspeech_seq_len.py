"""Benchmark: the largest sequence length of the unrolled DeepSpeech RNN that trains under a fixed testbed budget, vanilla TensorFlow vs tfmem.

TensorFlowMem's table under its own name: ``experiments.max_size`` restricted to ``deepspeech``
(see that module for the search, the probes and the results files it writes). Any other argument is passed on.

    python -m experiments.deepspeech_seq_len              # full size
    python -m experiments.deepspeech_seq_len --tiny       # CI smoke run
"""

from __future__ import annotations

import sys

from experiments import max_size

FAMILIES = ["deepspeech"]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    return max_size.main(args, default_families=FAMILIES)


if __name__ == "__main__":
    raise SystemExit(main())
