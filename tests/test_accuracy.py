"""The simulator against the testbed's measured device peak (one inter-op thread): within +-10%.

One graph's measured peak can vary between runs: TF times each op and runs cheap ones inline, so ops near
that threshold change the order from run to run (a small RNN measured 6.1-7.2 MiB, an Adam MLP 36.5 or
42.0 MiB over five runs). Each graph runs five times; the simulator must be within 10% of the median, or
within 2% of one of the runs (it then reproduces an order TF really took). The testbed reserves its budget
up front, so peaks do not depend on the graphs run before. experiments/simulator_accuracy.py writes the
same comparison, with every run, to experiments/results/.
"""

from __future__ import annotations

import statistics

import numpy as np
import pytest
import tensorflow as tf

from tfmem import examples
from tfmem.sim.memsim import simulate
from tfmem.testbed import Testbed

pytestmark = pytest.mark.testbed

CASES = {
    "mlp-sgd": lambda: examples.mlp(batch=64, dims=(784, 1024, 1024, 10)),
    "mlp-adam": lambda: examples.mlp(batch=128, dims=(512, 1024, 1024, 1024, 10), optimizer="adam"),
    "conv-residual-branches": lambda: examples.residual_convnet(batch=8, size=32, channels=32, blocks=3),
    "wide-16-branches": lambda: examples.wide_branches(branches=16, elems=1 << 18),
    "unrolled-rnn": lambda: examples.unrolled_rnn(steps=16, batch=64, hidden=512),
    # Every op is a pool task here and the shared weights' reads fan out past TF's 8 ordered out-edges: the
    # simulator used to say 18.0 MiB for a measured 22.0 (inline small ops, sliced copies of x, feeds freed).
    "unrolled-rnn-wide-batch": lambda: examples.unrolled_rnn(steps=8, batch=256, hidden=512, inputs=256),
    "moe-fan-out": lambda: examples.moe_layer(experts=8, batch=256),
    "inception-towers": lambda: examples.inception_towers(),
    "unet-skips": lambda: examples.unet(),
}


@pytest.fixture(scope="module")
def testbed():
    with Testbed("2GiB", inter_op_threads=1, intra_op_threads=1) as tb:
        yield tb


@pytest.mark.parametrize("name", sorted(CASES))
def test_simulated_peak_within_ten_percent(testbed, name):
    built = CASES[name]()
    runs = [testbed.run(built.graph, built.fetches, built.feeds, steps=1) for _ in range(5)]
    assert all(r.ran for r in runs), [r.error for r in runs]
    peaks = [r.device_peak_bytes for r in runs]
    measured = statistics.median(peaks)
    simulated = simulate(built.graph, built.fetches).peak_bytes
    close_to_median = abs(simulated - measured) <= 0.10 * measured
    reproduces_a_run = any(abs(simulated - p) <= 0.02 * p for p in peaks)
    assert close_to_median or reproduces_a_run, (name, simulated, peaks)


def test_peak_at_a_finite_capacity_counts_whole_chunks():
    """Near the cap, TF's BFC serves a request from a free chunk less than twice its size whole, and reports
    the chunk: a 6 MiB tensor on a 12 MiB device (a 2 MiB region, then one of 10 MiB) counts 10 MiB. So a
    measured peak depends on the device's capacity, and compares only with ``simulate(device_memory=...)``
    (a planned U-Net simulated at 42.6 MiB unbounded measured 69 MiB on an 80 MiB testbed, and the simulator
    given 80 MiB said 69.5)."""
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (1024,), name="x")
        tf.reduce_sum(tf.tile(x, [1536]), name="loss")  # a 6 MiB intermediate
    feeds = {"x:0": np.ones(1024, np.float32)}
    with Testbed("12MiB", inter_op_threads=1, intra_op_threads=1) as tb:
        measured = tb.run(g, ["loss:0"], feeds, steps=1).device_peak_bytes
    unbounded = simulate(g, ["loss:0"]).peak_bytes
    capped = simulate(g, ["loss:0"], device_memory=12 << 20).peak_bytes
    assert unbounded < (7 << 20) and capped >= (10 << 20), (unbounded, capped)
    assert abs(capped - measured) <= 0.02 * measured, (capped, measured)
