"""Benchmark: TensorFlow's CPU convolution kernels against the testbed cost model, by output size.

A fully-connected layer written as a convolution (TF-Slim's AlexNet, OverFeat and VGG heads: a 1x1 output) runs
far slower than its flops say: the kernel passes over the whole filter once per image. For convolutions of
several shapes (the forward op and both gradients), the best of ``--repeats`` runs of each op in a local
session on this machine's CPU (the kernels the testbed's device server runs), against
``tfmem.sim.costmodel.op_time_s`` on the testbed ``DeviceSpec`` with and without its filter-pass floor
(``conv_filter_pass_bandwidth``), and the measured rate of filter bytes per image.

    python -m experiments.conv_kernels          # 10 shapes, 5 repeats (about a minute)
    python -m experiments.conv_kernels --tiny   # CI smoke run: 2 small shapes
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

from experiments._common import RESULTS, load_average, provenance, write
from tfmem.ir.loading import load
from tfmem.sim import costmodel

v1 = tf.compat.v1
# (batch, input height = width, kernel size, input channels, output channels, padding)
SHAPES = [(2, 1, 1, 4096, 4096, "VALID"), (2, 2, 1, 2048, 2048, "VALID"), (2, 3, 3, 512, 512, "SAME"),
          (2, 5, 3, 512, 512, "SAME"), (2, 7, 3, 512, 512, "SAME"), (2, 14, 3, 256, 256, "SAME"),
          (2, 28, 3, 128, 128, "SAME"), (8, 7, 3, 512, 512, "SAME"), (2, 5, 5, 256, 4096, "VALID"),
          (2, 7, 7, 512, 4096, "VALID")]
TINY = [(2, 1, 1, 256, 256, "VALID"), (2, 8, 3, 32, 32, "SAME")]
OPS = {"Conv2D": "forward", "Conv2DBackpropInput": "input gradient", "Conv2DBackpropFilter": "filter gradient"}


def measure(shape: tuple[int, int, int, int, int, str], repeats: int) -> list[dict[str, Any]]:
    """One row per op of a convolution of ``shape``: measured and estimated milliseconds."""
    batch, size, kernel, cin, cout, padding = shape
    rng = np.random.default_rng(0)
    g = tf.Graph()
    with g.as_default():
        def variable(name: str, dims: tuple[int, ...]) -> tf.Tensor:
            init = rng.random(dims, dtype=np.float32)
            return v1.get_variable(name, initializer=init, use_resource=True).read_value()

        x, w = variable("x", (batch, size, size, cin)), variable("w", (kernel, kernel, cin, cout))
        y = tf.nn.conv2d(x, w, 1, padding, name="Conv2D")
        dy = variable("dy", tuple(y.shape.as_list()))
        strides = [1, 1, 1, 1]
        tf.raw_ops.Conv2DBackpropInput(input_sizes=x.shape.as_list(), filter=w, out_backprop=dy, strides=strides,
                                       padding=padding, name="Conv2DBackpropInput")
        tf.raw_ops.Conv2DBackpropFilter(input=x, filter_sizes=w.shape.as_list(), out_backprop=dy, strides=strides,
                                        padding=padding, name="Conv2DBackpropFilter")
        init = v1.global_variables_initializer()
    ir = load(g)
    without_floor = dataclasses.replace(costmodel.DEFAULT_DEVICE, conv_filter_pass_bandwidth=0.0)
    rows = []
    with v1.Session(graph=g) as sess:
        sess.run(init)
        for op, what in OPS.items():
            target = g.get_operation_by_name(op)
            sess.run(target)   # warm-up: the first run builds the kernel's primitives
            best = float("inf")
            for _ in range(repeats):
                started = time.perf_counter()
                sess.run(target)
                best = min(best, time.perf_counter() - started)
            filter_bytes = kernel * kernel * cin * cout * 4
            rows.append({"shape": list(shape), "output": int(y.shape[1]), "op": what, "measured_ms": best * 1e3,
                         "estimated_ms": costmodel.op_time_s(ir[op], ir) * 1e3,
                         "estimated_without_floor_ms": costmodel.op_time_s(ir[op], ir, without_floor) * 1e3,
                         "filter_mib": filter_bytes / 2**20,
                         "filter_gb_per_s_per_image": batch * filter_bytes / best / 1e9})
    return rows


def markdown(result: dict[str, Any]) -> str:
    lines = ["# TF's CPU convolutions against the testbed cost model", "",
             f"Command: `{result['command']}` ({result['date']}; {result['machine']['cpus']} CPUs, load average "
             f"{result['load_average']['1m']:.2f} at the end). Measured: best of {result['repeats']} runs of each "
             "op alone in a local session on this CPU. Estimated: `tfmem.sim.costmodel.op_time_s` on the testbed "
             "DeviceSpec, with its filter-pass floor (a convolution reads its filter once per image at "
             f"{costmodel.DEFAULT_DEVICE.conv_filter_pass_bandwidth / 1e9:.1f} GB/s) and without it.", "",
             "| batch, size, kernel, in, out | output | op | filter (MiB) | measured (ms) | estimated (ms) "
             "| without the floor (ms) | measured / estimated | filter GB/s per image |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        b, s, k, cin, cout, _ = r["shape"]
        lines.append(f"| {b}, {s}, {k}, {cin}, {cout} | {r['output']}x{r['output']} | {r['op']} "
                     f"| {r['filter_mib']:.1f} | {r['measured_ms']:.1f} | {r['estimated_ms']:.2f} "
                     f"| {r['estimated_without_floor_ms']:.2f} | {r['measured_ms'] / r['estimated_ms']:.2f} "
                     f"| {r['filter_gb_per_s_per_image']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.conv_kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each op; the fastest counts")
    parser.add_argument("--tiny", action="store_true", help="two small shapes, 2 repeats (CI smoke run)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    shapes, repeats = (TINY, 2) if args.tiny else (SHAPES, args.repeats)
    rows = [row for shape in shapes for row in measure(shape, repeats)]
    result = provenance(argv, load_average=load_average(), repeats=repeats, rows=rows)
    paths = write("conv_kernels_tiny" if args.tiny else "conv_kernels", result, markdown(result), Path(args.out))
    print(f"wrote {paths[0]} and {paths[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
