"""The cost model's step time for a graph over several machines: per machine a device (a named accelerator), its
host (a CPU) and the link between them, and a network between machines.

The estimate is the largest of four bounds: the critical path (each op at its device's cost-model time, each
tensor that crosses a link or the network waiting for its copy), the busiest device's and the busiest host's
total work (a device runs one op at a time at full speed), the busiest link direction, and the busiest network
port (each machine sends and receives one copy at a time). Like ``tfmem.sim.costmodel``, it ranks choices and
gives figures for hardware this project has not got; it is not a profiler. Host ops (a plan's copies and the
optimizer updates of variables kept in host memory) run at the testbed CPU's speed (``DEVICES["testbed"]``).

Examples
--------
>>> round(NETWORKS["100GbE"].transfer_s(125 * 10**6), 4)
0.01
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tfmem.ir.colocation import placed_as_tensorflow_would
from tfmem.ir.devices import Placement, check_devices
from tfmem.ir.loading import GraphSource, load
from tfmem.ir.shapes import FeedShapes
from tfmem.sim import costmodel
from tfmem.sim.analysis import analyse, unit_time_s
from tfmem.sim.arguments import checked_arguments


@dataclass(frozen=True)
class NetworkSpec:
    """The network between machines: each machine's port carries ``bandwidth`` bytes/s each way."""

    name: str
    bandwidth: float
    latency_s: float

    def transfer_s(self, nbytes: int) -> float:
        """Seconds to send ``nbytes`` from one machine to another."""
        return self.latency_s * (nbytes > 0) + nbytes / self.bandwidth


NETWORKS: dict[str, NetworkSpec] = {
    "100GbE": NetworkSpec("100 Gb/s Ethernet with RDMA", 12.5e9, 5e-6),
    "25GbE": NetworkSpec("25 Gb/s Ethernet (TCP)", 3.125e9, 30e-6),
}


def cluster_step_s(graph: GraphSource, fetches: Iterable[str] | str, devices: Mapping[str, str | None],
                   device: costmodel.DeviceSpec, network: NetworkSpec,
                   feed_shapes: FeedShapes | None = None) -> float:
    """The estimated step time of ``graph`` over the machines of ``devices`` (each device mapped to its host, as
    ``tfmem.optimize`` takes them), every device a ``device`` linked to its host by ``device``'s link, the machines
    joined by ``network``. Ops with no device run where TensorFlow's placer puts them (``tfmem.ir.colocation``)."""
    fetch_list, shapes, _ = checked_arguments(fetches, feed_shapes, None, None)
    pairs = check_devices(devices)
    ir = placed_as_tensorflow_would(load(graph, shapes), pairs[0][0])
    analysis = analyse(ir, fetch_list, list(shapes or {}), device)
    eg, cpu = analysis.eg, costmodel.DEVICES["testbed"]
    where: dict[str, tuple[int, str]] = {}
    for d in {n.device for n in ir.nodes}:   # (machine, "device" or "host"); elsewhere: the first device
        found = [(m, Placement(dev, host).domain(d)) for m, (dev, host) in enumerate(pairs)]
        where[d] = next(((m, dom) for m, dom in found if dom != "other"), (0, "device"))
    place = {u: where[eg.graph[eg.members[u][0]].device] for u in eg.units}
    own = {u: (analysis.durations[u] if place[u][1] == "device" or eg.is_region(u)
               else unit_time_s(eg, u, cpu)) for u in eg.units}
    busy: dict[tuple[object, ...], float] = {}
    for u, (m, dom) in place.items():
        busy[("compute", m, dom)] = busy.get(("compute", m, dom), 0.0) + own[u]
    finish: dict[str, float] = {}
    copied: set[tuple[object, ...]] = set()
    for u in eg.topological_units:
        ready = max((finish[p] for p in eg.unit_preds[u]), default=0.0)
        for t in eg.unit_inputs[u]:
            producer = eg.unit_of.get(t.node)
            if producer is None or t in eg.fed or place[producer] == place[u]:
                continue
            nbytes = eg.graph.spec(t).nbytes or 0
            (src, _), (dst, dst_dom) = place[producer], place[u]
            lanes: list[tuple[object, ...]]
            if src != dst:
                seconds, lanes = network.transfer_s(nbytes), [("send", src), ("receive", dst)]
            else:
                seconds, lanes = device.transfer_s(nbytes), [("link", src, dst_dom)]
            ready = max(ready, finish[producer] + seconds)
            if (t, place[u]) not in copied:   # a tensor several ops there read crosses once
                copied.add((t, place[u]))
                for lane in lanes:
                    busy[lane] = busy.get(lane, 0.0) + seconds
        finish[u] = ready + own[u]
    return max(max(finish.values(), default=0.0), max(busy.values(), default=0.0))
