"""Tests of the multi-machine testbed: each machine's device capped on its own, peaks per device, an
out-of-memory that names its device, real copies between machines. Cleanup on every exit path with two
machines is in tests/test_testbed.py (the user processes and the exception test run two)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tensorflow as tf

from tfmem.errors import BadInputError
from tfmem.testbed import Testbed
from tfmem.testbed.graph import calibration_graph, device_name

pytestmark = pytest.mark.testbed

MiB = 2**20
CAP = 32 * MiB
SMALL = 4096  # the small constants' 256-byte chunks beside the big tensors


@pytest.fixture(scope="module")
def tb() -> Iterator[Testbed]:
    with Testbed(CAP, machines=3) as testbed:
        yield testbed


@pytest.mark.parametrize("machines", [0, 17, 1.5, True, "2"])
def test_machines_out_of_range_is_bad_input(machines: object) -> None:
    with pytest.raises(BadInputError, match="machines must be an int from 1 to 16"):
        Testbed("16MiB", machines=machines)  # type: ignore[arg-type]


def test_devices_and_hosts_name_every_machine(tb: Testbed) -> None:
    assert tb.devices == [f"/job:worker/replica:0/task:{m}/device:CPU:0" for m in range(3)]
    assert tb.hosts == [f"/job:host/replica:0/task:{m}/device:CPU:0" for m in range(3)]
    assert sorted(tb.pids) == ["host:0", "host:1", "host:2", "worker:0", "worker:1", "worker:2"]
    assert len(set(tb.pids.values())) == 6


def test_each_device_has_its_own_peak(tb: Testbed) -> None:
    sizes = {0: 4 * MiB, 1: 8 * MiB, 2: 6 * MiB}
    r = tb.run(calibration_graph(sizes), ["total:0"])
    assert r.ran and sorted(r.device_peaks) == tb.devices and sorted(r.host_peaks) == tb.hosts
    for m, nbytes in sizes.items():   # x and 2x at once, nothing else of size
        assert 2 * nbytes <= r.device_peaks[tb.devices[m]] <= 2 * nbytes + SMALL, (m, r.device_peaks)
    assert r.device_peak_bytes == max(r.device_peaks.values()) == r.device_peaks[tb.devices[1]]


@pytest.mark.parametrize("machine", [2, 0])
def test_an_oom_names_the_device_that_went_over(tb: Testbed, machine: int) -> None:
    sizes = {m: MiB for m in range(3)}
    sizes[machine] = CAP   # x and 2x: twice the cap on that machine alone
    r = tb.run(calibration_graph(sizes), ["total:0"])
    assert r.oom and r.oom_device == tb.devices[machine], r.error
    assert f"out of memory on {tb.devices[machine]}" in (r.error or "")
    assert tb.run(calibration_graph({0: MiB, 1: MiB, 2: MiB}), ["total:0"]).ran   # and the testbed goes on


def test_values_cross_machines_unchanged(tb: Testbed) -> None:
    g = tf.Graph()
    with g.as_default():
        with tf.device(device_name(0)):
            x = tf.compat.v1.placeholder(tf.float32, [1000], name="x")
            y = tf.sin(x, name="y")
        with tf.device(device_name(2, "host")):
            z = tf.multiply(y, 3.0, name="z")
        with tf.device(device_name(1)):
            tf.reduce_sum(tf.exp(z), name="out")
    feed = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    r = tb.run(g, ["out:0"], {"x:0": feed})
    local = tf.Graph()
    with local.as_default():
        tf.import_graph_def(g.as_graph_def(), name="")
        for node in local.get_operations():
            node._set_device("/device:CPU:0")
        with tf.compat.v1.Session(graph=local) as sess:
            expected = sess.run("out:0", {"x:0": feed})
    assert r.outputs["out:0"].tobytes() == np.asarray(expected).tobytes()
