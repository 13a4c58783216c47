"""The simulator against the testbed's measured device peak (one inter-op thread): within +-10%.

The allocator's state carries over between runs in one device process (fragmentation), and one graph's
measured peak still varies by a few percent between runs, so each graph gets a fresh testbed and three
runs, and the simulator is compared with their median.
"""

from __future__ import annotations

import statistics

import pytest

from tfmem import examples
from tfmem.memsim import simulate
from tfmem.testbed import Testbed

pytestmark = pytest.mark.testbed

CASES = {
    "mlp-sgd": lambda: examples.mlp(batch=64, dims=(784, 1024, 1024, 10)),
    "conv-residual-branches": lambda: examples.residual_convnet(batch=8, size=32, channels=32, blocks=3),
    "wide-16-branches": lambda: examples.wide_branches(branches=16, elems=1 << 18),
    "unrolled-rnn": lambda: examples.unrolled_rnn(steps=16, batch=32, hidden=256),
    "moe-fan-out": lambda: examples.moe_layer(experts=8, batch=256),
}


# Known gap, kept visible: with Adam the measured peak runs ~12% above the simulator's (copies of slot
# buffers that share one zeros constant after initialisation are not modelled yet).
CASES_WITH_GAPS = {
    "mlp-adam": lambda: examples.mlp(batch=128, dims=(512, 1024, 1024, 1024, 10), optimizer="adam"),
}


@pytest.mark.parametrize("name", [
    *sorted(CASES),
    *(pytest.param(n, marks=pytest.mark.xfail(reason="Adam slot copies not modelled", strict=False))
      for n in sorted(CASES_WITH_GAPS)),
])
def test_simulated_peak_within_ten_percent(name):
    built = {**CASES, **CASES_WITH_GAPS}[name]()
    with Testbed("2GiB", inter_op_threads=1, intra_op_threads=1) as testbed:
        runs = [testbed.run(built.graph, built.fetches, built.feeds, steps=1) for _ in range(3)]
    assert not any(r.oom for r in runs), [r.error for r in runs]
    measured = statistics.median(r.device_peak_bytes for r in runs)
    simulated = simulate(built.graph, built.fetches).peak_bytes
    assert abs(simulated - measured) <= 0.10 * measured, (name, simulated, measured)
