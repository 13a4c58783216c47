"""Lower bounds on the device peak: no rewrite tfmem can make goes below these.

Every op needs its inputs, outputs and scratch on the device at once while it runs, and whatever must stay
on the device (constants and variables on it, when they cannot move to the host) is there throughout.
"""

from __future__ import annotations

from tfmem.bfc import rounded_bytes
from tfmem.execution import ALIAS_OPS, ExecutionGraph
from tfmem.ir import GraphIR
from tfmem.opmemory import temp_bytes


def op_working_set_bytes(graph: GraphIR, name: str) -> int:
    """Bytes ``name`` needs on its device while it runs: distinct inputs, outputs and scratch."""
    node = graph[name]
    if node.op in ALIAS_OPS:
        return 0
    inputs = {t: graph.spec(t).nbytes or 0 for t in node.inputs}
    outputs = [s.nbytes or 0 for s in node.outputs]
    return sum(rounded_bytes(n) for n in (*inputs.values(), *outputs, *temp_bytes(node, graph)) if n)


def largest_working_set(eg: ExecutionGraph) -> tuple[str, int]:
    """The executed op with the largest working set, and that set's bytes, fed tensors included.

    Fed tensors arrive before the step and stay on the device to its end (TF never forwards or frees them
    early), so they count at every op, not only at the ops that read them.
    """
    fed = {t: rounded_bytes(eg.graph.spec(t).nbytes or 0) for t in eg.fed}
    best = ("", 0)
    for name in eg.needed:
        if eg.unit_of[name] == name:
            node = eg.graph[name]
            size = op_working_set_bytes(eg.graph, name) if node.op not in ALIAS_OPS else 0
            size += sum(n for t, n in fed.items() if t not in node.inputs)
            if size > best[1]:
                best = (name, size)
    return best
