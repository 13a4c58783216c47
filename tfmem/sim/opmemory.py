"""How individual TF CPU kernels use memory beyond their outputs: scratch buffers, in-place forwarding, views.

Rules are plain dicts keyed by op type with a default (nothing), so that adding an op is one line. The
scratch sizes follow TensorFlow's kernels (checked against ``RunMetadata`` step stats in the testbed): the
custom CPU convolution gradients work through an im2col buffer sized to a ~30 MiB working set.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from math import ceil, prod

import numpy as np
from tensorflow.python.framework import tensor_util

from tfmem.ir.graph import GraphIR, OpNode, TensorRef

_WORKING_SET_BYTES = 30 << 20      # target working set of the custom conv-gradient kernels
_L2_CACHE_BYTES = 256 << 10        # TF's l2_cache_size: per-thread work above it, backprop-input goes per image


def _dims(graph: GraphIR, node: OpNode, index: int) -> tuple[int, ...]:
    shape = graph.spec(node.inputs[index]).shape or ()
    return tuple(int(d or 1) for d in shape)


def _itemsize(graph: GraphIR, node: OpNode) -> int:
    out = node.outputs[0]
    elems = prod(int(d or 1) for d in out.shape or ())
    return max(1, (out.nbytes or 0) // max(elems, 1))


def _conv_backprop_filter(node: OpNode, graph: GraphIR) -> list[int]:
    inp, grad = _dims(graph, node, 0), _dims(graph, node, 2)
    filt = node.outputs[0].shape or ()
    if len(inp) != 4 or len(grad) != 4 or len(filt) != 4:
        return []
    itemsize = _itemsize(graph, node)
    out_image = grad[1] * grad[2]
    filter_total = int(filt[0] or 1) * int(filt[1] or 1) * int(filt[2] or 1)
    work_unit = out_image * filter_total + out_image * grad[3] + filter_total * grad[3]
    shard = 1 if inp[0] == 1 else ceil((_WORKING_SET_BYTES // itemsize) / work_unit)
    return [shard * out_image * filter_total * itemsize]


def _conv_backprop_input(node: OpNode, graph: GraphIR) -> list[int]:
    filt, grad = _dims(graph, node, 1), _dims(graph, node, 2)
    if len(filt) != 4 or len(grad) != 4:
        return []
    itemsize = _itemsize(graph, node)
    out_image = grad[1] * grad[2]
    filter_total = filt[0] * filt[1] * filt[2]
    work_unit = out_image * filter_total + filter_total * grad[3] + out_image * grad[3]
    threads = os.cpu_count() or 1  # TF divides the work unit among the intra-op pool's threads
    parallel = grad[0] == 1 or work_unit // threads >= _L2_CACHE_BYTES // itemsize
    shard = 1 if parallel else ceil((_WORKING_SET_BYTES // itemsize) / work_unit)
    return [shard * out_image * filter_total * itemsize]


def _xla_grouped_backprop(node: OpNode, graph: GraphIR) -> list[int]:
    """A call of an XLA-compiled function (``_XlaMustCompile``; tf_keras compiles grouped convolutions so, as TF's
    CPU kernels take no groups) that runs a grouped convolution's gradients. XLA on the CPU holds, while the
    call runs, for a depthwise filter ``(kh, kw, 1, C)`` a dense ``kh x kw x C x C`` filter per gradient
    (measured: 2 x 110.25 MiB for C = 768, 7x7), and for other groups a copy of the convolution's input and
    one of its filter (measured at 4 shapes, to the byte; ``tests/test_memsim.py::test_xla_grouped_gradient``)."""
    name = node.attrs["f"].func.name if "f" in node.attrs else ""
    fdef = next((f for f in graph.library.function if f.signature.name == name), None)
    if fdef is None or not (fdef.attr["_XlaMustCompile"].b if "_XlaMustCompile" in fdef.attr else False):
        return []
    args = [a.name for a in fdef.signature.input_arg]
    inner = {nd.name: nd for nd in fdef.node_def}

    def outer_input(ref: str) -> TensorRef | None:
        """The call's input that the function's tensor ``ref`` is (through Identity and ShapeN)."""
        name, _, rest = ref.partition(":")
        index = int(rest.rsplit(":", 1)[-1]) if rest else 0
        while name in inner and inner[name].op in ("Identity", "ShapeN"):
            step = inner[name].input[index if inner[name].op == "ShapeN" else 0]
            name, _, rest = step.partition(":")
            index = int(rest.rsplit(":", 1)[-1]) if rest else 0
        return node.inputs[args.index(name)] if name in args and args.index(name) < len(node.inputs) else None

    out: list[int] = []
    grouped: set[TensorRef] = set()   # the input and filter of a grouped (not depthwise) convolution
    for nd in fdef.node_def:
        if nd.op not in ("Conv2DBackpropInput", "Conv2DBackpropFilter") or len(nd.input) < 2:
            continue
        ref = outer_input(nd.input[1])   # the filter, or (for the filter's gradient) the shape of it
        if ref is None:
            continue
        shape = graph.spec(ref).shape
        if not shape or len(shape) != 4 or not all(shape):
            continue
        kh, kw, per_group, channels = (int(d) for d in shape)   # type: ignore[arg-type]
        if per_group == 1:
            out.append(kh * kw * channels * channels * _itemsize(graph, graph[ref.node]))
            continue
        grouped.add(ref)
        source = outer_input(nd.input[0]) if nd.op == "Conv2DBackpropFilter" else None
        if source is not None:
            grouped.add(source)
    return out + [graph.spec(t).nbytes or 0 for t in sorted(grouped, key=str)]


TEMP_RULES: dict[str, Callable[[OpNode, GraphIR], list[int]]] = {
    "PartitionedCall": _xla_grouped_backprop,
    "StatefulPartitionedCall": _xla_grouped_backprop,
    "Conv2DBackpropFilter": _conv_backprop_filter,
    "Conv2DBackpropInput": _conv_backprop_input,
}


# A view must start on Eigen's alignment (EIGEN_MAX_ALIGN_BYTES: 64 in an AVX-512 build, 32 without; the larger
# one refuses views the smaller would allow, so the simulator errs toward allocating).
_ALIGN_BYTES = 64


def _rows_aligned(graph: GraphIR, ref: TensorRef) -> bool:
    """TF's ``IsInnerDimsSizeAligned``: the bytes of one dim-0 row are a multiple of the alignment."""
    spec = graph.spec(ref)
    shape = spec.shape
    if not shape or len(shape) < 2 or any(d is None for d in shape) or not spec.nbytes or not shape[0]:
        return False  # rank 1 needs the slice bounds aligned too: never a view here
    return (spec.nbytes // int(shape[0])) % _ALIGN_BYTES == 0


def _const(graph: GraphIR, ref: TensorRef) -> np.ndarray | None:
    node = graph[ref.node]
    return tensor_util.MakeNdarray(node.attrs["value"].tensor) if node.op == "Const" else None


def _dim0_slice(node: OpNode, graph: GraphIR, index: int) -> int | None:
    """``Slice``/``StridedSlice`` of whole rows (dim 0 only, stride 1) return ``input.Slice(begin, end)``."""
    src, out = graph.spec(node.inputs[0]).shape, node.outputs[0].shape
    if index != 0 or not src or out is None or not _rows_aligned(graph, node.inputs[0]):
        return None
    if node.op == "StridedSlice":
        strides = _const(graph, node.inputs[3])
        masks = {k: node.attrs[k].i if k in node.attrs else 0 for k in ("ellipsis_mask", "new_axis_mask",
                                                                       "shrink_axis_mask")}
        if strides is None or strides.size < 1 or int(strides.flat[0]) != 1 or masks["ellipsis_mask"] \
                or masks["new_axis_mask"] or masks["shrink_axis_mask"] not in (0, 1):
            return None
        if masks["shrink_axis_mask"]:
            out = (1, *out)
    return 0 if len(out) == len(src) and tuple(out[1:]) == tuple(src[1:]) else None


def _dim0_split(value_input: int) -> Callable[[OpNode, GraphIR, int], int | None]:
    """``Unpack``/``Split``/``SplitV`` along dim 0 of aligned rows give each output a view of the input."""
    def rule(node: OpNode, graph: GraphIR, index: int) -> int | None:
        if node.op == "Unpack":
            axis = node.attrs["axis"].i if "axis" in node.attrs else 0
        else:
            dim = _const(graph, node.inputs[0 if node.op == "Split" else 2])
            axis = None if dim is None or dim.size != 1 else int(dim.flat[0])
        rank = len(graph.spec(node.inputs[value_input]).shape or ())
        if axis is None or axis % max(rank, 1) != 0 or not _rows_aligned(graph, node.inputs[value_input]):
            return None
        return value_input
    return rule


# Outputs that the kernel returns as a view into an input's buffer, allocating nothing: op -> rule giving,
# for output ``index``, the input it views (or None). The view keeps the whole input buffer alive.
VIEW_RULES: dict[str, Callable[[OpNode, GraphIR, int], int | None]] = {
    # each output is its input, passed through (Keras 3's optimizers pass every gradient through one IdentityN)
    "IdentityN": lambda node, graph, index: index if index < len(node.inputs) else None,
    "StridedSlice": _dim0_slice,
    "Slice": _dim0_slice,
    "Unpack": _dim0_split(0),
    "Split": _dim0_split(1),
    "SplitV": _dim0_split(0),
}


def viewed_input(node: OpNode, graph: GraphIR, index: int) -> int | None:
    """The input whose buffer output ``index`` of ``node`` is a view of, or None when the kernel allocates."""
    rule = VIEW_RULES.get(node.op)
    if rule is None or not node.inputs:
        return None
    try:
        return rule(node, graph, index)
    except (KeyError, IndexError, TypeError, ValueError):  # odd shapes or attrs: assume a copy
        return None


def temp_bytes(node: OpNode, graph: GraphIR) -> list[int]:
    """Sizes of the scratch buffers ``node``'s kernel allocates while it runs (empty for most ops)."""
    rule = TEMP_RULES.get(node.op)
    if rule is None:
        return []
    try:
        return rule(node, graph)
    except (KeyError, IndexError, TypeError):  # odd shapes: no scratch rather than a wrong crash
        return []


def allocated_bytes(graph: GraphIR, name: str) -> int:
    """What an op allocates while it runs: its outputs and its kernel's scratch buffers.

    Scratch counts: a convolution's filter gradient returns a few KiB but may hold tens of MiB while it runs,
    and two of them side by side can be a conv net's peak (``experiments/results/simulator_order.md``).
    """
    node = graph[name]
    return sum(o.nbytes or 0 for o in node.outputs) + scratch_bytes(graph, name)


def scratch_bytes(graph: GraphIR, name: str) -> int:
    """What an op's kernel allocates for itself while it runs (``temp_bytes``)."""
    return sum(temp_bytes(graph[name], graph))
