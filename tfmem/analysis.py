"""The per-graph half of a simulation, cached, and the cost-model step-time estimate.

Passes simulate one graph many times (candidate orders, candidate parallelism limits); what depends only on
the graph -- its execution graph, per-unit durations, which ops TF would treat as expensive -- is computed
once per graph and fetches and kept here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tfmem import costmodel
from tfmem.errors import ScheduleError
from tfmem.execution import ALIAS_OPS, ExecutionGraph
from tfmem.ir import GraphIR, TensorRef
from tfmem.shapes import require_known


@dataclass(frozen=True)
class Analysis:
    ir: GraphIR                      # held so that the id() in the cache key stays this graph's
    eg: ExecutionGraph
    durations: dict[str, float]
    expensive: dict[str, bool]


_ANALYSES: dict[tuple[object, ...], Analysis] = {}
_ANALYSES_KEPT = 8


def analyse(ir: GraphIR, fetches: list[str], feeds: list[str], device: costmodel.DeviceSpec) -> Analysis:
    """The per-graph part of a simulation, cached: passes simulate one graph many times (orders, k values)."""
    key = (id(ir), tuple(fetches), tuple(sorted(feeds)), device)
    cached = _ANALYSES.get(key)
    if cached is not None and cached.ir is ir:
        return cached
    eg = ExecutionGraph.build(ir, fetches, feeds)
    require_known(ir, _sized_tensors(eg))
    durations = {u: unit_time_s(eg, u, device) for u in eg.units}
    analysis = Analysis(ir, eg, durations, expensive_of(eg, ir, device, gpu=False))
    if len(_ANALYSES) >= _ANALYSES_KEPT:
        _ANALYSES.pop(next(iter(_ANALYSES)))
    _ANALYSES[key] = analysis
    return analysis


def expensive_of(eg: ExecutionGraph, ir: GraphIR, device: costmodel.DeviceSpec, gpu: bool) -> dict[str, bool]:
    """Per unit: would TF's executor treat it as expensive (hand it to another thread)?"""
    return {u: not gpu and (eg.is_region(u) or costmodel.is_expensive(ir[u], ir, device)) for u in eg.units}


def step_time_estimate(eg: ExecutionGraph, durations: dict[str, float], expensive: dict[str, bool],
                       cores: int) -> float:
    """Step time if big ops spread over ``cores`` (intra-op parallelism) and ops share the cores.

    The larger of the critical path (big ops at ``cores``-fold speed, small ones on one core) and the total
    work over ``cores``: limiting inter-op parallelism costs time only where it lengthens the critical path.
    """
    finish: dict[str, float] = {}
    for u in _topological(eg):  # GraphDef order need not be topological
        own = durations[u] / cores if expensive[u] else durations[u]
        finish[u] = own + max((finish[p] for p in eg.unit_preds[u]), default=0.0)
    critical = max(finish.values(), default=0.0)
    return max(critical, sum(durations.values()) / cores)


def _topological(eg: ExecutionGraph) -> list[str]:
    pending = {u: len(eg.unit_preds[u]) for u in eg.units}
    ready = [u for u in eg.units if pending[u] == 0]
    order = []
    while ready:
        u = ready.pop()
        order.append(u)
        for s in eg.unit_succs[u]:
            pending[s] -= 1
            if pending[s] == 0:
                ready.append(s)
    return order


def _sized_tensors(eg: ExecutionGraph) -> list[TensorRef]:
    out = []
    for u in eg.units:
        if not eg.is_region(u):
            out.extend(t for t in eg.outputs_of(u) if eg.graph[t.node].op not in ALIAS_OPS)
    return out


def units_in(eg: ExecutionGraph, order: Sequence[str]) -> list[str]:
    units = list(dict.fromkeys(eg.unit_of[n] for n in order if n in eg.unit_of))
    given = set(units)
    missing = [u for u in eg.units if u not in given]
    if missing:
        raise ScheduleError(f"order omits {len(missing)} executed op(s), e.g. {', '.join(missing[:5])}")
    return units


def unit_time_s(eg: ExecutionGraph, unit: str, device: costmodel.DeviceSpec) -> float:
    return sum(costmodel.op_time_s(eg.graph[n], eg.graph, device) for n in eg.members[unit])
