"""Cost model: FLOP counts from shapes, and host<->device copies in the step-time estimate."""

from __future__ import annotations

import dataclasses

import pytest
import tensorflow as tf

from tests.helpers import HOST, MiB, v1
from tfmem.ir.loading import load
from tfmem.sim import costmodel
from tfmem.sim.memsim import simulate


def _einsum_ir(equation: str, *shapes: tuple[int, ...]):
    g = tf.Graph()
    with g.as_default():
        xs = [v1.placeholder(tf.float32, s, name=f"x{i}") for i, s in enumerate(shapes)]
        tf.einsum(equation, *xs)
    return load(g)


def _einsum(ir):
    return next(n for n in ir if n.op == "Einsum")


def test_einsum_flops_count_every_index_once():
    # attention scores: batch 2, heads 4, query 8, key 16, depth 32 -> 2 * 2*4*8*16*32 multiply-adds
    ir = _einsum_ir("bhqd,bhkd->bhqk", (2, 4, 8, 32), (2, 4, 16, 32))
    assert costmodel.op_flops(_einsum(ir), ir) == 2 * 2 * 4 * 8 * 16 * 32
    # an ellipsis stands for the leading dimensions of the operand that carries it
    ir = _einsum_ir("...ij,jk->...ik", (3, 5, 7, 11), (11, 13))
    assert costmodel.op_flops(_einsum(ir), ir) == 2 * 3 * 5 * 7 * 11 * 13


def test_einsum_flops_match_the_matmul_it_computes():
    g = tf.Graph()
    with g.as_default():
        a = v1.placeholder(tf.float32, (64, 128), name="a")
        b = v1.placeholder(tf.float32, (128, 256), name="b")
        tf.einsum("ij,jk->ik", a, b)
        tf.linalg.matmul(a, b, name="m")
    ir = load(g)
    assert costmodel.op_flops(_einsum(ir), ir) == costmodel.op_flops(ir["m"], ir) == 2 * 64 * 128 * 256


def _swapped(nbytes: int, branches: int = 1) -> tf.Graph:
    """Per branch: y = sin(x + i), a copy of y to the host and back; the sum reads the copies back."""
    n = nbytes // 4
    g = tf.Graph()
    with g.as_default():
        x = v1.placeholder(tf.float32, (n,), name="x")
        backs = []
        for i in range(branches):
            y = tf.math.sin(x + float(i), name=f"y{i}")
            with tf.device(HOST):
                out = tf.identity(y, name=f"y{i}_out")
            backs.append(tf.identity(out, name=f"y{i}_in"))
        tf.reduce_sum(tf.add_n(backs) if branches > 1 else backs[0], name="s")
    return g


def test_copies_lengthen_the_estimated_step_by_their_link_time():
    slow = dataclasses.replace(costmodel.DEFAULT_DEVICE, link_bandwidth=1e8, link_latency_s=0.0, transfer_cpu_share=0.0)
    fast = dataclasses.replace(slow, link_bandwidth=1e12)
    kw = dict(host=HOST, grappler=False, cores=1)
    slow_step = simulate(_swapped(8 * MiB), ["s:0"], cost_device=slow, **kw).estimated_step_s
    fast_step = simulate(_swapped(8 * MiB), ["s:0"], cost_device=fast, **kw).estimated_step_s
    # two copies of 8 MiB on the critical path (out, then back) at 1e8 B/s
    assert abs((slow_step - fast_step) - 2 * 8 * MiB / 1e8) < 1e-3


def test_copies_charged_as_work_where_the_link_shares_the_cores():
    # Three branches copy side by side: the critical path holds two copies, the link three each way. Charged as
    # work too (the testbed's gRPC "link" runs on the compute cores), the six copies and the ops share two cores.
    dedicated = dataclasses.replace(costmodel.DEFAULT_DEVICE, link_bandwidth=1e9, link_latency_s=0.0,
                                    transfer_cpu_share=0.0)
    shared = dataclasses.replace(dedicated, transfer_cpu_share=1.0)
    kw = dict(host=HOST, grappler=False, cores=2)
    g = _swapped(8 * MiB, branches=3)
    copy_s = 8 * MiB / 1e9
    without = simulate(g, ["s:0"], cost_device=dedicated, **kw).estimated_step_s
    with_share = simulate(g, ["s:0"], cost_device=shared, **kw).estimated_step_s
    assert without >= 3 * copy_s   # the link carries one copy at a time each way
    assert with_share > without


def _conv_ir(batch: int, size: int, kernel: int, cin: int, cout: int):
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (batch, size, size, cin), name="x")
        w = tf.compat.v1.placeholder(tf.float32, (kernel, kernel, cin, cout), name="w")
        y = tf.nn.conv2d(x, w, 1, "VALID", name="conv")
        tf.raw_ops.Conv2DBackpropFilter(input=x, filter_sizes=w.shape.as_list(), out_backprop=y, strides=[1] * 4,
                                        padding="VALID", name="dw")
        tf.raw_ops.Conv2DBackpropInput(input_sizes=x.shape.as_list(), filter=w, out_backprop=y, strides=[1] * 4,
                                       padding="VALID", name="dx")
    return load(g)


def test_a_convolution_with_a_small_output_takes_its_filter_pass_per_image():
    # experiments/results/conv_kernels.md: an fc layer as a 1x1-output convolution runs 30-40x its flops' time
    # on the testbed's CPU (the filter read once per image, 2.4-3.2 GB/s); at 28x28 its flops dominate.
    testbed, v100 = costmodel.DEFAULT_DEVICE, costmodel.DEVICES["V100+PCIe3"]
    fc = _conv_ir(2, 1, 1, 4096, 4096)
    filter_pass = 2 * 4096 * 4096 * 4 / testbed.conv_filter_pass_bandwidth
    for op in ("conv", "dw", "dx"):
        assert costmodel.op_time_s(fc[op], fc) == pytest.approx(testbed.launch_overhead_s + filter_pass)
        assert costmodel.op_time_s(fc[op], fc, v100) < 1e-3   # a GPU's kernels: the roofline
    wide = _conv_ir(2, 30, 3, 128, 128)
    flops = 2 * 2 * 28 * 28 * 3 * 3 * 128 * 128
    assert costmodel.op_time_s(wide["conv"], wide) == pytest.approx(testbed.launch_overhead_s
                                                                    + flops / testbed.peak_flops)
