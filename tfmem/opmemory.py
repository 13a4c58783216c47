"""How individual TF CPU kernels use memory beyond their outputs: scratch buffers and in-place forwarding.

Rules are plain dicts keyed by op type with a default (nothing), so that adding an op is one line. The
scratch sizes follow TensorFlow's kernels (checked against ``RunMetadata`` step stats in the testbed): the
custom CPU convolution gradients work through an im2col buffer sized to a ~30 MiB working set.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from math import ceil, prod

from tfmem.ir import GraphIR, OpNode

# Ops that may write their output into an input buffer they are the last reader of: op -> input indices
# (TF's ``forward_input_or_allocate_output`` in the element-wise kernels).
FORWARDING_OPS: dict[str, tuple[int, ...]] = {
    **{op: (0,) for op in (
        "Relu", "Relu6", "Elu", "Selu", "LeakyRelu", "Tanh", "Sigmoid", "Neg", "Abs", "Square", "Sqrt",
        "Rsqrt", "Exp", "Log", "Log1p", "Reciprocal", "Inv", "Sign", "Floor", "Ceil", "Round", "Softplus",
        "Softsign", "BiasAdd", "Cos", "Sin", "Erf", "OnesLike", "ZerosLike", "ClipByValue", "Gelu",
    )},
    **{op: (0, 1) for op in (
        "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "Maximum", "Minimum", "Pow",
        "SquaredDifference", "ReluGrad", "Relu6Grad", "EluGrad", "SeluGrad", "LeakyReluGrad", "TanhGrad",
        "SigmoidGrad", "RsqrtGrad", "SqrtGrad", "SoftplusGrad", "ReciprocalGrad", "FloorDiv", "FloorMod",
        "MulNoNan", "BiasAddV1",
    )},
    "AddN": tuple(range(64)),
}

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


TEMP_RULES: dict[str, Callable[[OpNode, GraphIR], list[int]]] = {
    "Conv2DBackpropFilter": _conv_backprop_filter,
    "Conv2DBackpropInput": _conv_backprop_input,
}


def temp_bytes(node: OpNode, graph: GraphIR) -> list[int]:
    """Sizes of the scratch buffers ``node``'s kernel allocates while it runs (empty for most ops)."""
    rule = TEMP_RULES.get(node.op)
    if rule is None:
        return []
    try:
        return rule(node, graph)
    except (KeyError, IndexError, TypeError):  # odd shapes: no scratch rather than a wrong crash
        return []
