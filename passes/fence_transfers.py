"""Make the device wait for its copies to host memory where the plan counted their memory as free.

The simulator frees a device tensor when its last device reader finishes, even when a host op reads it too
(a swap-out, a gradient for a host-placed variable): it takes the copy to be instantaneous. TensorFlow frees
the device buffer only once the host has received it, and over the testbed's loopback gRPC that can be much
later: unfenced, a plan's swapped-out activations can all wait on the device at once, far above its simulated
peak.

For every such tensor this pass picks the *fence*, a host op that runs as soon as the copy has arrived (the
swap-out ``Identity`` where there is one, else a new host ``Identity`` of the tensor), and gives it a control
edge to the first device op after the tensor's last device reader, in the one-thread order, that allocates
at least as much as the tensor (or ``FENCE_BYTES``): where the memory the plan freed is next needed. A copy that
is on time costs nothing; a late one stalls that op instead of running out of memory.

Requires: a ``host`` in the context. Ensures: values are unchanged (an ``Identity`` and control edges); the
fence depends only on the tensor, which comes before the fenced op in a topological order, so no cycle.

Examples
--------
>>> from tfmem.examples import mlp
>>> from tfmem.ir.loading import load
>>> from tfmem.pipeline import PassContext
>>> from passes.swap_activations import SwapActivations
>>> built = mlp(batch=2048, dims=(256, 512, 512, 512, 10))
>>> device, host = "/job:worker/task:0/device:CPU:0", "/job:host/task:0/device:CPU:0"
>>> ir = load(built.graph)
>>> peak = PassContext(tuple(built.fetches), None, device, host).simulate(ir).peak_bytes
>>> ctx = PassContext(tuple(built.fetches), int(peak * 0.9), device, host, inter_op_threads=1)
>>> swapped = SwapActivations().run(ir, ctx).graph
>>> result = FenceTransfers().run(swapped, ctx)
>>> result.changed, ctx.simulate(result.graph).peak_bytes <= peak * 0.9
(True, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from passes.transfer import activation_bytes, identity_attrs
from tfmem.ir.devices import Placement
from tfmem.ir.editor import GraphEditor
from tfmem.ir.execution import ExecutionGraph
from tfmem.ir.frames import find_regions, may_be_dead
from tfmem.ir.graph import GraphIR, OpNode, TensorRef
from tfmem.ir.ops import ALIAS_OPS, IDENTITY_OPS, PERSISTENT_OUTPUT_OPS, VARIABLE_READ_OPS
from tfmem.pipeline import PassContext, PassReport, PassResult
from tfmem.sim.opmemory import allocated_bytes
from tfmem.sim.tensor_list_memory import list_holdings
from tfmem.units import format_bytes

MIN_BYTES = 256 * 1024   # smaller copies cannot move a plan's peak by more than its safety margin
FENCE_BYTES = 1 << 20    # a later op allocating this much needs the memory a larger copy frees
FENCE_TAG = "_tfmem_fence"
# Outputs that live for the whole session (or view such a buffer): their copies free nothing.
_RESIDENT_OPS = PERSISTENT_OUTPUT_OPS | VARIABLE_READ_OPS


@dataclass(frozen=True)
class FenceTransfers:
    """Hold the next large device allocation after each device-to-host copy until the copy has arrived."""

    name: ClassVar[str] = "fence_transfers"
    budget_independent: ClassVar[bool] = True
    peak_non_increasing: ClassVar[bool] = False

    def run(self, graph: GraphIR, ctx: PassContext) -> PassResult:
        if ctx.host is None:
            return PassResult(graph, False, PassReport.empty(self.name, "no host device: nothing is copied there"))
        placement = Placement(ctx.device, ctx.host)
        domain = {n.name: placement.domain(n.device) for n in graph.nodes}
        # A TensorList's copy frees its items (passes.swap_activations): sized once the step's graph is built.
        copied = [t for t, readers in graph.consumers.items()
                  if domain[t.node] == "device" and any(domain.get(r) == "host" for r in readers)
                  and ((graph.spec(t).nbytes or 0) >= MIN_BYTES or graph.spec(t).dtype == "variant")
                  and not _resident(graph, graph[t.node])]
        if copied:
            eg = ExecutionGraph.build(graph, ctx.fetches, ctx.feed_shapes)
            lists = list_holdings(eg)
            copied = [t for t in copied if activation_bytes(graph, t, lists) >= MIN_BYTES]
        if not copied:
            return PassResult(graph, False, PassReport.empty(
                self.name, f"no device tensor of {format_bytes(MIN_BYTES)} or more is copied to the host"))
        # Copies fenced already (the planner judges its plans fenced; optimize fences again last) keep their
        # fence: another one could reorder a graph whose peak was taken with the first.
        copied = [t for t in copied if not _fenced(graph, t, domain)]
        if not copied:
            return PassResult(graph, False, PassReport.empty(self.name, "every copy to the host is fenced already"))
        # A copy of a tensor a TF1 cond may skip (a Switch's output, or below one) is dead with it, and would
        # stop the op it fences.
        copied = [t for t in copied if not may_be_dead(graph, t)]
        in_frames = find_regions(graph)
        # Units in the one-thread order (a v1 frame is one: a list it hands on is copied when it ends); only ops
        # outside frames can be fenced.
        order = [u for u in ctx.simulate(graph, inter_op_threads=1, grappler=False).schedule.order if u in eg.members]
        position = {u: i for i, u in enumerate(order)}
        unfenceable = ALIAS_OPS | _RESIDENT_OPS   # they allocate nothing of their own
        editor = GraphEditor(graph)
        fenced: list[tuple[TensorRef, str]] = []
        for tensor in copied:
            producer = eg.unit_of.get(tensor.node, "")
            host_readers = [r for r in graph.consumers[tensor] if domain.get(r) == "host" and r in position]
            if not host_readers or producer not in position:
                continue
            device_uses = [position[eg.unit_of[r]] for r in _device_readers(graph, tensor, domain)
                           if eg.unit_of.get(r) in position]
            last_use = max([position[producer], *device_uses])
            need = min(activation_bytes(graph, tensor, lists), FENCE_BYTES)
            target = next((u for u in order[last_use + 1:] if not eg.is_region(u) and u not in in_frames
                           and domain[u] == "device" and graph[u].op not in unfenceable
                           and allocated_bytes(graph, u) >= need), None)
            if target is None:
                continue
            fence = next((r for r in host_readers if graph[r].op == "Identity" and not graph[r].control_inputs), None)
            if fence is None:
                fence = editor.unique_name(f"{tensor.node}/tfmem_fence_{tensor.index}")
                editor.add_op(fence, "Identity", [tensor], [graph.spec(tensor)], device=ctx.host,
                              attrs=identity_attrs(graph, tensor, FENCE_TAG))
            editor.add_control_inputs(target, [fence])
            fenced.append((tensor, target))
        if not fenced:
            return PassResult(graph, False, PassReport.empty(self.name, "no large device allocation follows a copy"))
        total = sum(activation_bytes(graph, t, lists) for t, _ in fenced)
        note = (f"{len(fenced)} device-to-host copies ({format_bytes(total)}) fenced: the next large device "
                "allocation after each waits until its copy has arrived")
        return PassResult(editor.finish(), True, PassReport(
            self.name, True, nodes_added=len(editor.added), control_edges_added=len(fenced), notes=(note,),
            details={"fenced": [{"tensor": str(t), "waits": target} for t, target in fenced]}))


def _device_readers(graph: GraphIR, tensor: TensorRef, domain: dict[str, str]) -> set[str]:
    """The device ops that read ``tensor``'s device buffer: directly or through device-side identities.

    Host-side identities end the walk: what reads their output reads the host's copy (a swap-in's readers read
    a new device buffer), so the device buffer is free of them.
    """
    readers: set[str] = set()
    frontier = [tensor]
    while frontier:
        for reader in graph.consumers.get(frontier.pop(), ()):
            if domain.get(reader) != "device" or reader in readers:
                continue
            readers.add(reader)
            if graph[reader].op in IDENTITY_OPS:
                frontier.append(TensorRef(reader, 0))
    return readers


def _fenced(graph: GraphIR, tensor: TensorRef, domain: dict[str, str]) -> bool:
    """Whether a host reader of ``tensor`` already holds a device op back by a control edge (a fence)."""
    return any(domain.get(r) == "host" and any(domain.get(s) == "device" and r in graph[s].control_inputs
                                               for s in graph.successors[r])
               for r in graph.consumers[tensor])


def _resident(graph: GraphIR, node: OpNode) -> bool:
    """Whether ``node``'s output is (a view of) a buffer that lives for the whole session."""
    while node.op in ALIAS_OPS and node.inputs:
        node = graph[node.inputs[0].node]
    return node.op in _RESIDENT_OPS
