"""Estimated op compute time and transfer time, for a named device and link.

A roofline estimate per op: ``max(flops / peak_flops, bytes_touched / memory_bandwidth) + launch overhead``,
and for a convolution on a device whose kernels pass over the filter once per image (the testbed's CPU), at
least that pass.
It ranks choices (which tensor to swap, how far ahead to prefetch, what recomputation costs); it is not a
profiler. Figures computed with it are labelled "cost model" in reports.

Examples
--------
>>> v100 = DEVICES["V100+PCIe3"]
>>> round(v100.transfer_s(12 * 10**9), 3)
1.0
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from tfmem.ir.graph import GraphIR, OpNode
from tfmem.ir.ops import CONV_OPS, FREE_OPS, INLINE_KERNELS, MATMUL_OPS


@dataclass(frozen=True)
class DeviceSpec:
    """A compute device and the link that connects it to host memory."""

    name: str
    peak_flops: float              # sustained FLOP/s for dense math
    memory_bandwidth: float        # bytes/s of device memory
    link_bandwidth: float          # bytes/s host <-> device, one direction
    launch_overhead_s: float = 5e-6
    link_latency_s: float = 10e-6
    # Share of the compute cores a copy keeps busy for its link time (0 for a DMA engine).
    transfer_cpu_share: float = 0.0
    # Bytes/s at which the device's convolution kernels read a filter once per image (0: no such floor).
    conv_filter_pass_bandwidth: float = 0.0

    def transfer_s(self, nbytes: int) -> float:
        """Seconds to move ``nbytes`` over the link."""
        return self.link_latency_s * (nbytes > 0) + nbytes / self.link_bandwidth


DEVICES: dict[str, DeviceSpec] = {
    # The testbed: CPU cores doing float math, gRPC over loopback as the link, copies keeping the cores busy. Fitted
    # to the 2026-11-24 calibration run (1.62x estimated/measured, 1.03 ms per MiB copied); the latest run
    # (experiments/results/testbed_calibration.md) measured a slower day (0.84x, 1.43 ms per MiB); see docs/RESULTS.md.
    # TF's CPU convolutions pass over the whole filter once per image: a fully-connected layer written as a
    # convolution (1x1 output) took 30-40x its roofline time with 64 to 392 MiB filters alike (2.1-2.9 GB/s per
    # image: experiments/results/conv_kernels.md); outputs of 7x7 and more stay compute-bound.
    "testbed": DeviceSpec("testbed (CPU + loopback gRPC)", 4.87e10, 4.87e10, 1.02e9, 20e-6, 100e-6, transfer_cpu_share=1.0,
                          conv_filter_pass_bandwidth=2.5e9),
    "TitanX+PCIe3": DeviceSpec("TitanX (12 GB) + PCIe3 x16", 6e12, 3.36e11, 12e9),
    "V100+PCIe3": DeviceSpec("V100 (16 GB) + PCIe3 x16", 14e12, 9e11, 12e9),
    "H200+PCIe5": DeviceSpec("H200 (141 GB) + PCIe5 x16", 60e12, 4.8e12, 55e9),
}
DEFAULT_DEVICE = DEVICES["testbed"]



def op_flops(node: OpNode, graph: GraphIR) -> float:
    """Floating-point operations of one execution of ``node`` (an estimate from shapes)."""
    out = node.outputs[0] if node.outputs else None
    out_elems = _elems(out.shape) if out else 0
    if node.op in MATMUL_OPS:
        a = graph.spec(node.inputs[0]).shape or ()
        inner = a[-2] if node.attr_bool("transpose_a") or node.attr_bool("adj_x") else (a[-1] if a else 1)
        return 2.0 * out_elems * float(inner or 1)
    if node.op in CONV_OPS:
        return _conv_flops(node, graph)
    if node.op == "Einsum":
        return _einsum_flops(node, graph, out_elems)
    return float(out_elems)


def _einsum_flops(node: OpNode, graph: GraphIR, out_elems: int) -> float:
    """Multiply-adds over every index of the equation: ``"bij,bjk->bik"`` is ``2*b*i*j*k``.

    Each index letter's size comes from the operand it labels; an ellipsis stands for the leading dimensions
    of the operand that carries it. Without the equation, the largest operand is the guess.
    """
    value = node.attrs.get("equation")
    equation = value.s.decode() if value is not None else ""
    lhs = equation.split("->")[0].replace(" ", "").split(",") if "->" in equation else []
    sizes: dict[str, int] = {}
    for labels, ref in zip(lhs, node.inputs, strict=False):
        shape = graph.spec(ref).shape
        if shape is None:
            sizes.clear()
            break
        if "..." in labels:  # the ellipsis covers what the named letters leave of the rank
            head, tail = labels.split("...")
            n_ellipsis = len(shape) - len(head) - len(tail)
            labels = head + "".join(chr(0x100 + i) for i in range(n_ellipsis)) + tail
        for letter, dim in zip(labels, shape, strict=False):
            sizes[letter] = max(sizes.get(letter, 1), int(dim or 1))
    if not sizes:
        ins = [_elems(graph.spec(t).shape) for t in node.inputs]
        return 2.0 * max(ins + [out_elems])
    return 2.0 * prod(sizes.values())


def _conv_flops(node: OpNode, graph: GraphIR) -> float:
    shapes = [graph.spec(t).shape or () for t in node.inputs]
    if node.op == "Conv2DBackpropFilter":
        filt = node.outputs[0].shape or ()
        out_grad = shapes[2] if len(shapes) > 2 else ()
        return 2.0 * _elems(out_grad) * _elems(filt[:3] if filt else ())
    if node.op == "Conv2DBackpropInput":
        filt = shapes[1] if len(shapes) > 1 else ()
        out_grad = shapes[2] if len(shapes) > 2 else ()
        return 2.0 * _elems(out_grad) * _elems(filt[:3] if filt else ())
    filt = shapes[1] if len(shapes) > 1 else ()
    out = node.outputs[0].shape if node.outputs else ()
    return 2.0 * _elems(out) * _elems(filt[:3] if filt else ())


def _elems(shape: tuple[int | None, ...] | None) -> int:
    if not shape:
        return 1 if shape == () else 0
    return prod(int(d or 1) for d in shape)


def op_time_s(node: OpNode, graph: GraphIR, device: DeviceSpec = DEFAULT_DEVICE) -> float:
    """Estimated seconds for one execution of ``node`` on ``device``."""
    if node.op in FREE_OPS:
        return device.launch_overhead_s * 0.2
    touched = sum(s.nbytes or 0 for s in node.outputs)
    for t in node.inputs:
        try:
            touched += graph.spec(t).nbytes or 0
        except KeyError:
            pass
    compute = max(op_flops(node, graph) / device.peak_flops, touched / device.memory_bandwidth)
    if device.conv_filter_pass_bandwidth and node.op in FILTER_PASS_CONVS:
        compute = max(compute, _filter_passes_bytes(node, graph) / device.conv_filter_pass_bandwidth)
    return device.launch_overhead_s + compute


# Dense convolutions and their gradients (a depthwise filter is one channel deep: no such pass).
FILTER_PASS_CONVS = frozenset({"Conv2D", "_FusedConv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter"})


def _filter_passes_bytes(node: OpNode, graph: GraphIR) -> int:
    """The filter's bytes times the images of the batch: what a convolution reads passing over its filter once
    per image. The batch is the first dimension of the activations in either layout (NHWC, NCHW)."""
    if node.op == "Conv2DBackpropFilter":
        images, filt = node.inputs[0], node.outputs[0] if node.outputs else None
        filter_bytes = filt.nbytes if filt is not None else None
    else:
        images = node.inputs[2] if node.op == "Conv2DBackpropInput" else node.inputs[0]
        filter_bytes = graph.spec(node.inputs[1]).nbytes if len(node.inputs) > 1 else None
    shape = graph.spec(images).shape
    batch = int(shape[0] or 1) if shape else 1
    return batch * (filter_bytes or 0)


# Above this cost an op is worth spreading over the intra-op threads (the step-time estimate's rule). It is
# also the 8000-cycle mark under which TF's executor, once its cost estimates have settled, runs an op inline.
EXPENSIVE_THRESHOLD_S = 8000 / 3e9



def is_expensive(node: OpNode, graph: GraphIR, device: DeviceSpec = DEFAULT_DEVICE) -> bool:
    """Whether TF's CPU executor would hand ``node`` to its thread pool rather than run it inline.

    TF starts every kernel's cost estimate at 1e8 cycles and moves it a tenth of the way to the measured time
    after each run, so an op falls under the 8000-cycle threshold only after ~90 steps of one executor (each
    new session builds new executors; the testbed measures a session's second step). Until then every kernel
    that does not declare itself cheap (``INLINE_KERNELS``) counts as expensive, however small its work
    (``tests/test_memsim.py::test_small_kernels_still_go_to_the_pool``).
    """
    return node.op not in INLINE_KERNELS


def uses_intra_op_threads(node: OpNode, graph: GraphIR, device: DeviceSpec = DEFAULT_DEVICE) -> bool:
    """Whether ``node`` has enough work to be worth spreading over the intra-op threads."""
    if node.op in FREE_OPS:
        return False
    return op_time_s(node, graph, device) - device.launch_overhead_s > EXPENSIVE_THRESHOLD_S
