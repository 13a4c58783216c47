"""Tests of the cost model's step time over several machines (tfmem.sim.cluster)."""

from __future__ import annotations

import pytest
import tensorflow as tf

from tfmem.sim.cluster import NETWORKS, NetworkSpec, cluster_step_s
from tfmem.sim.costmodel import DEVICES
from tfmem.testbed.graph import device_name

V100 = DEVICES["V100+PCIe3"]
PAIRS = {device_name(m): device_name(m, "host") for m in range(2)}
MiB = 2**20


def graph(crossing: bool) -> tf.Graph:
    """Each machine squares a 16 MiB matrix; with ``crossing``, machine 1's input is machine 0's output."""
    g = tf.Graph()
    with g.as_default():
        outs = []
        for m in range(2):
            with tf.device(device_name(m)):
                x = tf.compat.v1.placeholder(tf.float32, (2048, 2048), name=f"x{m}")
                src = outs[0] if crossing and outs else x
                outs.append(tf.matmul(src, src, name=f"y{m}"))
        with tf.device(device_name(1)):
            tf.add(outs[0], outs[1], name="z")
    return g


def test_a_tensor_crossing_machines_waits_for_the_network() -> None:
    slow = NetworkSpec("slow", 1e8, 0.0)
    fast = cluster_step_s(graph(True), "z:0", PAIRS, V100, NETWORKS["100GbE"])
    crossing = cluster_step_s(graph(True), "z:0", PAIRS, V100, slow)
    assert crossing >= slow.transfer_s(16 * MiB) > fast


def test_independent_machines_run_side_by_side() -> None:
    both = cluster_step_s(graph(False), "z:0", PAIRS, V100, NETWORKS["100GbE"])
    chained = cluster_step_s(graph(True), "z:0", PAIRS, V100, NETWORKS["100GbE"])
    matmul = 2 * 2048**3 / V100.peak_flops
    assert matmul <= both < chained   # the two squarings overlap unless one waits for the other
    assert chained >= 2 * matmul


def test_one_machine_needs_no_network() -> None:
    one = {device_name(0): device_name(0, "host")}
    g = tf.Graph()
    with g.as_default(), tf.device(device_name(0)):
        x = tf.compat.v1.placeholder(tf.float32, (1024, 1024), name="x")
        tf.matmul(x, x, name="y")
    assert cluster_step_s(g, "y:0", one, V100, NetworkSpec("none", 1.0, 1.0)) == pytest.approx(
        cluster_step_s(g, "y:0", one, V100, NETWORKS["100GbE"]))
