"""What tfmem knows about TensorFlow op types: one table, grouped by the question each set answers.

Every module that asks "what kind of op is this?" imports the answer from here, so that adding an op is one
edit. Rules that compute something per op (a kernel's scratch bytes, which input a view reads) live with the
model they feed (``tfmem.sim.opmemory``); policy built from these facts (which ops a pass leaves alone) lives
in the pass, composed from these sets.
"""

from __future__ import annotations

# --- Sources -------------------------------------------------------------------------------------------------
PLACEHOLDER_OPS = frozenset({"Placeholder", "PlaceholderV2"})
# Every op a session may feed in place of computing it.
FEEDABLE_OPS = PLACEHOLDER_OPS | {"PlaceholderWithDefault"}
CONST_OPS = frozenset({"Const", "HostConst"})
# Ops whose outputs live as long as the graph (the kernel or the resource manager holds them).
PERSISTENT_OUTPUT_OPS = CONST_OPS | {"VariableV2", "Variable", "TemporaryVariable"}

# --- Variables -----------------------------------------------------------------------------------------------
RESOURCE_VARIABLE_OPS = frozenset({"VarHandleOp"})
REF_VARIABLE_OPS = frozenset({"VariableV2", "Variable"})
# Ops that declare a variable's storage (resource and reference variables).
VARIABLE_OPS = RESOURCE_VARIABLE_OPS | REF_VARIABLE_OPS
# Output 0 is the storage of the variable whose handle is input 0.
VARIABLE_READ_OPS = frozenset({"ReadVariableOp"})
# Readers of a reference variable that take its ref (not a copy) as input.
REF_READ_OPS = frozenset({"Identity", "RefIdentity", "IsVariableInitialized"})
ASSIGN_OPS = frozenset({"AssignVariableOp", "Assign"})
# Update a resource variable in place (and so copy its buffer first when another variable shares it).
IN_PLACE_UPDATE_OPS = frozenset({"AssignAddVariableOp", "AssignSubVariableOp"})
IN_PLACE_UPDATE_PREFIXES = ("ResourceApply", "ResourceSparseApply", "ResourceScatter")
INIT_CHECK_OPS = frozenset({"VarIsInitializedOp", "IsVariableInitialized"})
CHECKPOINT_OPS = frozenset({"SaveV2", "RestoreV2", "MergeV2Checkpoints", "Save", "Restore", "SaveSlices"})

# --- Buffers -------------------------------------------------------------------------------------------------
# Output 0 is input 0: same value, same shape, same buffer.
IDENTITY_OPS = frozenset({"Identity", "Snapshot", "StopGradient", "PreventGradient"})
# Output 0 is a view of input 0's buffer in another shape (the other inputs say which shape).
VIEW_OPS = frozenset({"Reshape", "ExpandDims", "Squeeze"})
# Output 0 shares the buffer of input 0 (no new memory): identities, views, checks and v1 control flow.
ALIAS_OPS = IDENTITY_OPS | VIEW_OPS | {
    "EnsureShape", "CheckNumerics", "DebugIdentity", "RefIdentity", "Enter", "Exit", "Switch", "Merge",
    "NextIteration", "LoopCond",
}
# Identities Grappler's dependency optimizer bypasses, so a reader of one reads its input at run time.
GRAPPLER_BYPASSED_OPS = frozenset({"Identity"})
# Identities that forward a variable's initial value unchanged (``tfmem.ir.shared_init`` follows them).
INITIAL_VALUE_PASS_THROUGH_OPS = frozenset({"Identity", "Snapshot"})
# Kernels that may write their output into an input buffer they are the last reader of: op -> input indices
# (TF's ``forward_input_or_allocate_output`` in the element-wise kernels).
BUFFER_FORWARDING_INPUTS: dict[str, tuple[int, ...]] = {
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

# --- Control flow --------------------------------------------------------------------------------------------
ENTER_OPS = frozenset({"Enter", "RefEnter"})
EXIT_OPS = frozenset({"Exit", "RefExit"})
NEXT_ITERATION_OPS = frozenset({"NextIteration", "RefNextIteration"})
SWITCH_OPS = frozenset({"Switch", "RefSwitch"})
MERGE_OPS = frozenset({"Merge", "RefMerge"})
CONTROL_FLOW_OPS = ENTER_OPS | EXIT_OPS | NEXT_ITERATION_OPS | SWITCH_OPS | MERGE_OPS | {"LoopCond"}
# Ops that run a function or a TF2 control-flow body (tfmem plans v1 frames, not these).
FUNCTIONAL_OPS = frozenset({"While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase",
                            "PartitionedCall", "StatefulPartitionedCall", "For", "RemoteCall"})

# --- The executor --------------------------------------------------------------------------------------------
RENDEZVOUS_OPS = frozenset({"_Send", "_Recv", "_HostSend", "_HostRecv"})
# Kernels whose ``OpKernel::IsExpensive()`` is false in TensorFlow's CPU build (constant, identity, shape,
# reshape, control-flow, function-argument and rendezvous kernels): the executor always runs them inline.
INLINE_KERNELS = frozenset({
    "Const", "HostConst", "Identity", "IdentityN", "StopGradient", "PreventGradient", "NoOp", "Shape", "ShapeN",
    "Rank", "Size", "ExpandDims", "Squeeze", "Reshape", "Switch", "Merge", "Enter", "RefEnter", "Exit",
    "NextIteration", "LoopCond", "ControlTrigger", "_Arg", "_Retval", "_Recv", "_Send", "Placeholder",
    "PlaceholderWithDefault",
})
# Ops the executor's constant folding never evaluates, besides stateful ones (TF's IsConstantFoldable).
NEVER_FOLDED = CONTROL_FLOW_OPS | FUNCTIONAL_OPS | RENDEZVOUS_OPS | FEEDABLE_OPS | {
    "_Arg", "_Retval", "ControlTrigger", "FakeParam", "GetSessionHandle", "GetSessionHandleV2",
    "GetSessionTensor", "DeleteSessionTensor",
}
# Ops whose kernels keep state or talk to other devices beyond what the op registry marks as stateful: a
# rewrite never clones them.
NEVER_CLONED = RENDEZVOUS_OPS | {"NoOp", "ControlTrigger"}

# --- Shape arithmetic ----------------------------------------------------------------------------------------
# Integer ops that shape-computing subgraphs are made of: ``tfmem.ir.static_values`` evaluates them on known
# values (``tfmem.ir.shape_arithmetic`` has a rule for each). A result can be larger than its inputs together (a
# Gather that repeats indices, a broadcasting Mul), by at most a product of input sizes; what bounds the values
# kept is the check after evaluation (``static_values.MAX_VALUE_ELEMENTS``). Fill and Tile are not here: their
# output's size is an input's value; Range's rule checks its length before it makes one (``MAX_RANGE``).
SHAPE_ARITHMETIC_OPS = frozenset({
    "Pack", "Unpack", "ConcatV2", "Concat", "StridedSlice", "Slice", "Gather", "GatherV2", "Cast", "Reshape",
    "Squeeze", "ExpandDims", "Add", "AddV2", "Sub", "Mul", "FloorDiv", "FloorMod", "Maximum", "Minimum", "Neg",
    "Prod", "Sum", "Max", "Min", "BroadcastArgs", "BroadcastGradientArgs", "Transpose", "ReverseV2", "Range",
    "InvertPermutation",
})

# --- Cost ----------------------------------------------------------------------------------------------------
# Ops that only pass a buffer along or touch metadata: they cost a launch, nothing more.
FREE_OPS = IDENTITY_OPS | VIEW_OPS | RENDEZVOUS_OPS.intersection({"_Send", "_Recv"}) | {
    "IdentityN", "NoOp", "Const", "Placeholder", "PlaceholderWithDefault", "Shape", "ShapeN", "Size", "Rank",
    "VarHandleOp", "ReadVariableOp", "VariableV2", "ControlTrigger",
}
MATMUL_OPS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "_FusedMatMul"})
CONV_OPS = frozenset({"Conv2D", "_FusedConv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter",
                      "DepthwiseConv2dNative"})

# --- Arithmetic Grappler rewrites ----------------------------------------------------------------------------
# Sums whose order of terms decides their rounding (``passes.split_addn``).
SUM_OPS = frozenset({"AddN", "Add", "AddV2"})
# Products and sums Grappler re-associates in place (``passes.pin_reassociation``).
CHAIN_OPS = frozenset({"Mul", "Add", "AddV2"})
